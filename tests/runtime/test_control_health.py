"""Failure detection with real processes: kill -9 is noticed by survivors in < 2 s (3 s allowed beside the suite).

Worker processes are this file run as a script (see `_worker_main`): each runs a FailureDetector
against a real coordinator and records, in the store, when its failure Event fired.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from oobleck.api.reports import FailureReport
from oobleck.runtime.elastic import keys as co
from oobleck.runtime.elastic.coordinator import Coordinator
from oobleck.runtime.elastic.gpu_health import GpuHealth, probe_gpus
from oobleck.runtime.elastic.health import (
    CallbackFailureReporter,
    FailureDetector,
    HealthTimeouts,
    is_peer_failure,
    wait_alive,
)
from oobleck.runtime.elastic.liveness import LivenessResponder, host_overloaded, probe_liveness, runnable_now
from oobleck.runtime.elastic.store import FixedEndpoint, StoreTimeouts, connect

FAST = StoreTimeouts(connect_s=5.0, op_s=2.0, reconnect_s=20.0, retry_s=0.02)
ENV = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
DETECTION_LIMIT_S = 2.0
"""The default dead_after_s (1 s), a probe and the scheduling of five processes: under 2 s. Beside the whole suite
at load ~10 a first report once took 2.37 s; the kill test allows LOADED_SLACK_S more for that."""
LOADED_SLACK_S = 1.0
RESTART_DEAD_AFTER_S = 1.5
# The process-heavy tests share one xdist worker with the launcher tests (see test_control_launcher).
GROUP = pytest.mark.xdist_group("control-processes")


def _spawn(port: int, worker: str, peers: list[str], *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, "--port", str(port), "--worker", worker, "--peers", ",".join(peers), *extra],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _stop(procs: list[subprocess.Popen], resume: bool = False) -> None:
    """SIGKILL the live ones (`resume`: SIGCONT first, so that a stopped one dies at once)."""
    for proc in procs:
        if resume and proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _collect(store: dist.Store, want: set[str], deadline_s: float) -> list[dict]:
    """Pop failure reports until every worker in `want` was named dead or the deadline passes."""
    reports: list[dict] = []
    named: set[str] = set()
    end = time.monotonic() + deadline_s
    while not want <= named and time.monotonic() < end:
        for report in co.pop_failures(store):
            reports.append(report)
            named.update(report["dead"])
        time.sleep(0.005)
    return reports


def _detections(store: dist.Store, workers: list[str], timeout_s: float, generation: int = 0) -> dict[str, float]:
    names = [f"detected/{w}/{generation}" for w in workers]
    store.wait(names, datetime.timedelta(seconds=timeout_s))
    return {w: float(v) for w, v in zip(workers, store.multi_get(names))}


def _watching(store: dist.Store, workers: list[str], generation: int = 0) -> None:
    store.wait([f"watching/{w}/{generation}" for w in workers], datetime.timedelta(seconds=60))


@contextlib.contextmanager
def _watching_workers(workers: list[str]) -> Iterator[tuple[dist.Store, list[subprocess.Popen]]]:
    """A coordinator and a detector process per worker, every one alive and watching generation 0; the
    processes SIGKILLed at the end."""
    with Coordinator() as coordinator:
        store = coordinator.store()
        procs = [_spawn(coordinator.port, w, workers) for w in workers]
        try:
            wait_alive(store, workers, 60)
            _watching(store, workers)
            yield store, procs
        finally:
            _stop(procs)


@GROUP
@pytest.mark.slow
def test_kill_9_is_detected_by_every_survivor_within_seconds():
    workers = [f"node{i}:0" for i in range(4)]
    with _watching_workers(workers) as (store, procs):
        time.sleep(1.5)  # longer than dead_after_s: no false positive while everyone is alive
        assert co.pop_failures(store) == []
        victim = workers[2]
        killed_at = time.time()
        os.kill(procs[2].pid, signal.SIGKILL)
        reports = _collect(store, {victim}, 10)
        survivors = [w for w in workers if w != victim]
        detected = _detections(store, survivors, 10)
        abort = json.loads(store.get(co.abort_key(0)))
    first = min(r["detected_at"] for r in reports if victim in r["dead"])
    latencies = {w: t - killed_at for w, t in detected.items()}
    print(f"kill -> first report {first - killed_at:.3f} s; per survivor {latencies}")
    assert all(set(r["dead"]) == {victim} for r in reports), reports
    assert all(r["kind"] == "heartbeat" and r["generation"] == 0 for r in reports)
    if max(latencies.values()) >= DETECTION_LIMIT_S:
        print(f"over the {DETECTION_LIMIT_S} s target on this host's load: {latencies}")
    assert first - killed_at < DETECTION_LIMIT_S + LOADED_SLACK_S
    assert max(latencies.values()) < DETECTION_LIMIT_S + LOADED_SLACK_S, latencies
    assert abort["dead"] == [victim]


@GROUP
@pytest.mark.slow
def test_a_peer_that_reported_its_last_step_done_exits_without_a_report():
    """At a job's end each worker reports its last step done, then exits: a peer a moment behind it (in a TP
    group, the last collective's partner) must not call it dead, or the finished job fails (seen in an e2e run,
    2026-11-29: both pods reported lost after step 30 of 30, the job Failed TooFewNodes). A peer that did not
    report done is still called dead."""
    workers = [f"node{i}:0" for i in range(3)]
    with _watching_workers(workers) as (store, procs):
        co.set_progress(store, workers[2], 0, 30, "done")
        os.kill(procs[2].pid, signal.SIGKILL)
        time.sleep(2.0)  # past dead_after_s and the probe's refusal
        assert co.pop_failures(store) == []
        os.kill(procs[1].pid, signal.SIGKILL)
        reports = _collect(store, {workers[1]}, 10)
    assert reports and all(set(r["dead"]) == {workers[1]} for r in reports), reports


@GROUP
@pytest.mark.slow
def test_coordinator_restart_then_two_simultaneous_kills():
    """A coordinator outage longer than dead_after_s is no worker death; kills after it are detected.

    After the restart every heartbeat client reconnects; connects to a fresh TCPStore take up to ~1 s
    on a loaded 2-core machine (measured), so this test gives the verdict 1.5 s instead of the default
    1.0 s (test_kill_9_is_detected_by_every_survivor_within_seconds keeps the default and the 2 s target).
    """
    workers = [f"node{i}:0" for i in range(5)]
    coordinator = Coordinator().start()
    port = coordinator.port
    procs = [_spawn(port, w, workers, "--dead-after", str(RESTART_DEAD_AFTER_S)) for w in workers]
    try:
        store = coordinator.store()
        wait_alive(store, workers, 60)
        _watching(store, workers)
        coordinator.stop()
        time.sleep(1.5)
        coordinator = Coordinator(port=port).start()
        store = coordinator.store()
        # Every worker reconnects, sees the new epoch and leaves generation 0 (nobody is called dead).
        restart_reports = []
        deadline = time.monotonic() + 20
        while len({r["reporter"] for r in restart_reports}) < len(workers) and time.monotonic() < deadline:
            restart_reports += co.pop_failures(store)
            time.sleep(0.01)
        assert {r["reporter"] for r in restart_reports} == set(workers)
        assert all(r["kind"] == "coordinator-restart" and r["dead"] == [] for r in restart_reports), restart_reports
        # The controller publishes the next generation; workers watch it.
        co.set_generation(store, 1)
        _watching(store, workers, 1)
        time.sleep(RESTART_DEAD_AFTER_S + 0.5)
        assert co.pop_failures(store) == [], "a coordinator outage must not look like dead workers"
        killed_at = time.time()
        os.kill(procs[1].pid, signal.SIGKILL)
        os.kill(procs[3].pid, signal.SIGKILL)
        reports = _collect(store, {workers[1], workers[3]}, 10)
        detected = _detections(store, [workers[0], workers[2], workers[4]], 10, generation=1)
        abort = json.loads(store.get(co.abort_key(1)))
    finally:
        _stop(procs)
        coordinator.stop()
    dead = {d for r in reports for d in r["dead"]}
    assert dead == {workers[1], workers[3]}
    assert all(r["generation"] == 1 for r in reports)
    latencies = sorted(t - killed_at for t in detected.values())
    print(f"after a coordinator restart: two kills detected in {latencies}")
    assert latencies[-1] < RESTART_DEAD_AFTER_S + (DETECTION_LIMIT_S - HealthTimeouts.dead_after_s)
    assert abort["kind"] == "heartbeat" and set(abort["dead"]) <= dead


def _gloo_pair(rank: int, port: int) -> None:
    """Rank 1 stays in an all_reduce that rank 0 never joins; rank 0 then dies by SIGKILL."""
    store, _ = connect("127.0.0.1", port, FAST)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("pair/", store), rank, 2, datetime.timedelta(seconds=60))
    tensor = torch.ones(4)
    pg.allreduce([tensor]).wait()  # both ranks: the group works
    store.set(f"ready/{rank}", "1")
    if rank == 0:
        time.sleep(600)
    try:
        pg.allreduce([tensor]).wait()
    except RuntimeError as error:
        store.set("error_at", str(time.time()))
        store.set("error", f"{type(error).__name__}: {error}"[:500])
        store.set("peer_failure", str(is_peer_failure(error)))


@GROUP
@pytest.mark.slow
def test_a_peer_death_breaks_a_gloo_collective_fast_and_is_classified_as_a_failure():
    with Coordinator() as coordinator:
        store = coordinator.store()
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--gloo-pair", str(r), "--port", str(coordinator.port)],
                env=ENV,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            for r in range(2)
        ]
        try:
            store.wait(["ready/0", "ready/1"], datetime.timedelta(seconds=60))
            time.sleep(0.3)
            killed_at = time.time()
            os.kill(procs[0].pid, signal.SIGKILL)
            store.wait(["peer_failure"], datetime.timedelta(seconds=30))
            error_after = float(store.get("error_at")) - killed_at
            error, classified = store.get("error").decode(), store.get("peer_failure").decode()
        finally:
            _stop(procs)
    print(f"collective error {error_after:.3f} s after the kill: {error}")
    assert classified == "True", error
    assert error_after < 0.5


def test_signal_and_trigger_report_once_per_generation():
    reports: list[FailureReport] = []
    with Coordinator() as coordinator:
        detector = FailureDetector(
            "job",
            "node0:0",
            FixedEndpoint("127.0.0.1", coordinator.port),
            reporter=CallbackFailureReporter(reports.append),
            store_timeouts=FAST,
            gpu_probe=lambda: [],
        )
        detector.watch(2, ["node0:0", "node1:0"])
        assert detector.signal(ValueError("shape mismatch")) is False
        assert not detector.failure.is_set()
        assert detector.signal(RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")) is True
        assert detector.failure.is_set()
        assert detector.signal(RuntimeError("Connection closed by peer")) is True  # still a failure ...
        assert len(reports) == 1  # ... but reported once
        assert co.aborted(coordinator.store(), 2)
        detector.trigger("heartbeat", ("node1:0",), "silent")
        detector.trigger("heartbeat", ("node1:0",), "silent")
        assert [r.dead for r in reports] == [(), ("node1:0",)]
        # A late signal about a generation the worker left is ignored; a new generation clears the Event.
        detector.watch(3, ["node0:0"])
        assert not detector.failure.is_set()
        assert detector.trigger("heartbeat", ("node1:0",), "late", generation=2) is None


def _closed_port() -> int:
    """A port nobody listens on (a dead peer's responder: the probe's connection is refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _detector(coordinator: Coordinator, timeouts: HealthTimeouts) -> Iterator[FailureDetector]:
    detector = FailureDetector(
        "job",
        "node0:0",
        FixedEndpoint("127.0.0.1", coordinator.port),
        reporter=CallbackFailureReporter(lambda report: None),
        timeouts=timeouts,
        store_timeouts=FAST,
        gpu_probe=lambda: [],
    ).start()
    try:
        yield detector
    finally:
        detector.stop()


def test_a_silent_peer_is_probed_when_its_suspicion_falls_due_not_at_the_next_read():
    """Reads 2 s apart, suspicion after 0.3 s: a peer that adopted the generation and then fell silent (its
    responder gone) is the verdict ~0.3 s after it was armed, not at the next read (~1.9 s)."""
    with Coordinator() as coordinator:
        store = coordinator.store()
        co.set_liveness(store, "node1:0", f"127.0.0.1:{_closed_port()}")
        store.set(co.heartbeat_key("node1:0"), "1")
        store.set(co.ready_key(0, "node1:0"), "1")
        timeouts = HealthTimeouts(heartbeat_period_s=0.25, dead_after_s=30.0, suspect_after_s=0.3, watch_period_s=2.0)
        with _detector(coordinator, timeouts) as detector:
            time.sleep(0.3)  # the detector's first beat and read are behind it
            watched = time.monotonic()
            detector.watch(0, ["node0:0", "node1:0"])  # read at once: node1 has adopted it (armed)
            assert detector.failure.wait(5)
            took = time.monotonic() - watched
    assert detector.last_report is not None and detector.last_report.dead == ("node1:0",)
    assert "refused" in detector.last_report.detail
    assert took < 1.2, f"verdict {took:.2f} s after the peer was armed: not at its suspicion (0.3 s)"


def test_an_abort_after_a_switch_without_one_is_followed_while_the_listener_waits_on_the_old_key():
    """A planned switch (no abort) finds the abort listener in its wait in the previous generation, 30 s long here
    (the 1 s backstop off): the detector thread wakes it onto the new one, whose abort it then follows, and
    stop() wakes it at once."""
    timeouts = HealthTimeouts(abort_wait_s=30.0, abort_backstop_s=60.0)
    with Coordinator() as coordinator, _detector(coordinator, timeouts) as detector:
        store = coordinator.store()
        detector.watch(0, ["node0:0"])
        time.sleep(0.3)  # the listener waits on gen0/abort
        detector.watch(1, ["node0:0"])
        posted = time.monotonic()
        co.post_abort(
            store, 1, {"job": "job", "generation": 1, "reporter": "node1:0", "kind": "heartbeat"}, ["node0:0"]
        )
        assert detector.failure.wait(5)
        took = time.monotonic() - posted
        stopping = time.monotonic()
    stopped = time.monotonic() - stopping
    assert took < 0.5, f"the abort of generation 1 followed after {took:.2f} s"
    assert stopped < 2.0, f"stop() waited {stopped:.2f} s for the listener's 30 s wait"


@pytest.mark.integration
def test_a_process_exits_cleanly_right_after_stop_while_its_abort_listener_waits():
    """CPython ends a daemon thread that comes back from a store call during interpreter shutdown by unwinding
    it, which aborts the process (SIGABRT, exit 134, seen with a listener left in its wait): stop() wakes the
    listener out of its 30 s wait and joins it: no thread of the detector is left, and the process exits 0 at
    once."""
    with Coordinator() as coordinator:
        script = textwrap.dedent(
            f"""
            import threading
            import time
            from oobleck.runtime.elastic.health import CallbackFailureReporter, FailureDetector, HealthTimeouts
            from oobleck.runtime.elastic.store import FixedEndpoint

            detector = FailureDetector(
                "job", "node0:0", FixedEndpoint("127.0.0.1", {coordinator.port}),
                reporter=CallbackFailureReporter(print), timeouts=HealthTimeouts(abort_wait_s=30.0), gpu_probe=list,
            ).start()
            detector.watch(0, ["node0:0"])
            time.sleep(0.5)  # the listener is in its wait
            began = time.monotonic()
            detector.stop()
            print("stopped in", time.monotonic() - began)
            assert not [t for t in threading.enumerate() if t.name.startswith("oobleck-")], threading.enumerate()
            """
        )
        proc = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.split("stopped in")[1]) < 2.0, proc.stdout


def test_an_unhealthy_gpu_reports_its_own_worker():
    reports: list[FailureReport] = []
    with Coordinator() as coordinator:
        detector = FailureDetector(
            "job",
            "node0:0",
            FixedEndpoint("127.0.0.1", coordinator.port),
            reporter=CallbackFailureReporter(reports.append),
            store_timeouts=FAST,
            timeouts=HealthTimeouts(gpu_probe_period_s=0.05),
            gpu_probe=lambda: [GpuHealth(0, True), GpuHealth(1, False, "uncorrected ECC errors: 3")],
        ).start()
        try:
            detector.watch(0, ["node0:0"])
            assert detector.failure.wait(5)
        finally:
            detector.stop()
    assert reports[0].kind == "gpu" and reports[0].dead == ("node0:0",)
    assert "gpu 1: uncorrected ECC errors: 3" in reports[0].detail


def test_gpu_probe_on_this_machine():
    gpus = probe_gpus()
    if not torch.cuda.is_available():
        assert all(g.healthy for g in gpus)  # a CPU machine (or a healthy one) reports healthy
    else:
        assert len(gpus) >= torch.cuda.device_count() and all(g.healthy for g in gpus), gpus


@pytest.mark.parametrize(
    "field, value",
    [
        ("heartbeat_period_s", 0),
        ("dead_after_s", -1),
        ("watch_period_s", -1),
        ("dead_after_s", 0.08),
        ("probe_timeout_s", 0),
        ("suspect_after_s", 0.04),
        ("suspect_after_s", -1),
        ("suspect_after_s", 2.0),
        ("confirm_timeout_s", 0),
        ("overloaded_per_core", -1),
    ],
)
def test_bad_timeouts_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        HealthTimeouts(**{field: value})


HUNG_LIMIT_S = 0.5
"""Stopped worker -> verdict, on a quiet machine (the issue's bound); LOADED_SLACK_S is added under load,
where an overloaded host also confirms an unanswered probe (HealthTimeouts.confirm_timeout_s)."""
LOADED_SLACK_S = 1.0 + HealthTimeouts().confirm_timeout_s


@GROUP
@pytest.mark.slow
def test_a_stopped_worker_is_found_by_probe_within_half_a_second_and_a_starved_one_is_not():
    """SIGSTOP (a hung node: no exit, no EOF) is a heartbeat-only failure: the silent peer is probed and
    its responder does not answer. A worker whose heartbeat thread is starved of the GIL for longer than
    the suspicion (its main thread spins with a 5 s switch interval) answers the probe: no verdict."""
    workers = [f"node{i}:0" for i in range(4)]
    starved = workers[3]
    with Coordinator() as coordinator:
        store = coordinator.store()
        procs = [
            _spawn(coordinator.port, w, workers, "--dead-after", "5", *(["--starve-gil", "2"] if w == starved else []))
            for w in workers
        ]
        try:
            wait_alive(store, workers, 60)
            _watching(store, workers)
            store.wait([f"starving/{starved}"], datetime.timedelta(seconds=30))
            time.sleep(2.5)  # the whole starvation and more: nobody is called dead
            assert co.pop_failures(store) == [], "a worker starved of the GIL answered probes: no verdict"
            victim = workers[1]
            os.kill(procs[1].pid, signal.SIGSTOP)
            stopped_at = time.time()
            reports = _collect(store, {victim}, 10)
            detected = _detections(store, [workers[0], workers[2]], 10)
        finally:
            _stop(procs, resume=True)
    first = min(r["detected_at"] for r in reports if victim in r["dead"])
    print(
        f"SIGSTOP -> first verdict {first - stopped_at:.3f} s; survivors woken {[t - stopped_at for t in detected.values()]}"
    )
    assert all(set(r["dead"]) == {victim} and r["kind"] == "heartbeat" for r in reports), reports
    assert any("did not answer" in r["detail"] for r in reports), reports
    loaded = os.getloadavg()[0] > 1.0
    assert first - stopped_at < HUNG_LIMIT_S + (LOADED_SLACK_S if loaded else 0.0)


@GROUP
@pytest.mark.slow
def test_on_an_overloaded_host_a_peer_held_off_the_cpu_for_a_moment_is_spared_and_a_hung_one_is_not():
    """A peer that gets no time slice for 1.6 s (SIGSTOP, then SIGCONT: what a run queue of dozens does to
    a process) answers a later probe of the confirmation and is spared; stopped for good, it is the
    verdict once the confirmation window (HealthTimeouts.confirm_timeout_s) is over, and it alone: the
    healthy peers, whose beats the prober could not read while it confirmed, are not taken for silent
    (dead_after_s 1.9 s here, shorter than the window). Every prober takes the host for overloaded here
    (--overloaded-per-core: any load at all)."""
    workers = [f"node{i}:0" for i in range(3)]
    paused = workers[1]
    with Coordinator() as coordinator:
        store = coordinator.store()
        procs = [
            _spawn(coordinator.port, w, workers, "--dead-after", "1.9", "--overloaded-per-core", "1e-9")
            for w in workers
        ]
        try:
            wait_alive(store, workers, 60)
            _watching(store, workers)
            os.kill(procs[1].pid, signal.SIGSTOP)
            time.sleep(1.6)
            os.kill(procs[1].pid, signal.SIGCONT)
            time.sleep(1.5)
            assert co.pop_failures(store) == [], "a peer stopped for 1.6 s answered the confirmation: no verdict"
            os.kill(procs[1].pid, signal.SIGSTOP)
            stopped_at = time.time()
            reports = _collect(store, {paused}, 20)
        finally:
            _stop(procs, resume=True)
    first = min(r["detected_at"] for r in reports if paused in r["dead"])
    print(f"SIGSTOP on an overloaded host -> first verdict {first - stopped_at:.3f} s")
    assert all(set(r["dead"]) == {paused} and r["kind"] == "heartbeat" for r in reports), reports
    assert HealthTimeouts().confirm_timeout_s <= first - stopped_at < HUNG_LIMIT_S + LOADED_SLACK_S


def test_runnable_now_reads_the_fourth_field_of_proc_loadavg_less_the_reader():
    assert runnable_now("0.52 0.58 0.59 7/345 12345\n") == 6
    assert runnable_now("0.00 0.01 0.05 1/80 99") == 0


def test_host_overloaded_compares_the_load_average_per_core(monkeypatch):
    cores = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0 * cores, 0.0, 0.0))
    assert host_overloaded(2.0) is True
    assert host_overloaded(1e9) is False


@pytest.mark.integration
def test_a_load_that_just_began_makes_the_host_overloaded_before_the_average_shows_it(monkeypatch):
    """Busy processes started now: the 1-minute average (held at 0 here, as it still reads seconds into a
    load) does not show them, the run queue does."""
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    cores = os.cpu_count() or 1
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3 * cores)]
    try:
        deadline = time.monotonic() + 10
        while not host_overloaded(2.0):
            assert time.monotonic() < deadline, f"never overloaded; /proc/loadavg: {open('/proc/loadavg').read()}"
            time.sleep(0.05)
    finally:
        for process in busy:
            process.kill()
            process.wait()


def test_probe_liveness_answers_for_a_live_responder_and_names_a_dead_port():
    responder = LivenessResponder("127.0.0.1")
    assert probe_liveness(responder.address, 1.0) is None
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    why = probe_liveness(f"127.0.0.1:{port}", 0.5)
    assert why is not None and "refused" in why and str(port) in why


def _starve_gil(seconds: float) -> None:
    """Hold the GIL in this (main) thread for `seconds`: the detector's Python threads cannot run."""
    sys.setswitchinterval(seconds + 1)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    sys.setswitchinterval(0.005)


def _worker_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--worker")
    parser.add_argument("--peers", default="")
    parser.add_argument("--gloo-pair", type=int)
    parser.add_argument("--dead-after", type=float, default=HealthTimeouts.dead_after_s)
    parser.add_argument("--starve-gil", type=float, default=0.0)
    parser.add_argument("--overloaded-per-core", type=float, default=HealthTimeouts.overloaded_per_core)
    args = parser.parse_args(argv)
    if args.gloo_pair is not None:
        _gloo_pair(args.gloo_pair, args.port)
        return 0
    detector = FailureDetector(
        "test",
        args.worker,
        FixedEndpoint("127.0.0.1", args.port),
        timeouts=HealthTimeouts(dead_after_s=args.dead_after, overloaded_per_core=args.overloaded_per_core),
        store_timeouts=FAST,
    ).start()
    store, _ = connect("127.0.0.1", args.port, FAST)
    generation = 0
    while True:
        detector.watch(generation, args.peers.split(","))
        detector.ready()
        store = _confirmed_set(store, args.port, f"watching/{args.worker}/{generation}", "1")
        if args.starve_gil and generation == 0:
            store = _confirmed_set(store, args.port, f"starving/{args.worker}", "1")
            _starve_gil(args.starve_gil)
        detector.failure.wait()
        store = _confirmed_set(store, args.port, f"detected/{args.worker}/{generation}", str(time.time()))
        # Like a worker waiting for the controller's next plan.
        while True:
            try:
                current = co.current_generation(store)
            except RuntimeError:
                store, _ = connect("127.0.0.1", args.port, FAST)
                continue
            if current is not None and current > generation:
                generation = current
                break
            time.sleep(0.01)


def _confirmed_set(store: dist.Store, port: int, key: str, value: str) -> dist.Store:
    """`set` has no reply, so a dead server only shows at the next call: confirm, reconnect, retry."""
    while True:
        try:
            store.set(key, value)
            store.check([key])
            return store
        except RuntimeError:
            store, _ = connect("127.0.0.1", port, FAST)


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
