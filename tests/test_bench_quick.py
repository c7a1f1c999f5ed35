"""Every benchmark script's --quick mode runs to the end and prints its figures, so that a change that
breaks a benchmark fails the suite (the full runs are `make bench`, `make bench-runtime`, `make bench-operator`).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # starts processes (see tests/conftest.py: make test-unit)


BENCH = Path(__file__).resolve().parents[1] / "bench"
NUMBER = r"[0-9]+(?:\.[0-9]+)?"


def run_quick(script: str, timeout: float, *extra: str) -> str:
    """Run `bench/<script> --quick [extra...]`; its output, after checking it exited 0."""
    done = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", *extra], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, (
        f"{script} --quick exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


def test_planner_templates_quick() -> None:
    out = run_quick("planner_templates.py", 120)
    assert re.search(rf"G=1: sizes 1\.\.16: {NUMBER} ms total \(search {NUMBER} ms\)", out), out
    assert re.search(rf"G=8: sizes 1\.\.8: {NUMBER} ms total", out), out
    assert re.search(
        rf"G=8 tensor-parallel \(t <= 8\) vs none, sizes 1\.\.8: {NUMBER} ms vs {NUMBER} ms: x{NUMBER}", out
    )
    assert re.search(rf"GPT-3 175B templates, N = 128 x 8 GPUs, f = 3: t <= 8 {NUMBER} ms", out), out
    assert re.search(
        rf"speed-up G=1, sizes 1\.\.8: compiled {NUMBER} ms, reference {NUMBER} ms: x{NUMBER} \(same layouts\)", out
    ), out


def test_planner_plans_quick() -> None:
    out = run_quick("planner_plans.py", 180)
    assert re.search(rf"plan: {NUMBER} pipelines of \[[0-9, ]+\] nodes, 1024 ranks, iteration {NUMBER} ms", out), out
    assert re.search(rf"with sizes [0-9]+\.\.[0-9]+ only \(the rule before\): iteration {NUMBER} ms", out), out
    for row in (
        "instantiation \\+ batch distribution",
        "reconfiguration, 1 of 128 nodes lost",
        "reconfiguration, 8 of 128 nodes lost",
    ):
        assert re.search(rf"{row}\s+{NUMBER} \(\s*{NUMBER}\)\s+{NUMBER} \(\s*{NUMBER}\)\s+{NUMBER}x", out), (row, out)


@pytest.mark.slow
@pytest.mark.xdist_group("control-processes")
def test_recovery_quick() -> None:
    out = run_quick("recovery.py", 420)
    for name in ("oobleck", "oobleck_heartbeats_only"):
        assert re.search(rf"{name}\s+recovery {NUMBER} s = detection {NUMBER} \+ plan {NUMBER}", out), out
    assert re.search(rf"torchrun restart\s+recovery {NUMBER} s", out), out
    assert re.search(rf"ratio baseline / oobleck: {NUMBER}x", out), out


@pytest.mark.slow
@pytest.mark.xdist_group("control-processes")
@pytest.mark.parametrize("shape", ["pipeline", "ddp"])
def test_overhead_quick(shape: str) -> None:
    import json

    out = run_quick("overhead.py", 420, "--shape", shape)
    result = json.loads(out[out.index("{") :])
    assert result["shape"] == shape
    assert set(result["step_ms"]["median"]) == {"on", "off"}
    assert all(ms > 0 for ms in result["step_ms"]["median"].values())
    assert set(result["overhead_on_vs_off"]) == {"median", "p10", "mean"}
    assert ("efficiency" in result) == (shape == "pipeline") and ("ranks" in result) == (shape == "ddp")


@pytest.mark.slow
@pytest.mark.xdist_group("control-processes")
def test_detector_idle_quick(tmp_path) -> None:
    import json

    out = run_quick("detector_idle.py", 300, "--out", str(tmp_path / "idle.json"))
    assert re.search(rf"idle detector {NUMBER} ms/s per worker vs a bare thread .*: {NUMBER}x", out), out
    figures = json.loads((tmp_path / "idle.json").read_text())
    # Both sides measured real processes' CPU: a process that wakes at all uses some.
    assert all(ms > 0 for ms in figures["per_worker_ms_per_s"].values()), figures
    assert figures["coordinator_ms_per_s"]["detector"] > 0, figures


@pytest.mark.slow
@pytest.mark.cluster
def test_operator_scale_quick() -> None:
    import json

    out = run_quick("operator_scale.py", 420)
    assert re.search(r"all 2 jobs at generation 0 in", out), out
    assert re.search(rf"round 1: pod-deleted x2: generation [0-9]+, failure-to-patch {NUMBER} s", out), out
    summary = json.loads(out[out.index("{\n") : out.rindex("}") + 1])
    assert summary["big_job_nodes"] == 8 and summary["big_p99_s"] > 0 and summary["operator_rss_mib"] > 0


@pytest.mark.slow
def test_stragglers_quick() -> None:
    from oobleck_dev import cpulimit

    if (why := cpulimit.available()) is not None:
        pytest.skip(why)
    out = run_quick("stragglers.py", 600)
    assert re.search(rf"slowdown {NUMBER} against the other nodes", out), out
    for row in ("unthrottled", "ideal"):
        assert re.search(rf"{row}\s+{NUMBER} samples/s", out), out
    assert re.search(rf"without mitigation\s+{NUMBER} samples/s\s+{NUMBER}% of ideal", out), out
    assert re.search(rf"with re-split\s+{NUMBER} samples/s\s+{NUMBER}% of ideal", out), out
    assert re.search(rf"with layers moved\s+{NUMBER} samples/s\s+{NUMBER}% of ideal\s+\(c, d stages", out), out
    assert "losses equal to the unthrottled run's: True" in out, out
