"""--min-nodes-per-pipeline (the Oobleck artifact's n0 given by hand): no template below it, every other size
keeps its exact best layout, plans and reconfigurations never form a smaller pipeline, and bad values are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oobleck.api.profile import ClusterShape
from oobleck.cli import main
from oobleck.planner import instantiate, reconfigure
from oobleck.planner.errors import PlanningError
from oobleck.planner.synthetic import PRESETS, gpt_profile
from oobleck.planner.templates import best_template, generate_templates

GiB = 1 << 30
PROFILE = gpt_profile(PRESETS["gpt3-350m"], seq_len=1024, microbatch_size=1, gpu_flops=1e14, hbm_bandwidth=1.5e12)
CLUSTER = ClusterShape(
    nodes=16, gpus_per_node=1, gpu_memory_bytes=40 * GiB, intra_node_bandwidth=3e11, inter_node_bandwidth=6.25e9
)


@pytest.mark.parametrize("least", [1, 2, 3, 5])
def test_sizes_start_at_the_minimum_and_keep_their_best_layout(least: int) -> None:
    plain = generate_templates(PROFILE, CLUSTER, 1, 8)
    assert plain[0].nodes == 1  # the model fits on one node: n0 = 1 without the flag
    templates = generate_templates(PROFILE, CLUSTER, 1, 8, min_nodes_per_pipeline=least)
    sizes = [t.nodes for t in templates]
    assert sizes[0] == least
    # every size from n0 to 2*n0 - 1 (so every node count >= n0 splits into pipelines), up to N - f*n0
    assert sizes == list(range(least, max(16 - least, 2 * least - 1) + 1))
    for template in templates:  # the search is unchanged: the same exact best layout per size
        assert template == best_template(PROFILE, CLUSTER, template.nodes, 8)


def test_plans_and_reconfigurations_never_form_a_smaller_pipeline() -> None:
    templates = generate_templates(PROFILE, CLUSTER, 1, 8, min_nodes_per_pipeline=4)
    nodes = [str(i) for i in range(16)]
    plan = instantiate(templates, nodes, 1, 64, "job", gpus_per_node=1)
    assert all(p.template_nodes >= 4 for p in plan.pipelines) and len(plan.pipelines) == 4
    layer_bytes = [layer.state_bytes for layer in PROFILE.layers]
    after = reconfigure(plan, templates, layer_bytes, lost=["0", "5", "9"], added=[], bandwidth=6.25e9)
    assert all(p.template_nodes >= 4 for p in after.pipelines)
    assert sum(p.template_nodes for p in after.pipelines) <= 13


@pytest.mark.parametrize(
    ("least", "message"),
    [
        (0, "min_nodes_per_pipeline: must be an integer in 1..N = 16, got 0"),
        (17, "min_nodes_per_pipeline: must be an integer in 1..N = 16, got 17"),
        (9, "(f+1)*n0 = 18 > 16"),
    ],
)
def test_bad_minimum_is_named(least: int, message: str) -> None:
    with pytest.raises(PlanningError) as error:
        generate_templates(PROFILE, CLUSTER, 1, 8, min_nodes_per_pipeline=least)
    assert message in str(error.value)


def test_more_nodes_than_layers_is_named() -> None:
    small = PROFILE.model_copy(update={"layers": PROFILE.layers[:5]})
    with pytest.raises(PlanningError, match="min_nodes_per_pipeline: 6 nodes exceed the model's 5 layers"):
        generate_templates(small, CLUSTER, 0, 8, min_nodes_per_pipeline=6)


def test_plan_cli_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "profile.json"
    path.write_text(PROFILE.model_dump_json())
    args = ["plan", str(path), "--nodes", "16", "--gpus-per-node", "1", "--gpu-memory", "40GiB"]
    args += ["--microbatches", "64", "--json"]
    assert main([*args, "--min-nodes-per-pipeline", "4"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert min(t["nodes"] for t in plan["templates"]) == 4
    assert all(p["template_nodes"] >= 4 for p in plan["pipelines"])
    assert main([*args, "--min-nodes-per-pipeline", "0"]) == 2
    assert "--min-nodes-per-pipeline: must be in 1..--nodes (16), got 0" in capsys.readouterr().err
    assert main([*args, "--min-nodes-per-pipeline", "9"]) == 2
    assert "(f+1)*n0 = 18 > 16" in capsys.readouterr().err


def test_plan_a_preset_without_a_profile_file(capsys: pytest.CaptureFixture[str]) -> None:
    """The paper's models plan by name: the same plan as their synthetic profile written to a file."""
    args = ["--nodes", "30", "--gpus-per-node", "1", "--gpu-memory", "40GiB", "--microbatches", "512", "--json"]
    assert main(["plan", "--model", "gpt3-6.7b", *args, "--min-nodes-per-pipeline", "6"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["num_layers"] == 34 and min(t["nodes"] for t in plan["templates"]) == 6
    assert main(["plan", "--model", "bert-large", *args]) == 0
    bert = json.loads(capsys.readouterr().out)
    expected = gpt_profile(
        PRESETS["bert-large"], seq_len=512, microbatch_size=1, gpu_flops=125e12, hbm_bandwidth=1.5e12
    )
    assert bert["num_layers"] == len(expected.layers) == 26
    assert main(["plan", "--model", "gpt5", *args]) == 2
    assert "--model: unknown 'gpt5'" in capsys.readouterr().err
    assert main(["plan", *args]) == 2
    assert "profile: give a profile JSON file or --model PRESET" in capsys.readouterr().err
