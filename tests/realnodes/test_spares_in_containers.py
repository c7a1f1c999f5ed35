"""Warm spares on real nodes (issue #22, item 4): the time from a member's container SIGKILLed through containerd
to the full node count back in the plan, with `spec.nodes.spares: 1` and without.

The shared nodes (three), one pod of the job per node: two members and, with a spare, the spare on the third; without one,
the third node takes the replacement pod, which starts its container, imports torch and reaches the store
before the operator folds it in. Each test prints both times (kill -> plan with two nodes, kill -> the newcomer
training in it), checks the target with a spare, and ends once the newcomer trains, every logged loss before
that step equal to the no-failure run (the job would only repeat that check to its end).
"""

from __future__ import annotations

import json
import time

import pytest

from oobleck.api.contract import PROGRESS_ANNOTATION
from oobleck_dev.poll import wait_until
from tests.realnodes.jobs import OPEN_ENDED_STEPS, START_TIMEOUT_S, RealJob, job_spec, wait_for
from tests.realnodes.marks import realnode_marks
from tests.targets import SPARE_RESTORE_TARGET_S

# Timed: after the local suite beside it has ended (tests/realnodes/conftest.py).
pytestmark = [*realnode_marks(1800), pytest.mark.quiet_host]

MEMBERS = 2


def _progress(job: RealJob, pod: str) -> dict:
    report = (job.cluster.reads.pod(job.ns, pod)["metadata"].get("annotations") or {}).get(PROGRESS_ANNOTATION)
    return json.loads(report) if report else {}


@pytest.mark.parametrize("spares", [1, 0])
def test_a_killed_member_is_replaced_by_the_warm_spare_at_once(real_job, spares):
    job = real_job
    job.apply(
        job_spec(job.nodes.image, OPEN_ENDED_STEPS, min_nodes=1, node_selector=job.nodes.node_selector, spares=spares)
    )
    first = wait_for(
        lambda: len((p := job.plan()).nodes) == MEMBERS and p, "generation 0 on two nodes", START_TIMEOUT_S
    )
    assert first.generation == 0
    spare = None
    if spares:
        body = wait_for(lambda: (j := job.job())["status"].get("spares") == 1 and j, "the spare ready", START_TIMEOUT_S)
        (spare,) = body["status"]["sparePods"]
        assert spare not in first.nodes and _progress(job, spare)["generation"] == -1
    wait_for(lambda: min(_progress(job, p).get("step", -1) for p in first.nodes) >= 10, "10 steps", START_TIMEOUT_S)
    survivor, victim = first.nodes
    pod = job.cluster.reads.pod(job.ns, victim)
    killed_at = time.monotonic()
    job.nodes.kill_container(pod["spec"]["nodeName"], pod["status"]["containerStatuses"][0]["containerID"])
    at_kill = _progress(job, survivor)["step"]

    full = wait_until(
        lambda: len((p := job.plan()).nodes) == MEMBERS and p.generation > 0 and p, "the full node count", 180, 0.02
    )
    restore_s = time.monotonic() - killed_at
    (newcomer,) = full.added_nodes
    wait_for(lambda: _progress(job, newcomer).get("generation") == full.generation, f"{newcomer} training", 180)
    resumed_s = time.monotonic() - killed_at
    print(
        f"spares={spares}: killed {victim}'s container at step {at_kill}; full node count in generation "
        f"{full.generation} {restore_s:.2f} s after the kill; {newcomer} training in it {resumed_s:.2f} s after"
    )
    assert victim not in full.nodes and survivor in full.nodes
    if spares:
        # One reconfiguration: the generation that drops the victim folds the spare in.
        assert full.generation == 1 and full.lost_nodes == [victim] and newcomer == spare
        assert restore_s <= SPARE_RESTORE_TARGET_S, f"{restore_s:.2f} s from the kill to the full node count"
        # The plan's ConfigMap is written before the status: until the status shows that generation its
        # sparePods still names the spare just folded in.
        replacement = wait_for(
            lambda: (
                (s := job.job()["status"]).get("spares") == 1
                and (s.get("plan") or {}).get("generation", -1) >= full.generation
                and s["sparePods"]
            ),
            "the next spare",
            300,
        )
        assert spare not in replacement and victim not in replacement
    else:
        assert full.generation >= 2 and newcomer not in first.nodes
    through = wait_for(
        lambda: (s := min(_progress(job, p).get("step", -1) for p in full.nodes)) > at_kill + 1 and s,
        "both members past the kill",
        180,
    )
    print(f"{job.check_losses(through=through)} logged losses of steps 0-{through - 1} match the no-failure run")
    assert job.job()["status"]["failuresSurvived"] >= 1
