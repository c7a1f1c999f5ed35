"""Plan sources: the file (atomic replacement, new generations noticed promptly, never going back) and
the ConfigMap (both encodings decode, generations never go back, updates that do not raise the
generation are not decoded, an invalid plan is an error naming the key). The ConfigMap source's
objects are fed to its watch callback directly here (the watch itself: test_kube.py and
test_kube_cluster.py)."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from oobleck.api import planmap
from oobleck.api.plan import Pipeline, Plan, Stage, Template, TemplateStage
from oobleck.runtime.backends.local.plan_file import FilePlanSource, write_plan
from oobleck.runtime.backends.pod.plan_configmap import ConfigMapPlanSource
from oobleck.runtime.elastic.plans import PlanSourceError, PlanWatcher
from oobleck_dev.poll import wait_until

# A functional bound, not a benchmark: the watcher polls every few ms, but a loaded 2-core machine
# can hold a thread off the CPU for a tenth of a second (measured: 160 ms once under load 9).
NOTICE_LIMIT_S = 1.0


def plan(generation: int, nodes: int = 2) -> Plan:
    names = [f"n{i}" for i in range(nodes)]
    return Plan(
        job="job",
        generation=generation,
        num_layers=2,
        gpus_per_node=1,
        f=nodes - 1,
        global_microbatches=nodes,
        templates=[
            Template(
                nodes=1,
                stages=[TemplateStage(start=0, end=2, node=0, gpus=1, gpu_offset=0, forward_ms=1, backward_ms=2)],
                iteration_ms=3,
                m_ref=1,
            )
        ],
        pipelines=[
            Pipeline(
                index=i,
                template_nodes=1,
                nodes=[n],
                microbatches=1,
                microbatch_offset=i,
                stages=[Stage(start=0, end=2, node=n, gpus=[0], ranks=[i])],
                iteration_ms=3,
            )
            for i, n in enumerate(names)
        ],
        iteration_ms=3,
        reason="test",
    )


def test_missing_file_means_no_plan_yet(tmp_path):
    source = FilePlanSource(tmp_path / "plan.json")
    assert source.current() is None
    assert source.wait_newer(-1, 0.05) is None


def test_new_generation_is_noticed_promptly(tmp_path):
    path = tmp_path / "plan.json"
    write_plan(path, plan(0))
    source = FilePlanSource(path)
    assert source.current().generation == 0
    latencies = []
    for generation in range(1, 11):
        got: list = []

        def wait(after: int = generation - 1) -> None:
            got.append((source.wait_newer(after, 5), time.perf_counter()))

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.03)
        written = time.perf_counter()
        write_plan(path, plan(generation))
        waiter.join(5)
        assert got[0][0].generation == generation
        latencies.append(got[0][1] - written)
    print(f"notice latency: max {max(latencies) * 1e3:.1f} ms, mean {sum(latencies) / len(latencies) * 1e3:.1f} ms")
    assert max(latencies) < NOTICE_LIMIT_S


def _writer(path: str, count: int) -> None:
    for generation in range(count):
        write_plan(path, plan(generation, nodes=1 + generation % 3))


@pytest.mark.integration
def test_a_reader_never_sees_half_a_plan_or_goes_back(tmp_path):
    """A writer process replaces the file as fast as it can; every read parses, generations never decrease."""
    path = tmp_path / "plan.json"
    write_plan(path, plan(0))
    source = FilePlanSource(path, poll_s=0.0001)
    writer = multiprocessing.get_context("spawn").Process(target=_writer, args=(str(path), 400))
    writer.start()
    seen = []
    while writer.is_alive() or not seen or seen[-1] < 399:
        seen.append(source.current().generation)
        if len(seen) > 1_000_000:
            break
    writer.join(10)
    assert seen == sorted(seen) and seen[-1] == 399
    assert len(set(seen)) > 1
    # A stale writer cannot undo a newer generation.
    write_plan(path, plan(5))
    assert source.current().generation == 399


def test_an_invalid_document_names_the_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"job": "x"}')
    with pytest.raises(PlanSourceError, match="plan.json: not a valid plan"):
        FilePlanSource(path).current()


def test_watcher_flags_newer_generations_only(tmp_path):
    path = tmp_path / "plan.json"
    write_plan(path, plan(0))
    watcher = PlanWatcher(FilePlanSource(path), poll_s=0.01).start()
    try:
        watcher.adopt(0)
        time.sleep(0.1)
        assert not watcher.newer.is_set()
        write_plan(path, plan(1))
        assert watcher.newer.wait(1)
        watcher.adopt(1)
        time.sleep(0.1)
        assert not watcher.newer.is_set()
    finally:
        watcher.stop()


def test_the_watcher_keeps_why_a_look_failed_until_a_look_succeeds(tmp_path, caplog):
    """An invalid plan document is logged once (not every poll) and kept in `error`; a valid one clears it."""
    path = tmp_path / "plan.json"
    path.write_text('{"job": "x"}')
    watcher = PlanWatcher(FilePlanSource(path), poll_s=0.01).start()
    try:
        watcher.adopt(0)
        wait_until(lambda: watcher.error is not None, "the invalid document seen", 2, 0.01)
        time.sleep(0.1)  # several more polls of the same document
        assert "not a valid plan" in str(watcher.error)
        assert len([r for r in caplog.records if "not a valid plan" in r.getMessage()]) == 1
        write_plan(path, plan(1))
        assert watcher.newer.wait(1)
        assert watcher.error is None
    finally:
        watcher.stop()


def test_poll_interval_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="poll_s"):
        FilePlanSource(tmp_path / "p.json", poll_s=0)


# -- the ConfigMap source -------------------------------------------------------------------------


def config_map(p: Plan, inline_limit: int = planmap.PLAN_INLINE_LIMIT, rv: str = "1") -> dict:
    data, binary = planmap.encode_plan(p, inline_limit)
    return {
        "metadata": {
            "name": "job-plan",
            "resourceVersion": rv,
            "annotations": {planmap.GENERATION_ANNOTATION: str(p.generation)},
        },
        "data": {**data, planmap.JOB_KEY: "{}"},
        "binaryData": binary,
    }


def source() -> ConfigMapPlanSource:
    # Never started: the test plays the watch.
    src = ConfigMapPlanSource(kube=None, namespace="ns", name="job-plan")
    src._thread = threading.current_thread()  # type: ignore[assignment]  (start() is then a no-op)
    return src


def test_decodes_inline_and_gzipped_plans():
    src = source()
    src._on_object(config_map(plan(0)))
    assert src.current() == plan(0)
    gz = config_map(plan(1, nodes=3), inline_limit=10)
    assert gz["data"][planmap.PLAN_KEY] == "" and planmap.PLAN_GZ_KEY in gz["binaryData"]
    src._on_object(gz)
    assert src.current() == plan(1, nodes=3)
    assert src.config_map() is gz


def test_never_returns_an_older_generation():
    src = source()
    src._on_object(config_map(plan(3)))
    src._on_object(config_map(plan(2)))  # a stale event (a replayed watch, a stale writer)
    assert src.current().generation == 3
    assert src.wait_newer(3, 0.05) is None
    assert src.wait_newer(2, 0.05).generation == 3


def test_wait_newer_wakes_on_a_new_generation():
    src = source()
    src._on_object(config_map(plan(0)))
    timer = threading.Timer(0.1, lambda: src._on_object(config_map(plan(1))))
    started = time.monotonic()
    timer.start()
    got = src.wait_newer(0, 5.0)
    assert got is not None and got.generation == 1 and time.monotonic() - started < 2.0


def test_wait_newer_stops_on_the_stop_event_and_absent_configmap_is_no_plan():
    src = source()
    src._on_object(None)
    assert src.current() is None
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    started = time.monotonic()
    assert src.wait_newer(-1, 30.0, stop) is None
    assert time.monotonic() - started < 5.0


def test_wait_read_is_the_first_delivery_present_or_absent():
    src = source()
    assert not src.wait_read(0.01), "nothing delivered yet: current() None says nothing"
    src._on_object(None)
    assert src.wait_read(0.01) and src.current() is None
    src = source()
    threading.Timer(0.1, lambda: src._on_object(config_map(plan(0)))).start()
    assert src.wait_read(5.0) and src.current() == plan(0)


def test_invalid_plan_names_the_key():
    src = source()
    src._on_object(
        {
            "metadata": {"name": "job-plan", "annotations": {planmap.GENERATION_ANNOTATION: "0"}},
            "data": {planmap.PLAN_KEY: "{}"},
        }
    )
    with pytest.raises(PlanSourceError, match="job-plan: key plan.json: not a valid plan"):
        src.current()
    src._on_object(config_map(plan(0)))  # a valid one clears the error
    assert src.current() == plan(0)


def test_job_spec_key():
    body = config_map(plan(0))
    assert planmap.read_job_spec(body) == {}
    with pytest.raises(ValueError, match="job.json: missing"):
        planmap.read_job_spec({"metadata": {"name": "x"}, "data": {}})
