"""`oobleck plan`: tables, JSON, reconfiguration previews, and exit 2 naming the field on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from oobleck.api.plan import Plan
from oobleck.api.profile import ClusterShape, ModelProfile
from oobleck.cli import main
from oobleck.planner import plan_job

LAYER = {
    "forward_ms": 2.0,
    "backward_ms": 4.0,
    "state_bytes": 8 << 30,
    "activation_bytes": 1 << 27,
    "output_bytes": 1 << 24,
}
CLUSTER = ["--nodes", "13", "--gpus-per-node", "4", "--gpu-memory", "40GiB", "--microbatches", "64", "--f", "1"]


def write_profile(tmp_path: Path, layers: list[dict] | None = None, **extra) -> Path:
    document = {
        "model": "equal24",
        "microbatch_size": 1,
        "layers": [dict(LAYER) for _ in range(24)] if layers is None else layers,
        **extra,
    }
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(document))
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["plan", *argv])
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    out, err = capsys.readouterr()
    return code, out, err


def test_table_shows_templates_pipelines_and_split(tmp_path: Path, capsys) -> None:
    code, out, err = run(capsys, str(write_profile(tmp_path)), *CLUSTER)
    assert code == 0, err
    assert "generation 0  reason initial" in out
    assert "templates:" in out and "pipelines (" in out
    plan = plan_job(
        ModelProfile.model_validate_json((tmp_path / "profile.json").read_text()),
        ClusterShape(
            nodes=13,
            gpus_per_node=4,
            gpu_memory_bytes=40 << 30,
            intra_node_bandwidth=100e9,
            inter_node_bandwidth=12.5e9,
        ),
        1,
        64,
        "job",
    )
    for p in plan.pipelines:
        assert f"{p.microbatches:>12} {p.microbatch_offset:>6} {p.iteration_ms:>12.2f}  {','.join(p.nodes)}" in out
    # which template sizes were considered (every usable one) and which the plan uses, how often
    sizes = [t.nodes for t in plan.templates]
    assert sizes == list(range(sizes[0], max(13 - sizes[0], 2 * sizes[0] - 1) + 1))
    used = {}
    for p in plan.pipelines:
        used[p.template_nodes] = used.get(p.template_nodes, 0) + 1
    shown = ", ".join(f"{n} nodes x {k}" for n, k in sorted(used.items(), reverse=True))
    assert f"template sizes considered: {sizes[0]}-{sizes[-1]} nodes ({len(sizes)} sizes" in out
    assert f"used: {shown}" in out


def test_json_is_the_plan_document(tmp_path: Path, capsys) -> None:
    code, out, _ = run(capsys, str(write_profile(tmp_path)), *CLUSTER, "--json", "--job", "demo")
    assert code == 0
    plan = Plan.model_validate_json(out)
    assert plan.job == "demo" and plan.generation == 0 and sorted(plan.nodes, key=int) == [str(i) for i in range(13)]
    expected = plan_job(
        ModelProfile.model_validate_json((tmp_path / "profile.json").read_text()),
        ClusterShape(
            nodes=13,
            gpus_per_node=4,
            gpu_memory_bytes=40 << 30,
            intra_node_bandwidth=100e9,
            inter_node_bandwidth=12.5e9,
        ),
        1,
        64,
        "demo",
    )
    assert out.strip() == expected.to_json()
    # Deterministic: a second run prints the same bytes.
    assert run(capsys, str(write_profile(tmp_path)), *CLUSTER, "--json", "--job", "demo")[1] == out


def test_lost_previews_the_next_generation(tmp_path: Path, capsys) -> None:
    code, out, _ = run(capsys, str(write_profile(tmp_path)), *CLUSTER, "--lost", "3,7")
    assert code == 0
    assert "generation 1  reason" in out and "lost 3,7  added -" in out
    assert "candidates (cost" in out and "<- chosen" in out and "layer copies" in out
    code, out, _ = run(capsys, str(write_profile(tmp_path)), *CLUSTER, "--lost", "3,7", "--added", "x", "--json")
    plan = Plan.model_validate_json(out)
    assert plan.generation == 1 and plan.lost_nodes == ["3", "7"] and plan.added_nodes == ["x"]
    assert "3" not in plan.nodes and "x" in plan.nodes and plan.copies


def layers_with(index: int, **change) -> list[dict]:
    layers = [dict(LAYER) for _ in range(24)]
    layers[index].update(change)
    for key, value in change.items():
        if value is None:
            del layers[index][key]
    return layers


@pytest.mark.parametrize(
    ("profile", "argv", "field"),
    [
        (
            dict(layers=layers_with(3, forward_ms=-1.0)),
            CLUSTER,
            "profile: layers.3.forward_ms: Input should be greater than or equal to 0",
        ),
        (dict(layers=layers_with(5, backward_ms=None)), CLUSTER, "profile: layers.5.backward_ms: Field required"),
        (dict(layers=[]), CLUSTER, "profile: layers: List should have at least 1 item"),
        (dict(layers=[dict(LAYER, forward_ms=0.0, backward_ms=0.0)]), CLUSTER, "forward_ms + backward_ms"),
        ({}, [*CLUSTER, "--gpus-per-node", "3"], "--gpus-per-node: Value error, must be a power of two, got 3"),
        ({}, [*CLUSTER, "--nodes", "3"], "--nodes (N = 3 nodes cannot hold f+1 = 2 pipelines"),
        ({}, [*CLUSTER, "--microbatches", "1"], "--microbatches (global_microbatches: 1 is fewer than the 2 pipelines"),
        ({}, [*CLUSTER, "--microbatches", "0"], "--microbatches: must be >= 1"),
        ({}, [*CLUSTER, "--f", "-1"], "--f: must be >= 0"),
        ({}, [*CLUSTER, "--gpu-memory", "lots"], "--gpu-memory: expected a number with an optional unit"),
        ({}, [*CLUSTER, "--gpu-memory", "1GiB"], "--gpu-memory (no template fits"),
        ({}, [*CLUSTER, "--inter-bandwidth", "0"], "--inter-bandwidth: must be > 0"),
        ({}, [*CLUSTER, "--lost", "3,,7"], "--lost: expected comma-separated node ids"),
        ({}, [*CLUSTER, "--lost", "99"], "--lost (lost: nodes ['99'] are not in plan generation 0)"),
    ],
)
def test_bad_input_exits_2_naming_the_field(tmp_path: Path, capsys, profile: dict, argv: list[str], field: str) -> None:
    code, out, err = run(capsys, str(write_profile(tmp_path, **profile)), *argv)
    assert code == 2 and not out
    assert err.startswith("oobleck plan: error: ") and field in err, err


def test_missing_profile_and_unknown_flag_exit_2(tmp_path: Path, capsys) -> None:
    code, _, err = run(capsys, str(tmp_path / "nope.json"), *CLUSTER)
    assert code == 2 and "profile: cannot read" in err
    (tmp_path / "broken.json").write_text("{not json")
    code, _, err = run(capsys, str(tmp_path / "broken.json"), *CLUSTER)
    assert code == 2 and "profile: not JSON" in err
    code, _, err = run(capsys, str(write_profile(tmp_path)), *CLUSTER, "--frobnicate")
    assert code == 2 and "unrecognized arguments: --frobnicate" in err
    code, _, err = run(capsys, str(write_profile(tmp_path)), "--nodes", "13")
    assert code == 2 and "required" in err and "--gpus-per-node" in err


def test_losing_every_replica_exits_1(tmp_path: Path, capsys) -> None:
    plan = Plan.model_validate_json(run(capsys, str(write_profile(tmp_path)), *CLUSTER, "--json")[1])
    first_nodes = ",".join(p.nodes[0] for p in plan.pipelines)  # every pipeline's first stage
    code, out, err = run(capsys, str(write_profile(tmp_path)), *CLUSTER, "--lost", first_nodes)
    assert code == 1 and not out and "have no surviving replica" in err


@pytest.mark.integration
def test_console_entry_point(tmp_path: Path) -> None:
    profile = write_profile(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "oobleck.cli", "plan", str(profile), *CLUSTER, "--lost", "3"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "generation 1" in done.stdout
    done = subprocess.run(
        [sys.executable, "-m", "oobleck.cli", "plan", str(profile), *CLUSTER, "--nodes", "-4"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "--nodes" in done.stderr


def test_tensor_parallel_stages_in_the_table_and_the_json(tmp_path: Path, capsys) -> None:
    """8 GiB of state per layer on 40 GiB GPUs, one-sample microbatches: without TP a layer's state sits whole on
    one GPU; with t = 4 a stage of 4 GPUs holds 2 GiB of it per GPU, and the plan says so per stage."""
    profile = str(write_profile(tmp_path))
    args = [*CLUSTER, "--microbatch-size", "1"]
    code, out, err = run(capsys, profile, *args, "--json")
    assert code == 0, err
    assert '"tensor_parallel"' not in out  # t = 1 everywhere: left out, the plan as before
    plain = Plan.model_validate_json(out)
    code, out, err = run(capsys, profile, *args, "--max-tensor-parallel", "4", "--json")
    assert code == 0, err
    plan = Plan.model_validate_json(out)
    degrees = {s.tensor_parallel for p in plan.pipelines for s in p.stages}
    assert degrees - {1} and all(len(s.gpus) % s.tensor_parallel == 0 for p in plan.pipelines for s in p.stages)
    for pipeline in plan.pipelines:  # a pipeline's stages carry its template's degrees
        template = next(t for t in plan.templates if t.nodes == pipeline.template_nodes)
        assert [s.tensor_parallel for s in pipeline.stages] == [s.tensor_parallel for s in template.stages]
    assert plan.iteration_ms < plain.iteration_ms  # fewer stages per pipeline: a shorter pipeline bubble
    code, out, err = run(capsys, profile, *args, "--max-tensor-parallel", "4")
    assert code == 0, err
    assert "(GPUs, tensor-parallel degree t)" in out and ",t4)" in out
    code, out, err = run(capsys, profile, *args, "--max-tensor-parallel", "4", "--lost", "3", "--json")
    assert code == 0, err
    assert Plan.model_validate_json(out).generation == 1
    code, out, err = run(capsys, profile, *args, "--max-tensor-parallel", "8")
    assert code == 2 and "--max-tensor-parallel (max_tensor_parallel: 8 exceeds gpus_per_node = 4" in err
