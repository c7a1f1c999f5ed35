"""oobleck simulate: trace parsing, each policy on a hand-checked trace, calibration against the planner,
determinism, the CLI's errors, and the benchmark's quick mode."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from oobleck.api.profile import LayerProfile, ModelProfile
from oobleck.cli import main
from oobleck.planner import plan_job
from oobleck.simulate import Costs, Job, simulate, traces
from oobleck.simulate.costs import BambooCosts, CheckpointCosts, NodeCosts, OobleckCosts, ReplicaCosts
from oobleck.simulate.traces import TraceError

REPO = Path(__file__).resolve().parents[2]
GiB = 1 << 30


def flat_profile(layers: int = 4, state: int = GiB) -> ModelProfile:
    """Equal layers of 10 ms forward + 20 ms backward, `state` bytes each: easy arithmetic."""
    layer = LayerProfile(forward_ms=10, backward_ms=20, state_bytes=state, activation_bytes=1, output_bytes=1)
    return ModelProfile(model="flat", microbatch_size=1, layers=[layer] * layers)


def job(f: int = 1, memory: int = 8 * GiB, batch: int = 8) -> Job:
    # 4 layers of 1 GiB in 8 GiB per GPU: one node holds the whole model, so every pipeline is one node.
    return Job(flat_profile(), 1, memory, 1e11, 1e9, f=f, global_batch=batch)


def trace_of(text: str, duration_ms: int | None = None) -> traces.Trace:
    return traces.parse(text, "t.csv", None if duration_ms is None else duration_ms / 1e3)


FOUR = "".join(f"0,add,n{i}\n" for i in range(4))


# -- traces --------------------------------------------------------------------------------------------


def test_artifact_format_parses_with_batches_and_duration() -> None:
    trace = trace_of("# comment\n" + FOUR + "# duration_ms: 5000\n1000,remove,n1\n1000,remove,n2\n2500,add,n9\n")
    assert trace.initial == ("n0", "n1", "n2", "n3")
    assert trace.duration_s == 5.0
    assert trace.batches() == [(1.0, ["n1", "n2"], []), (2.5, [], ["n9"])]
    assert trace.node_counts() == [(0.0, 4), (1.0, 2), (2.5, 3)]
    assert traces.parse(traces.dump(trace), "again").events == trace.events


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (FOUR + "10,remove\n", "t.csv:5: expected 3 fields"),
        (FOUR + "soon,remove,n1\n", "t.csv:5: time: expected milliseconds, got 'soon'"),
        (FOUR + "-5,remove,n1\n", "t.csv:5: time: must be a finite number >= 0"),
        (FOUR + "20,remove,n1\n10,remove,n2\n", "t.csv:6: time: 10 ms is before the previous event"),
        (FOUR + "10,crash,n1\n", "t.csv:5: event: expected 'add' or 'remove', got 'crash'"),
        (FOUR + "10,remove,n7\n", "t.csv:5: node: 'n7' is removed while not up"),
        (FOUR + "10,add,n0\n", "t.csv:5: node: 'n0' is added while already up"),
        (FOUR + "10,remove, \n", "t.csv:5: node: empty"),
        (FOUR + "# duration_ms: soon\n", "t.csv:5: duration_ms: expected milliseconds"),
        ("# nothing\n", "t.csv: the trace has no length"),
        ("# duration_ms: 5000\n", "t.csv: no node is ever added"),
        (FOUR + "# duration_ms: 5\n10,remove,n1\n", "t.csv: duration 0.005 s must not end before the last event"),
    ],
)
def test_bad_trace_names_line_and_field(text: str, message: str) -> None:
    with pytest.raises(TraceError) as error:
        trace_of(text)
    assert message in str(error.value)


def test_bad_trace_file_exits_2_naming_line_and_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(FOUR + "100,remove,n1\n200,explode,n2\n")
    assert main(["simulate", "--trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:6: event: expected 'add' or 'remove', got 'explode'" in err


def test_generated_traces_are_seeded_and_valid() -> None:
    one = traces.mtbf(16, 3600.0, 600.0, 86400.0, seed=4)
    assert one == traces.mtbf(16, 3600.0, 600.0, 86400.0, seed=4)
    assert one != traces.mtbf(16, 3600.0, 600.0, 86400.0, seed=5)
    assert 250 < one.losses() < 400  # 16 nodes x 24 h / (1 h up + 10 min repair) = 329 expected
    waves = traces.spot(32, 7200.0, 0.25, 1800.0, 86400.0, seed=1)
    assert waves == traces.spot(32, 7200.0, 0.25, 1800.0, 86400.0, seed=1)
    for trace in (one, waves):  # a generated trace is a valid file, read back the same
        again = traces.parse(traces.dump(trace), "dumped")
        assert [(round(e.time_s, 3), e.kind, e.node) for e in again.events] == [
            (round(e.time_s, 3), e.kind, e.node) for e in trace.events
        ]
    assert max(len(removed) for _, removed, _ in waves.batches()) > 1  # waves take several nodes at once


def test_bundled_artifact_traces_have_the_artifacts_shape() -> None:
    # The artifact's tools/simulator/traces/{10m,30m,1h,3h,6h}.csv: 30 nodes at 0, 15 removals at its spacing,
    # no additions, ending at the last removal.
    for name, interval in (("10m", 601.2), ("30m", 1800), ("1h", 3600), ("3h", 10800), ("6h", 21600)):
        trace = traces.load(f"artifact-30n-{name}")
        assert trace.initial == tuple(f"node{i}" for i in range(1, 31))
        assert [e.kind for e in trace.events] == ["remove"] * 15
        assert [e.time_s for e in trace.events] == pytest.approx([k * interval for k in range(1, 16)])
        assert len({e.node for e in trace.events}) == 15
        assert trace.duration_s == trace.events[-1].time_s
    assert traces.load("artifact-30n-10m").events[0].node == "node5"


def test_traces_may_start_empty_and_grow() -> None:
    growing = trace_of("1000,add,a\n1000,add,b\n5000,add,c\n7000,remove,a\n9000,add,d\n")
    assert growing.initial == () and growing.duration_s == 9.0
    assert growing.node_counts() == [(0.0, 0), (1.0, 2), (5.0, 3), (7.0, 2), (9.0, 3)]
    assert growing.max_nodes() == 3


def test_node_startup_delay_moves_every_join() -> None:
    trace = trace_of("0,add,a\n0,add,b\n1000,remove,b\n2000,add,c\n2500,remove,c\n3000,add,b\n", 10000)
    ready = trace.ready_after(0.75)
    # a and b usable at 0.75 s; b leaves at 1 s; c leaves at 2.5 s before its 2.75 s start: it never joins.
    assert ready.initial == ()
    assert [(e.time_s, e.kind, e.node) for e in ready.events] == [
        (0.75, "add", "a"),
        (0.75, "add", "b"),
        (1.0, "remove", "b"),
        (3.75, "add", "b"),
    ]
    assert trace.ready_after(0) is trace


def test_spot_patterns_are_seeded_and_shaped_like_the_artifacts_traces() -> None:
    gcp = traces.spot_pattern("gcp", seed=1)
    assert gcp == traces.spot_pattern("gcp", seed=1) and gcp != traces.spot_pattern("gcp", seed=2)
    assert gcp.initial == () and gcp.events[0].time_s == 480.0  # empty until the first nodes arrive
    assert gcp.max_nodes() == 30 and gcp.duration_s == 38760.0
    p3 = traces.spot_pattern("ec2-p3", seed=1)
    assert len(p3.initial) == 20 and p3.max_nodes() == 30
    for trace in (gcp, p3):
        assert max(len(removed) for _, removed, _ in trace.batches()) > 1  # preemption bursts
        counts = [n for t, n in trace.node_counts() if t > 3600]
        assert min(counts) >= 10 and max(counts) <= 30
        mean = sum(counts) / len(counts)
        assert 18 <= mean <= 28  # the artifact's scaled traces average 22.2 (GCP) and 24.1 (P3) nodes up
        again = traces.parse(traces.dump(trace), "dumped")  # a valid file, read back the same
        assert [(round(e.time_s, 3), e.kind, e.node) for e in again.events] == [
            (round(e.time_s, 3), e.kind, e.node) for e in trace.events
        ]
    with pytest.raises(TraceError, match="pattern: unknown 'azure'"):
        traces.spot_pattern("azure", 1)


# -- calibration -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "nodes", "gpus", "memory", "batch"),
    [("gpt3-1.3b", 12, 2, 16 * GiB, 64), ("gpt3-2.7b", 30, 1, 40 * GiB, 512)],  # the second: the CLI's defaults
)
def test_iteration_time_is_the_planners_z(model: str, nodes: int, gpus: int, memory: int, batch: int) -> None:
    from oobleck.api.profile import ClusterShape
    from oobleck.planner.synthetic import GPT3, gpt_profile

    profile = gpt_profile(GPT3[model], seq_len=2048, microbatch_size=1, gpu_flops=125e12, hbm_bandwidth=1.5e12)
    sim_job = Job(profile, gpus, memory, 3e11, 6.25e9, f=1, global_batch=batch)
    trace = traces.fixed_interval(nodes, 600.0, 1)
    result = simulate(trace, sim_job, Costs(), policies=("oobleck",))
    cluster = ClusterShape(
        nodes=nodes, gpus_per_node=gpus, gpu_memory_bytes=memory, intra_node_bandwidth=3e11, inter_node_bandwidth=6.25e9
    )
    plan = plan_job(profile, cluster, 1, batch, "x", nodes=list(trace.initial))
    first = result.timelines["oobleck"].segments[0]
    assert first.samples_per_s == pytest.approx(batch / (plan.iteration_ms / 1e3), rel=1e-12)
    no_ft = plan_job(profile, cluster, 0, batch, "x")
    assert result.baseline_iteration_s == pytest.approx(no_ft.iteration_ms / 1e3, rel=1e-12)


# -- each policy on a hand-checked trace ----------------------------------------------------------------
# 4 one-node pipelines, B = 8: 2 microbatches each, Z = T(2) = 4 * 30 ms + 1 * 120 ms = 240 ms -> 33.33 samples/s.
# Node n1 is lost at 10 s and a fresh node n9 joins at 20 s; the trace ends at 30 s.

TRACE = FOUR + "10000,remove,n1\n20000,add,n9\n"
Z = 0.240
RATE = 8 / Z


def hand_trace() -> traces.Trace:
    return trace_of(TRACE, 30000)


def run(policy: str, costs: Costs, **kwargs) -> tuple:
    result = simulate(hand_trace(), job(**kwargs), costs, policies=(policy,))
    return result, result.summaries[policy], result.timelines[policy]


def test_baseline_is_hand_computed() -> None:
    result = simulate(hand_trace(), job(), Costs(), policies=())
    assert result.baseline_iteration_s == pytest.approx(Z)


def test_oobleck_policy_by_hand() -> None:
    costs = Costs(oobleck=OobleckCosts(detection_s=0.1, plan_s=0.2, rendezvous_s=0.3))
    result, summary, timeline = run("oobleck", costs)
    # Loss: 3 pipelines, B = 8 -> 3,3,2 microbatches, Z = T(3) = 120 + 2 * 120 = 360 ms; no copy (whole
    # pipeline dropped): pause 0.6 s. Addition: the new node gets all 4 GiB over 1 GB/s: 4.29 s + 0.6 s.
    copy = 4 * GiB / 1e9
    assert summary.seconds_by_state["reconfiguring"] == pytest.approx(0.6 + 0.6 + copy)
    rates = [s.samples_per_s for s in timeline.segments if s.state == "training"]
    assert rates == pytest.approx([RATE, 8 / 0.360, RATE])
    # The iteration in flight at 10 s is lost: 10 s / 240 ms = 41.67 steps, 0.67 of a step.
    [loss] = timeline.losses
    assert loss.samples == pytest.approx((10 / Z - math.floor(10 / Z)) * 8)
    expected = 10.6 * 0 + 10 * RATE + (20 - 10.6) * 8 / 0.360 + (30 - 20 - 0.6 - copy) * RATE - loss.samples
    assert summary.samples == pytest.approx(expected)
    # The ideal uses the nodes up at each moment: 4, then 3 (Z = 360 ms), then 4 again.
    ideal = 10 * RATE + 10 * 8 / 0.360 + 10 * RATE
    assert result.ideal_samples == pytest.approx(ideal)
    assert summary.goodput == pytest.approx(expected / ideal)


def test_oobleck_rolls_back_beyond_f() -> None:
    # One-node pipelines: losing 3 of 4 at once leaves one whole replica, so no rollback (only the iteration).
    text = FOUR + "10000,remove,n0\n10000,remove,n1\n10000,remove,n2\n"
    result = simulate(trace_of(text, 30000), job(), Costs(), policies=("oobleck",))
    assert [loss.why for loss in result.timelines["oobleck"].losses] == ["iteration in flight"]
    # 2.5 GiB per GPU: 2 layers per node, two pipelines (n0, n1) and (n2, n3). Losing n0 and n2 loses every
    # replica of layers 0-1: rollback to the last snapshot (every 10 steps) on the survivors n1 + n3.
    tight = Job(flat_profile(), 1, int(2.5 * GiB), 1e11, 1e9, f=1, global_batch=8)
    text = FOUR + "10000,remove,n0\n10000,remove,n2\n20000,add,n8\n20000,add,n9\n"
    result = simulate(trace_of(text, 30000), tight, Costs(), policies=("oobleck",))
    timeline = result.timelines["oobleck"]
    assert [loss.why for loss in timeline.losses] == ["iteration in flight", "rollback to the last snapshot"]
    [first] = [s for s in timeline.segments if s.state == "training"][:1]
    steps = 10 / (8 / first.samples_per_s)
    assert sum(loss.seconds for loss in timeline.losses) == pytest.approx((steps % 10) * (8 / first.samples_per_s))
    assert result.summaries["oobleck"].seconds_by_state["rollback"] > 0


def test_recommend_f_ranks_every_f_the_cluster_holds() -> None:
    from oobleck.simulate import recommend_f

    # Four one-node pipelines: f = 0..3 are possible; all four lost at once is never survivable.
    text = FOUR + "10000,remove,n0\n10000,remove,n1\n15000,add,n0\n15000,add,n1\n"
    ranked = recommend_f(trace_of(text, 30000), job(), Costs())
    assert sorted(f for f, _ in ranked) == [0, 1, 2, 3]
    # Every f gives the same four pipelines here, so the same goodput: the tie goes to the larger f.
    assert len({round(g, 12) for _, g in ranked}) == 1
    assert [f for f, _ in ranked] == [3, 2, 1, 0]
    # Eight one-node pipelines with B = 8: every f from 0 to 7 fits; the list is ranked by goodput.
    wide = trace_of("".join(f"0,add,n{i}\n" for i in range(8)) + "10000,remove,n0\n", 30000)
    ranked = recommend_f(wide, job(), Costs())
    goodputs = [g for _, g in ranked]
    assert goodputs == sorted(goodputs, reverse=True) and len(ranked) == 8


def test_checkpoint_restart_by_hand() -> None:
    # 4 GiB per node at 4 GB/s: checkpoint 1.07 s, restart 2 + 1.07 s; checkpoints every 4 s of training.
    ckpt = 4 * GiB / 4e9
    costs = Costs(checkpoint=CheckpointCosts(interval_s=4.0, storage_bandwidth=4e9, restart_s=2.0))
    _, summary, timeline = run("checkpoint-restart", costs)
    # 0-4 train, 4-5.07 ckpt, 5.07-9.07 train, 9.07-10 ckpt interrupted by the loss: 4 s of training lost.
    [lost, *_] = timeline.losses
    assert lost.time_s == 10 and lost.seconds == pytest.approx(4.0)
    first_restart = next(s for s in timeline.segments if s.state == "restarting")
    assert first_restart.start_s == 10 and first_restart.end_s == pytest.approx(10 + 2 + ckpt)
    after = next(s for s in timeline.segments if s.state == "training" and s.start_s > 10)
    assert after.samples_per_s == pytest.approx(8 / 0.360)  # re-planned for 3 nodes
    # At 20 s the new node makes a bigger layout: checkpoint first, then restart on 4 nodes.
    second = [s for s in timeline.segments if s.state == "restarting"][1]
    assert second.start_s == 20 and second.end_s == pytest.approx(20 + ckpt + 2 + ckpt)
    assert timeline.segments[-1].samples_per_s == pytest.approx(RATE)
    assert len(timeline.losses) == 1


def test_redundant_computation_by_hand() -> None:
    costs = Costs(bamboo=BambooCosts(slowdown=1.5, failover_s=0.5), checkpoint=CheckpointCosts(interval_s=1e9))
    _, summary, timeline = run("redundant-computation", costs)
    # One-node pipelines keep no neighbour's layers: losing n1 is a fallback restart from the checkpoint (none
    # was taken: everything since the start is lost).
    assert timeline.losses[0].seconds == pytest.approx(10.0)
    assert timeline.segments[0].samples_per_s == pytest.approx(RATE / 1.5)
    # Two-node pipelines (2.5 GiB per GPU): a lost node fails over onto its neighbour, nothing is lost.
    tight = Job(flat_profile(), 1, int(2.5 * GiB), 1e11, 1e9, f=1, global_batch=8)
    result = simulate(hand_trace(), tight, costs, policies=("redundant-computation",))
    timeline = result.timelines["redundant-computation"]
    assert timeline.losses == []
    assert result.summaries["redundant-computation"].seconds_by_state["failover"] == pytest.approx(1.0)
    # Neighbours lost together: fallback.
    both = trace_of(FOUR + "10000,remove,n0\n10000,remove,n1\n", 30000)
    result = simulate(both, tight, costs, policies=("redundant-computation",))
    assert [loss.why for loss in result.timelines["redundant-computation"].losses] == [
        "neighbours lost together: work since the last checkpoint"
    ]


def test_replica_dropping_by_hand() -> None:
    costs = Costs(replicas=ReplicaCosts(quorum_s=0.5))
    _, summary, timeline = run("replica-dropping", costs)
    # n1's replica idles: 3 replicas of 2 microbatches each keep their T(2): 6 samples per 240 ms.
    rates = [(s.state, round(s.samples_per_s, 6)) for s in timeline.segments]
    heal = 0.5 + 4 * GiB / 1e9
    assert rates == [
        ("training", round(RATE, 6)),
        ("quorum", 0.0),
        ("training", round(6 / Z, 6)),
        ("quorum", 0.0),
        ("training", round(6 / Z, 6)),  # the others train while n9 fetches the state
        ("training", round(RATE, 6)),
    ]
    assert timeline.segments[-1].start_s == pytest.approx(20 + heal)


# -- accounting ----------------------------------------------------------------------------------------


def _check_accounting(result) -> None:
    duration = result.ready.duration_s
    for name, timeline in result.timelines.items():
        segments = timeline.segments
        # The segments tile [0, duration] with no gap or overlap (exact float equality).
        assert segments[0].start_s == 0.0 and segments[-1].end_s == duration, name
        assert all(a.end_s == b.start_s for a, b in zip(segments, segments[1:])), name
        summary = result.summaries[name]
        assert math.fsum(summary.time_by_category.values()) == pytest.approx(duration, rel=1e-12, abs=1e-9), name
        assert all(t >= -1e-9 for t in summary.time_by_category.values()), (name, summary.time_by_category)
        assert summary.goodput <= 1 + 1e-12, (name, summary.goodput)
        assert summary.effective_time_share == pytest.approx(summary.time_by_category["effective"] / duration)


GROWING = "".join(f"{t},add,g{i}\n" for i, t in enumerate([0, 0, 1000, 1000, 4000, 4000, 4000, 9000]))
GROWING += "12000,remove,g2\n15000,add,g8\n"


@pytest.mark.parametrize(
    "make",
    [
        lambda: trace_of(GROWING, 20000),  # starts with 2 nodes, grows to 8
        lambda: trace_of("3000,add,a\n3000,add,b\n6000,add,c\n8000,remove,a\n", 12000),  # starts empty
        hand_trace,
        lambda: traces.mtbf(6, 40.0, 15.0, 300.0, seed=3),
    ],
)
@pytest.mark.parametrize("startup", [0.0, 0.5])
def test_time_categories_sum_to_the_trace_length_and_goodput_stays_below_one(make, startup: float) -> None:
    costs = Costs(
        checkpoint=CheckpointCosts(interval_s=2.0, storage_bandwidth=4e9, restart_s=1.0),
        nodes=NodeCosts(startup_s=startup),
    )
    tight = Job(flat_profile(), 1, int(2.5 * GiB), 1e11, 1e9, f=1, global_batch=8)
    for sim_job in (job(), tight):
        _check_accounting(simulate(make(), sim_job, costs))


def test_goodput_on_a_growing_trace_is_against_the_nodes_up() -> None:
    # 2 nodes for 10 s, then 4: the ideal trains at 2 nodes' rate, then 4 nodes'. Measured against the
    # starting cluster (the old rule) oobleck's goodput would be far above 100 %.
    result = simulate(trace_of("0,add,a\n0,add,b\n10000,add,c\n10000,add,d\n", 30000), job(), Costs())
    two, four = 8 / 0.480, RATE  # B = 8 on two one-node pipelines: 4 microbatches each, T(4) = 480 ms
    assert result.ideal == [(0.0, pytest.approx(two)), (10.0, pytest.approx(four))]
    assert result.ideal_samples == pytest.approx(10 * two + 20 * four)
    oobleck = result.summaries["oobleck"]
    assert 0.7 < oobleck.goodput <= 1.0
    assert oobleck.samples > 30 * two * 1.3  # it did use the nodes that joined
    _check_accounting(result)


def test_a_trace_that_starts_empty_starts_the_job_when_nodes_arrive() -> None:
    no_checkpoints = Costs(checkpoint=CheckpointCosts(interval_s=1e9))
    result = simulate(trace_of("5000,add,a\n5000,add,b\n", 15000), job(), no_checkpoints)
    for name, summary in result.summaries.items():
        assert summary.time_by_category["waiting"] == pytest.approx(5.0), name
        if name != "redundant-computation":  # (slower by its redundancy)
            assert summary.goodput == pytest.approx(1.0), name  # starting is free and nothing fails
    from oobleck.planner.errors import PlanningError

    with pytest.raises(PlanningError):  # a trace whose largest cluster forms no pipeline cannot be simulated
        simulate(trace_of("0,add,a\n", 5000), Job(flat_profile(), 1, int(2.5 * GiB), 1e11, 1e9, 1, 8), Costs())


def test_artifact_share_counts_lost_work_twice_and_waiting_not_at_all() -> None:
    costs = Costs(
        checkpoint=CheckpointCosts(interval_s=4.0, storage_bandwidth=4e9, restart_s=2.0),
        nodes=NodeCosts(startup_s=1.0),
    )
    _, summary, timeline = run("checkpoint-restart", costs)
    training = summary.seconds_by_state["training"]
    waiting = summary.seconds_by_state["waiting"]
    assert waiting == pytest.approx(1.0)  # the start-up delay of the nodes at time 0
    assert summary.artifact_time_share == pytest.approx(training / (30 - waiting + summary.lost_seconds))
    assert summary.effective_time_share == pytest.approx((training - summary.lost_seconds) / 30)
    assert summary.artifact_time_share > summary.effective_time_share


def test_redundant_computation_splits_its_training_like_the_artifact() -> None:
    costs = Costs(bamboo=BambooCosts(slowdown=4.0, failover_s=0.5), checkpoint=CheckpointCosts(interval_s=1e9))
    tight = Job(flat_profile(), 1, int(2.5 * GiB), 1e11, 1e9, f=1, global_batch=8)
    result = simulate(hand_trace(), tight, costs, policies=("redundant-computation",))
    summary = result.summaries["redundant-computation"]
    kept = summary.seconds_by_state["training"] - summary.lost_seconds
    assert summary.time_by_category["effective"] == pytest.approx(kept / 4)
    assert summary.time_by_category["redundant computation"] == pytest.approx(kept * 3 / 4)
    _check_accounting(result)


# -- cost sets, presets, minimum pipeline size ------------------------------------------------------------


def test_artifact_cost_set_carries_the_published_values() -> None:
    from oobleck.simulate.costs import named

    costs = named("oobleck-artifact", "gpt3-2.7b")
    assert costs.checkpoint.restart_s == 515.0 and costs.checkpoint.checkpoint_time_s == 50.0
    assert costs.checkpoint.interval_steps == 10 and costs.checkpoint.restart_includes_reload
    assert costs.bamboo.slowdown == pytest.approx(1 / 0.1971) and costs.bamboo.failover_s == 230.0
    assert costs.nodes.startup_s == 45.0
    assert costs.oobleck == OobleckCosts()  # our own oobleck costs stay
    assert named("oobleck-artifact", "gpt3-350m").checkpoint.restart_s == 78.7  # GPT-3 medium
    assert named("oobleck-artifact", "bert-large").checkpoint.checkpoint_time_s == 15.8
    assert named("oobleck-artifact", "gpt3-6.7b").checkpoint.restart_s == 701.0
    assert named("default", "gpt3-2.7b") == Costs()
    with pytest.raises(ValueError, match="costs: unknown cost set 'cheap'"):
        named("cheap", "gpt3-2.7b")
    with pytest.raises(ValueError, match="not 'gpt3-175b'"):
        named("oobleck-artifact", "gpt3-175b")


def test_cli_cost_set_flags_override_it(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--model", "gpt3-medium", "--trace", "artifact-30n-10m", "--costs", "oobleck-artifact"]
    assert main([*args, "--restart", "10", "--policies", "checkpoint-restart", "--json", "-"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["costs"]["checkpoint"]["restart_s"] == 10.0
    assert document["costs"]["checkpoint"]["checkpoint_time_s"] == 11.2
    assert document["costs"]["nodes"]["startup_s"] == 45.0
    assert main([*args[:-1], "nope", "--json", "-"]) == 2
    assert "--costs: unknown cost set 'nope'" in capsys.readouterr().err
    assert main(["simulate", "--model", "gpt3-13b", *args[3:], "--json", "-"]) == 2
    assert "--costs: the artifact publishes costs for" in capsys.readouterr().err


@pytest.mark.parametrize(("model", "layers", "seq"), [("bert-large", 26, 512), ("gpt2-artifact", 34, 1024)])
def test_paper_presets(model: str, layers: int, seq: int, capsys: pytest.CaptureFixture[str]) -> None:
    from oobleck.planner.synthetic import PRESETS

    assert PRESETS["gpt3-medium"] == PRESETS["gpt3-350m"]
    assert PRESETS[model].seq_len == seq
    assert main(["simulate", "--model", model, "--trace", "artifact-30n-1h", "--json", "-"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["job"]["model"] == model and document["job"]["layers"] == layers


def test_tensor_parallel_planning_in_the_simulator() -> None:
    """4 layers of 1 GiB on 2-GPU nodes of 2.5 GiB each: without TP a node needs two 1-GPU stages (a pipeline
    bubble); with t = 2 one stage of 2 GPUs holds all 4 layers at 2 GiB per GPU, and the iteration is shorter."""
    plain = Job(flat_profile(), 2, int(2.5 * GiB), 1e11, 1e9, f=1, global_batch=8)
    split = Job(flat_profile(), 2, int(2.5 * GiB), 1e11, 1e9, f=1, global_batch=8, max_tensor_parallel=2)
    one = simulate(hand_trace(), plain, Costs(), policies=("oobleck",))
    two = simulate(hand_trace(), split, Costs(), policies=("oobleck",))
    assert two.baseline_iteration_s < one.baseline_iteration_s
    _check_accounting(two)


def test_min_nodes_per_pipeline_in_the_simulator(capsys: pytest.CaptureFixture[str]) -> None:
    sim_job = job()
    narrow = Job(flat_profile(), 1, 8 * GiB, 1e11, 1e9, f=1, global_batch=8, min_nodes_per_pipeline=2)
    one = simulate(hand_trace(), sim_job, Costs(), policies=("oobleck",))
    two = simulate(hand_trace(), narrow, Costs(), policies=("oobleck",))
    assert two.baseline_iteration_s > one.baseline_iteration_s  # pipelines of 2 nodes where 1 would do
    _check_accounting(two)
    args = ["simulate", "--model", "gpt3-350m", "--trace", "artifact-30n-10m"]
    assert main([*args, "--min-nodes-per-pipeline", "3", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["job"]["min_nodes_per_pipeline"] == 3
    assert main([*args, "--min-nodes-per-pipeline", "0"]) == 2
    assert "--min-nodes-per-pipeline: must be in 1..26" in capsys.readouterr().err


def test_start_plan_from_a_plan_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from oobleck.api.profile import ClusterShape
    from oobleck.planner.profile_io import save_profile

    # A plan of 2 two-node pipelines (min 2 nodes per pipeline) for the hand trace's 4 nodes: oobleck starts
    # from it (its nodes "0".."3" are the trace's n0..n3), where planning itself would form 4 one-node pipelines.
    cluster = ClusterShape(
        nodes=4, gpus_per_node=1, gpu_memory_bytes=8 * GiB, intra_node_bandwidth=1e11, inter_node_bandwidth=1e9
    )
    from oobleck.planner import instantiate
    from oobleck.planner.templates import generate_templates

    templates = generate_templates(flat_profile(), cluster, 1, 2, min_nodes_per_pipeline=2)
    plan = instantiate(templates, ["0", "1", "2", "3"], 1, 8, "given", gpus_per_node=1)
    assert [len(p.nodes) for p in plan.pipelines] == [2, 2]
    plan_path, profile_path, trace_path = tmp_path / "plan.json", tmp_path / "profile.json", tmp_path / "t.csv"
    plan_path.write_text(plan.to_json())
    save_profile(flat_profile(), profile_path)
    trace_path.write_text("# duration_ms: 30000\n" + TRACE)
    args = ["simulate", "--profile", str(profile_path), "--gpu-memory", "8GiB", "--inter-bandwidth", "1GB"]
    args += ["--intra-bandwidth", "100GB", "--global-batch", "8", "--trace", str(trace_path)]
    assert main([*args, "--start-plan", str(plan_path), "--policies", "oobleck", "--json", "-"]) == 0
    given = json.loads(capsys.readouterr().out)["policies"]["oobleck"]
    assert main([*args, "--policies", "oobleck", "--json", "-"]) == 0
    planned = json.loads(capsys.readouterr().out)["policies"]["oobleck"]
    assert given["samples"] < planned["samples"]  # two-node pipelines are slower here
    sim = simulate(hand_trace(), Job(flat_profile(), 1, 8 * GiB, 1e11, 1e9, 1, 8, start_plan=plan), Costs())
    first = sim.timelines["oobleck"].segments[0]
    assert first.samples_per_s == pytest.approx(8 / (plan.iteration_ms / 1e3))
    _check_accounting(sim)
    # errors name the flag and field
    assert main([*args, "--start-plan", str(plan_path), "--global-batch", "16"]) == 2
    assert "--global-batch: 16, the start plan trains 8 samples per iteration" in capsys.readouterr().err
    plan_path.write_text(plan.to_json().replace('"f":1', '"f":-1'))
    assert main([*args, "--start-plan", str(plan_path)]) == 2
    assert f"--start-plan: {plan_path}: f: Input should be greater than or equal to 0" in capsys.readouterr().err
    plan_path.write_text(plan.to_json())
    trace_path.write_text("# duration_ms: 30000\n0,add,a\n0,add,b\n")
    assert main([*args, "--start-plan", str(plan_path)]) == 2
    assert "start_plan: the plan has 4 nodes, the trace starts with 2" in capsys.readouterr().err


# -- determinism and the command line -------------------------------------------------------------------


def test_same_seed_same_output(tmp_path: Path) -> None:
    args = ["simulate", "--model", "gpt3-350m", "--nodes", "12", "--mtbf", "6h", "--repair", "20m"]
    args += ["--duration", "1d", "--seed", "7", "--global-batch", "64"]
    outputs = []
    for k in range(2):
        path = tmp_path / f"out{k}.json"
        assert main([*args, "--json", str(path)]) == 0
        outputs.append(path.read_text())
    assert outputs[0] == outputs[1]
    document = json.loads(outputs[0])
    assert set(document["policies"]) == {"oobleck", "checkpoint-restart", "redundant-computation", "replica-dropping"}
    path = tmp_path / "other.json"
    assert main([*args[:-4], "--seed", "8", "--global-batch", "64", "--json", str(path)]) == 0
    assert path.read_text() != outputs[0]


def test_cli_table_plot_and_recommend_f(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "out.png"
    args = ["simulate", "--model", "gpt3-350m", "--nodes", "8", "--mtbf", "4h", "--repair", "30m"]
    assert main([*args, "--duration", "12h", "--global-batch", "32", "--plot", str(png), "--recommend-f"]) == 0
    out = capsys.readouterr().out
    assert "goodput" in out and "recommended f = " in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mtbf", "soon"], "--mtbf: expected a number with an optional unit"),
        (["--mtbf", "1h", "--trace", "x.csv"], "give one trace source"),
        (["--mtbf", "1h", "--global-batch", "0"], "--global-batch: must be a positive multiple"),
        (["--mtbf", "1h", "--model", "gpt5"], "--model: unknown 'gpt5'"),
        (["--mtbf", "1h", "--gpu-memory", "lots"], "--gpu-memory: expected a number"),
        (["--mtbf", "1h", "--policies", "magic"], "--policies: unknown ['magic']"),
        (["--spot-interval", "1h", "--spot-fraction", "1.5"], "--spot-fraction: must be in (0, 1], got 1.5"),
        (["--spot-pattern", "azure"], "--spot-pattern: unknown 'azure'; choose from gcp, ec2-p3"),
        (["--spot-pattern", "gcp", "--mtbf", "1h"], "give one trace source, got --mtbf and --spot-pattern"),
        (["--mtbf", "1h", "--node-startup", "soon"], "--node-startup: expected a number"),
        (["--mtbf", "1h", "--checkpoint-every", "0"], "--checkpoint-every: must be >= 1, got 0"),
        (
            ["--mtbf", "1h", "--profile", "p.json", "--costs", "oobleck-artifact"],
            "--costs: oobleck-artifact is per model",
        ),
        (["--mtbf", "1h", "--repair", "0"], "--repair: must be > 0"),
        (["--trace", "missing.csv"], "missing.csv: cannot read"),
        (["--mtbf", "1h", "--gpu-memory", "1MiB"], "cannot be planned"),
        ([], "--trace: give a trace"),
        (
            ["--mtbf", "1h", "--max-tensor-parallel", "2"],
            "--max-tensor-parallel: must be a power of two <= --gpus-per-node (1), got 2",
        ),
    ],
)
def test_cli_bad_input_exits_2(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--nodes", "4", *args]) == 2
    assert message in capsys.readouterr().err


def test_measured_profile_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from oobleck.planner.profile_io import save_profile

    path = tmp_path / "profile.json"
    save_profile(flat_profile(), path)
    args = ["simulate", "--profile", str(path), "--gpu-memory", "8GiB", "--global-batch", "64", "--json", "-"]
    assert main([*args, "--trace", str(REPO / "simulator" / "traces" / "artifact-30n-10m.csv")]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["job"]["model"] == "flat" and document["trace"]["losses"] == 15
    path.write_text('{"model": "x", "microbatch_size": 1, "layers": []}')
    assert main([*args[:-2], "--mtbf", "1h"]) == 2
    assert f"{path}: layers" in capsys.readouterr().err


@pytest.mark.integration
def test_bench_quick() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "simulate.py"), "--quick"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "whole simulation, 4 policies" in done.stdout and "of the 10 s target" in done.stdout


def test_cli_spot_pattern_and_node_startup(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--model", "gpt3-350m", "--spot-pattern", "gcp", "--seed", "2", "--node-startup", "45"]
    assert main([*args, "--json", "-"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["trace"]["initial_nodes"] == 0 and document["trace"]["most_nodes"] == 30
    assert document["costs"]["nodes"]["startup_s"] == 45.0
    for name, policy in document["policies"].items():
        assert policy["time_by_category"]["waiting"] >= 480 + 45, name  # nothing up until the first joins
        assert 0 < policy["goodput"] <= 1, name


def test_paper_figures_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`make paper-figures` in its quick mode: every PNG drawn, oobleck ahead of its peers on every trace."""
    from oobleck.simulate import paper

    assert paper.main(["--out", str(tmp_path), "--quick"]) == 0
    out = capsys.readouterr().out
    names = sorted(p.name for p in tmp_path.glob("*.png"))
    assert names == [
        "paper-fig1-12-breakdown.png",
        "paper-fig10-14-ec2-p3.png",
        "paper-fig10-15-gcp.png",
        "paper-fig9-13-throughput-vs-failure-frequency.png",
    ]
    for name in names:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "done in" in out
    # The breakdown's published comparison: BERT-large on the artifact's 10-minute trace, in the paper's order.
    result = paper.run("bert-large", traces.load("artifact-30n-10m"))
    shares = {name: s.artifact_time_share for name, s in result.summaries.items()}
    assert shares["oobleck"] > shares["checkpoint-restart"] > shares["redundant-computation"]
    _check_accounting(result)
