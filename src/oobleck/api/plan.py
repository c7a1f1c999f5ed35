"""The plan: the one contract between the planner, the operator and the runtime.

The operator (or the local launcher) writes a plan; every worker reads it and executes it. A plan is
immutable; a change of layout is a new plan with a higher `generation`. Layers are the profile's
layers, identified by index; half-open ranges `[start, end)` name contiguous runs of them.

Ranks are dense, 0..world_size-1, each held by exactly one GPU. A worker is one process per GPU,
identified across generations by `(node, gpu)`; its rank may change. The planner numbers generation 0
pipeline by pipeline, stage by stage, GPU by GPU; later generations keep every surviving GPU's rank
that is still below the new world size and give the free ranks to the others (oobleck.planner), so
that a failure renumbers few workers. Nothing here depends on either rule.

The document stores, per stage, its node, its local GPUs and their ranks; nothing per rank. `ranks`,
`world_size`, `rank_of` and `holders` are derived from the stages, once per plan (validation builds
the (node, gpu) -> rank index in one pass, O(world size), and keeps it). A 1024-node x 8-GPU plan is
thus about half the JSON of the previous version and validates 4x faster. Documents of the previous
version (plan-v1, which also listed every rank) are upgraded when read, so a plan written by an
older operator stays readable.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

PLAN_API_VERSION: Final = "oobleck.dev/plan-v2"
PLAN_V1 = "oobleck.dev/plan-v1"
MAX_TENSOR_PARALLEL: Final = 16
"""the largest tensor-parallel degree a stage may have (spec.maxTensorParallel's largest value)"""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _OmitsDegreeOne(_Strict):
    """tensor_parallel = 1 is left out of the JSON: plans without tensor parallelism keep their bytes (and size)."""

    @model_serializer(mode="wrap")
    def _omit_degree_one(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("tensor_parallel") == 1:
            del data["tensor_parallel"]
        return data


def _check_tensor_parallel(degree: int, gpus: int) -> None:
    if degree & (degree - 1) or gpus % degree:
        raise ValueError(f"tensor_parallel: must be a power of two dividing the stage's {gpus} GPUs, got {degree}")


class TemplateStage(_OmitsDegreeOne):
    """A stage of a pipeline template: layers [start, end) on `gpus` GPUs of one node."""

    start: int = Field(ge=0)
    end: int = Field(ge=1)
    node: int = Field(ge=0, description="index of the node within the pipeline")
    gpus: int = Field(ge=1, description="GPUs splitting every microbatch (a power of two)")
    gpu_offset: int = Field(ge=0, description="first local GPU of the stage on its node")
    forward_ms: float = Field(ge=0, description="per microbatch, already divided by gpus / tensor_parallel")
    backward_ms: float = Field(ge=0, description="per microbatch, already divided by gpus / tensor_parallel")
    tensor_parallel: int = Field(
        default=1,
        ge=1,
        description="t: each layer is split over t GPUs (Megatron-style); the gpus / t groups split every "
        "microbatch. A power of two dividing gpus",
    )

    @model_validator(mode="after")
    def _tp_divides_gpus(self) -> TemplateStage:
        _check_tensor_parallel(self.tensor_parallel, self.gpus)
        return self


class Template(_Strict):
    """The best pipeline for a node count (the planner's cost model; see oobleck.planner)."""

    nodes: int = Field(ge=1)
    stages: list[TemplateStage] = Field(min_length=1)
    iteration_ms: float = Field(ge=0, description="T(m_ref) of the cost model")
    m_ref: int = Field(ge=1, description="microbatch count the template was optimised for")
    max_microbatches: int | None = Field(
        default=None,
        ge=1,
        description="the most microbatches one pipeline of this template may run: the memory rule checked at that "
        "count (in flight on stage s: min(stages - s + 1, count)); None: any count fits",
    )


class Stage(_OmitsDegreeOne):
    """A stage of a concrete pipeline: layers [start, end) on GPUs of one node, one rank per GPU.

    `forward_ms`/`backward_ms` are set only on a stage whose bounds are not its template stage's (layers
    moved off a slow node, oobleck.planner.rebalance): the runtime's pace needs every stage's profiled cost,
    and a template names only its own stages'. Left out of the JSON when unset."""

    start: int = Field(ge=0)
    end: int = Field(ge=1)
    node: str = Field(min_length=1, description="the node running the stage (one of its pipeline's nodes)")
    gpus: list[Annotated[int, Field(ge=0)]] = Field(
        min_length=1, description="local GPUs of the node running the stage"
    )
    ranks: list[Annotated[int, Field(ge=0)]] = Field(
        min_length=1,
        description="the rank of each GPU in `gpus` (as many; checked by the Plan): all hold the stage's layers; "
        "ranks[i] runs the i-th 1/len of every microbatch",
    )
    tensor_parallel: int = Field(
        default=1,
        ge=1,
        description="t: consecutive runs of t ranks split each layer (Megatron-style) and share one 1/(len/t) of "
        "every microbatch. A power of two dividing len(gpus) (runtime/train/tp_stage.py)",
    )
    forward_ms: float | None = Field(
        default=None, ge=0, description="profiled, per microbatch, divided by the GPUs (None: the template stage's)"
    )
    backward_ms: float | None = Field(
        default=None, ge=0, description="profiled, per microbatch, divided by the GPUs (None: the template stage's)"
    )

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = _OmitsDegreeOne._omit_degree_one(self, handler)
        for name in ("forward_ms", "backward_ms"):
            if data.get(name, 0) is None:
                del data[name]
        return data

    @model_validator(mode="after")
    def _tp_divides_gpus(self) -> Stage:
        _check_tensor_parallel(self.tensor_parallel, len(self.gpus))
        if (self.forward_ms is None) != (self.backward_ms is None):
            raise ValueError("forward_ms, backward_ms: set both or neither")
        return self


class Pipeline(_Strict):
    index: int = Field(ge=0)
    template_nodes: int = Field(ge=1, description="the template this pipeline instantiates, by node count")
    nodes: list[str] = Field(min_length=1)
    microbatches: int = Field(ge=1)
    microbatch_offset: int = Field(ge=0, description="first global microbatch index this pipeline runs")
    stages: list[Stage] = Field(min_length=1)
    iteration_ms: float = Field(ge=0, description="T(microbatches) of the cost model")


@dataclass(frozen=True, slots=True)
class RankAssignment:
    """One rank of a plan: where it runs and what it holds (derived from the stages, never stored)."""

    rank: int
    node: str
    gpu: int  # local GPU index on the node
    pipeline: int
    stage: int
    start: int
    end: int


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
    source_kind: Literal["live", "snapshot", "checkpoint"] = Field(
        default="live",
        description="live: the source's current state; snapshot: its host-memory snapshot at the plan's "
        "restore_step (src == dst: the destination's own); checkpoint: read by the destination (src == dst) "
        "from the checkpoint directory at restore_step",
    )
    src_tensor_parallel: int = Field(
        default=1,
        ge=1,
        le=MAX_TENSOR_PARALLEL,
        description="the source holds the layer as shard src_tp_index of src_tensor_parallel (1: whole); the "
        "copy's (t, k) header must say the same (runtime/train/shard_copy.py). Left out of the JSON when 1",
    )
    src_tp_index: int = Field(default=0, ge=0, description="k of the source's shard (0 <= k < src_tensor_parallel)")

    @model_serializer(mode="wrap")
    def _omit_whole_source(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("src_tensor_parallel") == 1 and data.get("src_tp_index") == 0:
            del data["src_tensor_parallel"], data["src_tp_index"]
        return data

    @model_validator(mode="after")
    def _shard_in_range(self) -> LayerCopy:
        t, k = self.src_tensor_parallel, self.src_tp_index
        if t & (t - 1):
            raise ValueError(f"src_tensor_parallel: must be a power of two <= {MAX_TENSOR_PARALLEL}, got {t}")
        if k >= t:
            raise ValueError(f"src_tp_index: must be below src_tensor_parallel ({t}), got {k}")
        return self

    @property
    def src_shard(self) -> tuple[int, int]:
        """(t, k) of the source's piece of the layer: (1, 0) for a whole layer."""
        return self.src_tensor_parallel, self.src_tp_index


_INDEX = "_rank_index"  # key in a Plan's __dict__: {(node, gpu): rank}, built by validation (not a field)
_RANKS = "_rank_list"  # key in a Plan's __dict__: the derived RankAssignments, built on first use


class Plan(_Strict):
    api_version: Literal["oobleck.dev/plan-v2"] = PLAN_API_VERSION
    job: str = Field(min_length=1)
    generation: int = Field(ge=0)
    num_layers: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)
    f: int = Field(ge=0)
    global_microbatches: int = Field(ge=1)
    templates: list[Template] = Field(min_length=1)
    pipelines: list[Pipeline] = Field(min_length=1)
    copies: list[LayerCopy] = Field(default_factory=list, description="state moves to do before the first step")
    degraded: bool = Field(default=False, description="fewer than f+1 pipelines")
    iteration_ms: float = Field(ge=0, description="estimated iteration time Z (slowest pipeline)")
    lost_nodes: list[str] = Field(default_factory=list, description="nodes dropped since the previous generation")
    added_nodes: list[str] = Field(default_factory=list, description="nodes added since the previous generation")
    reason: str = Field(
        default="", description="why this generation exists: initial, shrink, borrow, merge, reinstantiate, ..."
    )
    restore_step: int | None = Field(
        default=None,
        ge=0,
        description="set on a rollback: every rank resets to this step (every layer from `copies`) and replays from it",
    )
    slowdowns: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict,
        description="the measured slowdowns of the nodes this generation was planned around (a straggler "
        "mitigation, oobleck.operator.stragglers); empty: the profile's speeds",
    )
    mitigation_step: int | None = Field(
        default=None, ge=0, description="the step the members agreed on when this straggler mitigation was planned"
    )
    mitigations: int = Field(
        default=0,
        ge=0,
        description="straggler plans (mitigations and their undoing) up to this one since the layout was last "
        "planned from scratch (0: none): each stays twice as long as the one before",
    )
    benched: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict,
        description="nodes taken out of training for their slowness (stragglers.mitigation spare), with the "
        "slowdown each was taken out at: in no pipeline, their pods wait as warm spares until a later generation "
        "takes them back",
    )
    pace_anchors: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict,
        description="straggler detection (oobleck.operator.stragglers): each node's calibrated pace over that of "
        "the nodes on its layers, when it last had such peers (a node slow from its start reads 1 against its "
        "own pace); a node without peers in this plan is measured by its own pace times this (absent: 1)",
    )
    # -- derived (cached in __dict__ beside the fields: equality, dumps and copies see only fields) --

    def _index(self) -> dict[tuple[str, int], int]:
        index = self.__dict__.get(_INDEX)
        if index is None:  # a plan made without validation (model_construct, model_copy(update=...))
            index = self.__dict__[_INDEX] = {(s.node, g): r for s in self._stages() for g, r in zip(s.gpus, s.ranks)}
        return index

    def _stages(self) -> list[Stage]:
        return [stage for pipeline in self.pipelines for stage in pipeline.stages]

    @property
    def ranks(self) -> tuple[RankAssignment, ...]:
        """Every rank in order (ranks[r].rank == r), derived from the stages and cached."""
        ranks = self.__dict__.get(_RANKS)
        if ranks is None:
            table: list[RankAssignment | None] = [None] * self.world_size
            for pipeline in self.pipelines:
                for s, stage in enumerate(pipeline.stages):
                    for gpu, rank in zip(stage.gpus, stage.ranks):
                        table[rank] = RankAssignment(rank, stage.node, gpu, pipeline.index, s, stage.start, stage.end)
            ranks = self.__dict__[_RANKS] = tuple(table)  # type: ignore[arg-type]
        return ranks

    @property
    def world_size(self) -> int:
        return len(self._index())

    @property
    def nodes(self) -> list[str]:
        return [node for pipeline in self.pipelines for node in pipeline.nodes]

    def rank_of(self, node: str, gpu: int) -> int | None:
        return self._index().get((node, gpu))

    def holders(self, layer: int) -> list[int]:
        """Ranks holding `layer` (every GPU of every stage containing it), ascending."""
        return sorted(rank for stage in self._stages() if stage.start <= layer < stage.end for rank in stage.ranks)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Plan:
        copied = super().model_copy(update=update, deep=deep)
        if update:  # the derived values may no longer hold: rebuilt on first use
            copied.__dict__.pop(_INDEX, None)
            copied.__dict__.pop(_RANKS, None)
        return copied

    # -- validation --

    # plan-v1 documents are upgraded here rather than in a "before" validator, which would make every
    # JSON parse build Python objects first (1.7x slower for a 1024-node plan).
    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Plan:
        if isinstance(obj, dict) and obj.get("api_version") == PLAN_V1:
            obj = upgrade_v1(obj)
        return super().model_validate(obj, **kwargs)

    @classmethod
    def model_validate_json(cls, json_data: str | bytes | bytearray, **kwargs: Any) -> Plan:
        try:
            return super().model_validate_json(json_data, **kwargs)
        except ValidationError:
            try:
                data = json.loads(json_data)
            except ValueError:
                data = None
            if not (isinstance(data, dict) and data.get("api_version") == PLAN_V1):
                raise
        return super().model_validate(upgrade_v1(data), **kwargs)

    @model_validator(mode="after")
    def _benched_train_nowhere(self) -> Plan:
        training = sorted(set(self.nodes) & set(self.benched))
        if training:
            raise ValueError(f"benched: nodes {training} are in a pipeline (a benched node trains in none)")
        return self

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        total = sum(p.microbatches for p in self.pipelines)
        if total != self.global_microbatches:
            raise ValueError(
                f"pipelines: microbatches sum to {total}, global_microbatches is {self.global_microbatches}"
            )
        index: dict[tuple[str, int], int] = {}
        offset = gpus = 0
        seen: set[str] = set()
        for i, pipeline in enumerate(self.pipelines):
            where = f"pipelines[{i}]"
            if pipeline.index != i:
                raise ValueError(f"{where}: index is {pipeline.index}, must be its position {i}")
            if pipeline.microbatch_offset != offset:
                raise ValueError(
                    f"{where}: microbatch_offset is {pipeline.microbatch_offset}, expected {offset} "
                    "(pipelines run contiguous blocks of microbatches, in order)"
                )
            offset += pipeline.microbatches
            members = set(pipeline.nodes)
            if len(members) != len(pipeline.nodes) or members & seen:
                twice = sorted({n for n in pipeline.nodes if pipeline.nodes.count(n) > 1} | (members & seen))
                raise ValueError(f"{where}: nodes {twice} appear twice in the plan")
            seen |= members
            bounds = [(s.start, s.end) for s in pipeline.stages]
            if (
                bounds[0][0] != 0
                or bounds[-1][1] != self.num_layers
                or any(a[1] != b[0] for a, b in zip(bounds, bounds[1:]))
            ):
                raise ValueError(f"{where}: stages must cover layers 0..{self.num_layers} contiguously")
            if any(start >= end for start, end in bounds):
                raise ValueError(f"{where}: a stage holds no layer: {bounds}")
            hosts = set()
            for s, stage in enumerate(pipeline.stages):  # per stage, not per GPU: C-level loops inside
                node = stage.node
                if node not in members:
                    raise ValueError(f"{where}.stages[{s}]: node {node!r} is not one of the pipeline's nodes")
                if len(stage.ranks) != len(stage.gpus):
                    raise ValueError(
                        f"{where}.stages[{s}]: {len(stage.ranks)} ranks for {len(stage.gpus)} gpus; one rank per GPU"
                    )
                if max(stage.gpus) >= self.gpus_per_node:
                    raise ValueError(
                        f"{where}.stages[{s}]: GPU {max(stage.gpus)} of {node!r}, gpus_per_node is {self.gpus_per_node}"
                    )
                hosts.add(node)
                gpus += len(stage.gpus)
                index.update(zip([(node, gpu) for gpu in stage.gpus], stage.ranks))
                if len(index) < gpus:
                    shared = next(
                        g for g in stage.gpus if stage.gpus.count(g) > 1 or self._runs_elsewhere(node, g, stage)
                    )
                    raise ValueError(f"{where}.stages[{s}]: GPU {shared} of {node!r} runs two ranks")
            if hosts != members:
                raise ValueError(f"{where}: nodes {sorted(members - hosts)} host no stage")
        ranks = set(index.values())
        if len(ranks) != len(index) or max(ranks) != len(index) - 1:
            used = sorted(r for p in self.pipelines for st in p.stages for r in st.ranks)
            repeated = sorted({r for r, nxt in zip(used, used[1:]) if r == nxt})
            missing = sorted(set(range(len(index))) - ranks)
            raise ValueError(
                f"ranks: must be 0..{len(index) - 1}, each on one GPU; listed twice {repeated}, missing {missing}"
            )
        for c, copy in enumerate(self.copies):
            for side, node, gpu, claimed in (
                ("src", copy.src_node, copy.src_gpu, copy.src_rank),
                ("dst", copy.dst_node, copy.dst_gpu, copy.dst_rank),
            ):
                if index.get((node, gpu)) != claimed:
                    raise ValueError(
                        f"copies[{c}]: {side}_rank is {claimed}, ({node!r}, {gpu}) has rank {index.get((node, gpu))}"
                    )
            if copy.layer >= self.num_layers:
                raise ValueError(f"copies[{c}]: layer {copy.layer}, the plan has {self.num_layers} layers")
        self.__dict__[_INDEX] = index
        return self

    def _runs_elsewhere(self, node: str, gpu: int, stage: Stage) -> bool:
        """Whether another stage than `stage` uses GPU `gpu` of `node` (for an error message)."""
        return any(other is not stage and other.node == node and gpu in other.gpus for other in self._stages())

    def to_json(self) -> str:
        """Canonical JSON: the same plan always gives the same bytes."""
        return self.model_dump_json(indent=None)


def upgrade_v1(data: dict[str, Any]) -> dict[str, Any]:
    """A plan-v1 document (every rank listed, stages naming their ranks) as a plan-v2 one.

    Raises ValueError when a v1 stage cannot be expressed (a rank not listed, or ranks on several nodes).
    """
    data = dict(data)
    assignments = {a["rank"]: a for a in data.pop("ranks", None) or []}
    pipelines = []
    for i, pipeline in enumerate(data.get("pipelines") or []):
        stages = []
        for s, stage in enumerate(pipeline.get("stages") or []):
            ranks = list(stage.get("ranks") or [])
            places = [assignments.get(r) for r in ranks]
            if not ranks or None in places:
                raise ValueError(f"pipelines[{i}].stages[{s}]: v1 ranks {ranks} are not all listed in ranks")
            nodes = {p["node"] for p in places if p is not None}
            if len(nodes) != 1:
                raise ValueError(f"pipelines[{i}].stages[{s}]: v1 ranks {ranks} span nodes {sorted(nodes)}")
            stages.append(
                {
                    "start": stage["start"],
                    "end": stage["end"],
                    "node": nodes.pop(),
                    "gpus": [p["gpu"] for p in places if p is not None],
                    "ranks": ranks,
                }
            )
        pipelines.append({**pipeline, "stages": stages})
    return {**data, "api_version": PLAN_API_VERSION, "pipelines": pipelines}
