"""Run the policies over a trace and sum up what each trained.

Accounting (README, Simulating goodput):
- Goodput is samples trained (work lost to failures taken back) divided by the ideal: at every moment, the
  best throughput our planner reaches (f = 0, no fault tolerance) on the nodes up then (after their start-up
  delay), or on fewer of them if that is faster. No policy trains faster on the same nodes, so goodput never
  exceeds 100 %, on growing traces too.
  The ideal ignores node speeds and warm spares: it is every node up at full speed, so a straggler's or a
  spare's cost shows in every policy's goodput.
- Each policy's time splits into categories that sum to the trace length: "effective" (training whose work
  was kept), "lost work" (training thrown away by a failure) and its other states (reconfiguring,
  restarting, checkpointing, waiting, ...). The effective time share is effective / trace length.
- The artifact's share is computed as the Oobleck artifact's simulators compute theirs: all training time
  (work later thrown away included) over the sum of their categories, in which thrown-away work is counted a
  second time as "fallback" and waiting for nodes is not counted; so it is not a share of the trace length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from oobleck.api.plan import Plan
from oobleck.api.profile import ClusterShape, LayerProfile, ModelProfile
from oobleck.planner.errors import PlanningError

from .baselines import BambooPolicy, CheckpointPolicy, ReplicaPolicy
from .costs import Costs
from .oobleck_policy import OobleckPolicy
from .planning import NoPipeline, Planner
from .policies import TRAINING, Timeline
from .traces import Trace, TraceError

POLICIES = ("oobleck", "checkpoint-restart", "redundant-computation", "replica-dropping")


@dataclass(frozen=True)
class Job:
    """What is trained, on which machines: the planner's inputs minus the node count (the trace's)."""

    profile: ModelProfile
    gpus_per_node: int
    gpu_memory_bytes: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    f: int
    global_batch: int  # samples per iteration
    m_ref: int | None = None
    min_nodes_per_pipeline: int = 1  # the artifact's n0: no pipeline of fewer nodes
    start_plan: Plan | None = None  # oobleck starts from this plan (its templates serve every policy)
    max_tensor_parallel: int = 1  # the largest tensor-parallel degree a stage may take (planning only)

    @property
    def microbatches(self) -> int:
        return self.global_batch // self.profile.microbatch_size

    def cluster(self, nodes: int) -> ClusterShape:
        return ClusterShape(
            nodes=nodes,
            gpus_per_node=self.gpus_per_node,
            gpu_memory_bytes=self.gpu_memory_bytes,
            intra_node_bandwidth=self.intra_node_bandwidth,
            inter_node_bandwidth=self.inter_node_bandwidth,
        )


EFFECTIVE = "effective"
LOST = "lost work"


@dataclass(frozen=True)
class Summary:
    policy: str
    samples: float
    goodput: float  # samples / the ideal's samples
    effective_time_share: float  # effective / trace length
    artifact_time_share: float  # as the artifact computes it (module doc)
    time_by_category: dict[str, float]  # effective, lost work and the other states: sums to the trace length
    seconds_by_state: dict[str, float]
    lost_seconds: float
    note: str = ""


@dataclass
class Result:
    trace: Trace  # as given
    ready: Trace  # the trace the policies ran on: nodes usable after their start-up delay
    job: Job
    costs: Costs
    baseline_samples_per_s: float  # the ideal on the most nodes the trace reaches
    baseline_iteration_s: float
    bamboo_slowdown: float | None
    ideal: list[tuple[float, float]]  # (time, ideal samples/s from then on)
    ideal_samples: float
    speed_bound: float = 1.0  # the ideal scaled by the nodes' mean speed (issue #22's reference), over the ideal
    timelines: dict[str, Timeline] = field(default_factory=dict)
    summaries: dict[str, Summary] = field(default_factory=dict)


def redundant_profile(profile: ModelProfile) -> ModelProfile:
    """Bamboo's steady state as a profile: each layer also carries a neighbour's eager forward pass and state."""
    return profile.model_copy(
        update={
            "model": f"{profile.model} (redundant computation)",
            "layers": [
                LayerProfile(
                    name=layer.name,
                    forward_ms=2 * layer.forward_ms,
                    backward_ms=layer.backward_ms,
                    state_bytes=2 * layer.state_bytes,
                    activation_bytes=layer.activation_bytes,
                    output_bytes=layer.output_bytes,
                )
                for layer in profile.layers
            ],
        }
    )


def ideal_rates(trace: Trace, planner: Planner) -> list[tuple[float, float]]:
    """(time, samples/s) steps of the ideal: the best f = 0 plan on the nodes up, or on fewer if faster."""
    best: dict[int, float] = {}

    def rate(count: int) -> float:
        if count not in best:
            try:
                best[count] = planner.fresh([str(i) for i in range(count)], 0).samples_per_s
            except NoPipeline:
                best[count] = 0.0
        return best[count]

    counts = trace.node_counts()
    for _, count in counts:
        rate(count)
    # Fewer nodes may plan faster (memory-capped pipelines, counts the templates split badly): take the best
    # of every count at or below this one that the trace visits.
    envelope = {n: max(r for k, r in best.items() if k <= n) for n in best}
    return [(time_s, envelope[count]) for time_s, count in counts]


def speed_bound(trace: Trace, ideal: list[tuple[float, float]]) -> float:
    """The share of the ideal left when every moment's ideal is scaled by the mean speed of the nodes up
    (issue #22: the unthrottled throughput x sum of speeds / nodes; 3.5 / 4 with one node of 4 at 1/2)."""
    if not any(e.kind == "slow" for e in trace.events):
        return 1.0
    speeds: dict[str, float] = {}
    up = set(trace.initial)
    points = [(0.0, 1.0)]
    for step in trace.steps():
        up -= set(step.removed)
        up |= set(step.added)
        speeds.update(step.speeds)
        mean = sum(speeds.get(n, 1.0) for n in up) / len(up) if up else 1.0
        points.append((step.time_s, mean))
    times = sorted({t for t, _ in ideal} | {t for t, _ in points})
    rate = [(t, _at(ideal, t) * _at(points, t)) for t in times]
    whole = integrate(ideal, trace.duration_s)
    return integrate(rate, trace.duration_s) / whole if whole > 0 else 1.0


def _at(steps: list[tuple[float, float]], time_s: float) -> float:
    """The value of a step function (time, value from then on) at `time_s`."""
    value = steps[0][1]
    for t, v in steps:
        if t > time_s:
            break
        value = v
    return value


def integrate(steps: list[tuple[float, float]], duration_s: float) -> float:
    ends = [t for t, _ in steps[1:]] + [duration_s]
    return math.fsum((end - start) * rate for (start, rate), end in zip(steps, ends))


REDUNDANT = "redundant computation"


def summarize(timeline: Timeline, duration_s: float, ideal_samples: float, slowdown: float = 1.0) -> Summary:
    """Totals of one timeline; `slowdown` > 1 (redundant computation) splits kept training into the part the
    plain model would have needed ("effective") and the rest ("redundant computation"), as the artifact does."""
    states: dict[str, list[float]] = {}
    trained = []
    for segment in timeline.segments:
        states.setdefault(segment.state, []).extend((segment.end_s, -segment.start_s))
        trained.append((segment.end_s - segment.start_s) * segment.samples_per_s)
    seconds = {state: math.fsum(parts) for state, parts in sorted(states.items())}
    lost_samples = math.fsum(loss.samples for loss in timeline.losses)
    lost_seconds = math.fsum(loss.seconds for loss in timeline.losses)
    samples = math.fsum(trained) - lost_samples
    training = seconds.get(TRAINING, 0.0)
    kept = training - lost_seconds
    categories = {EFFECTIVE: kept / slowdown, LOST: lost_seconds}
    if slowdown != 1.0:
        categories[REDUNDANT] = kept - kept / slowdown
    categories.update((state, t) for state, t in seconds.items() if state != TRAINING)
    counted = math.fsum(t for state, t in seconds.items() if state != "waiting") + lost_seconds
    return Summary(
        policy=timeline.policy,
        samples=samples,
        goodput=samples / ideal_samples if ideal_samples > 0 else 0.0,
        effective_time_share=categories[EFFECTIVE] / duration_s,
        artifact_time_share=training / slowdown / counted if counted > 0 else 0.0,
        time_by_category=categories,
        seconds_by_state=seconds,
        lost_seconds=lost_seconds,
        note=timeline.note,
    )


def _bamboo(trace: Trace, job: Job, planner: Planner, costs: Costs) -> tuple[Timeline, float | None]:
    if costs.bamboo.slowdown is not None:
        policy = BambooPolicy(
            trace, planner, costs.bamboo, costs.bamboo.fallback or costs.checkpoint, costs.bamboo.slowdown
        )
        return policy.run(), costs.bamboo.slowdown
    try:
        # m_ref chosen for the redundant layouts' own (deeper) pipelines: the job's may not hold the batch.
        redundant = Planner(
            redundant_profile(job.profile),
            job.cluster(trace.max_nodes()),
            job.microbatches,
            min_nodes=job.min_nodes_per_pipeline,
            max_tp=job.max_tensor_parallel,
        )
        most = [str(i) for i in range(trace.max_nodes())]
        slowdown = redundant.fresh(most, 0).iteration_s / planner.fresh(most, 0).iteration_s
    except (PlanningError, NoPipeline) as error:
        timeline = Timeline("redundant-computation", note=f"cannot run: {error}")
        timeline.add(0.0, trace.duration_s, "cannot run", 0.0)
        return timeline, None
    # The redundant planner's layouts already carry the slowdown (and its memory-driven pipeline depth).
    return BambooPolicy(trace, redundant, costs.bamboo, costs.bamboo.fallback or costs.checkpoint, 1.0).run(), slowdown


def _planner(trace: Trace, job: Job) -> Planner:
    return Planner(
        job.profile,
        job.cluster(trace.max_nodes()),
        job.microbatches,
        m_ref=job.m_ref,
        min_nodes=job.min_nodes_per_pipeline,
        templates=job.start_plan.templates if job.start_plan is not None else None,
        max_tp=job.max_tensor_parallel,
    )


def with_start_plan(trace: Trace, plan: Plan) -> Trace:
    """The trace with its starting nodes named as the plan's nodes, in order; TraceError when the counts differ."""
    if len(trace.initial) != len(plan.nodes):
        raise TraceError(
            f"start_plan: the plan has {len(plan.nodes)} nodes, the trace starts with {len(trace.initial)}"
        )
    return trace.renamed(dict(zip(trace.initial, plan.nodes)))


def simulate(trace: Trace, job: Job, costs: Costs, policies: Sequence[str] = POLICIES) -> Result:
    """Every requested policy over `trace`; PlanningError/NoPipeline when the trace's largest cluster
    cannot train."""
    if job.start_plan is not None:
        trace = with_start_plan(trace, job.start_plan)
    ready = trace.ready_after(costs.nodes.startup_s)
    planner = _planner(ready, job)
    baseline = planner.fresh([str(i) for i in range(ready.max_nodes())], 0)
    ideal = ideal_rates(ready, planner)
    ideal_samples = integrate(ideal, ready.duration_s)
    result = Result(trace, ready, job, costs, baseline.samples_per_s, baseline.iteration_s, None, ideal, ideal_samples)
    result.speed_bound = speed_bound(ready, ideal)
    # Warm spares are nodes up that do not train: the ideal still counts them, the policies do without.
    ready = ready.with_spares(costs.nodes.spares, costs.nodes.spare_join_s)
    for name in policies:
        if name == "oobleck":
            timeline = OobleckPolicy(ready, planner, job.f, costs.oobleck, job.start_plan).run()
        elif name == "checkpoint-restart":
            timeline = CheckpointPolicy(ready, planner, costs.checkpoint).run()
        elif name == "redundant-computation":
            timeline, result.bamboo_slowdown = _bamboo(ready, job, planner, costs)
        elif name == "replica-dropping":
            timeline = ReplicaPolicy(ready, planner, costs.replicas).run()
        else:
            raise ValueError(f"policies: unknown policy {name!r}; choose from {', '.join(POLICIES)}")
        result.timelines[name] = timeline
        slowdown = result.bamboo_slowdown or 1.0 if name == "redundant-computation" else 1.0
        result.summaries[name] = summarize(timeline, ready.duration_s, ideal_samples, slowdown)
    return result


def recommend_f(trace: Trace, job: Job, costs: Costs, most: int = 8) -> list[tuple[int, float]]:
    """Oobleck's goodput for every f the largest cluster can hold (up to `most`), best first.

    Ties go to the larger f: when the starting plan already has more than f+1 pipelines, a larger f costs
    nothing on this trace and protects against worse ones."""
    ready = trace.ready_after(costs.nodes.startup_s)
    planner = _planner(ready, job)
    ideal_samples = integrate(ideal_rates(ready, planner), ready.duration_s)
    ready = ready.with_spares(costs.nodes.spares, costs.nodes.spare_join_s)
    scores = []
    for f in range(most + 1):
        if (f + 1) * planner.min_nodes > ready.max_nodes() or f + 1 > job.microbatches:
            break
        timeline = OobleckPolicy(ready, planner, f, costs.oobleck).run()
        scores.append((f, summarize(timeline, ready.duration_s, ideal_samples).goodput))
    return sorted(scores, key=lambda item: (-round(item[1], 12), -item[0]))
