"""The policies Oobleck is compared with: checkpoint + restart (`CheckpointPolicy`), Bamboo's redundant
computation (`BambooPolicy`) and replica dropping (`ReplicaPolicy`). The shared rules are policies.py's."""

from __future__ import annotations

import math

from .costs import BambooCosts, CheckpointCosts, ReplicaCosts
from .planning import Layout, NoPipeline, Planner, paced
from .policies import TRAINING, Policy
from .traces import Trace


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
