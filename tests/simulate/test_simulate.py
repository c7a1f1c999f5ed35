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
from oobleck.simulate.costs import BambooCosts, CheckpointCosts, OobleckCosts, ReplicaCosts
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
        ("10,add,n0\n", "t.csv: no node is added at time 0"),
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


def test_bundled_artifact_scenarios() -> None:
    for name, interval in (("artifact-30n-10m", 600), ("artifact-30n-1h", 3600), ("artifact-30n-6h", 21600)):
        trace = traces.load(name)
        assert len(trace.initial) == 30 and trace.losses() == 15
        removals = [e.time_s for e in trace.events if e.kind == "remove"]
        additions = [e.time_s for e in trace.events if e.kind == "add"]
        assert removals == [k * interval for k in range(1, 16)]
        assert additions == [k * interval + 45 for k in range(1, 16)]
        assert trace.duration_s == 16 * interval


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
    trace = traces.fixed_interval(nodes, 600.0, 1, None)
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
    assert summary.goodput == pytest.approx(expected / (30 * RATE))


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
        (["--mtbf", "1h", "--repair", "0"], "--repair: must be > 0"),
        (["--trace", "missing.csv"], "missing.csv: cannot read"),
        (["--mtbf", "1h", "--gpu-memory", "1MiB"], "cannot be planned"),
        ([], "--trace: give a trace"),
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


def test_bench_quick() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "simulate.py"), "--quick"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "whole simulation, 4 policies" in done.stdout and "of the 10 s target" in done.stdout
