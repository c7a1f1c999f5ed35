"""Drive one real Worker through a sequence of plan generations (a test driver, not a test).

usage: drive_worker.py CONFIG STORE_PORT NODE GPU LOSSES DUMP PLAN:UNTIL [PLAN:UNTIL ...]
Adopts each plan in turn and trains until the global step reaches UNTIL, then moves to the next
generation the way the control side does (`run_generation`: abandon the old groups, adopt the new plan,
train). `run_generation` is also what tests drive a bare Worker with, without the elastic loop.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch.distributed import TCPStore

from oobleck.api.plan import Plan
from oobleck.runtime.elastic.worker import Worker
from oobleck.runtime.train.config import load_config
from oobleck.runtime.train.groups import CommError, Interrupted


def run_generation(worker: Worker, plan: Plan, until_step: int, on_step=None) -> tuple[str, Exception | None]:
    """Adopt `plan` and train until global step `until_step` or until the generation breaks: ("done" |
    "interrupted" | "failed", the error). The worker's step counter names the step to redo."""
    worker.abandon()
    try:
        worker.adopt(plan)
        while worker.step < until_step:
            outcome = worker.train_step()
            if on_step is not None:
                on_step(outcome)
    except Interrupted as error:
        return "interrupted", error
    except CommError as error:
        return "failed", error
    return "done", None


def main(argv: list[str]) -> int:
    config_path, port, node, gpu, losses, dump, *phases = argv
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    store = TCPStore("127.0.0.1", int(port), is_master=False, wait_for_workers=False)
    worker = Worker(load_config(config_path), store, node, int(gpu), losses_path=losses)
    for phase in phases:
        plan_path, until = phase.rsplit(":", 1)
        with open(plan_path) as handle:
            plan = Plan.model_validate_json(handle.read())
        status, error = run_generation(worker, plan, int(until))
        if status != "done":
            raise SystemExit(f"generation {plan.generation} ended {status} at step {worker.step}: {error}")
    torch.save(worker.layer_state(), dump)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
