"""The simulator's one door into the planner: every call of `oobleck.planner` lives here.

Only the planner's public functions are used (generate_templates, instantiate, reconfigure,
LostLayersError), so a change of their signatures is fixed in this module alone. Everything the
policies need comes back as plain numbers: iteration time Z, pipelines as node groups, copy bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from oobleck.api.plan import Plan, Template
from oobleck.api.profile import ClusterShape, ModelProfile
from oobleck.planner import LostLayersError, instantiate, reconfigure
from oobleck.planner.errors import PlanningError
from oobleck.planner.templates import generate_templates

JOB = "simulated"


class NoPipeline(Exception):
    """The nodes left cannot form a single pipeline (fewer than the smallest template needs)."""


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
        return Layout(
            iteration_s=plan.iteration_ms / 1e3,
            samples_per_iteration=plan.global_microbatches * mbs,
            groups=tuple(tuple(p.nodes) for p in plan.pipelines),
            group_iteration_s=tuple(p.iteration_ms / 1e3 for p in plan.pipelines),
            group_samples=tuple(p.microbatches * mbs for p in plan.pipelines),
            degraded=plan.degraded,
            state_bytes_per_node=_node_state(plan, self.layer_bytes),
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


__all__ = ["Layout", "LostLayersError", "NoPipeline", "Planner", "copy_seconds"]
