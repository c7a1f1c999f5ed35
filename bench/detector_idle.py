"""What failure detection costs a worker when nothing fails: CPU per second of idle detector processes.

N worker processes each run a `FailureDetector` (runtime/elastic/health.py) with the detection settings
`oobleck launch` gives its workers, watching each other through one coordinator (this process), and
nothing else: no training, so every CPU-millisecond they use is the detector's (beats, reads of the
peers' beats, the abort listener's waits, their GIL hand-offs). The baseline, measured in the same run,
is N processes that each wake one bare thread at the detector's tick and do nothing: the floor any
periodic detector pays. Rounds alternate the two; each process's CPU (its threads' run time) is read from /proc
over a window after every detector has adopted the generation.

    .venv/bin/python bench/detector_idle.py [--workers 4] [--seconds 8] [--rounds 3] [--out f.json]

Prints, per side, the median over rounds of the mean CPU ms per second per worker, the coordinator's
(this process: its TCPStore server threads), and the ratio detector / baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path


def _cpu_s(pid: int) -> float:
    """CPU seconds run by the live threads of process `pid`, in nanoseconds from /proc/<pid>/task/*/schedstat
    (/proc/<pid>/stat counts in clock ticks of 10 ms: too coarse for a thread that wakes for microseconds)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return total / 1e9


def _launch_timeouts():
    from oobleck.runtime.backends.local.config import LaunchOptions
    from oobleck.runtime.elastic.health import HealthTimeouts

    return HealthTimeouts(heartbeat_period_s=LaunchOptions.heartbeat_period_s, dead_after_s=LaunchOptions.dead_after_s)


def _detector_child(port: int, worker: str, peers: list[str]) -> None:
    from oobleck.runtime.elastic.health import FailureDetector
    from oobleck.runtime.elastic.store import FixedEndpoint

    detector = FailureDetector("detector-idle", worker, FixedEndpoint("127.0.0.1", port), timeouts=_launch_timeouts())
    detector.start()
    detector.watch(0, peers)
    detector.ready()
    print("ready", flush=True)
    threading.Event().wait()  # until killed


def _baseline_child(tick_s: float) -> None:
    import torch.distributed  # noqa: F401  (the same imports resident as a detector's process)

    idle = threading.Event()

    def wake() -> None:
        while not idle.wait(tick_s):
            pass

    threading.Thread(target=wake, daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()


def _measure(procs: list[subprocess.Popen], seconds: float) -> tuple[list[float], float]:
    """CPU ms per second of each process and of this one (the coordinator) over `seconds`."""
    began = [_cpu_s(p.pid) for p in procs]
    own, wall = time.process_time(), time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - wall
    return [(_cpu_s(p.pid) - b) * 1e3 / wall for p, b in zip(procs, began)], (time.process_time() - own) * 1e3 / wall


def _side(kind: str, workers: int, seconds: float, settle_s: float) -> tuple[list[float], float]:
    from oobleck.runtime.elastic.coordinator import Coordinator

    names = [f"node{i}:0" for i in range(workers)]
    tick = _launch_timeouts().heartbeat_period_s
    with Coordinator() as coordinator:
        env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR")  # as `oobleck launch` runs its workers
        argv = [sys.executable, __file__, "--child", kind, "--port", str(coordinator.port), "--peers", ",".join(names)]
        procs = [
            subprocess.Popen([*argv, "--worker", name, "--tick", str(tick)], stdout=subprocess.PIPE, text=True, env=env)
            for name in names
        ]
        try:
            for proc in procs:  # imported and started (a detector: it has adopted generation 0)
                if proc.stdout is None or proc.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"a {kind} process exited before it was ready: {proc.wait()}")
            time.sleep(settle_s)
            return _measure(procs, seconds)
        finally:
            for proc in procs:  # all at once: a detector that outlives a peer would report it
                proc.kill()
            for proc in procs:
                proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=8.0, help="measurement window per side and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="2 workers, 2 s windows, 1 round (the suite's run)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", choices=("detector", "baseline"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--peers", default="", help=argparse.SUPPRESS)
    parser.add_argument("--tick", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "detector":
        _detector_child(args.port, args.worker, args.peers.split(","))
        return 0
    if args.child == "baseline":
        _baseline_child(args.tick)
        return 0
    if args.quick:
        args.workers, args.seconds, args.rounds = 2, 2.0, 1
    if args.workers < 2:
        parser.error(f"--workers must be at least 2 (a detector watches its peers), got {args.workers}")

    sides = ("baseline", "detector")
    per_worker: dict[str, list[float]] = {s: [] for s in sides}
    coordinator: dict[str, list[float]] = {s: [] for s in sides}
    load = [os.getloadavg()[0]]
    for round_ in range(args.rounds):
        for side in sides if round_ % 2 == 0 else sides[::-1]:
            workers_ms, own_ms = _side(side, args.workers, args.seconds, settle_s=1.0)
            per_worker[side].append(statistics.mean(workers_ms))
            coordinator[side].append(own_ms)
            load.append(os.getloadavg()[0])
            print(
                f"round {round_} {side:8s}: {per_worker[side][-1]:.2f} ms/s per worker, coordinator {own_ms:.2f} ms/s"
            )
    figures = {
        "workers": args.workers,
        "seconds": args.seconds,
        "rounds": args.rounds,
        "tick_s": _launch_timeouts().heartbeat_period_s,
        "per_worker_ms_per_s": {s: statistics.median(v) for s, v in per_worker.items()},
        "coordinator_ms_per_s": {s: statistics.median(v) for s, v in coordinator.items()},
        "runs": {"per_worker": per_worker, "coordinator": coordinator},
        "cpu_count": os.cpu_count(),
        "load_1min": {"min": min(load), "max": max(load)},
    }
    medians = figures["per_worker_ms_per_s"]
    figures["ratio"] = medians["detector"] / medians["baseline"]
    print(
        f"idle detector {medians['detector']:.2f} ms/s per worker vs a bare thread waking every "
        f"{figures['tick_s']:.2f} s {medians['baseline']:.2f} ms/s: {figures['ratio']:.2f}x; coordinator "
        f"{figures['coordinator_ms_per_s']['detector']:.2f} ms/s (vs {figures['coordinator_ms_per_s']['baseline']:.2f})"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
