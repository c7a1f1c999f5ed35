"""The planner's one error type: an input the planner cannot turn into a plan.

Raised for infeasible jobs (too few nodes, a model that fits in no template) and for inputs outside
the cost model's range. The message always carries the numbers behind the verdict, so the operator
can put it in a `Failed` condition and a human can act on it without rerunning anything.
"""

from __future__ import annotations


class PlanningError(ValueError):
    """The inputs admit no valid plan; the message names the field or the arithmetic that fails."""
