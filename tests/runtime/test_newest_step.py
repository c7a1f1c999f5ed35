"""Data-parallel steps need no commit: a rank left a step behind its replicas catches up by copy.

When every rank holds the whole model, a rank that applied a step is a complete replica at the next one
(runtime/elastic/commit.py `needs_commit`), so steps skip the commit's barrier, and a rank interrupted after
its sums while its replicas applied the step takes every layer from them as the next generation settles its
sources (runtime/elastic/sources.py `catch_up_step`). Pure choices first (the workers' and `oobleck launch`'s
controller's), then two real workers (threads, gloo) of which one misses an update, against the reference.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from torch.distributed import TCPStore

from oobleck.api.profile import ClusterShape
from oobleck.planner.instantiate import plan_job
from oobleck.runtime.backends.local.plan_control import StepsDisagree, at_newest_step, replan
from oobleck.runtime.elastic import keys
from oobleck.runtime.elastic.commit import StepCommit, needs_commit
from oobleck.runtime.elastic.loop import _settle_sources
from oobleck.runtime.elastic.sources import Holding, catch_up_step, resolve
from oobleck.runtime.elastic.worker import Worker
from oobleck.runtime.train.groups import Interrupted
from oobleck.runtime.train.reference import train_reference
from tests.runtime.drive_worker import run_generation
from tests.runtime.sizes import exact_config

STATE = [30728, 152496, 152496, 152496, 152496, 25356]
WHOLE = (0, 1, 2, 3, 4, 5)


def _two_replicas(make_plan, Spec, generation: int = 0):
    return make_plan([Spec(stages=[(0, 6, 0, 1)], microbatches=2)] * 2, num_layers=6, job="dp", generation=generation)


def test_only_plans_of_whole_unsplit_replicas_skip_the_commit(plan_builder):
    make_plan, Spec = plan_builder
    assert not needs_commit(_two_replicas(make_plan, Spec))
    assert not needs_commit(make_plan([Spec(stages=[(0, 6, 0, 2)], microbatches=2)], num_layers=6, gpus_per_node=2))
    assert needs_commit(make_plan([Spec(stages=[(0, 3, 0, 1), (3, 6, 1, 1)], microbatches=2)], num_layers=6))
    assert needs_commit(make_plan([Spec(stages=[(0, 6, 0, 2, 2)], microbatches=2)], num_layers=6, gpus_per_node=2))


def test_a_replica_behind_catches_up_from_the_newest(plan_builder):
    make_plan, Spec = plan_builder
    plan = _two_replicas(make_plan, Spec, generation=1)
    ahead, behind = (f"{a.node}:{a.gpu}" for a in plan.ranks)
    holdings = {
        ahead: Holding(step=4, layers=WHOLE, started=True),
        behind: Holding(step=3, layers=WHOLE, started=True),
    }
    settled = resolve(plan, holdings, STATE)
    assert settled.restore_step is None and settled.reason.endswith("+resolved")
    assert {(c.layer, c.src_rank, c.dst_rank) for c in settled.copies} == {(layer, 0, 1) for layer in WHOLE}
    assert catch_up_step(settled, holdings, behind) == 4
    assert catch_up_step(settled, holdings, ahead) is None
    # A rollback goes on from its restore step: nobody catches up to a live step then.
    assert catch_up_step(settled.model_copy(update={"restore_step": 2}), holdings, behind) is None


def test_pipeline_holders_at_the_newest_step_that_cover_every_layer_go_on_without_a_rollback(plan_builder):
    """Pipelines commit every step, so this arises only when a commit decision was lost with the coordinator."""
    make_plan, Spec = plan_builder
    plan = make_plan([Spec(stages=[(0, 3, 0, 1), (3, 6, 1, 1)], microbatches=2)] * 2, num_layers=6, generation=1)
    names = [f"{a.node}:{a.gpu}" for a in plan.ranks]  # ranks 0-1: pipeline 0, ranks 2-3: pipeline 1
    holdings = {
        names[0]: Holding(step=6, layers=(0, 1, 2), started=True),
        names[1]: Holding(step=5, layers=(3, 4, 5), started=True),
        names[2]: Holding(step=5, layers=(0, 1, 2), started=True),
        names[3]: Holding(step=6, layers=(3, 4, 5), started=True),
    }
    settled = resolve(plan, holdings, STATE)
    assert settled.restore_step is None
    assert {(c.src_rank, c.dst_rank) for c in settled.copies} == {(3, 1), (0, 2)}
    assert [catch_up_step(settled, holdings, w) for w in names] == [None, 6, 6, None]


def test_the_launchers_controller_copies_from_the_newest_or_rolls_back():
    holdings = {"a:0": set(WHOLE), "b:0": set(WHOLE), "c:0": set()}
    assert at_newest_step(holdings, {"a:0": 4, "b:0": 4, "c:0": 0}, 6) is holdings
    assert at_newest_step(holdings, {"a:0": 4, "b:0": 3}, 6) == {"a:0": set(WHOLE), "b:0": set(), "c:0": set()}
    with pytest.raises(StepsDisagree, match=r"\(\[3, 4\]\) and those at step 4 do not hold every layer"):
        at_newest_step({"a:0": {0, 1, 2}, "b:0": {3, 4, 5}}, {"a:0": 4, "b:0": 3}, 6)


def test_the_launchers_controller_plans_the_copies_to_a_replica_behind(uniform_profile_model):
    """`oobleck launch` re-plans from the reports (plan_control.replan) with what `at_newest_step` leaves: the
    replica behind holds nothing, so the planner copies it every layer from one at the newest step."""
    cluster = ClusterShape(
        nodes=3, gpus_per_node=1, gpu_memory_bytes=80 << 30, intra_node_bandwidth=100e9, inter_node_bandwidth=10e9
    )
    previous = plan_job(uniform_profile_model, cluster, 1, 6, "dp", nodes=["a", "b", "c"])
    assert not needs_commit(previous)
    held = at_newest_step({"a:0": set(WHOLE), "b:0": set(WHOLE), "c:0": set(WHOLE)}, {"a:0": 5, "b:0": 4, "c:0": 5}, 6)
    retry = replan(previous, previous.nodes, held, uniform_profile_model, reason="retry")
    behind = previous.rank_of("b", 0)
    assert {c.layer for c in retry.copies if c.dst_rank == behind} == set(WHOLE)
    assert all(c.src_node in ("a", "c") for c in retry.copies)
    lost = replan(
        previous,
        ["a", "b"],
        {w: v for w, v in held.items() if w != "c:0"},
        uniform_profile_model,
        lost=["c"],
        reason="lost",
    )
    assert {c.layer for c in lost.copies if (c.dst_node, c.src_node) == ("b", "a")} == set(WHOLE)


# -- two real replicas, one of which misses an update ----------------------------------------------------


CONFIG = exact_config("dp", steps=7, seed=5)
MISSED = 3


class _MissesOneUpdate:
    """The optimizer of a rank whose failure event fires between its sums and step MISSED's update."""

    def __init__(self, inner, worker: Worker) -> None:
        self._inner, self._worker = inner, worker

    def step(self, *args, **kwargs):
        if self._worker.step == MISSED:
            raise Interrupted(f"step {MISSED}: interrupted after the sums (test)")
        return self._inner.step(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def test_a_replica_that_missed_an_update_catches_up_and_every_loss_matches_the_reference(plan_builder):
    make_plan, Spec = plan_builder
    first, second = _two_replicas(make_plan, Spec), _two_replicas(make_plan, Spec, generation=1)
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    events = [threading.Event() for _ in first.ranks]
    controls = [SimpleNamespace(store=TCPStore("127.0.0.1", master.port, is_master=False)) for _ in first.ranks]
    workers = [
        Worker(
            CONFIG,
            TCPStore("127.0.0.1", master.port, is_master=False),
            a.node,
            a.gpu,
            failed=events[a.rank],
            commit=StepCommit(controls[a.rank], events[a.rank], f"{a.node}:{a.gpu}"),
        )
        for a in first.ranks
    ]
    ahead, behind = workers
    behind.optimizer = _MissesOneUpdate(behind.optimizer, behind)  # type: ignore[assignment]
    pool = ThreadPoolExecutor(2)

    def all_of(call):
        return [future.result(timeout=60) for future in [pool.submit(call, w) for w in workers]]

    losses: dict[int, list[float]] = {}

    def record(outcomes):
        for outcome in outcomes:
            if outcome is not None and outcome.loss is not None:
                losses.setdefault(outcome.step, []).append(outcome.loss)

    all_of(lambda w: w.adopt(first))
    for _ in range(MISSED):
        record(all_of(lambda w: w.train_step()))
    # No commit keys: data-parallel steps never wait on the store.
    assert not master.check([keys.commit_prefix(0, step) + "arrived" for step in range(MISSED)])

    def step_or_interrupted(worker):
        try:
            return worker.train_step()
        except Interrupted:
            return None

    record(all_of(step_or_interrupted))
    assert (ahead.step, behind.step) == (MISSED + 1, MISSED)
    for event in events:  # the control side moves both on; the one ahead is interrupted in its next step
        event.set()
    with pytest.raises(Interrupted):
        ahead.train_step()
    for event in events:
        event.clear()
    detectors = [SimpleNamespace(failure=event) for event in events]
    settled = all_of(
        lambda w: (w.abandon(), _settle_sources(second, w, controls[w.rank], f"{w.node}:{w.gpu}", detectors[w.rank]))[1]
    )
    assert settled[0] == settled[1] and settled[0].restore_step is None
    assert behind.step == MISSED + 1 and not behind.layers  # dropped: its layers come by copy
    results = all_of(lambda w: run_generation(w, settled[0], CONFIG.steps, on_step=lambda o: record([o])))
    assert results == [("done", None), ("done", None)]
    reference = train_reference(CONFIG, first.global_microbatches)
    assert sorted(losses) == list(range(CONFIG.steps))
    assert len(losses[MISSED]) == 1, "the rank behind never logs the step it missed"
    for step, expected in enumerate(reference.losses):
        for loss in losses[step]:
            assert abs(loss - expected) <= 1e-5 * abs(expected), f"step {step}"
    one, two = ahead.layer_state(), behind.layer_state()
    assert all(torch.equal(one[layer][name], two[layer][name]) for layer in one for name in one[layer])
    for layer, params in one.items():
        for name, value in params.items():
            assert (value - reference.layers[layer][name]).abs().max().item() <= 1e-5, f"layer {layer} {name}"
    pool.shutdown()
