"""oobleck.simulate: goodput of a training job under node failure traces, for oobleck and its peers.

Traces (traces.py) drive four policies (their shared loop in policies.py, oobleck's in oobleck_policy.py,
the baselines in baselines.py) whose costs are explicit inputs (costs.py); the planner is reached
through one adapter (planning.py); engine.py sums up, report.py prints and plots,
cli.py is `oobleck simulate`, paper.py draws `make paper-figures`. Pure and deterministic: no GPU, no clock, seeded randomness only.
"""

from __future__ import annotations

from .costs import BambooCosts, CheckpointCosts, Costs, NodeCosts, OobleckCosts, ReplicaCosts
from .engine import POLICIES, Job, Result, recommend_f, simulate
from .traces import Trace, TraceError

__all__ = [
    "POLICIES",
    "BambooCosts",
    "CheckpointCosts",
    "Costs",
    "Job",
    "NodeCosts",
    "OobleckCosts",
    "ReplicaCosts",
    "Result",
    "Trace",
    "TraceError",
    "recommend_f",
    "simulate",
]
