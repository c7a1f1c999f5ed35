"""Which nodes are stragglers: a pure function of the workers' pace reports and the previous status.

Each worker reports the (step, slowdown) of its last steps (oobleck.runtime.train.pace: its compute per
profiled cost, a median of its last steps, over the same figure when it started on its stage) and that
calibrated figure. A node's slowdown at a step is its figure over the median of its peers' figures at
that step: a host that slows every node down (other jobs, a burst of imports) makes no one a straggler,
and with two nodes the slow one is measured against the fast one rather than against a median it pulls
up itself. Its peers are the nodes running the same layers (in f+1 replicated pipelines of one template,
every stage has f+1 of them), whose compute per profiled cost compares directly: so a node slow from the
start (a degraded GPU at launch) or one that calibrated at another time (a spare folded in while a
replacement imported torch) is measured right. A node with no such peer is compared with all the others
by its figure against its own calibrated pace (the profile alone misjudges stages against each other: on
a busy host, untouched nodes read 1.5-2.8x), times its anchor: how far that pace was off its peers' when
it last had some (kept in the plan, Plan.pace_anchors), so a node slow from its start whose layers moved
does not read at pace for want of a peer. Lining the nodes up step by step (not report by report) gives
the step a node fell behind exactly, however late the operator reads the reports.

A node at or over `spec.stragglers.threshold` is listed in `status.stragglers` with the step from which
it has been slow (kept from the previous status while it stays slow); once it has been slow for
`spec.stragglers.window` steps it is confirmed and one `Straggler` event says so. A confirmed node is
released as it was confirmed: once its last `window` figures are all under the threshold it leaves the list
with a `StragglerRecovered` event (until then it stays listed and confirmed, with its figure); one not
measured in the current generation yet keeps its entry.

With `mitigation: spare` a node may also be benched: taken out of training as a warm spare
(planner_cy/bench.py, when the price says so). It is measured again by training: once its back-off is
over it is taken back like a scale-up, and if it is still slow it is confirmed and benched again at
once, for twice as long as the time before (with a warm spare at hand the spare takes its place in the
same generation, and the benched node is the spare until a loss). Why not measure the spare where it waits: a node's speed is
its speed on its stage's work with its peers' traffic, and a synthetic run beside a job would be a new
yardstick to calibrate (and a second code path to trust); a probe costs one reconfiguration and a
window of slow steps, and the exponential back-off keeps that to about log2(steps / window) probes.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from oobleck.api.plan import Plan
from oobleck.api.profile import ModelProfile
from oobleck.api.reports import ProgressReport
from oobleck.api.spec import StragglerPolicy
from oobleck.api.status import Straggler
from oobleck.operator.decision import CurrentPlan, Decision, Event, JobContext
from oobleck.operator.observe import JobObservation, ready_newcomers
from oobleck.operator.planning import Tuning, cluster_shape
from oobleck.planner.bench import BENCH_REASON, READMIT_REASON, readmit
from oobleck.planner.rebalance import REBALANCE_REASON, mitigate, rebalance
from oobleck.planner.resplit import RESPLIT_REASON, resplit

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
    steady: frozenset[str] = frozenset()
    """the members with at least `steady_steps(policy)` figures, all of them under the threshold: at pace for
    long enough to undo a mitigation"""
    measured: frozenset[str] = frozenset()
    """the members with at least `steady_steps(policy)` figures: measured for long enough to act on"""
    confirmed: dict[str, float] = field(default_factory=dict)
    """the confirmed stragglers at or over the threshold, by their figure: what a mitigation plans around (a
    confirmed node back under it, not yet released, is listed but not planned around)"""
    typical: dict[str, float] = field(default_factory=dict)
    """each straggler's median figure over its last `steady_steps(policy)` steps since it has been slow: what a
    mitigation plans around (one figure of a node under a CPU quota on a loaded host swung 3.4 to 18)"""
    anchors: dict[str, float] = field(default_factory=dict)
    """each node compared with peers on its layers: its figure against them over its figure against its own
    calibrated pace (a median over its steps), i.e. how far that pace is off theirs (Plan.pace_anchors)"""


STEADY_STEPS_MAX = 20
"""A report carries the last 24 steps' figures (runtime/train/pace.py): the most steps one read can show."""


def steady_steps(policy: StragglerPolicy) -> int:
    """Steps a node's figures must cover before a mitigation is changed for it: `window`, as for confirming."""
    return min(policy.window, STEADY_STEPS_MAX)


def _at(series: Sequence[tuple[int, float]], step: int) -> float:
    """A node's figure at `step`: its newest at or before it (its oldest if it starts later)."""
    value = series[0][1]
    for at, figure in series:
        if at > step:
            break
        value = figure
    return value


Work = tuple[int, int, int, int]
"""A stage's layers [start, end), GPU count and tensor-parallel degree: what it computes per microbatch."""


def same_work(plan: Plan) -> dict[str, Work]:
    """Each node's work in `plan`: nodes with equal work run the same layers on as many GPUs, so their
    compute per profiled cost compares directly (the profile's error on those layers is common to them)."""
    return {
        stage.node: (stage.start, stage.end, len(stage.gpus), stage.tensor_parallel)
        for pipeline in plan.pipelines
        for stage in pipeline.stages
    }


def _relative(
    series: Sequence[tuple[int, float]], peers: Sequence[Sequence[tuple[int, float]]]
) -> list[tuple[int, float]]:
    return [(step, figure / statistics.median(_at(p, step) for p in peers)) for step, figure in series]


def _peers(
    node: str, raw: Mapping[str, Sequence[tuple[int, float]]], work: Mapping[str, Work]
) -> list[Sequence[tuple[int, float]]]:
    """The raw series of the other nodes running `node`'s layers (none unless `node` reports one too)."""
    if not raw.get(node) or node not in work:
        return []
    return [s for n, s in raw.items() if n != node and s and work.get(n) == work[node]]


def relative_series(
    paces: Mapping[str, Sequence[tuple[int, float]]],
    raw: Mapping[str, Sequence[tuple[int, float]]] | None = None,
    work: Mapping[str, Work] | None = None,
    anchors: Mapping[str, float] | None = None,
) -> dict[str, list[tuple[int, float]]]:
    """Each node's (step, figure over its peers' median figure at that step). A node whose `raw` series
    (compute per profiled cost) is known is compared with the nodes of the same `work` that report one:
    that compares what each computes at the same steps, however and whenever each calibrated (a node slow
    since it started reads 1 against its own pace; a newcomer that calibrated while the host was busier
    makes its peers look slow). Any other node is compared by its `paces` (against its own calibrated pace)
    times its anchor (`anchors`: how far its calibrated pace was off its peers' when it last had some, 1 by
    default) with all the other nodes' figures so scaled. A lone node has nothing to compare with and is left out."""
    raw, work, anchors = raw or {}, work or {}, anchors or {}
    anchored = {n: [(step, f * anchors.get(n, 1.0)) for step, f in series] for n, series in paces.items()}
    result = {}
    for node, series in anchored.items():
        if peers := _peers(node, raw, work):
            result[node] = _relative(raw[node], peers)
            continue
        others = [s for n, s in anchored.items() if n != node and s]
        if series and others:
            result[node] = _relative(series, others)
    return result


def relative_slowdowns(paces: Mapping[str, float]) -> dict[str, float]:
    """Each node's pace over the median of the other nodes' paces (the newest step of `relative_series`)."""
    return {node: series[-1][1] for node, series in relative_series({n: [(0, p)] for n, p in paces.items()}).items()}


Series = dict[str, list[tuple[int, float]]]


def _series(members: Sequence[str], generation: int, reports: Mapping[str, ProgressReport]) -> tuple[Series, Series]:
    """The members' (step, figure against their own paces) and, where reported with the pace they are over,
    (step, compute per profiled cost), from their reports of `generation`."""
    reported = {
        node: report
        for node in members
        if (report := reports.get(node)) is not None and report.generation == generation and report.pace
    }
    paces = {node: list(report.pace) for node, report in reported.items()}
    raw = {
        node: [(step, figure * baseline) for step, figure in report.pace]
        for node, report in reported.items()
        if (baseline := report.pace_baseline) is not None
    }
    return paces, raw


def assess(
    members: Sequence[str],
    generation: int,
    reports: Mapping[str, ProgressReport],
    previous: Sequence[Straggler],
    policy: StragglerPolicy,
    work: Mapping[str, Work] | None = None,
    anchors: Mapping[str, float] | None = None,
) -> Assessment:
    """The stragglers among the plan's `members`, from their `reports` of plan generation `generation`
    (a report of another generation, or without a pace, is left out) and the `previous` status; nodes of
    the same `work` (same_work) are compared with each other, the others by their own paces times their
    `anchors` (relative_series)."""
    paces, raw = _series(members, generation, reports)
    relative = relative_series(paces, raw, work, anchors)
    slowdowns = {node: series[-1][1] for node, series in relative.items()}
    found_anchors = {
        node: round(statistics.median(r / own for (_, r), (_, own) in zip(relative[node], paces[node])), 3)
        for node in relative
        if _peers(node, raw, work or {})
    }
    before = {s.node: s for s in previous}
    stragglers, events = [], []
    typical: dict[str, float] = {}
    for node in sorted(relative):
        series = relative[node]
        slowdown, step = series[-1][1], series[-1][0]
        if slowdown < policy.threshold:
            continue
        # The first step of the trailing run over the threshold; a run as old as the history continues
        # the one the previous status holds.
        run = 0
        while run < len(series) and series[-1 - run][1] >= policy.threshold:
            run += 1
        since = run_since = series[-run][0]
        known = before.get(node)
        if known is not None and (known.confirmed or run == len(series)) and known.since_step <= since:
            since = known.since_step  # the same episode: a confirmed one lasts until it is released
        confirmed = step - since >= policy.window
        stragglers.append(Straggler(node=node, slowdown=round(slowdown, 3), since_step=since, confirmed=confirmed))
        recent = [figure for at, figure in series[-steady_steps(policy) :] if at >= run_since]
        typical[node] = round(statistics.median(recent), 3)
        if confirmed and not (known is not None and known.confirmed):
            events.append(
                (
                    "Warning",
                    STRAGGLER,
                    f"{node} computes {slowdown:.2f}x slower than its peers' median "
                    f"(threshold {policy.threshold}) since step {since}",
                )
            )
    k = steady_steps(policy)
    measured = frozenset(node for node, series in relative.items() if len(series) >= k)
    steady = frozenset(node for node in measured if all(f < policy.threshold for _, f in relative[node][-k:]))
    confirmed_over = {s.node: s.slowdown for s in stragglers if s.confirmed}  # before the under-threshold entries
    listed = {s.node for s in stragglers}
    for node, known in before.items():
        if node in listed or node not in members:
            continue
        if node not in relative:
            # A member not measured in this generation yet (a new plan just went out) keeps its entry: no
            # news is not a recovery, and it must not be confirmed (and announced) a second time.
            stragglers.append(known)
        elif known.confirmed and node not in steady:
            # Under the threshold, not yet for `k` steps: still confirmed (released as it was confirmed, after
            # a window), so a node that wobbles about the threshold raises no event per wobble. Seen: a node
            # under a CPU quota read 4.15x, 1.63x then 2.17x as its re-split share settled.
            stragglers.append(known.model_copy(update={"slowdown": round(slowdowns[node], 3)}))
        else:
            continue
        listed.add(node)
    stragglers.sort(key=lambda s: s.node)
    for node, known in before.items():
        # A node that stopped reporting (lost, replaced) is the failure path's business, not a recovery.
        if known.confirmed and node not in listed and node in slowdowns:
            events.append(("Normal", RECOVERED, f"{node} is back under {policy.threshold}x its peers' median"))
    return Assessment(slowdowns, stragglers, events, steady, measured, confirmed_over, typical, found_anchors)


REPLAN_FACTOR = 2.0
"""A mitigated straggler's figure must move by this factor from the one its plan was made for before the plan
is made again: measured under a CPU quota on a loaded host, one node's figure wobbled between 5.9 and 10.8
window by window, and each figure alone called for another split."""


def dwell_until(plan: Plan, policy: StragglerPolicy) -> int:
    """The step before which the straggler plan in force stays, whatever the figures say: `window` steps after
    it was made, twice that after a second plan in a row, and so on (exponential back-off: in S steps at most
    about log2(S / window) + 1 plans in a row, however the figures wobble)."""
    return (plan.mitigation_step or 0) + policy.window * 2 ** max(plan.mitigations - 1, 0)


def _replan(planned: Mapping[str, float], confirmed: Mapping[str, float], steady: frozenset[str]) -> bool:
    """Whether the plan in force, made around `planned` slowdowns, is to be made again for the `confirmed`
    stragglers: one is new, or its figure moved by REPLAN_FACTOR from its planned one, or a planned node is
    confirmed no more and `steady` (at pace for long enough: its layers come back)."""
    if any(node not in confirmed and node not in steady for node in planned):
        return False  # a planned node between slow and steady: wait for it
    for node, figure in confirmed.items():
        if node not in planned or not 1 / REPLAN_FACTOR <= figure / planned[node] <= REPLAN_FACTOR:
            return True
    return set(planned) != set(confirmed)


RESPLIT_MIN_GAIN = 0.1
"""A re-split or a move of layers must shorten the step at the measured speeds by a tenth: a wobbling
measurement makes no new generation per wobble (each costs a redone step)."""

LAYERS_REBALANCED = "LayersRebalanced"
BATCH_RESPLIT = "BatchResplit"
STRAGGLER_BENCHED = "StragglerBenched"
BENCHED_READMITTED = "BenchedNodeReadmitted"


def _event_reason(plan: Plan) -> str:
    for prefix, reason in (
        (REBALANCE_REASON, LAYERS_REBALANCED),
        (BENCH_REASON, STRAGGLER_BENCHED),
        (READMIT_REASON, BENCHED_READMITTED),
    ):
        if plan.reason.startswith(prefix):
            return reason
    return BATCH_RESPLIT


def _mitigation_plan(
    ctx: JobContext,
    obs: JobObservation,
    in_force: Plan,
    found: Assessment,
    profile: ModelProfile | None,
    tuning: Tuning,
) -> Plan | None:
    """The next straggler plan by `stragglers.mitigation` (see with_stragglers), or None: the plan in force stays."""
    mitigation = ctx.spec.stragglers.mitigation
    moves = mitigation in ("rebalance", "spare") and profile is not None
    confirmed = dict(found.confirmed)
    # A benched node taken back that is still slow is benched again at once: taking it back was the probe.
    probed = in_force.reason.startswith(READMIT_REASON) and any(n in confirmed for n in in_force.added_nodes)
    if in_force.mitigations and not probed and obs.step < dwell_until(in_force, ctx.spec.stragglers):
        return None  # a straggler plan in force too briefly to change again
    waiting = ready_newcomers(obs, in_force, reported=True)
    # A benched node whose pod waits as a spare (one that is gone is replaced like any pod: membership.py),
    # taken back into the room it left (not while a warm spare took its place: then it is the spare).
    back = [node for node in in_force.benched if node in waiting] if len(in_force.nodes) < ctx.spec.nodes.wanted else []
    spare = next((node for node in waiting if node not in in_force.benched), None)
    if confirmed:
        confirmed = {node: found.typical.get(node, figure) for node, figure in confirmed.items()}
        if not _replan(in_force.slowdowns, confirmed, found.steady):
            return None
    if confirmed and moves:
        assert profile is not None
        return mitigate(
            in_force,
            profile,
            confirmed,
            RESPLIT_MIN_GAIN,
            bandwidth=tuning.inter_node_bandwidth,
            horizon=tuning.horizon,
            gpu_memory_bytes=cluster_shape(ctx.spec, tuning).gpu_memory_bytes,
            bench_min_nodes=ctx.spec.nodes.min if mitigation == "spare" else None,
            bench_replacement=spare,
        )
    if back and profile is not None:
        # Its back-off is over: measured again the only honest way, by training (see the module docstring).
        return readmit(in_force, profile, back[0], bandwidth=tuning.inter_node_bandwidth, horizon=tuning.horizon)
    if confirmed:
        return resplit(in_force, confirmed, RESPLIT_MIN_GAIN)
    if found.steady >= set(in_force.nodes) and in_force.reason.startswith(REBALANCE_REASON):
        assert profile is not None, "layers were moved with the job's profile"
        return rebalance(in_force, profile, {})  # the template's layout, the layers copied back
    if found.steady >= set(in_force.nodes) and in_force.reason.startswith(RESPLIT_REASON):
        return resplit(in_force, {})  # the profile's split
    return None


def with_stragglers(
    ctx: JobContext,
    obs: JobObservation,
    current: CurrentPlan | None,
    decision: Decision,
    profile: ModelProfile | None = None,
    tuning: Tuning | None = None,
) -> Decision:
    """The decision with status.stragglers and the Straggler events (operator/stragglers.py) while the
    plan in force trains (nothing is slow in a job that does not). With nothing else to change, the next
    generation works around the confirmed stragglers by `stragglers.mitigation`: `resplit` re-splits the
    batch (planner_cy/resplit.py); `rebalance` takes the cheaper by the planner's price (copy time +
    horizon x step time at the measured speeds) of that and moving layers off the slow nodes
    (planner_cy/rebalance.py, with the job's profile). Once none is slow, the profile's split and the
    template's layout again.

    Hysteresis, so that a mitigation cannot oscillate: nothing changes until every member has reported
    `steady_steps` figures in the plan in force (a moved node's figures start afresh after its warm-up);
    a change for a confirmed straggler (slow for `window` steps) must shorten the step by
    RESPLIT_MIN_GAIN at the measured speeds; whatever the mitigation, a straggler's figure is its median over
    those steps (`Assessment.typical`), a plan made around it (Plan.slowdowns) is made again only once that figure moved by REPLAN_FACTOR, another node is
    confirmed, or a planned node is steady at pace again (`_replan`), so a wobbling figure cannot flip the
    plan; the mitigation is undone only once every member's last `steady_steps` figures are all under the
    threshold. And a straggler plan in force stays for `dwell_until` (an exponential back-off over the
    straggler plans in a row, Plan.mitigations): a host whose load slows one node, then its peer, then the
    first again (measured on 2 shared cores) gets fewer and fewer generations, not one per window. The runtime carries each node's calibration across a stage
    change (runtime/train/pace.py), so a node moved while slow still reads slow and keeps its mitigation.
    `spare` prices benching the slowest confirmed node too (planner_cy/bench.py) and takes a benched node
    back once its plan's back-off is over (see the module docstring)."""
    in_force = decision.plan or (current.plan if current is not None else None)
    if in_force is None or decision.status.get("phase") not in ("Running", "Reconfiguring"):
        return decision
    reports = {w.name: w.progress for w in obs.workers if w.progress is not None and w.status == "running"}
    found = assess(
        in_force.nodes,
        in_force.generation,
        reports,
        ctx.status.stragglers,
        ctx.spec.stragglers,
        same_work(in_force),
        in_force.pace_anchors,
    )
    status = {**decision.status, "stragglers": [s.to_kubernetes() for s in found.stragglers]}
    events = tuple(Event(*event) for event in found.events)
    decision = replace(decision, status=status, events=(*decision.events, *events), slowdowns=found.slowdowns)
    if current is None or decision.plan is not None or decision.status.get("phase") != "Running":
        return decision
    mitigation = ctx.spec.stragglers.mitigation
    if mitigation == "none" or not found.measured >= set(current.plan.nodes):
        return decision  # nothing to do, or some member not measured long enough in this generation
    plan = _mitigation_plan(ctx, obs, current.plan, found, profile, tuning or Tuning())
    if plan is None:
        return decision
    count = current.plan.mitigations + 1 if plan.slowdowns or plan.benched or current.plan.mitigations else 0
    # A node whose layers move may have no peer left: its own pace, anchored, still says how slow it is.
    anchors = {n: a for n, a in (current.plan.pace_anchors | found.anchors).items() if a != 1.0 and n in plan.nodes}
    update = {"mitigation_step": obs.step, "mitigations": count, "pace_anchors": anchors}
    plan = Plan.model_validate(plan.model_dump() | update)
    reason = _event_reason(plan)
    return replace(
        decision,
        plan=plan,
        failures_survived=current.failures_survived,
        events=(*decision.events, Event("Normal", reason, plan.reason)),
    )
