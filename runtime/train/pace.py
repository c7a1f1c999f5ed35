"""A rank's pace: how much slower its own compute runs than the plan's profile says it should.

The plan carries, per template stage, the profiled forward and backward milliseconds of one
microbatch; a rank of a pipeline with `m` microbatches should then spend `m * (forward + backward)`
computing per step (runtime/train/engine.py times exactly that, without the waits for its peers).
Their ratio is the rank's slowdown against its profile. One step's ratio is noisy (a page fault,
a neighbour's burst), so the reported figure is the median of the last `window` steps: one odd
step never moves it.

Comparing nodes with each other (so that a machine that is slower than its profile everywhere
does not count as a straggler) is the operator's part: oobleck.operator.stragglers.
"""

from __future__ import annotations

import statistics
from collections import deque

from oobleck.api.plan import Plan

DEFAULT_WINDOW = 7


def expected_compute_seconds(plan: Plan, rank: int) -> float | None:
    """What `rank`'s forwards and backwards of one step cost by the plan's profile (None: not in the plan,
    or its stage matches no template stage)."""
    for pipeline in plan.pipelines:
        for stage_index, stage in enumerate(pipeline.stages):
            if rank not in stage.ranks:
                continue
            for template in plan.templates:
                if template.nodes != pipeline.template_nodes or len(template.stages) != len(pipeline.stages):
                    continue
                profiled = template.stages[stage_index]
                if (profiled.start, profiled.end) == (stage.start, stage.end):
                    return pipeline.microbatches * (profiled.forward_ms + profiled.backward_ms) / 1000.0
            return None
    return None


class Pace:
    """The median slowdown against the profile over the last `window` steps."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"window: must be at least 1 step, got {window}")
        self.ratios: deque[float] = deque(maxlen=window)

    def add(self, compute_seconds: float, expected_seconds: float | None) -> None:
        """One step's measurement; a step without a profiled cost (or with a zero one) is left out."""
        if expected_seconds is not None and expected_seconds > 0 and compute_seconds > 0:
            self.ratios.append(compute_seconds / expected_seconds)

    @property
    def slowdown(self) -> float | None:
        """Measured / profiled compute time, the window's median (None before the first measured step)."""
        return statistics.median(self.ratios) if self.ratios else None
