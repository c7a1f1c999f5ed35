"""Oobleck's policy in the simulator: the planner's reconfiguration in place, rollback to a snapshot
beyond f failures, scale-up on additions, and the priced straggler mitigations (re-split, move layers,
bench slow nodes). The shared rules are policies.py's."""

from __future__ import annotations

import math
from dataclasses import dataclass

from oobleck.api.plan import Plan

from .costs import OobleckCosts
from .planning import Layout, LostLayersError, NoPipeline, Planner, copy_seconds, paced, rebalanced
from .policies import TRAINING, Policy
from .traces import Trace


@dataclass(frozen=True)
class Option:
    """A straggler mitigation as priced: the layout it leads to, its copy time and its pause."""

    name: str
    plan: Plan
    layout: Layout
    copy_s: float
    pause_s: float
    benched: frozenset[str]


class OobleckPolicy(Policy):
    """Our planner's reconfiguration in place; rollback to a snapshot beyond f; scale-up on additions."""

    name = "oobleck"

    def __init__(
        self, trace: Trace, planner: Planner, f: int, costs: OobleckCosts, start_plan: Plan | None = None
    ) -> None:
        super().__init__(trace)
        self.planner, self.f, self.costs = planner, f, costs
        self.start_plan = start_plan  # generation 0 as given (its nodes named as the trace's first nodes)
        self.plan: Plan | None = None
        self.bandwidth = planner.cluster.inter_node_bandwidth
        self.layout: Layout | None = None  # the plan at the nodes' speeds, as the job runs it now
        self.benched: set[str] = set()  # up, but taken out of training for being slow (mitigation (c))
        self.layer_ms = [layer.forward_ms + layer.backward_ms for layer in planner.profile.layers]
        self.layer_activation = [layer.activation_bytes for layer in planner.profile.layers]
        self.keep_steps = float(costs.snapshot_interval_steps)

    def nodes(self) -> list[str]:
        return [n for n in self.alive if n not in self.benched]

    def _known(self, layout: Layout, timings: tuple | None = None) -> Layout:
        """A layout planned with the speeds known: the batch split by them (the plan's own at full speed)."""
        planned = {n for group in layout.groups for n in group}
        if timings is None and all(self.speeds.get(n, 1.0) == 1.0 for n in planned):
            return layout
        return paced(layout, self.speeds, resplit=True, timings=timings, microbatch_size=self._mbs)

    @property
    def _mbs(self) -> int:
        return self.planner.profile.microbatch_size

    def _adopt(self, plan: Plan) -> Layout:
        self.plan = plan
        layout = self._known(self.planner.layout(plan))
        self.layout = layout
        self.set_layout(layout)
        if any(self.speeds.get(n, 1.0) != 1.0 for group in layout.groups for n in group):
            # The speeds are known already: weigh moving layers or benching at once (after this recovery).
            self.wake_at = self.now
        return layout

    def sped(self, changed: set[str]) -> None:
        if self.plan is None or self.layout is None:
            return
        # The job keeps its split until the change is known: it runs at its slowest pipeline's pace.
        old = self.train_rate
        self.layout = paced(self.layout, self.speeds, resplit=False, microbatch_size=self._mbs)
        self.set_layout(self.layout)
        self.repace(old)
        self.wake_at = self.now + self.costs.straggler_window_steps * self.layout.iteration_s

    def wake(self) -> None:
        """Price the straggler mitigations as copy time + horizon x Z and take the cheapest (ties: keep)."""
        if self.plan is None or self.layout is None:
            return
        options = [Option("keep", self.plan, self.layout, 0.0, 0.0, frozenset(self.benched))]
        options += [o for o in (self._resplit(), self._move_layers(), self._bench()) if o is not None]
        best = min(options, key=lambda o: o.copy_s + self.costs.horizon_steps * o.layout.iteration_s)
        if best.name == "keep":
            return
        self.plan, self.layout, self.benched = best.plan, best.layout, set(best.benched)
        self.set_layout(best.layout)
        if self.state != TRAINING and self.schedule:  # mid-recovery: the mitigation follows it
            resume = self.schedule[-1][0]
            self.schedule = [(resume, "mitigating", 0.0), (resume + best.pause_s, TRAINING, self.train_rate)]
        else:
            self.pause("mitigating", best.pause_s)
        self.note(f"straggler mitigation: {best.name}, Z = {best.layout.iteration_s * 1e3:.1f} ms")

    def _resplit(self) -> Option:
        """(a) The batch split by the pipelines' slowed costs: nothing moves, a new generation is published."""
        assert self.plan is not None and self.layout is not None, "only while a plan trains"
        layout = paced(self.layout, self.speeds, resplit=True, microbatch_size=self._mbs)
        return Option("re-split the batch", self.plan, layout, 0.0, self.costs.plan_s, frozenset(self.benched))

    def _move_layers(self) -> Option | None:
        """(b) Stage boundaries moved by node speed inside every pipeline, the batch re-split."""
        assert self.plan is not None and self.layout is not None, "only while a plan trains"
        timings, busiest = [], 0
        for timing, group in zip(self.layout.timings, self.layout.groups):
            moved, received = rebalanced(
                timing,
                group,
                self.speeds,
                self.layer_ms,
                self.planner.layer_bytes,
                self.layer_activation,
                self.planner.cluster.gpu_memory_bytes,
            )
            timings.append(moved)
            busiest = max(busiest, received)  # pipelines are disjoint: their copies run in parallel
        if not busiest:
            return None
        layout = paced(self.layout, self.speeds, resplit=True, timings=tuple(timings), microbatch_size=self._mbs)
        copy_s = busiest / self.bandwidth
        pause_s = self.costs.plan_s + self.costs.rendezvous_s + copy_s
        return Option("move layers by node speed", self.plan, layout, copy_s, pause_s, frozenset(self.benched))

    def _bench(self) -> Option | None:
        """(c) Slow nodes out of training (kept up), benched nodes back at full speed in: the planner's
        reconfigure. Not when it would cost the f + 1 pipelines that tolerate f failures."""
        assert self.plan is not None, "only while a plan trains"
        planned = {n for p in self.plan.pipelines for n in p.nodes}
        slow = sorted(n for n in planned if self.speeds.get(n, 1.0) < 1.0)
        back = [n for n in self.alive if n in self.benched and self.speeds.get(n, 1.0) == 1.0]
        if not slow and not back:
            return None
        try:
            plan = self.planner.reconfigure(self.plan, slow, back)
        except (NoPipeline, LostLayersError):
            return None
        if plan.degraded and not self.plan.degraded:
            return None
        copy_s = copy_seconds(plan, self.bandwidth)
        pause_s = self.costs.plan_s + self.costs.rendezvous_s + copy_s
        benched = frozenset((self.benched - set(back)) | set(slow))
        return Option(_membership(slow, back), plan, self._known(self.planner.layout(plan)), copy_s, pause_s, benched)

    def start(self) -> None:
        try:
            if self.start_plan is None:
                self._adopt(self.planner.initial(self.nodes(), self.f))
            else:  # the given plan, adjusted to the nodes actually up when the job can start
                up, planned = set(self.nodes()), set(self.start_plan.nodes)
                lost, added = sorted(planned - up), [n for n in self.nodes() if n not in planned]
                plan = self.start_plan
                if lost or added:
                    plan = self.planner.reconfigure(self.start_plan, lost, added)
                self._adopt(plan)
        except (NoPipeline, LostLayersError):
            return
        self.state, self.rate, self.started = TRAINING, self.train_rate, True
        self.note(f"start on {len(self.nodes())} nodes")

    def _restart(self, why: str) -> None:
        """A fresh layout on the nodes up, every GPU restoring its layers from snapshots over the network."""
        try:
            layout = self._adopt(self.planner.initial(self.nodes(), self.f))
        except NoPipeline:
            self.plan = self.layout = None
            self.set_layout(None)
            self.hold("waiting")
            self.note(f"{why}: waiting for nodes")
            return
        restore_s = layout.state_bytes_per_node / self.bandwidth
        self.pause("rollback", self.costs.pause_s(restore_s))
        self.note(f"{why}: fresh layout of {len(layout.groups)} pipelines, Z = {layout.iteration_s * 1e3:.1f} ms")

    def handle(self, removed: set[str], added: list[str]) -> None:
        self.benched -= removed
        if self.plan is None:
            if added:
                self._restart("nodes back")
            return
        in_plan = {n for p in self.plan.pipelines for n in p.nodes}
        lost = sorted(removed & in_plan, key=lambda n: n)
        if not lost and not added:
            return
        if lost:
            self.lose_steps(self.steps - math.floor(self.steps), "iteration in flight")
        try:
            plan = self.planner.reconfigure(self.plan, lost, added)
        except LostLayersError:
            self.lose_steps(self.steps % self.costs.snapshot_interval_steps, "rollback to the last snapshot")
            self.restore_point()
            self._restart(f"lost {len(lost)} nodes holding every replica of some layers")
            return
        except NoPipeline:
            self.lose_steps(self.steps % self.costs.snapshot_interval_steps, "rollback to the last snapshot")
            self.restore_point()
            self.plan = self.layout = None
            self.set_layout(None)
            self.hold("waiting")
            self.note("too few nodes for a pipeline: waiting")
            return
        layout = self._adopt(plan)
        self.pause("reconfiguring", self.costs.pause_s(copy_seconds(plan, self.bandwidth)))
        self.note(
            f"-{len(lost)} +{len(added)} nodes: {len(layout.groups)} pipelines, Z = {layout.iteration_s * 1e3:.1f} ms"
        )


def _nodes(count: int) -> str:
    return f"{count} node" + ("s" if count != 1 else "")


def _membership(slow: list[str], back: list[str]) -> str:
    """Mitigation (c) in words: slow nodes benched, recovered ones taken back."""
    parts = ([f"bench {_nodes(len(slow))} as slow"] if slow else []) + (
        [f"{_nodes(len(back))} back at full speed"] if back else []
    )
    return ", ".join(parts)
