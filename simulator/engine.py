"""Run the policies over a trace and sum up what each trained.

Goodput is samples trained (work lost to failures taken back) divided by what the trace's starting
cluster trains without failures and without fault tolerance (our planner, f = 0) over the same time.
The effective time share is (training time - time whose work was lost) / duration: the figure the
Oobleck artifact publishes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from oobleck.api.profile import ClusterShape, LayerProfile, ModelProfile
from oobleck.planner.errors import PlanningError

from .costs import Costs
from .planning import NoPipeline, Planner
from .policies import TRAINING, BambooPolicy, CheckpointPolicy, OobleckPolicy, ReplicaPolicy, Timeline
from .traces import Trace

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


@dataclass(frozen=True)
class Summary:
    policy: str
    samples: float
    goodput: float
    effective_time_share: float
    seconds_by_state: dict[str, float]
    lost_seconds: float
    note: str = ""


@dataclass
class Result:
    trace: Trace
    job: Job
    costs: Costs
    baseline_samples_per_s: float
    baseline_iteration_s: float
    bamboo_slowdown: float | None
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


def summarize(timeline: Timeline, duration_s: float, baseline_rate: float) -> Summary:
    states: dict[str, float] = {}
    trained = 0.0
    for segment in timeline.segments:
        states[segment.state] = states.get(segment.state, 0.0) + segment.end_s - segment.start_s
        trained += (segment.end_s - segment.start_s) * segment.samples_per_s
    lost_samples = sum(loss.samples for loss in timeline.losses)
    lost_seconds = sum(loss.seconds for loss in timeline.losses)
    samples = trained - lost_samples
    return Summary(
        policy=timeline.policy,
        samples=samples,
        goodput=samples / (baseline_rate * duration_s),
        effective_time_share=(states.get(TRAINING, 0.0) - lost_seconds) / duration_s,
        seconds_by_state=dict(sorted(states.items())),
        lost_seconds=lost_seconds,
        note=timeline.note,
    )


def _bamboo(trace: Trace, job: Job, planner: Planner, costs: Costs) -> tuple[Timeline, float | None]:
    if costs.bamboo.slowdown is not None:
        policy = BambooPolicy(trace, planner, costs.bamboo, costs.checkpoint, costs.bamboo.slowdown)
        return policy.run(), costs.bamboo.slowdown
    try:
        # m_ref chosen for the redundant layouts' own (deeper) pipelines: the job's may not hold the batch.
        redundant = Planner(redundant_profile(job.profile), job.cluster(trace.max_nodes()), job.microbatches)
        slowdown = (
            redundant.fresh(list(trace.initial), 0).iteration_s / planner.fresh(list(trace.initial), 0).iteration_s
        )
    except (PlanningError, NoPipeline) as error:
        timeline = Timeline("redundant-computation", note=f"cannot run: {error}")
        timeline.add(0.0, trace.duration_s, "cannot run", 0.0)
        return timeline, None
    # The redundant planner's layouts already carry the slowdown (and its memory-driven pipeline depth).
    return BambooPolicy(trace, redundant, costs.bamboo, costs.checkpoint, 1.0).run(), slowdown


def simulate(trace: Trace, job: Job, costs: Costs, policies: Sequence[str] = POLICIES) -> Result:
    """Every requested policy over `trace`; PlanningError/NoPipeline when the starting cluster cannot train."""
    planner = Planner(job.profile, job.cluster(trace.max_nodes()), job.microbatches, m_ref=job.m_ref)
    baseline = planner.fresh(list(trace.initial), 0)
    result = Result(trace, job, costs, baseline.samples_per_s, baseline.iteration_s, None)
    for name in policies:
        if name == "oobleck":
            timeline = OobleckPolicy(trace, planner, job.f, costs.oobleck).run()
        elif name == "checkpoint-restart":
            timeline = CheckpointPolicy(trace, planner, costs.checkpoint).run()
        elif name == "redundant-computation":
            timeline, result.bamboo_slowdown = _bamboo(trace, job, planner, costs)
        elif name == "replica-dropping":
            timeline = ReplicaPolicy(trace, planner, costs.replicas).run()
        else:
            raise ValueError(f"policies: unknown policy {name!r}; choose from {', '.join(POLICIES)}")
        result.timelines[name] = timeline
        result.summaries[name] = summarize(timeline, trace.duration_s, baseline.samples_per_s)
    return result


def recommend_f(trace: Trace, job: Job, costs: Costs, most: int = 8) -> list[tuple[int, float]]:
    """Oobleck's goodput for every f the starting cluster can hold (up to `most`), best first.

    Ties go to the larger f: when the starting plan already has more than f+1 pipelines, a larger f costs
    nothing on this trace and protects against worse ones."""
    planner = Planner(job.profile, job.cluster(trace.max_nodes()), job.microbatches, m_ref=job.m_ref)
    baseline = planner.fresh(list(trace.initial), 0)
    scores = []
    for f in range(most + 1):
        if (f + 1) * planner.min_nodes > len(trace.initial) or f + 1 > job.microbatches:
            break
        timeline = OobleckPolicy(trace, planner, f, costs.oobleck).run()
        scores.append((f, summarize(timeline, trace.duration_s, baseline.samples_per_s).goodput))
    return sorted(scores, key=lambda item: (-round(item[1], 12), -item[0]))
