"""The policies' shared event loop (`Policy`) and what it records (`Timeline`): how a policy turns a
trace's events into states over time and work lost. The four policies: `OobleckPolicy`
(oobleck_policy.py) and the baselines checkpoint-restart, Bamboo and replica dropping (baselines.py).

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

from .planning import Layout
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
