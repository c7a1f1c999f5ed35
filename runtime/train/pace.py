"""A rank's pace: how much slower its own compute runs now than it did when it started on its stage.

The plan carries, per template stage, the profiled forward and backward milliseconds of one
microbatch; a rank of a pipeline with `m` microbatches should then spend `m * (forward + backward)`
computing per step (runtime/train/engine.py times exactly that, without the waits for its peers).
Their ratio, `profile_ratio`, normalises away the share of the batch a plan gives the rank.

The profile alone is not a trustworthy yardstick: it is taken once, layer by layer, on one node, and
on a busy host one layer's figure can be off by 2x, so every stage carries its own bias (measured: an
untouched node 1.5x "slower" than another). So the rank calibrates: the median ratio of its first
`calibration` steps on a stage (after `warmup` steps) is its baseline, and `slowdown` is the median of
its last `window` ratios over that baseline. A new batch split of the same stage keeps the baseline,
since the ratio is per microbatch. So does a stage change (other layers, e.g. moved off a slow node:
every stage of a plan has a profiled cost, its template's or its own): the baseline is a ratio to the
profile, so keeping it scales the rank's calibrated seconds by the profiled ratio of new to old stage
costs. A node moved while slow thus still reads slow, and one that recovers reads at pace (were it to
recalibrate, it would take its slow pace as normal, and a mitigation would never be undone). Only the
first calibration, or a stage without a profiled cost, calibrates from scratch. One odd step never
moves a median. Comparing nodes with each other, so that a host slowing everyone down counts no one, is the
operator's part: oobleck.operator.stragglers.
"""

from __future__ import annotations

import statistics
from collections import deque

from oobleck.api.plan import Plan

DEFAULT_WINDOW = 9
HISTORY = 24
"""Steps of (step, slowdown) a report carries: more than the steps between two reads by the operator."""


def expected_compute_seconds(plan: Plan, rank: int) -> float | None:
    """What `rank`'s forwards and backwards of one step cost by the plan's profile: its stage's own cost
    when the plan carries one (layers moved off a slow node), else its template stage's (None: not in the
    plan, or neither names a cost)."""
    for pipeline in plan.pipelines:
        for stage_index, stage in enumerate(pipeline.stages):
            if rank not in stage.ranks:
                continue
            if stage.forward_ms is not None and stage.backward_ms is not None:
                return pipeline.microbatches * (stage.forward_ms + stage.backward_ms) / 1000.0
            for template in plan.templates:
                if template.nodes != pipeline.template_nodes or len(template.stages) != len(pipeline.stages):
                    continue
                profiled = template.stages[stage_index]
                if (profiled.start, profiled.end) == (stage.start, stage.end):
                    return pipeline.microbatches * (profiled.forward_ms + profiled.backward_ms) / 1000.0
            return None
    return None


class Pace:
    """A rank's slowdown against its own calibrated pace on its stage (see the module docstring)."""

    def __init__(
        self, window: int = DEFAULT_WINDOW, warmup: int = 5, calibration: int = DEFAULT_WINDOW, history: int = HISTORY
    ) -> None:
        if window < 1 or calibration < 1 or warmup < 0:
            raise ValueError(
                f"window, calibration (at least 1 step) and warmup (at least 0): got {window}, {calibration}, {warmup}"
            )
        self.ratios: deque[float] = deque(maxlen=window)
        self.warmup, self.calibration = warmup, calibration
        self.stage: tuple[int, ...] | None = None
        self.seen = 0
        self.calibrating: list[float] = []
        self.baseline: float | None = None
        self.history: deque[tuple[int, float]] = deque(maxlen=history)
        """(step, slowdown) of the last steps: the operator lines the nodes' up step by step"""

    def on_stage(self, stage: tuple[int, ...], carry: bool = True) -> None:
        """The rank's stage (its layers and GPUs) from now on. Another one than before starts afresh: its
        figures and history are dropped and its first `warmup` steps left out; the calibrated baseline is
        carried over (`carry`, when the new stage has a profiled cost) or calibrated anew."""
        if stage != self.stage:
            self.stage, self.seen = stage, 0
            if not carry:
                self.baseline = None
            self.history.clear()
            self.calibrating.clear()
            self.ratios.clear()

    def add(self, compute_seconds: float, expected_seconds: float | None, step: int = 0) -> None:
        """Global step `step`'s measurement; a step without a profiled cost (or with a zero one) is left out."""
        if expected_seconds is None or expected_seconds <= 0 or compute_seconds <= 0:
            return
        ratio = compute_seconds / expected_seconds
        self.seen += 1
        if self.seen <= self.warmup and self.baseline is not None:
            return  # a carried baseline: the new stage's first steps (fresh layers, cold caches) are no figure
        self.ratios.append(ratio)
        if self.baseline is None and self.seen > self.warmup:
            self.calibrating.append(ratio)
            if len(self.calibrating) == self.calibration:
                self.baseline = statistics.median(self.calibrating)
        slowdown = self.slowdown
        if slowdown is not None:
            self.history.append((step, round(slowdown, 3)))

    @property
    def profile_ratio(self) -> float | None:
        """Measured / profiled compute time, the median of the last steps (None before the first)."""
        return statistics.median(self.ratios) if self.ratios else None

    @property
    def slowdown(self) -> float | None:
        """The median of the last steps over the calibrated baseline (None while calibrating)."""
        ratio = self.profile_ratio
        return None if self.baseline is None or ratio is None else ratio / self.baseline
