"""Drive one real Worker through a sequence of plan generations (a test driver, not a test).

usage: drive_worker.py CONFIG STORE_PORT NODE GPU LOSSES DUMP PLAN:UNTIL [PLAN:UNTIL ...]
Adopts each plan in turn and trains until the global step reaches UNTIL, then moves to the next
generation the way the control side will (Worker.run_generation: abandon the old groups, adopt the
new plan, train).
"""

from __future__ import annotations

import logging
import sys

import torch
from torch.distributed import TCPStore

from oobleck.api.plan import Plan
from oobleck.runtime.elastic.worker import Worker
from oobleck.runtime.train.config import load_config


def main(argv: list[str]) -> int:
    config_path, port, node, gpu, losses, dump, *phases = argv
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    store = TCPStore("127.0.0.1", int(port), is_master=False, wait_for_workers=False)
    worker = Worker(load_config(config_path), store, node, int(gpu), losses_path=losses)
    for phase in phases:
        plan_path, until = phase.rsplit(":", 1)
        with open(plan_path) as handle:
            plan = Plan.model_validate_json(handle.read())
        result = worker.run_generation(plan, int(until))
        if result.status != "done":
            raise SystemExit(
                f"generation {plan.generation} ended {result.status} at step {result.step}: {result.error}"
            )
    torch.save(worker.layer_state(), dump)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
