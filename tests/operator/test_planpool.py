"""The planner pool (operator/planpool.py): real planner processes, real limits, real planning.

Each test spawns its own small pool; the processes import only the planner (about a second at load).
"""

from __future__ import annotations

import threading
import time

import pytest

from oobleck.api.conditions import Reason
from oobleck.operator.decide import decide
from oobleck.operator.planning import Tuning, check_spec
from oobleck.operator.planpool import PlannerLimits, PlannerPool, PlanningLimitExceeded
from oobleck.planner.errors import PlanningError
from oobleck.planner.synthetic import GPTShape, gpt_profile

pytestmark = pytest.mark.integration  # planner processes (see tests/conftest.py: make test-unit)


@pytest.fixture
def pool():
    pools: list[PlannerPool] = []

    def make(**limits) -> PlannerPool:
        pools.append(PlannerPool(PlannerLimits(**limits)))
        return pools[-1]

    yield make
    for p in pools:
        p.close()


def test_a_call_over_the_time_limit_is_killed_named_and_the_process_replaced(pool):
    planner = pool(workers=1, timeout_s=1.0)
    assert planner.run(sum, [1, 2, 3]) == 6  # the process is up
    began = time.monotonic()
    with pytest.raises(PlanningLimitExceeded) as raised:
        planner.run(time.sleep, 30)
    assert time.monotonic() - began < 10
    assert "limit of 1 s" in str(raised.value) and "--planner-timeout" in str(raised.value)
    assert planner.replaced == 1
    assert planner.run(sum, [4, 5]) == 9  # the replacement answers


def test_a_call_over_the_memory_limit_is_named_and_the_process_replaced(pool):
    planner = pool(workers=1, memory_bytes=512 << 20)
    with pytest.raises(PlanningLimitExceeded) as raised:
        planner.run(bytearray, 1 << 30)  # 1 GiB under a 512 MiB address space
    assert "memory limit of 512 MiB" in str(raised.value) and "--planner-memory-mib" in str(raised.value)
    assert planner.replaced == 1
    assert len(planner.run(bytearray, 1 << 20)) == 1 << 20


def test_a_planning_error_comes_back_as_itself_and_the_process_stays(pool):
    planner = pool(workers=1)
    with pytest.raises(ValueError, match="invalid literal"):
        planner.run(int, "x")
    assert planner.replaced == 0


def test_one_long_call_leaves_the_other_process_to_other_callers(pool):
    planner = pool(workers=2, timeout_s=5.0)
    planner.run(sum, [])
    outcome: list[BaseException] = []

    def slow_call() -> None:
        try:
            planner.run(time.sleep, 60)
        except PlanningLimitExceeded as error:
            outcome.append(error)

    slow = threading.Thread(target=slow_call)
    slow.start()
    time.sleep(0.5)
    began = time.monotonic()
    assert planner.run(sum, [1]) == 1
    assert time.monotonic() - began < 2.5  # not queued behind the slow call
    slow.join()
    assert len(outcome) == 1


def test_a_spec_over_the_limits_fails_invalid_spec_naming_the_limit(pool, h):
    """4096 nodes x 1024 layers (an entry point's measured profile: the API server cannot see its layers)."""
    planner = pool(workers=1, timeout_s=2.0)
    spec = h.spec(nodes={"min": 2, "max": 4096}, training={"steps": 10, "globalBatchSize": 8192, "microbatchSize": 1})
    profile = gpt_profile(
        GPTShape(blocks=1022, hidden=64, heads=4, vocab=256),
        seq_len=32,
        microbatch_size=1,
        gpu_flops=300e12,
        hbm_bandwidth=2e12,
    )
    planner.run(sum, [])  # started (its imports are not the call's time)
    began = time.monotonic()
    decision = decide(h.context(spec), _no_pods(h), None, profile, Tuning(), h.NOW, planner=planner)
    assert time.monotonic() - began < 15
    failed = next(c for c in decision.status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == Reason.INVALID_SPEC
    assert "limit of 2 s" in failed["message"] and "--planner-timeout" in failed["message"], failed["message"]
    assert not decision.create  # no pod for a job that cannot be planned
    # The verdict is memoised: the next reconcile does not plan again.
    began = time.monotonic()
    assert "--planner-timeout" in (check_spec(spec, profile, Tuning(), planner) or "")
    assert time.monotonic() - began < 0.5


def test_the_pool_plans_what_the_process_itself_would(pool, h):
    planner = pool(workers=1)
    spec = h.spec()
    profile = gpt_profile(
        GPTShape(blocks=4, hidden=64, heads=4, vocab=256),
        seq_len=32,
        microbatch_size=2,
        gpu_flops=300e12,
        hbm_bandwidth=2e12,
    )
    assert check_spec(spec, profile, Tuning(), planner) is None
    from oobleck.operator.planning import first_plan

    pooled = planner.run(first_plan, spec, profile, Tuning(), ["a", "b", "c", "d"], "tiny")
    assert pooled == first_plan(spec, profile, Tuning(), ["a", "b", "c", "d"], "tiny")
    with pytest.raises(PlanningError):
        planner.run(first_plan, spec, profile, Tuning(), [], "tiny")


def test_a_planner_process_imports_the_planner_and_not_the_operator(pool):
    planner = pool(workers=1)
    loaded = planner.run(eval, "sorted(__import__('sys').modules)")
    assert "oobleck.operator.planning" in loaded
    assert not {"kopf", "kubernetes", "torch", "oobleck.operator.decide"} & set(loaded)


def _no_pods(h):
    from oobleck.operator.observe import observe

    return observe(h.JOB, h.UID, [], h.nodes(0), None, gpu_resource="nvidia.com/gpu")
