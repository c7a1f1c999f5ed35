"""oobleck simulate: trace parsing, each policy on a hand-checked trace, calibration against the planner,
determinism, the CLI's errors, and the benchmark's quick mode."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from oobleck.api.profile import LayerProfile, ModelProfile
from oobleck.cli import main
from oobleck.planner import plan_job
from oobleck.simulate import Costs, Job, simulate, traces
from oobleck.simulate.costs import BambooCosts, CheckpointCosts, NodeCosts, OobleckCosts, ReplicaCosts
from oobleck.simulate.planning import PipelineTiming, Planner, paced, rebalanced
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
        (FOUR + "10,crash,n1\n", "t.csv:5: event: expected 'add', 'remove' or 'slow', got 'crash'"),
        (FOUR + "10,slow,n1\n", "t.csv:5: expected 4 fields TIME_MS,slow,NODE,SPEED, got 3"),
        (FOUR + "10,remove,n1,0.5\n", "t.csv:5: expected 3 fields TIME_MS,add|remove,NODE, got 4"),
        (FOUR + "10,slow,n1,half\n", "t.csv:5: speed: expected a share of full speed in (0, 1], got 'half'"),
        (FOUR + "10,slow,n1,2\n", "t.csv:5: speed: must be in (0, 1]"),
        (FOUR + "10,slow,n1,0\n", "t.csv:5: speed: must be in (0, 1]"),
        (FOUR + "10,slow,n7,0.5\n", "t.csv:5: node: 'n7' is slowed while not up"),
        (FOUR + "10,slow,,0.5\n", "t.csv:5: node: empty"),
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
    assert f"{path}:6: event: expected 'add', 'remove' or 'slow', got 'explode'" in err


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
    # The simulator's per-pipeline cost model at full speed is the planner's: same T per pipeline, same split.
    layout = Planner(profile, cluster, batch).layout(plan)
    assert paced(layout, {}, resplit=False).group_iteration_s == pytest.approx(layout.group_iteration_s, rel=1e-12)
    assert paced(layout, {}, resplit=True).group_samples == layout.group_samples
    assert [p.iteration_ms / 1e3 for p in plan.pipelines] == pytest.approx(layout.group_iteration_s, rel=1e-12)


def test_moved_stage_boundaries_keep_to_the_memory_rule() -> None:
    # Two stages of 4 layers (30 ms, 1 GiB and 1 activation byte each); the second node at 1/2. With room,
    # the first node takes 6 layers (180 ms) and the slow one 2 (120 ms at 1/2): 2 GiB to receive.
    timing = PipelineTiming((120.0, 120.0), (0, 1), ((0, 4), (4, 8)), (1, 1), 0.0, None)
    layer_ms, state, activation = [30.0] * 8, [GiB] * 8, [1] * 8
    moved, received = rebalanced(timing, ["a", "b"], {"b": 0.5}, layer_ms, state, activation, 16 * GiB)
    assert moved.stage_layers == ((0, 6), (6, 8)) and moved.stage_ms == (180.0, 60.0) and received == 2 * GiB
    assert moved.cost(["a", "b"], {"b": 0.5}).slope_ms == 180.0
    # Memory for exactly the first stage as it is (4 GiB + 2 microbatches in flight x 4 bytes): nothing moves.
    assert rebalanced(timing, ["a", "b"], {"b": 0.5}, layer_ms, state, activation, 4 * GiB + 8) == (timing, 0)
    # One more layer's room: the first node takes 5 (150 ms), the slow one 3 (180 ms at 1/2).
    moved, received = rebalanced(timing, ["a", "b"], {"b": 0.5}, layer_ms, state, activation, 5 * GiB + 10)
    assert moved.stage_layers == ((0, 5), (5, 8)) and received == GiB


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


# -- stragglers and spares ----------------------------------------------------------------------------

# n1 at half speed from 10 s to 60 s, on the hand job's four one-node pipelines (2 microbatches each).
SLOW_N1 = FOUR + "10000,slow,n1,0.5\n60000,slow,n1,1\n"


def test_slow_events_parse_group_and_dump() -> None:
    trace = trace_of(FOUR + "# duration_ms: 90000\n5000,slow,n1,0.25\n5000,remove,n2\n8000,slow,n1,1\n")
    assert [(e.time_s, e.kind, e.node, e.speed) for e in trace.events] == [
        (5.0, "slow", "n1", 0.25),
        (5.0, "remove", "n2", 1.0),
        (8.0, "slow", "n1", 1.0),
    ]
    assert [(s.time_s, s.removed, s.added, s.speeds) for s in trace.steps()] == [
        (5.0, ["n2"], [], {"n1": 0.25}),
        (8.0, [], [], {"n1": 1.0}),
    ]
    assert trace.batches() == [(5.0, ["n2"], [])]  # availability only
    assert trace.node_counts() == [(0.0, 4), (5.0, 3)] and trace.max_nodes() == 4
    assert (trace.losses(), trace.additions(), trace.slowdowns()) == (1, 0, 1)
    again = traces.parse(traces.dump(trace), "again")
    assert sorted(again.events, key=lambda e: (e.time_s, e.kind)) == sorted(
        trace.events, key=lambda e: (e.time_s, e.kind)
    )
    # Start-up delays move additions, never speed changes (a speed is the node's, up or not).
    late = trace.ready_after(2.0)
    assert [(e.time_s, e.kind, e.node) for e in late.events if e.kind == "slow"] == [
        (5.0, "slow", "n1"),
        (8.0, "slow", "n1"),
    ]


def test_oobleck_resplits_the_batch_around_a_slow_pipeline() -> None:
    result = simulate(trace_of(SLOW_N1, 100000), job(), Costs(), policies=("oobleck",))
    timeline = result.timelines["oobleck"]
    # Unmitigated: n1's pipeline takes T(2) = 2 * 240 ms, the job with it. Known after 20 such steps
    # (9.6 s): re-split as 3, 3, 1 | 1 microbatch on n1 -> Z = max(3 * 120, 240) = 360 ms, a 0.11 s pause
    # (plan published, nothing moves: benching n1 reaches the same Z but copies). Back at full speed:
    # known 20 steps of 360 ms later, the even split again.
    training = [(s.start_s, s.end_s, s.samples_per_s) for s in timeline.segments if s.state == "training"]
    assert training == [
        (0.0, 10.0, pytest.approx(RATE)),
        (10.0, pytest.approx(19.6), pytest.approx(8 / 0.480)),
        (pytest.approx(19.71), pytest.approx(67.2), pytest.approx(8 / 0.360)),
        (pytest.approx(67.31), 100.0, pytest.approx(RATE)),
    ]
    assert [what for _, what in timeline.events[1:]] == [
        "straggler mitigation: re-split the batch, Z = 360.0 ms",
        "straggler mitigation: re-split the batch, Z = 240.0 ms",
    ]
    assert result.summaries["oobleck"].time_by_category["mitigating"] == pytest.approx(0.22)
    # Issue #22's reference: the ideal x mean speed, 3.5 / 4 for 50 of the 100 s.
    assert result.speed_bound == pytest.approx((50 + 50 * 3.5 / 4) / 100)
    _check_accounting(result)


def paired_job(batch: int) -> Job:
    """8 equal layers (30 ms, 1 GiB each) on two-node pipelines: 4 layers a node, T(m) = 240 + (m - 1) * 120 ms."""
    return Job(flat_profile(8), 1, 16 * GiB, 1e11, 1e9, f=1, global_batch=batch, min_nodes_per_pipeline=2)


def test_oobleck_moves_layers_off_a_slow_node() -> None:
    trace = trace_of(FOUR + "10000,slow,n1,0.5\n200000,slow,n1,1\n", 300000)
    result = simulate(trace, paired_job(8), Costs(), policies=("oobleck",))
    timeline = result.timelines["oobleck"]
    # n1 at 1/2 holds the second half of pipeline (n0, n1): 240 ms a microbatch -> T(4) = 360 + 3 * 240.
    # Options at Z (priced copy + 100 Z): (a) re-split 2 | 6 or 3 | 5: 840 ms; (b) n0 takes 6 layers
    # (180 ms), n1 keeps 2 (120 ms at 1/2): T_A(m) = 300 + (m - 1) * 180, split 3 | 5 -> Z = 720 ms for
    # 2 GiB copied to n0 (2.15 s); (c) bench n1: a 3-node pipeline and a 2-node one, 870 ms. (b) wins.
    copy = 2 * GiB / 1e9
    rates = [(s.state, s.samples_per_s) for s in timeline.segments]
    assert rates == [
        ("training", pytest.approx(8 / 0.600)),
        ("training", pytest.approx(8 / 1.080)),
        ("mitigating", 0.0),
        ("training", pytest.approx(8 / 0.720)),
        ("mitigating", 0.0),
        ("training", pytest.approx(8 / 0.600)),  # back at full speed: the layers move back
    ]
    mitigating = [s for s in timeline.segments if s.state == "mitigating"]
    assert mitigating[0].start_s == pytest.approx(10 + 20 * 1.080)
    assert mitigating[0].end_s - mitigating[0].start_s == pytest.approx(0.11 + 0.17 + copy)
    assert "move layers" in timeline.events[1][1]
    _check_accounting(result)


def test_oobleck_benches_a_very_slow_node_and_takes_it_back() -> None:
    eight = "".join(f"0,add,n{i}\n" for i in range(8))
    trace = trace_of(eight + "10000,slow,n1,0.05\n600000,slow,n1,1\n", 900000)
    result = simulate(trace, paired_job(16), Costs(), policies=("oobleck", "checkpoint-restart"))
    timeline = result.timelines["oobleck"]
    # At 1/20, n1's 4 layers take 2.4 s a microbatch: T(4) = 2.52 + 3 * 2.4 = 9.72 s. Moving layers leaves
    # n1 one layer (600 ms): 810 ms at best; benching n1 gives pipelines of 3, 2 and 2 nodes: 720 ms.
    training = [s.samples_per_s for s in timeline.segments if s.state == "training"]
    assert training == pytest.approx([16 / 0.600, 16 / 9.720, 16 / 0.720, 16 / 0.600])
    assert [what.split(",")[0] for _, what in timeline.events[1:]] == [
        "straggler mitigation: bench 1 node as slow",
        "straggler mitigation: 1 node back at full speed",
    ]
    assert timeline.events[1][0] == pytest.approx(10 + 20 * 9.720)
    # Checkpoint-restart knows nothing of speeds: the whole slowdown at the slowest pipeline's pace.
    checkpoint = [s for s in result.timelines["checkpoint-restart"].segments if s.state == "training"]
    assert {round(s.samples_per_s, 6) for s in checkpoint} == {round(16 / 0.600, 6), round(16 / 9.720, 6)}
    assert result.summaries["oobleck"].goodput > 1.8 * result.summaries["checkpoint-restart"].goodput
    _check_accounting(result)


def test_oobleck_mitigates_right_after_a_failure_when_a_slow_node_is_known() -> None:
    six = "".join(f"0,add,n{i}\n" for i in range(6))
    trace = trace_of(six + "10000,slow,n1,0.5\n100000,remove,n4\n", 200000)
    result = simulate(trace, paired_job(12), Costs(), policies=("oobleck",))
    timeline = result.timelines["oobleck"]
    # Three 2-node pipelines: re-splitting around n1 is the cheapest (720 ms). Losing n4 leaves pipelines
    # of 2 and 3 nodes, n1 still slow (1050 ms); its speed is known, so the mitigation is weighed at once
    # and follows the reconfiguration: benching n1 leaves two 2-node pipelines, 6 microbatches each, 840 ms.
    assert [(t, what.split(",")[0]) for t, what in timeline.events[1:]] == [
        (pytest.approx(10 + 20 * 1.080), "straggler mitigation: re-split the batch"),
        (100.0, "-1 +0 nodes: 2 pipelines"),
        (100.0, "straggler mitigation: bench 1 node as slow"),
    ]
    states = [(s.state, s.samples_per_s) for s in timeline.segments if s.start_s >= 100]
    assert states == [("reconfiguring", 0.0), ("mitigating", 0.0), ("training", pytest.approx(12 / 0.840))]
    _check_accounting(result)


def test_checkpoint_restart_runs_at_the_slowest_pace() -> None:
    no_checkpoints = Costs(checkpoint=CheckpointCosts(interval_s=1e9))
    for policy in ("checkpoint-restart", "redundant-computation"):
        result = simulate(trace_of(SLOW_N1, 100000), job(), no_checkpoints, policies=(policy,))
        timeline = result.timelines[policy]
        plain = timeline.segments[0].samples_per_s
        assert [(s.start_s, s.end_s) for s in timeline.segments] == [(0.0, 10.0), (10.0, 60.0), (60.0, 100.0)]
        rates = [s.samples_per_s for s in timeline.segments]
        if policy == "checkpoint-restart":
            # n1's pipeline runs its 2 microbatches at 1/2 speed: the job's Z doubles, nothing else changes.
            assert rates == pytest.approx([plain, plain / 2, plain])
        else:  # its own (deeper) pipelines: n1's is slower, and the job with it
            assert rates[1] < plain and rates[2] == plain
        _check_accounting(result)


def test_checkpoints_every_n_steps_follow_the_pace() -> None:
    # Every 10 iterations: 4.8 s apart at n1's slow pace, 2.4 s once it is back; a checkpoint due sooner
    # than what was trained since the last one is written at once (and the time still sums up).
    costs = Costs(checkpoint=CheckpointCosts(interval_steps=10, checkpoint_time_s=0.5))
    for text in (SLOW_N1, FOUR + "10000,slow,n1,0.5\n13000,slow,n1,1\n"):
        result = simulate(trace_of(text, 100000), job(), costs, policies=("checkpoint-restart",))
        segments = result.timelines["checkpoint-restart"].segments
        writes = [s.start_s for s in segments if s.state == "checkpointing"]
        assert all(b - a >= 2.4 + 0.5 - 1e-9 for a, b in zip(writes, writes[1:]))
        _check_accounting(result)


def test_replica_dropping_waits_for_a_slow_replica_within_the_timeout() -> None:
    result = simulate(trace_of(SLOW_N1, 100000), job(), Costs(), policies=("replica-dropping",))
    timeline = result.timelines["replica-dropping"]
    # 480 ms against 240 ms: 0.24 s late, well within torchft's 60 s: every step waits for it.
    assert [(s.start_s, s.samples_per_s) for s in timeline.segments] == [
        (0.0, pytest.approx(RATE)),
        (10.0, pytest.approx(8 / 0.480)),
        (60.0, pytest.approx(RATE)),
    ]
    assert timeline.losses == []


def test_replica_dropping_drops_a_slow_replica_on_timeout_and_heals_it_back() -> None:
    costs = Costs(replicas=ReplicaCosts(quorum_s=0.5, timeout_s=0.2))
    result = simulate(trace_of(SLOW_N1, 100000), job(), costs, policies=("replica-dropping",))
    timeline = result.timelines["replica-dropping"]
    # 0.24 s late > 0.2 s: the step in flight is lost, the others wait out the timeout and the quorum
    # change, then go on as 3 replicas (6 samples per 240 ms). Back at full speed n1's replica heals
    # from a live one (0.5 s + 4 GiB at 1 GB/s) while the others train.
    heal = 0.5 + 4 * GiB / 1e9
    assert [(s.state, round(s.samples_per_s, 6)) for s in timeline.segments] == [
        ("training", round(RATE, 6)),
        ("timeout", 0.0),
        ("training", round(6 / Z, 6)),
        ("quorum", 0.0),
        ("training", round(6 / Z, 6)),
        ("training", round(RATE, 6)),
    ]
    assert timeline.segments[1].end_s == pytest.approx(10 + 0.2 + 0.5)
    assert timeline.segments[-1].start_s == pytest.approx(60 + heal)
    [loss] = timeline.losses
    assert loss.why == "iteration in flight" and loss.time_s == 10.0
    _check_accounting(result)


def test_replica_dropping_drops_every_replica_the_fastest_would_time_out_on() -> None:
    costs = Costs(replicas=ReplicaCosts(quorum_s=0.5, timeout_s=0.2))
    trace = trace_of(FOUR + "10000,slow,n1,0.5\n10000,slow,n2,0.5\n60000,slow,n1,1\n", 100000)
    timeline = simulate(trace, job(), costs, policies=("replica-dropping",)).timelines["replica-dropping"]
    # Both slow replicas end their steps 0.24 s after the fastest: both go; n1's comes back at 60 s.
    assert [what for _, what in timeline.events] == [
        "start: 4 replicas",
        "2/4 replicas in the quorum (was 33.3 samples/s), 2 dropped as too slow",
        "3/4 replicas in the quorum (was 16.7 samples/s), 1 dropped as too slow",
    ]
    assert [s.samples_per_s for s in timeline.segments if s.state == "training"] == pytest.approx(
        [RATE, 4 / Z, 4 / Z, 6 / Z]
    )


def test_oobleck_never_benches_below_f_plus_one_pipelines() -> None:
    # Two 2-node pipelines (f = 1): benching n1 at 1/20 would leave one 3-node pipeline (870 ms, degraded);
    # moving layers keeps both: n1 keeps 1 layer (600 ms a microbatch), re-split 1 | 7 -> 960 ms.
    trace = trace_of(FOUR + "10000,slow,n1,0.05\n600000,slow,n1,1\n", 900000)
    timeline = simulate(trace, paired_job(8), Costs(), policies=("oobleck",)).timelines["oobleck"]
    assert [what for _, what in timeline.events[1:]] == [
        "straggler mitigation: move layers by node speed, Z = 960.0 ms",
        "straggler mitigation: move layers by node speed, Z = 600.0 ms",
    ]


def test_warm_spares_replace_losses_after_the_join_time() -> None:
    trace = trace_of(
        FOUR + "10000,remove,n1\n30000,add,n9\n40000,remove,n0\n41000,remove,n9\n"
        "50000,remove,n2\n60000,add,n10\n62000,add,n11\n",
        80000,
    )
    training = trace.with_spares(1, 5.0)
    # n3 is the spare. n1 lost: n3 trains at 15 s. n9 arrives: the pool is empty, it becomes the spare.
    # n0 lost: n9 folds in at 45 s, but is lost itself at 41 s: nothing left to fold in (one vacancy);
    # n2 lost: a second vacancy; n10 and n11 fill them at once (already started).
    assert training.initial == ("n0", "n1", "n2")
    assert [(e.time_s, e.kind, e.node) for e in training.events] == [
        (10.0, "remove", "n1"),
        (15.0, "add", "n3"),
        (40.0, "remove", "n0"),
        (50.0, "remove", "n2"),
        (60.0, "add", "n10"),
        (62.0, "add", "n11"),
    ]
    assert trace.with_spares(0, 5.0) is trace
    one = "0,add,a\n0,add,b\n0,add,c\n"
    spare_lost = trace_of(one + "5000,remove,c\n6000,add,d\n7000,remove,a\n", 20000).with_spares(1, 2.0)
    # The spare c is lost (nothing trains less); d refills the pool and replaces a at 9 s.
    assert [(e.time_s, e.kind, e.node) for e in spare_lost.events] == [(7.0, "remove", "a"), (9.0, "add", "d")]


def test_spares_fold_in_for_every_policy_and_the_fresh_node_becomes_the_spare() -> None:
    # Nodes are usable 20 s after they join; n1 is lost at 50 s, its replacement n9 joins at 60 s.
    text = FOUR + "50000,remove,n1\n60000,add,n9\n"
    costs = Costs(checkpoint=CheckpointCosts(interval_s=1e9, restart_s=4.0), nodes=NodeCosts(startup_s=20.0))
    spared = replace(costs, nodes=NodeCosts(startup_s=20.0, spares=1, spare_join_s=3.0))
    without = simulate(trace_of(text, 200000), job(), costs)
    with_spare = simulate(trace_of(text, 200000), job(), spared)
    assert without.ideal_samples == with_spare.ideal_samples  # the ideal counts the spare as a node up
    # n3 is the spare: n0, n1, n2 train from 20 s; n3 trains 3 s after n1's loss; n9 (usable at 80 s)
    # becomes the spare, so nothing happens then.
    ready = trace_of(text, 200000).ready_after(20.0).with_spares(1, 3.0)
    assert [(e.time_s, e.kind, e.node) for e in ready.events] == [
        (20.0, "add", "n0"),
        (20.0, "add", "n1"),
        (20.0, "add", "n2"),
        (50.0, "remove", "n1"),
        (53.0, "add", "n3"),
    ]
    assert [what for _, what in with_spare.timelines["checkpoint-restart"].events] == [
        "start on 3 nodes",
        "lost 1 nodes: restart on 2 nodes, Z = 480.0 ms",
        "+1 nodes: restart on 3 nodes, Z = 360.0 ms",  # during the first restart: it starts over
    ]
    # Without a spare the job waits for n9's start-up: 30 s on 3 nodes instead of 3 s on 2.
    assert [t for t, _ in without.timelines["checkpoint-restart"].events] == [20.0, 50.0, 80.0]
    for name in ("oobleck", "replica-dropping"):
        assert with_spare.timelines[name].segments[-1].samples_per_s == pytest.approx(8 / 0.360), name
        assert without.timelines[name].segments[-1].samples_per_s == pytest.approx(RATE), name
    for result in (without, with_spare):
        _check_accounting(result)


def _readme_straggler_table() -> dict[str, list[tuple[float, float]]]:
    """The README's straggler table: policy -> [(goodput %, eff. share %)] per column."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("**Stragglers and spares, bundled trace**") :]
    rows = {}
    for line in section.splitlines()[section.count("\n", 0, section.index("| policy |")) + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = [tuple(float(x) for x in re.findall(r"([0-9.]+) %", cell)) for cell in cells[1:]]
    return rows


def test_bundled_straggler_trace_matches_the_readme_table(capsys: pytest.CaptureFixture[str]) -> None:
    table = _readme_straggler_table()
    names = {"redundant computation": "redundant-computation", "replica dropping": "replica-dropping"}
    columns = [["--spares", "0"], ["--spares", "2"], ["--costs", "oobleck-artifact"]]
    columns.append(["--costs", "oobleck-artifact", "--spares", "2"])
    for k, extra in enumerate(columns):
        args = ["simulate", "--model", "gpt3-2.7b", "--trace", "stragglers-32n-2h", *extra, "--json", "-"]
        assert main(args) == 0
        document = json.loads(capsys.readouterr().out)
        assert document["trace"]["slowdowns"] == 5 and document["trace"]["losses"] == 3
        for policy, cells in table.items():
            summary = document["policies"][names.get(policy, policy)]
            measured = (round(summary["goodput"] * 100, 1), round(summary["effective_time_share"] * 100, 1))
            assert measured == cells[k], (policy, extra)
            assert math.fsum(summary["time_by_category"].values()) == pytest.approx(7200.0)
        goodput = {name: policy["goodput"] for name, policy in document["policies"].items()}
        assert max(goodput, key=lambda name: goodput[name]) == "oobleck", (extra, goodput)
        assert document["policies"]["replica-dropping"]["time_by_category"]["timeout"] > 60  # the 1/20 node


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
# Slowdowns of every depth, a slow node lost, a fresh node that arrives and then slows down.
STRAGGLING = FOUR + "3000,slow,n1,0.3\n8000,remove,n2\n9000,slow,n1,1\n9000,slow,n3,0.1\n"
STRAGGLING += "11000,remove,n3\n12000,add,n7\n15000,slow,n7,0.5\n17000,slow,n0,0.02\n"


@pytest.mark.parametrize(
    "make",
    [
        lambda: trace_of(GROWING, 20000),  # starts with 2 nodes, grows to 8
        lambda: trace_of("3000,add,a\n3000,add,b\n6000,add,c\n8000,remove,a\n", 12000),  # starts empty
        hand_trace,
        lambda: traces.mtbf(6, 40.0, 15.0, 300.0, seed=3),
        lambda: trace_of(STRAGGLING, 20000),
    ],
)
@pytest.mark.parametrize("startup", [0.0, 0.5])
@pytest.mark.parametrize("spares", [0, 1])
def test_time_categories_sum_to_the_trace_length_and_goodput_stays_below_one(make, startup: float, spares: int) -> None:
    costs = Costs(
        checkpoint=CheckpointCosts(interval_s=2.0, storage_bandwidth=4e9, restart_s=1.0),
        replicas=ReplicaCosts(timeout_s=0.5),  # small enough for the slow nodes below to time out
        oobleck=OobleckCosts(straggler_window_steps=3),  # acts within these short traces
        nodes=NodeCosts(startup_s=startup, spares=spares, spare_join_s=0.7),
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
        (["--mtbf", "1h", "--spares", "-1"], "--spares: must be >= 0, got -1"),
        (["--mtbf", "1h", "--spares", "4"], "--spares: 4 leaves no node to train (the trace has 4 at most)"),
        (["--mtbf", "1h", "--spare-join", "soon"], "--spare-join: expected a number"),
        (["--mtbf", "1h", "--straggler-window", "0"], "--straggler-window: must be >= 1, got 0"),
        (["--mtbf", "1h", "--replica-timeout", "0"], "--replica-timeout: must be > 0"),
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


def test_cli_straggler_trace_with_spares_and_timeouts(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--model", "gpt3-2.7b", "--trace", "stragglers-32n-2h", "--spares", "2"]
    assert main([*args, "--spare-join", "4", "--straggler-window", "5", "--replica-timeout", "30"]) == 0
    table = capsys.readouterr().out
    assert "32 nodes at start, 3 losses, 3 additions, 5 slowdowns over 2.0 h; 2 warm spares, 4 s" in table
    assert "the ideal x the mean speed of the nodes up is" in table
    assert main([*args, "--json", "-"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["trace"]["slowdowns"] == 5 and 0.95 < document["speed_bound"] < 1
    assert document["costs"]["nodes"]["spares"] == 2
    assert document["costs"]["oobleck"]["straggler_window_steps"] == 20
    assert document["costs"]["replicas"]["timeout_s"] == 60.0


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
