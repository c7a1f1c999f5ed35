"""The plan document: stages carry node, GPUs and ranks; every per-rank view is derived and validated."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from oobleck.api.plan import PLAN_API_VERSION, LayerCopy, Pipeline, Plan, RankAssignment, Stage, Template, TemplateStage


def template(nodes: int, gpus: int = 2) -> Template:
    stages = [
        TemplateStage(start=i, end=i + 1, node=i // gpus, gpus=1, gpu_offset=i % gpus, forward_ms=1, backward_ms=2)
        for i in range(nodes * gpus)
    ]
    return Template(nodes=nodes, stages=stages, iteration_ms=3 * len(stages), m_ref=4)


def plan_dict() -> dict:
    """Two pipelines on 2 + 1 nodes of 2 GPUs, 4 layers; ranks deliberately not in layout order."""
    return {
        "job": "j",
        "generation": 2,
        "num_layers": 4,
        "gpus_per_node": 2,
        "f": 1,
        "global_microbatches": 5,
        "templates": [template(1, 4).model_dump(), template(2).model_dump()],
        "pipelines": [
            {
                "index": 0,
                "template_nodes": 2,
                "nodes": ["a", "b"],
                "microbatches": 3,
                "microbatch_offset": 0,
                "iteration_ms": 9,
                "stages": [
                    {"start": 0, "end": 2, "node": "a", "gpus": [0, 1], "ranks": [0, 1]},
                    {"start": 2, "end": 3, "node": "b", "gpus": [0], "ranks": [5]},
                    {"start": 3, "end": 4, "node": "b", "gpus": [1], "ranks": [3]},
                ],
            },
            {
                "index": 1,
                "template_nodes": 1,
                "nodes": ["c"],
                "microbatches": 2,
                "microbatch_offset": 3,
                "iteration_ms": 9,
                "stages": [
                    {"start": 0, "end": 1, "node": "c", "gpus": [1], "ranks": [2]},
                    {"start": 1, "end": 4, "node": "c", "gpus": [0], "ranks": [4]},
                ],
            },
        ],
        "copies": [
            {
                "layer": 3,
                "src_node": "b",
                "src_gpu": 1,
                "src_rank": 3,
                "dst_node": "c",
                "dst_gpu": 0,
                "dst_rank": 4,
                "bytes": 10,
            }
        ],
        "iteration_ms": 9,
    }


def test_derived_views_follow_the_stages():
    plan = Plan.model_validate(plan_dict())
    assert plan.api_version == PLAN_API_VERSION and plan.world_size == 6
    assert [a.rank for a in plan.ranks] == list(range(6))
    assert plan.ranks[5] == RankAssignment(rank=5, node="b", gpu=0, pipeline=0, stage=1, start=2, end=3)
    assert plan.ranks[2] == RankAssignment(rank=2, node="c", gpu=1, pipeline=1, stage=0, start=0, end=1)
    assert plan.rank_of("b", 1) == 3 and plan.rank_of("c", 0) == 4 and plan.rank_of("x", 0) is None
    assert plan.holders(0) == [0, 1, 2] and plan.holders(3) == [3, 4] and plan.holders(2) == [4, 5]
    assert plan.pipelines[0].stages[0].ranks == [0, 1] and plan.nodes == ["a", "b", "c"]
    assert plan.ranks is plan.ranks  # computed once


def test_json_round_trip_is_canonical_and_has_no_per_rank_list():
    plan = Plan.model_validate(plan_dict())
    _ = plan.ranks  # a cached view must not leak into the document or into equality
    text = plan.to_json()
    assert "rank_index" not in text and "rank_list" not in text and '"ranks":[' in text
    assert set(json.loads(text)) == set(Plan.model_fields)
    again = Plan.model_validate_json(text)
    assert again == plan and again.to_json() == text and again.rank_of("b", 0) == 5


def test_model_copy_rebuilds_the_derived_views():
    plan = Plan.model_validate(plan_dict())
    assert plan.rank_of("a", 0) == 0
    data = plan_dict()
    data["pipelines"][0]["stages"][0]["ranks"] = [1, 0]
    swapped = plan.model_copy(update={"pipelines": Plan.model_validate(data).pipelines})
    assert swapped.rank_of("a", 0) == 1 and swapped.ranks[0].gpu == 1
    assert plan.model_copy(update={"generation": 3}).world_size == 6
    unvalidated = Plan.model_construct(**Plan.model_validate(plan_dict()).__dict__)
    unvalidated.__dict__.pop("_rank_index", None)
    assert unvalidated.rank_of("c", 1) == 2 and unvalidated.world_size == 6


def _invalid(change, match: str) -> None:
    data = plan_dict()
    change(data)
    with pytest.raises(ValidationError, match=match):
        Plan.model_validate(data)


def _stage(data: dict, pipeline: int, stage: int) -> dict:
    return data["pipelines"][pipeline]["stages"][stage]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda d: _stage(d, 1, 1).update(ranks=[1]),
            r"ranks: must be 0..5, each on one GPU; listed twice \[1\], missing \[4\]",
        ),
        (lambda d: _stage(d, 1, 1).update(ranks=[6]), r"ranks: must be 0..5.*missing \[4\]"),
        (lambda d: _stage(d, 1, 1).update(gpus=[1]), r"GPU 1 of 'c' runs two ranks"),
        (lambda d: _stage(d, 0, 2).update(gpus=[0], ranks=[5]), r"GPU 0 of 'b' runs two ranks"),
        (lambda d: _stage(d, 1, 1).update(gpus=[0, 1]), r"1 ranks for 2 gpus; one rank per GPU"),
        (lambda d: _stage(d, 1, 1).update(gpus=[2]), r"GPU 2 of 'c', gpus_per_node is 2"),
        (lambda d: _stage(d, 1, 1).update(node="a"), r"node 'a' is not one of the pipeline's nodes"),
        (lambda d: d["pipelines"][1]["nodes"].append("d"), r"nodes \['d'\] host no stage"),
        (lambda d: d["pipelines"][1].update(nodes=["c", "a"]), r"nodes \['a'\] appear twice"),
        (lambda d: _stage(d, 1, 1).update(start=2), r"stages must cover layers 0..4 contiguously"),
        (lambda d: d["pipelines"][1].update(index=0), r"pipelines\[1\]: index is 0, must be its position 1"),
        (lambda d: d["pipelines"][1].update(microbatch_offset=2), r"microbatch_offset is 2, expected 3"),
        (lambda d: d.update(global_microbatches=6), r"microbatches sum to 5, global_microbatches is 6"),
        (lambda d: d["copies"][0].update(dst_rank=2), r"copies\[0\]: dst_rank is 2, \('c', 0\) has rank 4"),
        (lambda d: d["copies"][0].update(src_node="z"), r"copies\[0\]: src_rank is 3, \('z', 1\) has rank None"),
        (lambda d: d["copies"][0].update(layer=4), r"copies\[0\]: layer 4, the plan has 4 layers"),
    ],
)
def test_inconsistent_plans_are_rejected_naming_the_field(change, match):
    _invalid(change, match)


def _as_v1(plan: Plan) -> dict:
    """The plan-v1 document of `plan`: stages naming their ranks, and every rank listed."""
    data = json.loads(plan.to_json())
    data["api_version"] = "oobleck.dev/plan-v1"
    for pipeline in data["pipelines"]:
        for stage in pipeline["stages"]:
            del stage["node"], stage["gpus"]
    data["ranks"] = [
        {
            "rank": a.rank,
            "node": a.node,
            "gpu": a.gpu,
            "pipeline": a.pipeline,
            "stage": a.stage,
            "start": a.start,
            "end": a.end,
        }
        for a in plan.ranks
    ]
    return data


def test_a_v1_document_is_upgraded_when_read():
    plan = Plan.model_validate(plan_dict())
    v1 = _as_v1(plan)
    assert Plan.model_validate(v1) == plan
    assert Plan.model_validate_json(json.dumps(v1)) == plan
    v1["ranks"][1]["node"] = "b"  # the first stage's ranks 0 and 1 on two nodes: not a v2 stage
    with pytest.raises(ValueError, match=r"pipelines\[0\].stages\[0\]: v1 ranks \[0, 1\] span nodes \['a', 'b'\]"):
        Plan.model_validate_json(json.dumps(v1))
    with pytest.raises(ValidationError):  # anything else that is not a plan still fails as before
        Plan.model_validate_json(json.dumps({**v1, "api_version": "oobleck.dev/plan-v9"}))


def test_a_1024_node_plan_is_compact():
    """1024 nodes x 8 GPUs, one stage per GPU (the most stages a plan can have): no object per rank in the
    document, and far below the 1 MiB a ConfigMap holds."""
    nodes = [f"big-worker-{i}" for i in range(1024)]
    pipelines = []
    for p in range(64):
        names = nodes[16 * p : 16 * p + 16]
        pipelines.append(
            {
                "index": p,
                "template_nodes": 16,
                "nodes": names,
                "microbatches": 1,
                "microbatch_offset": p,
                "iteration_ms": 1,
                "stages": [
                    {
                        "start": 8 * k + g,
                        "end": 8 * k + g + 1,
                        "node": names[k],
                        "gpus": [g],
                        "ranks": [128 * p + 8 * k + g],
                    }
                    for k in range(16)
                    for g in range(8)
                ],
            }
        )
    one = TemplateStage(start=0, end=128, node=0, gpus=8, gpu_offset=0, forward_ms=1, backward_ms=1)
    plan = Plan.model_validate(
        {
            "job": "big",
            "generation": 0,
            "num_layers": 128,
            "gpus_per_node": 8,
            "f": 3,
            "global_microbatches": 64,
            "templates": [Template(nodes=1, stages=[one], iteration_ms=2, m_ref=1)],
            "pipelines": pipelines,
            "iteration_ms": 1,
        }
    )
    assert plan.world_size == 8192 and plan.rank_of("big-worker-1023", 7) == 8191
    assert len(plan.to_json()) < 8192 * 80  # ~75 bytes per single-GPU stage (a v1 rank entry alone took ~100 more)


def test_stage_parts():
    assert Stage(start=0, end=1, node="a", gpus=[1, 0], ranks=[3, 4]).ranks == [3, 4]
    assert (
        LayerCopy(layer=0, src_node="a", src_gpu=0, src_rank=0, dst_node="b", dst_gpu=0, dst_rank=1, bytes=1).bytes == 1
    )
    assert Pipeline.model_fields["stages"].is_required()


def test_stages_carry_their_tensor_parallel_degree():
    """t defaults to 1 and is then left out of the JSON (older plans keep their bytes); t must divide the GPUs."""
    one = Stage(start=0, end=1, node="a", gpus=[0, 1], ranks=[0, 1])
    assert one.tensor_parallel == 1 and "tensor_parallel" not in one.model_dump_json()
    two = Stage(start=0, end=1, node="a", gpus=[0, 1], ranks=[0, 1], tensor_parallel=2)
    assert Stage.model_validate_json(two.model_dump_json()) == two and '"tensor_parallel":2' in two.model_dump_json()
    with pytest.raises(ValidationError, match="tensor_parallel: must be a power of two dividing the stage's 2 GPUs"):
        Stage(start=0, end=1, node="a", gpus=[0, 1], ranks=[0, 1], tensor_parallel=4)
    with pytest.raises(ValidationError, match="tensor_parallel: must be a power of two dividing the stage's 8 GPUs"):
        TemplateStage(start=0, end=1, node=0, gpus=8, gpu_offset=0, forward_ms=1, backward_ms=1, tensor_parallel=3)
    stage = TemplateStage(start=0, end=1, node=0, gpus=8, gpu_offset=0, forward_ms=1, backward_ms=1, tensor_parallel=8)
    assert TemplateStage.model_validate_json(stage.model_dump_json()).tensor_parallel == 8
