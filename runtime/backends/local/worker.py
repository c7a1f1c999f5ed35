"""One worker process of `oobleck launch`: `python -m oobleck.runtime.backends.local.worker --config C
--plan-file P --store HOST:PORT --node N --gpu G` (plans from the file the local plan controller replaces,
failures onto the coordinator's queue)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from oobleck.api.addresses import parse_host_port, worker_id
from oobleck.api.contract import ExitCode
from oobleck.runtime.elastic.health import HealthTimeouts

log = logging.getLogger(__name__)


def _store_address(value: str) -> tuple[str, int]:
    try:
        return parse_host_port(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m oobleck.runtime.backends.local.worker", description="one elastic training worker"
    )
    parser.add_argument("--config", required=True, help="worker config (JSON or YAML)")
    parser.add_argument("--plan-file", required=True, help="plan JSON the controller replaces atomically")
    parser.add_argument("--store", type=_store_address, required=True, help="coordinator HOST:PORT")
    parser.add_argument("--node", required=True, help="this worker's node id in the plan")
    parser.add_argument("--gpu", type=int, default=0, help="local GPU index")
    parser.add_argument("--steps", type=int, default=None, help="override config.steps")
    parser.add_argument("--losses", default=None, help="append per-step global losses here (JSON lines)")
    parser.add_argument("--dump", default=None, help="write the final parameters of held layers here (torch.save)")
    parser.add_argument("--heartbeat-period", type=float, default=HealthTimeouts.heartbeat_period_s)
    parser.add_argument("--dead-after", type=float, default=HealthTimeouts.dead_after_s)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    import torch

    from oobleck.api.reports import FailureKind
    from oobleck.runtime.backends.base import build_worker, finish
    from oobleck.runtime.backends.local.plan_file import FilePlanSource
    from oobleck.runtime.causes import JobFault
    from oobleck.runtime.elastic.health import FailureDetector
    from oobleck.runtime.elastic.loop import run_elastic
    from oobleck.runtime.elastic.sources import Unrecoverable
    from oobleck.runtime.elastic.store import FixedEndpoint, StoreTimeouts
    from oobleck.runtime.train.config import load_config

    try:
        config = load_config(args.config)
        health = HealthTimeouts(heartbeat_period_s=args.heartbeat_period, dead_after_s=args.dead_after)
    except (OSError, ValueError) as error:
        print(f"oobleck elastic worker: {error}", file=sys.stderr)
        return ExitCode.CONFIG
    endpoint = FixedEndpoint(*args.store)
    store_timeouts = StoreTimeouts()
    me = worker_id(args.node, args.gpu)
    detector = FailureDetector(config.job, me, endpoint, timeouts=health, store_timeouts=store_timeouts).start()
    built = build_worker(config, args.node, args.gpu, endpoint, detector, store_timeouts, losses_path=args.losses)
    worker = built.worker
    try:
        steps = config.steps if args.steps is None else args.steps
        result = run_elastic(worker, FilePlanSource(args.plan_file), detector, built.control, steps)
    except Unrecoverable as error:
        log.error(json.dumps({"event": "unrecoverable", "worker": me, "error": str(error)}))
        detector.trigger(FailureKind.UNRECOVERABLE, (), str(error))
        return ExitCode.UNRECOVERABLE
    except JobFault as error:  # the job's own (runtime/causes.py): the launcher fails the job with it
        log.error(json.dumps({"event": "cause", "worker": me, "error": str(error)}))
        return error.cause.exit_code
    finally:
        detector.stop()
    finish(worker, result, snapshot_wait_s=60.0)
    if args.dump and result.exit_code == ExitCode.DONE:
        torch.save(worker.layer_state(), args.dump)
    log.info(
        json.dumps(
            {
                "event": "exit",
                "worker": me,
                "steps": result.steps,
                "generations": result.generations,
                "interruptions": result.interruptions,
                "code": result.exit_code,
                "snapshots": worker.snapshots.stats if worker.snapshots is not None else None,
            }
        )
    )
    return result.exit_code


def run_main() -> None:
    """main(), then leave without running destructors: abandoned generations may leave gloo threads blocked
    on dead peers (train/groups.py GRAVEYARD), and a normal interpreter teardown would abort on them
    ("terminate called without an active exception"). Everything this worker owes is written by then."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_main()
