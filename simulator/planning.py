"""The simulator's one door into the planner: every call of `oobleck.planner` lives here.

Only the planner's public functions are used (generate_templates, instantiate, reconfigure,
LostLayersError), so a change of their signatures is fixed in this module alone. Everything the
policies need comes back as plain numbers: iteration time Z, pipelines as node groups, copy bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from oobleck.api.plan import Plan, Template
from oobleck.api.profile import ClusterShape, ModelProfile
from oobleck.planner import LostLayersError, instantiate, reconfigure
from oobleck.planner.errors import PlanningError
from oobleck.planner.instantiate import TemplateCost, known, split_batch, template_cost
from oobleck.planner.templates import generate_templates

JOB = "simulated"


class NoPipeline(Exception):
    """The nodes left cannot form a single pipeline (fewer than the smallest template needs)."""


@dataclass(frozen=True)
class PipelineTiming:
    """One pipeline's cost model at any node speeds: the planner's T(m) = base + (m - 1) * slope
    (oobleck.planner.instantiate), with base = the stages' compute + the rest (activation transfers) and
    slope = the slowest stage, each stage's compute divided by its node's speed. At full speed this is
    the template's own T(m), so the planner's Z is unchanged."""

    stage_ms: tuple[float, ...]  # forward + backward per microbatch at full speed
    stage_node: tuple[int, ...]  # each stage's node, as a position in the pipeline's node group
    stage_layers: tuple[tuple[int, int], ...]  # each stage's layers [start, end)
    stage_gpus: tuple[int, ...]
    transfer_ms: float  # T(1) beyond the stages' compute
    max_microbatches: int | None

    def cost(self, nodes: Sequence[str], speeds: Mapping[str, float]) -> TemplateCost:
        slowed = [ms / speeds.get(nodes[k], 1.0) for ms, k in zip(self.stage_ms, self.stage_node)]
        return TemplateCost(len(nodes), self.transfer_ms + sum(slowed), max(slowed), self.max_microbatches)


def pipeline_timing(template: Template) -> PipelineTiming:
    """A template's timing (cached per template object, as the planner caches its costs)."""
    return known(template, "simulator timing", lambda: _pipeline_timing(template))


def _pipeline_timing(template: Template) -> PipelineTiming:
    base = template_cost(template)
    stage_ms = tuple(stage.forward_ms + stage.backward_ms for stage in template.stages)
    return PipelineTiming(
        stage_ms=stage_ms,
        stage_node=tuple(stage.node for stage in template.stages),
        stage_layers=tuple((stage.start, stage.end) for stage in template.stages),
        stage_gpus=tuple(stage.gpus for stage in template.stages),
        transfer_ms=max(0.0, base.base_ms - sum(stage_ms)),
        max_microbatches=base.max_microbatches,
    )


@dataclass(frozen=True)
class Layout:
    """A plan reduced to what the policies price: Z, samples per iteration, node groups, bytes per node."""

    iteration_s: float
    samples_per_iteration: int
    groups: tuple[tuple[str, ...], ...]  # nodes of each pipeline, in plan order
    group_iteration_s: tuple[float, ...]  # each pipeline's own T(nb)
    group_samples: tuple[int, ...]  # samples each pipeline runs per iteration
    degraded: bool
    state_bytes_per_node: int  # the most layer state any one node holds (all its GPUs together)
    timings: tuple[PipelineTiming, ...] = ()  # each pipeline's cost model, for node speeds other than 1

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_iteration / self.iteration_s

    @property
    def nodes(self) -> int:
        return sum(len(g) for g in self.groups)


def _node_state(plan: Plan, layer_bytes: Sequence[int]) -> int:
    per_node: dict[str, int] = {}
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            per_node[stage.node] = per_node.get(stage.node, 0) + len(stage.gpus) * sum(
                layer_bytes[stage.start : stage.end]
            )
    return max(per_node.values(), default=0)


def copy_seconds(plan: Plan, bandwidth: float) -> float:
    """Time of a plan's layer copies: copies between distinct node pairs run in parallel, so the node
    that sends or receives the most bytes over its link sets the time (copies within a node are free)."""
    into: dict[str, int] = {}
    out: dict[str, int] = {}
    for copy in plan.copies:
        if copy.src_node != copy.dst_node:
            into[copy.dst_node] = into.get(copy.dst_node, 0) + copy.bytes
            out[copy.src_node] = out.get(copy.src_node, 0) + copy.bytes
    busiest = max([*into.values(), *out.values()], default=0)
    return busiest / bandwidth


class Planner:
    """Templates generated once for the largest cluster a trace reaches; plans on any node set of it."""

    def __init__(
        self,
        profile: ModelProfile,
        cluster: ClusterShape,
        microbatches: int,
        *,
        m_ref: int | None = None,
        min_nodes: int = 1,
        templates: Sequence[Template] | None = None,
        max_tp: int = 1,
    ) -> None:
        self.profile = profile
        self.cluster = cluster
        self.microbatches = microbatches
        self.layer_bytes = [layer.state_bytes for layer in profile.layers]
        # f = 0 here: the template set does not depend on f beyond the (f+1)*n0 <= N check, which
        # instantiate applies per call (degraded plans allowed: a shrunken cluster keeps training).
        if templates is not None:  # a given plan's own (--start-plan)
            self.templates: list[Template] = list(templates)
        elif m_ref is None:
            # The planner's advice: m_ref = the most microbatches a pipeline will run. With the default, a
            # deep model's few pipelines may not hold the batch at all; then plan for what they must hold.
            # A larger m_ref keeps more microbatches in flight, which can deepen the pipelines: iterate a little.
            self.templates = generate_templates(profile, cluster, f=0, min_nodes_per_pipeline=min_nodes, max_tp=max_tp)
            for _ in range(4):
                most = cluster.nodes // min(t.nodes for t in self.templates)
                need = -(-microbatches // most)
                # A pipeline's microbatches are capped at m_ref only while m_ref < its stage count.
                capped = any(t.m_ref < len(t.stages) for t in self.templates)
                if not capped or need <= self.templates[0].m_ref:
                    break
                self.templates = generate_templates(
                    profile, cluster, f=0, m_ref=need, min_nodes_per_pipeline=min_nodes, max_tp=max_tp
                )
        else:
            self.templates = generate_templates(
                profile, cluster, f=0, m_ref=m_ref, min_nodes_per_pipeline=min_nodes, max_tp=max_tp
            )
        self.min_nodes = min(t.nodes for t in self.templates)
        self._fresh: dict[tuple[int, int], tuple[Plan, int] | None] = {}
        self._why = ""  # why the last uncached count formed no plan (for the error message)

    def layout(self, plan: Plan) -> Layout:
        mbs = self.profile.microbatch_size
        by_size = {t.nodes: t for t in plan.templates}
        return Layout(
            iteration_s=plan.iteration_ms / 1e3,
            samples_per_iteration=plan.global_microbatches * mbs,
            groups=tuple(tuple(p.nodes) for p in plan.pipelines),
            group_iteration_s=tuple(p.iteration_ms / 1e3 for p in plan.pipelines),
            group_samples=tuple(p.microbatches * mbs for p in plan.pipelines),
            degraded=plan.degraded,
            state_bytes_per_node=_node_state(plan, self.layer_bytes),
            timings=tuple(pipeline_timing(by_size[p.template_nodes]) for p in plan.pipelines),
        )

    def _fresh_on_count(self, count: int, f: int) -> tuple[Plan, int] | None:
        """The plan on `count` nodes named "0".."count-1" (nodes beyond a formable count stay idle)."""
        key = (count, f)
        if key not in self._fresh:
            found = None
            self._why = ""
            # Counts the templates cannot split exactly leave a few nodes idle: fewer than n0 need dropping.
            for used in range(count, max(self.min_nodes, count - self.min_nodes + 1) - 1, -1):
                try:
                    names = [str(i) for i in range(used)]
                    plan = instantiate(
                        self.templates,
                        names,
                        f,
                        self.microbatches,
                        JOB,
                        gpus_per_node=self.cluster.gpus_per_node,
                        allow_degraded=True,
                    )
                except PlanningError as error:
                    if used == count:
                        self._why = str(error)
                    continue
                found = (plan, used)
                break
            self._fresh[key] = found
        return self._fresh[key]

    def fresh(self, nodes: Sequence[str], f: int) -> Layout:
        """The best layout from scratch on `nodes` (taken in the order given); NoPipeline if none fits.

        Plans on the same node count differ only in node names: one is planned per count and renamed.
        """
        found = self._fresh_on_count(len(nodes), f)
        if found is None:
            raise NoPipeline(
                f"{len(nodes)} nodes form no pipeline (the smallest template has {self.min_nodes} nodes)"
                + (f": {self._why}" if getattr(self, "_why", "") else "")
            )
        plan, used = found
        layout = self.layout(plan)
        names = dict(zip((str(i) for i in range(used)), nodes))
        return replace(layout, groups=tuple(tuple(names[n] for n in g) for g in layout.groups))

    def initial(self, nodes: Sequence[str], f: int) -> Plan:
        """Generation 0 as the operator creates it (validated, with every rank), for reconfigure."""
        try:
            return instantiate(
                self.templates,
                list(nodes),
                f,
                self.microbatches,
                JOB,
                gpus_per_node=self.cluster.gpus_per_node,
                allow_degraded=True,
            )
        except PlanningError as error:
            raise NoPipeline(str(error)) from error

    def reconfigure(self, plan: Plan, lost: Sequence[str], added: Sequence[str]) -> Plan:
        """The next generation; LostLayersError when a layer lost every replica, NoPipeline when the
        survivors cannot form any pipeline."""
        try:
            return reconfigure(
                plan,
                self.templates,
                self.layer_bytes,
                lost=list(lost),
                added=list(added),
                bandwidth=self.cluster.inter_node_bandwidth,
            )
        except LostLayersError:
            raise
        except PlanningError as error:
            raise NoPipeline(str(error)) from error


def paced(
    layout: Layout,
    speeds: Mapping[str, float],
    *,
    resplit: bool,
    timings: Sequence[PipelineTiming] | None = None,
    microbatch_size: int = 1,
) -> Layout:
    """`layout` at node speeds: every pipeline's T(nb) with its stages slowed, Z the slowest pipeline's.

    resplit=False keeps each pipeline's share of the batch (a job that does not know the speeds: it
    runs at its slowest pipeline's pace); resplit=True water-fills the batch by the slowed costs, as the
    planner's split does (oobleck's mitigation (a)). `timings` replaces the layout's own (moved stage
    boundaries, mitigation (b))."""
    timings = tuple(layout.timings if timings is None else timings)
    costs = [timing.cost(group, speeds) for timing, group in zip(timings, layout.groups, strict=True)]
    samples = layout.group_samples
    if resplit:
        microbatches = sum(samples) // microbatch_size
        samples = tuple(nb * microbatch_size for nb in split_batch(costs, microbatches, engine="compiled"))
    times = tuple(cost.at(n // microbatch_size) / 1e3 for cost, n in zip(costs, samples))
    return replace(layout, iteration_s=max(times), group_iteration_s=times, group_samples=samples, timings=timings)


def rebalanced(
    timing: PipelineTiming,
    nodes: Sequence[str],
    speeds: Mapping[str, float],
    layer_ms: Sequence[float],
    layer_bytes: Sequence[int],
    layer_activation: Sequence[int],
    gpu_memory_bytes: int,
) -> tuple[PipelineTiming, int]:
    """The pipeline's stage boundaries moved so that no stage takes longer (at the nodes' speeds) than it
    must, and the bytes the busiest node receives (mitigation (b): its slow node's stage carries less).

    Stages keep their nodes, GPUs and order; a stage's time stays proportional to its layers' profiled
    time (its own ratio, which carries its GPU split). Every stage keeps to the planner's memory rule
    (oobleck.planner.templates: state + in-flight microbatches x activations / GPUs <= GPU memory), with
    as many microbatches in flight as the stage can have (stages after it + 1). Minimises the slowest stage
    by bisection on it, each stage taking greedily all the layers that fit (what a contiguous split with
    a fixed stage order allows)."""
    count = len(timing.stage_ms)
    ratio = []
    for (start, end), ms in zip(timing.stage_layers, timing.stage_ms):
        profiled = sum(layer_ms[start:end])
        ratio.append(ms / profiled if profiled > 0 else 1.0)
    speed = [speeds.get(nodes[k], 1.0) for k in timing.stage_node]
    total = timing.stage_layers[-1][1]

    def fits(k: int, state: int, activation: int) -> bool:
        return state + (count - k) * activation / timing.stage_gpus[k] <= gpu_memory_bytes

    def split(bottleneck_ms: float) -> list[tuple[int, int]] | None:
        bounds, position = [], 0
        for k in range(count):
            end, used_ms, used_bytes, used_activation = position, 0.0, 0, 0
            last = total - (count - k - 1)  # leave a layer for each stage after this one
            while end < last:
                ms = used_ms + layer_ms[end] * ratio[k] / speed[k]
                held, activation = used_bytes + layer_bytes[end], used_activation + layer_activation[end]
                if ms > bottleneck_ms * (1 + 1e-12) or not fits(k, held, activation):
                    break
                used_ms, used_bytes, used_activation, end = ms, held, activation, end + 1
            if end == position or (k == count - 1 and end < total):
                return None
            bounds.append((position, end))
            position = end
        return bounds

    slowest = max(ms / v for ms, v in zip(timing.stage_ms, speed))
    low, high, best = 0.0, slowest, list(timing.stage_layers)
    for _ in range(60):
        middle = (low + high) / 2
        found = split(middle)
        if found is None:
            low = middle
        else:
            high, best = middle, found
    stage_ms = tuple(sum(layer_ms[a:b]) * ratio[k] for k, (a, b) in enumerate(best))
    if max(ms / v for ms, v in zip(stage_ms, speed)) >= slowest:  # nothing better: keep the layout as it is
        return timing, 0
    received: dict[str, int] = {}
    for k, ((a, b), (old_a, old_b)) in enumerate(zip(best, timing.stage_layers)):
        new_layers = set(range(a, b)) - set(range(old_a, old_b))
        node = nodes[timing.stage_node[k]]
        received[node] = received.get(node, 0) + timing.stage_gpus[k] * sum(layer_bytes[i] for i in new_layers)
    return replace(timing, stage_ms=stage_ms, stage_layers=tuple(best)), max(received.values(), default=0)


__all__ = [
    "Layout",
    "LostLayersError",
    "NoPipeline",
    "PipelineTiming",
    "Planner",
    "copy_seconds",
    "paced",
    "rebalanced",
]
