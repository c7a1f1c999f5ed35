"""A very slow node benched as a spare and taken back (issue 22, mitigation c), end to end on local nodes.

A job of three one-node pipelines (six microbatches: two each) with `stragglers.mitigation: spare` trains
unthrottled; one worker pod's processes are then held by a CFS quota (oobleck_dev.cpulimit) to 0.06 CPUs, a
tenth of what it computes with or less. At that speed the planner's price prefers the best plan on the other
two nodes (three microbatches each) to a re-split (one microbatch still costs the slow node more than three
cost the others from about 3x on), so the operator benches it: the plan no longer has it, its pod stays up
and is counted a spare. Released, it is taken back once its back-off is over (or, if the host's load kept it
throttled past the back-off, benched again and taken back later), and it stays in. Every step's loss equals
the single-process reference through both changes and a window after (the test ends there, the job still
training).

What is asserted is what matters on a loaded 2-core host: which node is out, that it is a spare while out,
that it comes back, and exact losses; not how fast any step ran.

With a warm spare (`spec.nodes.spares: 1`) the same throttle swaps the spare in at the full node count in
the generation that benches the slow node, which then waits as the spare and is not taken back while the
job is whole (released, it stays out).
"""

from __future__ import annotations

import time

import pytest

from oobleck.operator import render
from oobleck_dev import cpulimit

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.xdist_group("local-node-jobs-1")]
LOCAL_NODES = {"nodes": 4, "gpus_per_node": 1, "cpu": "4", "memory": "16Gi", "preforked": True}
"""Three members and, in the second test, a warm spare."""
NODES = 3
WINDOW = 8
STEPS = 400
"""Enough for calibration, a throttled window, the bench, its back-off and a window at pace after the node is
back, with room for a second bench (a back-off of 4 windows) if the release comes late. Both tests end with their
story, so the steps past it cost nothing."""
HELD_CPUS = 0.06
"""The throttled pod's CPUs (a CFS quota). A computing worker here gets 0.5 to 1 CPU, so its compute runs 8 to 16x
slower, and still 4x or more when the host's load on the other nodes grows 2.5-fold after their calibration
(the figure is relative to them; a quota is immune to that load): past the price's ~3x. Much less starves the
pod: held to 0.037, its peers called it dead within 10 s."""


def _spares(run) -> list[str]:
    return (run.job().get("status") or {}).get("sparePods") or []


def _start(run, spares: int = 0, threshold: float = 1.5):
    """A job of three one-node pipelines with `mitigation: spare`, trained until every member is calibrated;
    its generation 0 and its sorted member pods."""
    run.STEPS = STEPS
    # A very slow node is not a dead one: held to HELD_CPUS on a loaded host (both e2e groups at once, load ~11), a
    # pod sent no heartbeat for 5 s, the suite's usual verdict, and its peers called it dead before its pace was
    # judged (2026-11-27). Nothing here kills a worker, so the verdict can wait.
    spec = run.job_spec(STEPS, nodes=NODES, env={"WORKER_DEAD_AFTER_S": "20"})
    spec["training"]["globalBatchSize"] = 6  # two microbatches per pipeline
    spec["nodes"]["min"] = 2
    spec["nodes"]["spares"] = spares
    # As test_stragglers.py: tens of milliseconds of compute per step, mostly compute rather than host noise.
    spec["model"]["gpt"].update({"hiddenSize": 128, "sequenceLength": 64})
    spec["stragglers"] = {"threshold": threshold, "window": WINDOW, "mitigation": "spare"}
    run.apply(spec)
    first = run.wait_for(run.plan, "generation 0")
    assert [len(p.nodes) for p in first.pipelines] == [1, 1, 1], first.reason
    pods = sorted(first.nodes)
    # Calibrated: every member's report carries a pace.
    run.wait_for(lambda: all(run.progress(p).get("pace") for p in pods), "every node's pace")
    return first, pods


def _throttle(run, pod: str) -> float:
    """Hold `pod`'s processes to HELD_CPUS; when (monotonic)."""
    assert run.agent.throttle_cpu(run.ns, pod, HELD_CPUS), f"no process of {pod} held"
    return time.monotonic()


def _benched(run, pod: str, throttled_at: float):
    """The first plan that benches `pod`, printed; if none comes, what the operator measured."""
    try:
        benched = run.wait_for(lambda: pod in (plan := run.plan()).benched and plan, f"{pod} benched", timeout=240)
    except AssertionError as error:
        stragglers = (run.job().get("status") or {}).get("stragglers")
        lost = run.events("NodeLost")
        raise AssertionError(
            f"{error}; status.stragglers: {stragglers}; NodeLost: {lost}; plan: {run.plan().reason}"
        ) from None
    print(
        f"benched at step {benched.mitigation_step}, {time.monotonic() - throttled_at:.1f} s after the throttle: "
        f"{benched.reason}"
    )
    return benched


def test_a_very_slow_node_waits_as_a_spare_and_comes_back_released(job_run) -> None:
    if (why := cpulimit.available()) is not None:
        pytest.skip(why)
    run = job_run
    _, pods = _start(run)
    slow = pods[-1]
    benched = _benched(run, slow, _throttle(run, slow))
    assert slow not in benched.nodes and sorted(benched.nodes) == pods[:-1] and not benched.lost_nodes
    # (The operator posts the event after it wrote the plan.)
    run.wait_for(lambda: [e for e in run.events("StragglerBenched") if slow in e], "the StragglerBenched event", 30)
    run.wait_for(lambda: _spares(run) == [slow], f"{slow} counted a spare")
    run.agent.throttle_cpu(run.ns, slow, None)

    # Back in training once its back-off is over (a second bench, if the release came late, only delays it).
    back = run.wait_for(
        lambda: slow in (plan := run.plan()).nodes and plan.generation > benched.generation and plan,
        f"{slow} taken back",
        timeout=240,
    )
    print(f"taken back at generation {back.generation}, step {back.mitigation_step}: {back.reason}")
    assert back.reason.startswith("benched node taken back") and not back.benched
    run.wait_for(lambda: [e for e in run.events("BenchedNodeReadmitted") if slow in e], "the readmitted event", 30)
    # A window of steps back in, every loss so far exact (the job's remaining steps would only repeat the check).
    # (The host's own load may slow an untouched node past the price's ~3x for a window: measured once at
    # load 10, 3.1x. It is then benched and taken back the same way; no assertion on the plan after this.)
    run.check_losses_so_far(None, after=run.step(slow) + WINDOW)
    assert run.job()["status"].get("failuresSurvived", 0) == 0


def test_with_a_warm_spare_a_very_slow_node_is_swapped_for_it_and_stays_the_spare(job_run) -> None:
    if (why := cpulimit.available()) is not None:
        pytest.skip(why)
    run = job_run
    # A swap for an idle spare is cheap at any confirmed slowdown: at the usual 1.5 the host's own load once
    # benched an untouched node at 1.69x (the spare in its place), before the throttle. 4x is clear of that
    # noise and under the throttled node's figure (HELD_CPUS).
    first, pods = _start(run, spares=1, threshold=4.0)
    spare = render.worker_name("tiny", NODES)
    assert spare not in first.nodes
    run.wait_for(lambda: _spares(run) == [spare], f"{spare} a spare")
    slow = pods[-1]
    benched = _benched(run, slow, _throttle(run, slow))
    # The generation that benches the slow node folds the spare in: the full node count kept.
    assert benched.added_nodes == [spare], benched.reason
    assert sorted(benched.nodes) == sorted([*pods[:-1], spare]) and not benched.lost_nodes
    run.wait_for(lambda: _spares(run) == [slow], f"{slow} counted the spare")
    run.agent.throttle_cpu(run.ns, slow, None)
    released = run.step(pods[0])

    # Not taken back while the job is whole, three windows after its release (twice its back-off) and on:
    # read while the job trains (a job that ends deletes its spare), before the losses' reference is computed.
    assert STEPS - released >= 6 * WINDOW, "too few steps after the release to show it stays out"
    past = released + 3 * WINDOW
    run.wait_for(lambda: min(run.step(p) for p in run.plan().nodes) > past, f"the members past step {past}")
    print(f"released at step {released} of {STEPS}; generations {run.generations_seen}")
    assert not [e for e in run.events("BenchedNodeReadmitted") if slow in e]
    assert _spares(run) == [slow] and slow not in run.plan().nodes
    assert run.job()["status"].get("failuresSurvived", 0) == 0
    run.check_losses_so_far(None, after=past)
