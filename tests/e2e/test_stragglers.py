"""A slow node found for real (issue 22, detection): a job of three local nodes trains unthrottled (no
straggler, no event), then one worker pod's processes are held by a CFS quota of the cgroup v1 cpu
controller to an eighth of the CPU they were using (oobleck_dev.cpulimit, a node turned slow mid-job), and
then released.

Checked: while nothing is throttled nothing is listed and no Straggler event is raised; once throttled,
the pod is in status.stragglers, confirmed, with a Straggler event naming it, within 20 steps of the
throttle (window 10); the operator's and the worker's slowdown metrics show it; a new generation re-splits
the batch so that its pipeline runs fewer microbatches, moving no layer; released, it leaves the list with
a StragglerRecovered event and the profile's split comes back; every step's loss up to a few steps after that
equals the single-process reference (the test ends there, the job still training).

And a node slow from its very start (a degraded GPU at launch): held before its first step, it calibrates at
its slow pace and reads 1x against itself, yet it is confirmed, measured against the nodes that run the same
layers, and the batch is re-split around it.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from oobleck_dev import cpulimit

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.xdist_group("local-node-jobs-2")]
LOCAL_NODES = {"nodes": 3, "gpus_per_node": 1, "cpu": "4", "memory": "16Gi", "preforked": True}
NODES = 3
WINDOW = 10
THRESHOLD = 2.0
"""Over the default 1.5, for the shared host: in the calm phase an untouched node once read 1.55x the others'
median for a window (the other xdist worker's job took its CPU)."""
SHARE = 8
"""The held node gets 1/SHARE of the CPU it was using. A quota is absolute, so when the host's load rises the
others slow down and the held node does not: held to half, it read 2.4x-4.1x at confirmation alone, but beside
the suite it stayed between 1.5x and 2x for 60 steps; held to a quarter, it read 6.5x-12x at confirmation, but
in one CI run beside the real-node tests (steps of ~1 s) it took 15 steps to read 2x against its peers, and was
confirmed 25 steps after the throttle."""
DETECTION_STEPS = 20
"""The issue's target: a node slowed at step s is a confirmed straggler by step s + 20."""
CALM_STEPS = 30
STEPS = 300
"""Room for the whole story on a loaded host: calm, throttled and confirmed, re-split, released and the
profile's split again before the job ends (at 200 steps a run at load ~10 ended still re-split). The test ends
with the story (step ~100 at load 2): the job's remaining steps would only repeat the loss check."""


def stragglers(run) -> list[dict[str, Any]]:
    return (run.job().get("status") or {}).get("stragglers") or []


def naming(messages: list[str], node: str) -> list[str]:
    return [m for m in messages if node in m]


def paced_steps(run, pods: list[str]) -> int:
    """The lowest step among `pods` whose report carries a measured pace (0 while one has none)."""
    steps = []
    for pod in pods:
        progress = run.progress(pod)
        steps.append(progress.get("step", 0) if progress.get("pace") else 0)
    return min(steps)


def start_job(run) -> list[str]:
    """Apply the job (NODES one-node pipelines, `resplit`) and return its worker pods' names, sorted."""
    # Step counts read from the progress reports bound the detection: reported five times a second.
    spec = run.job_spec(STEPS, nodes=NODES, env={"WORKER_PROGRESS_INTERVAL_S": "0.2"})
    spec["training"]["globalBatchSize"] = 12  # 4 microbatches per pipeline: room to re-split
    spec["nodes"]["min"] = NODES
    # Wider than the other e2e jobs' GPT: tens of milliseconds of compute per step, not a few, so that a
    # step's figure is mostly compute rather than a loaded host's scheduling noise.
    spec["model"]["gpt"].update({"hiddenSize": 128, "sequenceLength": 64})
    spec["stragglers"] = {"threshold": THRESHOLD, "window": WINDOW, "mitigation": "resplit"}
    run.apply(spec)
    return run.wait_for(
        lambda: len(p := [w["metadata"]["name"] for w in run._worker_pods()]) == NODES and sorted(p),
        "three worker pods",
    )


def test_a_worker_throttled_to_an_eighth_of_its_cpu_is_a_confirmed_straggler_within_20_steps(job_run) -> None:
    if (why := cpulimit.available()) is not None:
        pytest.skip(why)
    run = job_run
    pods = start_job(run)
    # Unthrottled: every node measured, then CALM_STEPS more steps with nothing listed.
    start = run.wait_for(lambda: paced_steps(run, pods) >= 20 and paced_steps(run, pods), "every node's pace")
    while (step := paced_steps(run, pods)) < start + CALM_STEPS:
        assert not [s for s in stragglers(run) if s.get("confirmed")], (
            f"at step {step}: {stragglers(run)}; reports {[run.progress(p) for p in pods]}; "
            f"stages {[(s.node, s.start, s.end, p.microbatches) for p in run.plan().pipelines for s in p.stages]}"
        )
        time.sleep(0.3)
    assert run.events("Straggler") == []

    even = {p.nodes[0]: p.microbatches for p in run.plan().pipelines}  # the profile's split
    # One node to a fraction of its own pace: of the CPU its processes used over the last seconds.
    slow = pods[-1]
    before, began = run.agent.pod_cpu_seconds(run.ns, slow), time.monotonic()
    time.sleep(3)
    rate = (run.agent.pod_cpu_seconds(run.ns, slow) - before) / (time.monotonic() - began)
    assert rate > 0.01, f"{slow} used {rate:.3f} CPUs"
    held = run.agent.throttle_cpu(run.ns, slow, rate / SHARE)
    assert held, f"no process of {slow} held"
    throttled_at = max(run.progress(p).get("step", 0) for p in pods)

    def confirmed() -> dict[str, Any] | None:
        return next((s for s in stragglers(run) if s["node"] == slow and s.get("confirmed")), None)

    found = run.wait_within_steps(confirmed, f"{slow} confirmed a straggler", pods, 2 * DETECTION_STEPS)
    seen_at = max(run.progress(p).get("step", 0) for p in pods)
    print(
        f"throttled {slow} to {rate / SHARE:.3f} CPUs at step {throttled_at}: slow since step {found['sinceStep']}, "
        f"confirmed by step {found['sinceStep'] + WINDOW}, in status by step {seen_at}, slowdown {found['slowdown']}"
    )
    assert found["sinceStep"] + WINDOW <= throttled_at + DETECTION_STEPS, (
        f"throttled at step {throttled_at}, slow since {found['sinceStep']}: confirmed at {found['sinceStep'] + WINDOW}"
    )
    assert found["slowdown"] >= THRESHOLD
    # On the shared 2-core CI host, a neighbour test's load once held an untouched node at 1.66x for a window
    # too (a slow node, truly; THRESHOLD is over that now): the others may be listed, but never slower than the
    # throttled one.
    listed = {s["node"]: s["slowdown"] for s in stragglers(run)}
    assert listed[slow] == max(listed.values()), listed
    messages = run.wait_for(lambda: naming(run.events("Straggler"), slow), "the Straggler event")
    assert len(messages) == 1, messages
    assert run.agent.cpu_throttled_seconds(run.ns, slow) > 0, "the kernel never held the pod back"
    labels = f'job="tiny",namespace="{run.ns}",node="{slow}"'
    # (A re-split generation may be under way: the series returns with the nodes' reports in it.)
    metric = f"oobleck_operator_node_slowdown{{{labels}}}"
    run.wait_for(lambda: run.operator_metrics().get(metric, 0) >= THRESHOLD, "the operator's slowdown metric")
    assert run.scrape(slow)["oobleck_worker_slowdown"] > run.scrape(pods[0])["oobleck_worker_slowdown"]

    # Mitigated: a generation that gives the slow node's pipeline fewer microbatches, moving no layer.
    resplit = run.wait_for(lambda: (plan := run.plan()).reason.startswith("batch re-split") and plan, "a re-split")
    split = {p.nodes[0]: p.microbatches for p in resplit.pipelines}
    assert split[slow] < min(m for node, m in split.items() if node != slow), (even, split)
    assert resplit.copies == [] and sum(split.values()) == 12
    print(f"re-split at generation {resplit.generation}: {split}")

    # Released: back under the threshold, off the list, one recovery event, the profile's split again.
    run.agent.throttle_cpu(run.ns, slow, None)
    run.wait_for(lambda: run.events("StragglerRecovered"), "the StragglerRecovered event", timeout=240)
    back = run.wait_for(lambda: "(all at pace)" in (plan := run.plan()).reason and plan, "the profile's split again")
    assert sorted(p.microbatches for p in back.pipelines) == sorted(even.values())
    # A CPU quota caps a node's work, not its speed: with the smaller share of a re-split the held node may
    # read under the threshold for a while (seen: 4.15x, 1.63x, 2.17x). A node is released as it was
    # confirmed, after a window of figures under the threshold, so episodes are at least two windows apart:
    # never an event per wobble.
    began = sorted(int(m.rsplit("since step ", 1)[1]) for m in naming(run.events("Straggler"), slow))
    assert began and all(b - a >= 2 * WINDOW for a, b in zip(began, began[1:])), began
    assert len(run.events("StragglerRecovered")) >= len(began) - 1
    # The same losses as one process training the job without any of it, through a few steps at the profile's
    # split (the job's remaining steps would only repeat the check).
    run.check_losses_so_far(pods, after=max(run.step(p) for p in pods) + 4)


FROM_START_CPUS = 0.08
"""The node slow from its start gets this many CPUs (a quota is absolute: each of three unheld workers gets
0.3-0.7 of the 2 shared cores, so it computes 4-8x slower than they do)."""


def test_a_worker_slow_from_its_first_step_is_found_against_the_nodes_running_the_same_layers(job_run) -> None:
    if (why := cpulimit.available()) is not None:
        pytest.skip(why)
    run = job_run
    pods = start_job(run)
    slow = pods[-1]
    # Held as soon as its worker process runs: before the job's first plan, so before its first step.
    run.wait_for(lambda: run.agent.throttle_cpu(run.ns, slow, FROM_START_CPUS), f"{slow}'s worker process")
    assert run.step(slow) == 0 and run.progress(slow).get("generation", -1) <= 0 and not run.progress(slow).get("pace")
    first = run.wait_for(run.plan, "the first plan")
    assert {len(p.nodes) for p in first.pipelines} == {1}, "three one-node pipelines: every node runs the same layers"

    def confirmed() -> dict[str, Any] | None:
        return next((s for s in stragglers(run) if s["node"] == slow and s.get("confirmed")), None)

    found = run.wait_within_steps(confirmed, f"{slow} confirmed a straggler", pods, 4 * DETECTION_STEPS)
    own = run.scrape(slow)["oobleck_worker_slowdown"]  # against the pace it calibrated at: held all along
    print(
        f"{slow} held to {FROM_START_CPUS} CPUs from its start: slow since step {found['sinceStep']}, "
        f"{found['slowdown']}x the nodes on its layers, {own:.2f}x its own calibrated pace"
    )
    assert found["slowdown"] >= THRESHOLD and own < THRESHOLD
    assert found["sinceStep"] <= 2 * WINDOW + 14, "slow from its first calibrated steps"  # warm-up 5 + 9 steps
    assert run.agent.cpu_throttled_seconds(run.ns, slow) > 0, "the kernel never held the pod back"
    listed = {s["node"]: s["slowdown"] for s in stragglers(run)}
    assert listed[slow] == max(listed.values()), listed
    assert len(run.wait_for(lambda: naming(run.events("Straggler"), slow), "the Straggler event")) == 1

    resplit = run.wait_for(lambda: (plan := run.plan()).reason.startswith("batch re-split") and plan, "a re-split")
    split = {p.nodes[0]: p.microbatches for p in resplit.pipelines}
    assert split[slow] < min(m for node, m in split.items() if node != slow), split
    print(f"re-split at generation {resplit.generation}: {split}")
    run.check_losses_so_far(pods, after=max(run.step(p) for p in pods) + 4)
