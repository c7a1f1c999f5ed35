"""Network partitions, end to end: `kubectl apply` -> the operator -> worker pods on local nodes, one of
them cut off by nftables while its processes live (NodeAgent.cut_network: the pod's sockets send and
receive nothing, no EOF, no refused connection; see oobleck_dev/netfault.py).

One job, one worker cut off twice:
- first from the API server only: training goes on with every worker in generation 0, and once healed its
  progress reaches the API server again;
- then from its peers and the coordinator (not from the API server): the survivors find it silent,
  probe it, get no answer and go on without it in a new generation; the cut-off worker fences itself
  (it cannot commit a step: commits go through the coordinator it cannot reach) and exits once the
  plan leaves it out; no step is committed twice. The partition heals, and the node's replacement
  pod is folded back in (a scale-up generation).

The test ends with the job still training once the story is over (the replacement training in the scale-up
generation), every step's loss so far equal to a no-failure run's.
Skipped, with the reason, where pods cannot be cut off (no root, no writable cgroup2, no nft).
"""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.xdist_group("local-node-jobs-2")]
LOCAL_NODES = {"nodes": 3, "gpus_per_node": 1, "cpu": "4", "memory": "16Gi", "preforked": True}
STEPS = 1500
"""Long enough that training outlasts both partitions, the detection and a replacement's start (steps run at
4-50/s on the 2-core host, by its load); the test ends while the job trains."""
API_CUT_S = 10.0
"""How long the worker is cut from the API server: at 4 steps/s, the pace at the host's highest load, it trains
twice the 20 steps the test asks for meanwhile."""
SURVIVORS_ON_S = 20.0
"""Cut -> the survivors' new generation, on a loaded 2-core host (detection itself is ~0.5 s: probe timeout)."""


@pytest.fixture
def cuttable(local_nodes):
    reason = local_nodes.network_faults_unavailable()
    if reason:
        pytest.skip(f"pods cannot be cut off here: {reason}")
    return local_nodes


def _start(run, warm_steps: int = 10):
    run.STEPS = STEPS
    run.apply(run.job_spec(steps=STEPS, nodes=3))
    first = run.wait_for(run.plan, "generation 0")
    run.wait_for(lambda: run.step(first.nodes[0]) >= warm_steps, f"{warm_steps} steps trained")
    return first


def _gone(agent, namespace: str, pod: str) -> bool:
    try:
        return not agent.pod_pids(namespace, pod)
    except LookupError:
        return True


def _steps_by_generation(run) -> dict[int, set[int]]:
    """step -> the generations in which some worker logged (i.e. committed) it."""
    out: dict[int, set[int]] = defaultdict(set)
    for record in run.records():
        if record.get("event") == "step":
            out[int(record["step"])].add(int(record["generation"]))
    return out


def test_a_worker_cut_off_from_the_api_server_trains_on_then_cut_from_its_peers_is_fenced_and_replaced(
    job_run, cuttable
):
    run, agent = job_run, cuttable
    first = _start(run)
    victim = first.nodes[1]

    # Cut from the API server: it trains on in generation 0 (its metrics port is not the API server).
    agent.cut_network(run.ns, victim, "api")
    try:
        before = run.scrape(victim)["oobleck_worker_step"]
        time.sleep(API_CUT_S)
        during = run.scrape(victim)["oobleck_worker_step"]
        assert run.plan().generation == 0
    finally:
        agent.heal_network(run.ns, victim)
    print(f"the worker cut from the API server trained {during - before:.0f} steps in {API_CUT_S:.0f} s")
    assert during - before >= 20, (before, during)
    # Healed: its progress reaches the API server again (its annotation moves past what it trained cut off).
    run.wait_for(lambda: run.step(victim) > during, "the healed worker's progress past what it trained cut off")
    assert run.plan().generation == 0, run.plan().reason

    # Cut from its peers and the coordinator: the survivors go on without it, and it fences itself.
    agent.cut_network(run.ns, victim, "peers")
    cut_at = time.monotonic()
    try:
        second = run.wait_for(
            lambda: (p := run.plan()).generation >= 1 and p, "a generation without the cut-off worker"
        )
        switched_s = time.monotonic() - cut_at
        assert victim in second.lost_nodes and victim not in second.nodes, second
        run.wait_for(lambda: _gone(agent, run.ns, victim), "the cut-off worker's process to end", timeout=60)
    finally:
        agent.heal_network(run.ns, victim)
    print(f"cut -> generation 1 published in {switched_s:.2f} s")
    assert switched_s < SURVIVORS_ON_S

    # The node comes back: the replacement pod (it runs once the old one is gone) is folded in.
    third = run.wait_for(lambda: (p := run.plan()).generation >= 2 and p, "the replacement folded in")
    assert len(third.nodes) == 3, third
    # Every member of generation 2, the replacement included, trains past the step its survivors had reached.
    run.check_losses_so_far(third.nodes, after=max(run.step(node) for node in third.nodes))
    assert run.plan().generation == 2, run.plan().reason
    run.check_generations(2)
    run.check_no_duplicate_pods(3 + 1)
    twice = {step: g for step, g in _steps_by_generation(run).items() if len(g) > 1}
    assert not twice, f"steps committed in more than one generation: {dict(list(twice.items())[:5])}"
    victim_steps = [r for r in run.records() if r.get("event") == "step" and r.get("node") == victim]
    assert victim_steps and all(r["generation"] == 0 for r in victim_steps), "the cut-off worker left generation 0"
    dropped = [r for r in run.records() if r.get("event") == "dropped" and victim in str(r.get("worker"))]
    print(f"the cut-off worker: last step {victim_steps[-1]['step']}, dropped records {dropped}")
