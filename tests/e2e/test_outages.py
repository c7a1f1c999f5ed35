"""Control-plane outages, end to end, through the test suite's own control plane (etcd + kube-apiserver
processes that `ControlPlane.stop_component` / `start_component` stop and bring back on the same ports
with the same data): `kubectl apply` -> the operator (a real process) -> worker pods on local nodes.

Training never needs the API server: the workers find each other through the coordinator's store,
and read the API server only for new plan generations (a watch that retries) and write progress
annotations (best effort). So while the API server is down the workers keep training (their
/metrics, scraped over HTTP from the pod IPs, keep counting steps); when it returns, the operator's
and the workers' watches resume and nothing is planned twice: training goes on in generation 0, with every
step's loss equal to a no-failure run's. (Ending Succeeded at the exact step after disruptions is shown by
tests/e2e/test_partitions.py; waiting here for a job long enough to outlast the outages took up to 21 min of
one pytest worker on the loaded host.)
"""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from oobleck.api import contract
from oobleck_dev.operatorproc import OperatorExited

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.xdist_group("local-node-jobs-2")]
LOCAL_NODES = {"nodes": 2, "gpus_per_node": 1, "cpu": "4", "memory": "16Gi", "preforked": True}
NODES = 2
"""The fewest a job runs on: the outages stop no worker, and each one trains through the whole story."""
OUTAGE_S = 20.0
STEPS = 20000
"""Long enough that training outlasts the 20 s outage, the operator's restart and an etcd restart on a loaded host
(steps run at 4-90/s on the 2-core host, by its load: 90/s quiet since data-parallel steps skip the commit); the
test ends while the job still trains."""
RESTART_S = 240.0
"""How long the operator restarted during the outage may take to serve: at load ~20 (two suites at once) one
start took over 60 s, and a start killed at a shorter limit only began the next one from scratch."""


def _steps_during(ip: str, seconds: float) -> list[int]:
    """The worker step at pod IP `ip` (its /metrics; the address read before the API server went away),
    every 2 s for `seconds`."""
    steps: list[int] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(f"http://{ip}:{contract.WORKER_PORT}/metrics", timeout=5) as response:
                metrics = {
                    s.name: s.value for f in text_string_to_metric_families(response.read().decode()) for s in f.samples
                }
            steps.append(int(metrics["oobleck_worker_step"]))
        except (OSError, KeyError):
            pass
        time.sleep(2)
    return steps


def _restart_until_up(operator, until: float) -> None:
    """Start the operator again and again until it is up, as a Deployment's kubelet restarts a crashed
    container: started while the API server is away, it may exit before it can serve."""
    while time.monotonic() < until:
        try:
            operator.start(timeout_s=max(1.0, until - time.monotonic()))
            return
        except OperatorExited:
            time.sleep(1)


def _up(operator) -> bool:
    """Whether the operator serves; one that exited is started again (a Deployment's restart)."""
    try:
        return operator.healthy()
    except OperatorExited:
        operator.start(timeout_s=RESTART_S / 2)
        return operator.healthy()


@pytest.mark.timeout(900)  # a 20-40 s outage, two restarts and the waits after them on a loaded host
def test_apiserver_outage_with_an_operator_restart_then_an_etcd_restart(job_run, local_nodes, cluster):
    run = job_run
    control = cluster.control_plane
    if control is None:
        pytest.skip("needs the suite's own control plane: an existing cluster's API server is not ours to stop")
    run.STEPS = STEPS
    run.apply(run.job_spec(steps=STEPS, nodes=NODES))
    first = run.wait_for(run.plan, "generation 0")
    watched = first.nodes[0]
    run.wait_for(lambda: run.step(watched) >= 10, "10 steps trained")
    ip = run.pod(watched)["status"]["podIP"]

    # The API server is down for OUTAGE_S; halfway through the operator crashes and starts again (it
    # comes up while the API server is still away).
    control.stop_component("kube-apiserver")
    down_at = time.monotonic()
    during = _steps_during(ip, OUTAGE_S / 2)
    run.operator.kill()
    restart = threading.Thread(target=_restart_until_up, args=(run.operator, time.monotonic() + RESTART_S))
    restart.start()
    during += _steps_during(ip, OUTAGE_S - (time.monotonic() - down_at))
    control.start_component("kube-apiserver")
    print(f"API server down {time.monotonic() - down_at:.1f} s; {watched}'s step during it: {during}")
    assert len(during) >= 5 and during[-1] - during[0] >= 20, f"training stalled without the API server: {during}"
    restart.join(RESTART_S)
    run.wait_for(lambda: _up(run.operator), "the operator restarted during the outage to serve", timeout=RESTART_S)
    print(f"operator starts: {run.operator.starts}")

    # Both watches resumed: the workers' progress reaches the job's status again through the operator.
    after = during[-1]
    run.wait_for(
        lambda: run.job().get("status", {}).get("progress", {}).get("step", 0) > after,
        "the job's status to report steps trained after the outage",
    )

    # etcd restarts under the API server (a few seconds away, same data).
    control.stop_component("etcd")
    time.sleep(5)
    control.start_component("etcd")
    at_etcd = run.job()["status"]["progress"]["step"]
    assert at_etcd < STEPS, "the job finished before the etcd restart: raise STEPS"
    run.wait_for(
        lambda: run.job().get("status", {}).get("progress", {}).get("step", 0) > at_etcd,
        "steps reported after the etcd restart",
    )

    # Still the first generation and never a lost node; every step up to the etcd restart logged and exact.
    assert run.job()["status"].get("phase") != "Failed", run.job()["status"]
    plan = run.plan()
    assert plan.generation == 0, f"an outage made a generation: {plan.reason}, lost: {run.events('NodeLost')}"
    compared = run.check_losses(through=at_etcd)
    print(f"{compared} logged losses of steps 0-{at_etcd - 1} match the no-failure reference within 1e-5")
    run.check_generations(0)
    run.check_no_duplicate_pods(NODES)
    assert not run.events("NodeLost"), run.events("NodeLost")
