"""The four policies: how each turns a trace's events into states over time and work lost.

Shared rules, so the policies differ only in what the papers say they do:
- Between events a policy trains at its layout's throughput (global batch / iteration time), or sits in a
  named state (reconfiguring, restarting, checkpointing, failover, waiting) at zero throughput.
- Work lost to a failure (the iteration in flight, or everything since the last snapshot or checkpoint) is
  recorded as samples and seconds taken back at the failure's time.
- An event during a recovery starts the recovery over at the event's time, with the nodes up then.
- Nodes are taken in the order they first appeared, so the same trace always gives the same layouts.
- A trace may start empty or too small: the job waits ("waiting") and starts, at no cost, at the first
  event after which its nodes form a pipeline; starting is not a failure, so every policy starts alike.
- Node speeds (the trace's `slow` events) slow every stage on the node (planning.PipelineTiming); a
  synchronous job runs at its slowest pipeline's pace until a policy does something about it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from oobleck.api.plan import Plan

from .costs import BambooCosts, CheckpointCosts, OobleckCosts, ReplicaCosts
from .planning import Layout, LostLayersError, NoPipeline, Planner, copy_seconds, paced, rebalanced
from .traces import Trace

TRAINING = "training"


@dataclass(frozen=True)
class Segment:
    start_s: float
    end_s: float
    state: str
    samples_per_s: float


@dataclass(frozen=True)
class Loss:
    time_s: float
    samples: float
    seconds: float  # training time whose work was thrown away
    why: str


@dataclass
class Timeline:
    """What one policy did over one trace."""

    policy: str
    segments: list[Segment] = field(default_factory=list)
    losses: list[Loss] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)  # (time, what the policy did)
    note: str = ""

    def add(self, start: float, end: float, state: str, rate: float) -> None:
        if end <= start:
            return
        last = self.segments[-1] if self.segments else None
        if last and last.state == state and last.samples_per_s == rate and last.end_s == start:
            self.segments[-1] = Segment(last.start_s, end, state, rate)
        else:
            self.segments.append(Segment(start, end, state, rate))


class Policy:
    """Event loop shared by the policies: current state + a schedule of state changes to come."""

    name = "policy"

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.timeline = Timeline(self.name)
        self.alive: dict[str, None] = dict.fromkeys(trace.initial)  # insertion order = first appearance
        self.now = 0.0
        self.state = "waiting"
        self.rate = 0.0
        self.iteration_s = math.inf
        self.samples_per_iteration = 0
        self.train_rate = 0.0  # throughput of the current layout when training
        self.steps = 0.0  # iterations since the last restore point (fractional: the one in flight)
        # The latest steps as [steps, seconds per step, samples per step], newest last: work thrown away is
        # priced at the pace it was done at (speeds change Z between snapshots).
        self.recent: list[list[float]] = []
        self.keep_steps = 1.0  # the most steps a loss can take back (a policy with snapshots keeps more)
        self.schedule: list[tuple[float, str, float]] = []
        self.started = False  # set by start() once the job trains
        self.speeds: dict[str, float] = {}  # nodes not named run at full speed (1)
        self.wake_at: float | None = None  # when the policy acts on its own (a straggler decision)

    # -- machinery -------------------------------------------------------------------------------------
    def set_layout(self, layout: Layout | None) -> None:
        if layout is None:
            self.iteration_s, self.samples_per_iteration, self.train_rate = math.inf, 0, 0.0
        else:
            self.iteration_s = layout.iteration_s
            self.samples_per_iteration = layout.samples_per_iteration
            self.train_rate = layout.samples_per_s

    def repace(self, old_rate: float) -> None:
        """The layout's throughput changed under the job (speeds): training, or the training a pause
        leads to, goes on at the new one."""
        if self.state == TRAINING:
            self.rate = self.train_rate
        self.schedule = [
            (at, state, self.train_rate if state == TRAINING and rate == old_rate else rate)
            for at, state, rate in self.schedule
        ]

    def pause(self, state: str, seconds: float, then_rate: float | None = None) -> None:
        """Sit in `state` for `seconds` from now, then train (at the layout's throughput by default)."""
        rate = self.train_rate if then_rate is None else then_rate
        self.schedule = [(self.now + seconds, TRAINING if rate > 0 else "waiting", rate)]
        self.state, self.rate = state, 0.0

    def hold(self, state: str) -> None:
        """Stay in `state` (zero throughput) until an event changes it."""
        self.state, self.rate, self.schedule = state, 0.0, []

    def lose(self, samples: float, seconds: float, why: str) -> None:
        if samples > 0:
            self.timeline.losses.append(Loss(self.now, samples, seconds, why))

    def lose_steps(self, steps: float, why: str) -> None:
        """Take back the latest `steps` steps, each at the pace it was trained at."""
        samples = seconds = 0.0
        left = steps
        while left > 1e-12 and self.recent:
            chunk = self.recent[-1]
            taken = min(left, chunk[0])
            seconds += taken * chunk[1]
            samples += taken * chunk[2]
            left -= taken
            chunk[0] -= taken
            if chunk[0] <= 1e-12:
                self.recent.pop()
        self.lose(samples, seconds, why)
        self.steps -= steps

    def restore_point(self) -> None:
        """Nothing trained before now can be lost any more (a rollback restored the last snapshot)."""
        self.steps = 0.0
        self.recent.clear()

    def train(self, start: float, end: float) -> None:
        """Record training over [start, end); policies that checkpoint split it."""
        self.timeline.add(start, end, TRAINING, self.rate)
        if self.iteration_s < math.inf and end > start:
            steps = (end - start) / self.iteration_s
            self.steps += steps
            pace = [self.iteration_s, self.rate * self.iteration_s]
            if self.recent and self.recent[-1][1:] == pace:
                self.recent[-1][0] += steps
            else:
                self.recent.append([steps, *pace])
            while self.recent and sum(chunk[0] for chunk in self.recent[1:]) >= self.keep_steps:
                self.recent.pop(0)

    def advance(self, until: float) -> None:
        while True:
            upcoming = self.schedule[0][0] if self.schedule else math.inf
            end = min(until, upcoming)
            if self.state == TRAINING and self.rate > 0:
                self.train(self.now, end)
            else:
                self.timeline.add(self.now, end, self.state, 0.0)
            self.now = end
            if upcoming > until:
                return
            _, self.state, self.rate = self.schedule.pop(0)

    def wake_until(self, until: float) -> None:
        while self.wake_at is not None and self.wake_at <= until:
            at, self.wake_at = self.wake_at, None
            self.advance(at)
            self.wake()

    def run(self) -> Timeline:
        if self.alive:
            self.start()
        for step in self.trace.steps():
            self.wake_until(step.time_s)
            self.advance(step.time_s)
            for node in step.removed:
                self.alive.pop(node, None)
            for node in step.added:
                self.alive[node] = None
            if self.started:
                if step.removed or step.added:
                    self.handle(set(step.removed), list(step.added))
                # After the layout change: a new speed is not known to the planner until detected.
                self.speeds.update(step.speeds)
                if step.speeds:
                    self.sped(set(step.speeds))
            else:
                self.speeds.update(step.speeds)
                if self.alive:
                    self.start()
        self.wake_until(self.trace.duration_s)
        self.advance(self.trace.duration_s)
        if not self.started:
            self.timeline.note = "never started: the nodes up never formed a pipeline"
        return self.timeline

    def nodes(self) -> list[str]:
        return list(self.alive)

    def note(self, what: str) -> None:
        self.timeline.events.append((self.now, what))

    # -- policy hooks ----------------------------------------------------------------------------------
    def start(self) -> None:
        raise NotImplementedError

    def handle(self, removed: set[str], added: list[str]) -> None:
        raise NotImplementedError

    def sped(self, changed: set[str]) -> None:
        """Nodes changed speed (the policy's layout already runs at the new speeds' pace when called)."""
        raise NotImplementedError

    def wake(self) -> None:
        """The time asked for in `wake_at` has come."""


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


class CheckpointPolicy(Policy):
    """Checkpoint + restart, re-planned for the nodes up (Varuna's job morphing, torchrun)."""

    name = "checkpoint-restart"

    def __init__(self, trace: Trace, planner: Planner, costs: CheckpointCosts, slowdown: float = 1.0) -> None:
        super().__init__(trace)
        self.planner, self.costs, self.slowdown = planner, costs, slowdown
        self.layout: Layout | None = None
        self.planned: Layout | None = None  # the layout at full speed, as restarted (speeds unknown to it)
        self.trained_since_checkpoint = 0.0  # seconds of training since the last completed checkpoint
        self.samples_since_checkpoint = 0.0
        self.interval_s = math.inf
        self.checkpoint_s = 0.0
        self.writing_until: float | None = None  # a checkpoint write an event interrupted ends then

    def set_layout(self, layout: Layout | None) -> None:
        self.planned = layout
        if layout is not None and any(self.speeds.get(n, 1.0) != 1.0 for g in layout.groups for n in g):
            layout = paced(layout, self.speeds, resplit=False, microbatch_size=self.planner.profile.microbatch_size)
        if layout is not None and self.slowdown != 1.0:
            layout = Layout(
                layout.iteration_s * self.slowdown,
                layout.samples_per_iteration,
                layout.groups,
                tuple(t * self.slowdown for t in layout.group_iteration_s),
                layout.group_samples,
                layout.degraded,
                layout.state_bytes_per_node,
            )
        self.layout = layout
        super().set_layout(layout)
        if layout is not None:
            self.checkpoint_s = self.costs.checkpoint_s(layout.state_bytes_per_node)
            if self.costs.interval_steps is not None:
                self.interval_s = self.costs.interval_steps * layout.iteration_s

    def _layout_on(self, nodes: list[str]) -> Layout | None:
        try:
            return self.planner.fresh(nodes, 0)
        except NoPipeline:
            return None

    def start(self) -> None:
        self.set_layout(self._layout_on(self.nodes()))
        if self.layout is None:
            return
        self.state, self.rate, self.started = TRAINING, self.train_rate, True
        self.note(f"start on {self.layout.nodes} nodes")
        if self.costs.interval_steps is not None:
            pass  # set with each layout
        elif self.costs.interval_s is not None:
            self.interval_s = self.costs.interval_s
        else:  # Young's optimum for the trace's job-level MTBF
            mtbf = self.trace.duration_s / max(1, self.trace.losses())
            self.interval_s = math.sqrt(2 * max(self.checkpoint_s, 1e-9) * mtbf)

    def train(self, start: float, end: float) -> None:
        t = start
        while t < end:
            # max: the interval may have shrunk below what was trained (Z fell back with a node's speed)
            due = t + max(0.0, self.interval_s - self.trained_since_checkpoint)
            stop = min(due, end)
            self.timeline.add(t, stop, TRAINING, self.rate)
            self.trained_since_checkpoint += stop - t
            self.samples_since_checkpoint += (stop - t) * self.rate
            t = stop
            if t < end:  # a checkpoint is due: the job stalls while it is written
                written = t + self.checkpoint_s
                if written > end:
                    # interrupted by the next event: recorded up to it, the rest written afterwards
                    self.timeline.add(t, end, "checkpointing", 0.0)
                    self.schedule.insert(0, (written, TRAINING, self.rate))
                    self.state, self.rate = "checkpointing", 0.0
                    self.writing_until = written
                    return
                self.timeline.add(t, written, "checkpointing", 0.0)
                self.trained_since_checkpoint = self.samples_since_checkpoint = 0.0
                t = written

    def advance(self, until: float) -> None:
        # A checkpoint whose write finished before this event counts as taken.
        if self.writing_until is not None and self.writing_until <= until:
            self.trained_since_checkpoint = self.samples_since_checkpoint = 0.0
            self.writing_until = None
        super().advance(until)

    def lose_since_checkpoint(self, why: str) -> None:
        self.writing_until = None  # a checkpoint still being written when the failure hit is useless
        self.lose(self.samples_since_checkpoint, self.trained_since_checkpoint, why)
        self.trained_since_checkpoint = self.samples_since_checkpoint = 0.0

    def restart(self, why: str, *, save_first: bool) -> None:
        layout = self._layout_on(self.nodes())
        if layout is None:
            self.set_layout(None)
            self.hold("waiting")
            self.note(f"{why}: waiting for nodes")
            return
        saving = self.checkpoint_s if save_first and self.trained_since_checkpoint > 0 else 0.0
        if saving:
            self.trained_since_checkpoint = self.samples_since_checkpoint = 0.0
        self.set_layout(layout)
        self.pause("restarting", saving + self.costs.restart_cost_s(layout.state_bytes_per_node))
        self.note(f"{why}: restart on {layout.nodes} nodes, Z = {layout.iteration_s * 1e3:.1f} ms")

    def used(self) -> set[str]:
        return {n for g in self.layout.groups for n in g} if self.layout else set()

    def sped(self, changed: set[str]) -> None:
        """No mitigation: the job runs at its slowest pipeline's pace (the restart plans ignore speeds too)."""
        if self.planned is not None and changed & self.used():
            old = self.train_rate
            self.set_layout(self.planned)
            self.repace(old)

    def handle(self, removed: set[str], added: list[str]) -> None:
        if removed & self.used():
            self.lose_since_checkpoint("work since the last checkpoint")
            self.restart(f"lost {len(removed & self.used())} nodes", save_first=False)
        elif added or self.layout is None:
            bigger = self._layout_on(self.nodes())
            if bigger is not None and (self.layout is None or bigger.samples_per_s > self.layout.samples_per_s):
                self.restart(f"+{len(added)} nodes", save_first=self.layout is not None)


class BambooPolicy(CheckpointPolicy):
    """Redundant computation: failover onto the predecessor, pipelines re-formed; neighbours lost together
    (or a one-node pipeline's node) fall back to a checkpoint restart."""

    name = "redundant-computation"

    def __init__(
        self, trace: Trace, planner: Planner, costs: BambooCosts, checkpoint: CheckpointCosts, slowdown: float
    ) -> None:
        super().__init__(trace, planner, checkpoint, slowdown)
        self.bamboo = costs
        self.pending: set[str] = set()  # nodes lost whose redundancy has not been rebuilt yet

    def handle(self, removed: set[str], added: list[str]) -> None:
        used = self.used()
        hit = removed & used
        if self.state == TRAINING:
            self.pending = set()
        if hit:
            assert self.layout is not None, "a training job has a layout"
            gone = hit | self.pending
            fatal = any(
                (len(group) == 1 and group[0] in gone)
                or any(group[i] in gone and group[(i + 1) % len(group)] in gone for i in range(len(group)))
                for group in self.layout.groups
            )
            if fatal:
                self.pending = set()
                self.lose_since_checkpoint("neighbours lost together: work since the last checkpoint")
                self.restart("redundancy lost", save_first=False)
                return
            self.pending |= hit
        if hit or added or self.layout is None:
            layout = self._layout_on(self.nodes())
            if layout is None:
                self.lose_since_checkpoint("too few nodes: work since the last checkpoint")
                self.set_layout(None)
                self.hold("waiting")
                return
            was_running = self.layout is not None
            self.set_layout(layout)
            if was_running:
                self.pause("failover", self.bamboo.failover_s)
                self.note(f"-{len(hit)} +{len(added)} nodes: failover, {len(layout.groups)} pipelines")
            else:
                self.restart("nodes back", save_first=False)


class ReplicaPolicy(Policy):
    """Replica dropping (torchft): fixed pipelines as data-parallel replicas, never reshaped."""

    name = "replica-dropping"

    def __init__(self, trace: Trace, planner: Planner, costs: ReplicaCosts) -> None:
        super().__init__(trace)
        self.planner, self.costs = planner, costs
        self.slots: list[list[str | None]] = []
        self.layout: Layout | None = None
        self.bandwidth = planner.cluster.inter_node_bandwidth
        self.dropped: set[int] = set()  # whole replicas left out of the quorum for being too slow

    def start(self) -> None:
        try:
            self.layout = self.planner.fresh(self.nodes(), 0)
        except NoPipeline:
            return
        self.slots = [list(g) for g in self.layout.groups]
        self._update_rate()
        self.state, self.rate, self.started = TRAINING, self.train_rate, True
        self.note(f"start: {len(self.slots)} replicas")

    def _whole(self) -> list[int]:
        """The replicas in the quorum: complete, and not dropped for being too slow."""
        return [i for i, slots in enumerate(self.slots) if None not in slots and i not in self.dropped]

    def _step_s(self, i: int) -> float:
        """Replica i's step at its nodes' speeds (its share of the batch never changes)."""
        assert self.layout is not None, "replicas exist only under a layout"
        nodes = [n or "" for n in self.slots[i]]
        microbatches = self.layout.group_samples[i] // self.planner.profile.microbatch_size
        return self.layout.timings[i].cost(nodes, self.speeds).at(microbatches) / 1e3

    def _rate_of(self, replicas: set[int] | list[int]) -> float:
        if not replicas:
            return 0.0
        assert self.layout is not None, "replicas exist only under a layout"
        return sum(self.layout.group_samples[i] for i in replicas) / max(self._step_s(i) for i in replicas)

    def _update_rate(self) -> None:
        whole = self._whole()
        if not whole:
            self.iteration_s, self.samples_per_iteration, self.train_rate = math.inf, 0, 0.0
            return
        assert self.layout is not None, "whole replicas exist only under a layout"
        # Synchronous data parallelism: every whole replica runs its own share; the slowest sets the pace.
        self.iteration_s = max(self._step_s(i) for i in whole)
        self.samples_per_iteration = sum(self.layout.group_samples[i] for i in whole)
        self.train_rate = self.samples_per_iteration / self.iteration_s

    def _settle(self) -> tuple[list[int], list[int]]:
        """The timeout model: the first replica to reach the allreduce waits `timeout_s` for the others, so
        every replica of the quorum whose step ends more than that after the fastest one's is dropped (the
        step fails for all); a dropped replica rejoins once its step would end within the timeout of the
        quorum's fastest. Returns (dropped now, rejoined now)."""
        whole = self._whole()
        dropped: list[int] = []
        if len(whole) > 1:
            fastest = min(self._step_s(i) for i in whole)
            dropped = [i for i in whole if self._step_s(i) - fastest > self.costs.timeout_s]
            self.dropped.update(dropped)
        fastest = min((self._step_s(i) for i in self._whole()), default=math.inf)
        rejoined = []
        for i in sorted(self.dropped - set(dropped)):
            if None in self.slots[i] or self._step_s(i) - fastest <= self.costs.timeout_s:
                self.dropped.discard(i)  # an incomplete replica heals through its new nodes instead
                if None not in self.slots[i]:
                    rejoined.append(i)
        return dropped, rejoined

    def sped(self, changed: set[str]) -> None:
        if self.layout is None:
            return
        old = self.train_rate
        dropped, rejoined = self._settle()
        self._update_rate()
        if not dropped and not rejoined:
            self.repace(old)
            return
        self._reform(dropped, rejoined, old, timed_out=bool(dropped))

    def handle(self, removed: set[str], added: list[str]) -> None:
        if self.layout is None:
            return
        broke = [i for i, slots in enumerate(self.slots) if i not in self.dropped and removed & {s for s in slots if s}]
        for slots in self.slots:
            for k, node in enumerate(slots):
                if node in removed:
                    slots[k] = None
        if broke:
            self.lose_steps(self.steps - math.floor(self.steps), "iteration in flight")
        healed = []
        for node in added:
            open_replicas = [i for i, slots in enumerate(self.slots) if None in slots]
            if not open_replicas:
                break  # spare: replicas never grow
            i = min(open_replicas, key=lambda i: (self.slots[i].count(None), i))
            self.slots[i][self.slots[i].index(None)] = node
            if None not in self.slots[i]:
                healed.append(i)
        timed_out, rejoined = self._settle()
        healed = [i for i in healed if i not in self.dropped] + rejoined
        old = self.train_rate
        self._update_rate()
        if not broke and not healed and not timed_out:
            self.repace(old)
            return
        self._reform(broke + timed_out, healed, old, timed_out=bool(timed_out), already_lost=bool(broke))

    def _reform(
        self, broke: list[int], healed: list[int], before: float, *, timed_out: bool, already_lost: bool = False
    ) -> None:
        """The quorum changes: replicas out (the step in flight lost), replicas back (healing from a live one)."""
        assert self.layout is not None, "replicas exist only under a layout"
        if broke and not already_lost:
            self.lose_steps(self.steps - math.floor(self.steps), "iteration in flight")
        # A replica dropped on timeout held the others for the whole timeout before the quorum changed.
        wait = self.costs.quorum_s + (self.costs.timeout_s if timed_out else 0.0)
        if healed:
            # The healed replicas fetch their state from a live one while the others keep training.
            heal = self.costs.heal_s(self.layout.state_bytes_per_node, self.bandwidth)
            with_healed = self.train_rate
            without = self._rate_of(set(self._whole()) - set(healed))
            self.pause("timeout" if timed_out else "quorum", wait, then_rate=without)
            self.schedule.append((self.now + max(heal, wait), TRAINING, with_healed))
        else:
            self.pause("timeout" if timed_out else "quorum", wait)
        self.note(
            f"{len(self._whole())}/{len(self.slots)} replicas in the quorum (was {before:.1f} samples/s)"
            + (f", {len(self.dropped)} dropped as too slow" if self.dropped else "")
        )
