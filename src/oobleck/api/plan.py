"""The plan: the one contract between the planner, the operator and the runtime.

The operator (or the local launcher) writes a plan; every worker reads it and executes it. A plan is
immutable; a change of layout is a new plan with a higher `generation`. Layers are the profile's
layers, identified by index; half-open ranges `[start, end)` name contiguous runs of them.

Ranks are dense, 0..world_size-1, numbered pipeline by pipeline, stage by stage, GPU by GPU. A worker
is one process per GPU, identified across generations by `(node, gpu)`; its rank may change.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PLAN_API_VERSION = "oobleck.dev/plan-v1"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TemplateStage(_Strict):
    """A stage of a pipeline template: layers [start, end) on `gpus` GPUs of one node."""

    start: int = Field(ge=0)
    end: int = Field(ge=1)
    node: int = Field(ge=0, description="index of the node within the pipeline")
    gpus: int = Field(ge=1, description="GPUs splitting every microbatch (a power of two)")
    gpu_offset: int = Field(ge=0, description="first local GPU of the stage on its node")
    forward_ms: float = Field(ge=0, description="per microbatch, already divided by gpus")
    backward_ms: float = Field(ge=0, description="per microbatch, already divided by gpus")


class Template(_Strict):
    """The best pipeline for a node count (the planner's cost model; see oobleck.planner)."""

    nodes: int = Field(ge=1)
    stages: list[TemplateStage] = Field(min_length=1)
    iteration_ms: float = Field(ge=0, description="T(m_ref) of the cost model")
    m_ref: int = Field(ge=1, description="microbatch count the template was optimised for")


class Stage(_Strict):
    """A stage of a concrete pipeline: its layers and the ranks that run it."""

    start: int = Field(ge=0)
    end: int = Field(ge=1)
    ranks: list[int] = Field(min_length=1, description="all hold the stage's layers; each runs 1/len of every microbatch")


class Pipeline(_Strict):
    index: int = Field(ge=0)
    template_nodes: int = Field(ge=1, description="the template this pipeline instantiates, by node count")
    nodes: list[str] = Field(min_length=1)
    microbatches: int = Field(ge=1)
    microbatch_offset: int = Field(ge=0, description="first global microbatch index this pipeline runs")
    stages: list[Stage] = Field(min_length=1)
    iteration_ms: float = Field(ge=0, description="T(microbatches) of the cost model")


class RankAssignment(_Strict):
    rank: int = Field(ge=0)
    node: str
    gpu: int = Field(ge=0, description="local GPU index on the node")
    pipeline: int = Field(ge=0)
    stage: int = Field(ge=0)
    start: int = Field(ge=0)
    end: int = Field(ge=1)


class LayerCopy(_Strict):
    """Move one layer's full state (parameters + optimizer state) from a survivor to a GPU that lacks it."""

    layer: int = Field(ge=0)
    src_node: str
    src_gpu: int = Field(ge=0)
    src_rank: int = Field(ge=0, description="the source's rank in this plan")
    dst_node: str
    dst_gpu: int = Field(ge=0)
    dst_rank: int = Field(ge=0, description="the destination's rank in this plan")
    bytes: int = Field(ge=0)


class Plan(_Strict):
    api_version: Literal["oobleck.dev/plan-v1"] = PLAN_API_VERSION
    job: str = Field(min_length=1)
    generation: int = Field(ge=0)
    num_layers: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)
    f: int = Field(ge=0)
    global_microbatches: int = Field(ge=1)
    templates: list[Template] = Field(min_length=1)
    pipelines: list[Pipeline] = Field(min_length=1)
    ranks: list[RankAssignment] = Field(min_length=1)
    copies: list[LayerCopy] = Field(default_factory=list, description="state moves to do before the first step")
    degraded: bool = Field(default=False, description="fewer than f+1 pipelines")
    iteration_ms: float = Field(ge=0, description="estimated iteration time Z (slowest pipeline)")
    lost_nodes: list[str] = Field(default_factory=list, description="nodes dropped since the previous generation")
    added_nodes: list[str] = Field(default_factory=list, description="nodes added since the previous generation")
    reason: str = Field(default="", description="why this generation exists: initial, shrink, borrow, merge, reinstantiate, ...")

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def nodes(self) -> list[str]:
        return [node for pipeline in self.pipelines for node in pipeline.nodes]

    def rank_of(self, node: str, gpu: int) -> int | None:
        for assignment in self.ranks:
            if assignment.node == node and assignment.gpu == gpu:
                return assignment.rank
        return None

    def holders(self, layer: int) -> list[int]:
        """Ranks holding `layer` (every GPU of every stage containing it), ascending."""
        return [a.rank for a in self.ranks if a.start <= layer < a.end]

    @model_validator(mode="after")
    def _consistent(self) -> "Plan":
        ranks = [a.rank for a in self.ranks]
        if ranks != list(range(len(ranks))):
            raise ValueError("ranks: must be listed in order 0..world_size-1")
        places = {(a.node, a.gpu) for a in self.ranks}
        if len(places) != len(self.ranks):
            raise ValueError("ranks: a (node, gpu) appears twice")
        total = sum(p.microbatches for p in self.pipelines)
        if total != self.global_microbatches:
            raise ValueError(
                f"pipelines: microbatches sum to {total}, global_microbatches is {self.global_microbatches}"
            )
        for pipeline in self.pipelines:
            bounds = [(s.start, s.end) for s in pipeline.stages]
            if bounds[0][0] != 0 or bounds[-1][1] != self.num_layers or any(
                a[1] != b[0] for a, b in zip(bounds, bounds[1:])
            ):
                raise ValueError(f"pipelines[{pipeline.index}]: stages must cover layers 0..{self.num_layers} contiguously")
        return self

    def to_json(self) -> str:
        """Canonical JSON: the same plan always gives the same bytes."""
        return self.model_dump_json(indent=None)
