"""Which nodes are stragglers: a pure function of the workers' pace reports and the previous status.

Each worker reports its slowdown against the plan's profile (oobleck.runtime.train.pace: measured over
profiled compute, a median of its last steps). A node's slowdown here is its figure over the median of
the *other* nodes' figures: a machine that runs every node slower than the profile (a loaded host, a
profile taken elsewhere) makes no one a straggler, and with two nodes the slow one is measured against
the fast one rather than against a median it pulls up itself.

A node at or over `spec.stragglers.threshold` is listed in `status.stragglers` with the step from which
it has been slow (kept from the previous status while it stays slow); once it has been slow for
`spec.stragglers.window` steps it is confirmed and one `Straggler` event says so. A confirmed node that
falls back under the threshold leaves the list with a `StragglerRecovered` event.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from oobleck.api.job import Straggler, StragglerPolicy
from oobleck.api.reports import ProgressReport

STRAGGLER = "Straggler"
RECOVERED = "StragglerRecovered"


@dataclass(frozen=True)
class Assessment:
    slowdowns: dict[str, float]
    """every reporting member's slowdown against the others (for the per-node metric)"""
    stragglers: list[Straggler]
    """the nodes at or over the threshold, for status.stragglers"""
    events: list[tuple[str, str, str]]
    """(type, reason, message) to post on the job"""


def relative_slowdowns(paces: Mapping[str, float]) -> dict[str, float]:
    """Each node's pace over the median of the other nodes' paces (a lone node has nothing to compare with)."""
    result = {}
    for node, pace in paces.items():
        others = [p for n, p in paces.items() if n != node]
        if others:
            result[node] = pace / statistics.median(others)
    return result


def assess(
    members: Sequence[str],
    generation: int,
    reports: Mapping[str, ProgressReport],
    previous: Sequence[Straggler],
    policy: StragglerPolicy,
) -> Assessment:
    """The stragglers among the plan's `members`, from their `reports` of plan generation `generation`
    (a report of another generation, or without a slowdown, is left out) and the `previous` status."""
    current = {
        node: report
        for node in members
        if (report := reports.get(node)) is not None and report.generation == generation and report.slowdown
    }
    paces = {node: report.slowdown for node, report in current.items() if report.slowdown is not None}
    slowdowns = relative_slowdowns(paces)
    before = {s.node: s for s in previous}
    stragglers, events = [], []
    for node in sorted(slowdowns):
        slowdown, step = slowdowns[node], current[node].step
        if slowdown < policy.threshold:
            continue
        known = before.get(node)
        since = known.since_step if known is not None and known.since_step <= step else step
        confirmed = step - since >= policy.window
        stragglers.append(Straggler(node=node, slowdown=round(slowdown, 3), since_step=since, confirmed=confirmed))
        if confirmed and not (known is not None and known.confirmed):
            events.append(
                (
                    "Warning",
                    STRAGGLER,
                    f"{node} computes {slowdown:.2f}x slower than the other nodes' median "
                    f"(threshold {policy.threshold}) since step {since}",
                )
            )
    listed = {s.node for s in stragglers}
    for node, known in before.items():
        # A node that stopped reporting (lost, replaced) is the failure path's business, not a recovery.
        if known.confirmed and node not in listed and node in slowdowns:
            events.append(("Normal", RECOVERED, f"{node} is back under {policy.threshold}x the other nodes' median"))
    return Assessment(slowdowns, stragglers, events)
