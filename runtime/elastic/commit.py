"""The step commit: every rank of a generation applies a global step, or none does.

Commit: a global step must be applied by every rank or by none, otherwise replicas of a layer
diverge (a rank whose gradient sum completed would update while a neighbour, interrupted a moment
earlier, would not). So before the optimizer update each rank arrives at
`gen{g}/commit/{step}/arrived`; the rank that completes the count writes "commit" to
`.../decision`, a rank that sees the failure Event first writes "abort" (compare-and-set: the first
writer wins) and everyone follows the decision. Arriving means "my gradient sums completed", so a
commit is safe even if some rank dies right after it. The hook is the optimizer's `step` (the
engine calls it right after the sums and before touching any state): `CommittingOptimizer`.

Not when every rank holds the whole model unsplit (data parallelism only, `needs_commit`): a rank that
applies a step is then a complete replica at the next one, so a rank that did not apply it (interrupted
after its sums) is merely behind and takes every layer from the newest ones in the next generation
(runtime/elastic/sources.py `catch_up_step`): nothing forks and no step is lost or redone twice. Such steps
skip the decision's barrier, which costs the step the wait for the slowest rank on top of its round trips
(on 4 ranks sharing 2 cores, 2-3 % of a step: README, "Steady-state speed").
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from oobleck.api.addresses import worker_id
from oobleck.runtime.elastic import keys, nonfinite
from oobleck.runtime.elastic.store import ControlStore, is_store_loss
from oobleck.runtime.train.groups import Interrupted

if TYPE_CHECKING:
    from oobleck.api.plan import Plan
    from oobleck.runtime.elastic.worker import Worker

log = logging.getLogger(__name__)


NON_FINITE_MARK = 1 << 24
"""Added to a commit's arrival count by a rank that found a NaN/Inf (world sizes stay far below it)."""
COMMIT_NON_FINITE = "commit-nonfinite"
"""The decision when some rank found a NaN/Inf: every rank applies the job's policy (runtime/elastic/nonfinite.py)."""


class StepCommit:
    """All-or-nothing agreement on applying a step, decided through the coordinator's store.

    If the coordinator dies while a rank waits for the decision, some ranks may have read "commit"
    (and applied the step) and others not. The waiting rank then keeps its reduced gradients,
    reconnects to the recreated coordinator, reports itself pending (`held/{worker}` with phase
    "pending"), and waits for the decision to be re-posted: "commit" if any survivor reports the step
    applied, else "abort". The local controller re-posts it once every survivor has reported; a
    controller that cannot read the store (the operator) never does, so after `self_decide_s` the
    pending ranks post it themselves from the reports present (compare-and-set: they agree). A rank
    that applied the step but had not reported yet then holds a newer step than the others: the
    next generation's members see the disagreement and go on from the newest step when its holders cover
    every layer, else roll back (runtime/elastic/sources.py); they never mix steps.
    """

    def __init__(
        self,
        control: ControlStore,
        failed,
        worker: str = "",
        poll_s: float = 0.05,
        recover_timeout_s: float = 300.0,
        self_decide_s: float = 10.0,
    ) -> None:
        self.control = control
        self.failed = failed
        self.worker = worker
        self.poll_s = poll_s
        self.recover_timeout_s = recover_timeout_s
        self.self_decide_s = self_decide_s
        self.members: tuple[str, ...] = ()
        self.non_finite: str | None = None
        """what some rank found NaN/Inf in the step just committed (see `decide`)"""
        """the generation's workers ("node:gpu"), whose reports a self-decided re-post reads"""

    def decide(self, generation: int, world_size: int, step: int, non_finite: str | None = None) -> bool:
        """Arrive and wait for the decision; True: apply the step, False: abort it. `non_finite`: what this
        rank found NaN/Inf; after a commit, `self.non_finite` says what any rank found (else None)."""
        self.non_finite = None
        try:
            return self._decide(generation, world_size, step, non_finite)
        except RuntimeError as error:
            if not is_store_loss(error):
                raise
            return self._recover(generation, step)

    def _decide(self, generation: int, world_size: int, step: int, non_finite: str | None) -> bool:
        store = self.control.store
        prefix = keys.commit_prefix(generation, step)
        decision = keys.decision_key(generation, step)
        if non_finite is not None:  # the slow path only: the detail first, then the marked arrival
            store.compare_set(prefix + "nonfinite", "", non_finite)
        arrived = store.add(prefix + "arrived", 1 + (NON_FINITE_MARK if non_finite is not None else 0))
        count, marked = arrived % NON_FINITE_MARK, arrived >= NON_FINITE_MARK
        if count == world_size:
            # The last arrival decides: compare_set's reply is the decision in force ("commit", or an
            # "abort" posted first), so waiting for the key and reading it back would only add two
            # round trips to the step's critical path (every other rank is waiting on this one).
            # A marked count carries "some rank saw NaN/Inf" at no extra round trip.
            value = keys.propose_decision(store, generation, step, COMMIT_NON_FINITE if marked else "commit")
            if world_size == 1:
                self._collect(store, generation, step - 2)
            return self._read(store, prefix, value)
        if count == 1:
            # The first arrival waits for the others anyway: it drops old keys meanwhile.
            self._collect(store, generation, step - 2)
        while True:
            if self.failed.is_set():
                # compare_set returns the value in force: ours if we were first, else the winner's.
                return self._read(store, prefix, keys.propose_decision(store, generation, step, "abort"))
            try:
                store.wait([decision], datetime.timedelta(seconds=self.poll_s))
            except RuntimeError as error:
                if is_store_loss(error):
                    raise
                continue  # a wait timeout: look at the failure Event again
            verified = keys.read_decision(store, generation, step)
            if verified is not None:
                return self._read(store, prefix, verified)
            time.sleep(self.poll_s)  # present but not a verified decision (a stranger's): never followed

    def _read(self, store, prefix: str, value: str) -> bool:
        """Whether `value` (a decision) commits; sets `non_finite` from a COMMIT_NON_FINITE decision."""
        if value == COMMIT_NON_FINITE:
            self.non_finite = store.get(prefix + "nonfinite").decode() or "a rank found a NaN/Inf"
        return value in ("commit", COMMIT_NON_FINITE)

    @staticmethod
    def _collect(store, generation: int, step: int) -> None:
        """Drop `step`'s commit keys, so that a long job does not grow the store without bound.

        Safe from a rank arriving at step + 2: step + 1 committed, so every rank arrived at step + 1,
        i.e. every rank had read `step`'s decision already."""
        old = keys.commit_prefix(generation, step)
        store.delete_key(old + "arrived")
        store.delete_key(old + "decision")
        store.delete_key(old + "nonfinite")

    def _recover(self, generation: int, step: int) -> bool:
        log.warning(
            json.dumps({"event": "commit-pending", "worker": self.worker, "generation": generation, "step": step})
        )
        self.control.reconnect()
        store = self.control.store
        keys.set_held(store, self.worker, {"generation": generation, "step": step, "layers": [], "phase": "pending"})
        began = time.monotonic()
        while (value := keys.read_decision(store, generation, step)) is None:
            waited = time.monotonic() - began
            if waited > self.recover_timeout_s:
                raise RuntimeError(f"commit of step {step}: no decision within {self.recover_timeout_s:.0f} s")
            if waited > self.self_decide_s:
                applied = self._applied_by_a_peer(store, generation, step)
                keys.propose_decision(store, generation, step, "commit" if applied else "abort")
            else:
                time.sleep(self.poll_s)
        return self._read(store, keys.commit_prefix(generation, step), value)

    def _applied_by_a_peer(self, store, generation: int, step: int) -> bool:
        """Whether a member reported leaving `generation` with `step` applied (its next step is step + 1)."""
        for member in self.members:
            report = keys.get_held(store, member) if member != self.worker else None
            if report is not None and (
                report.get("generation") == generation
                and report.get("phase") == "left"
                and report.get("step") == step + 1
            ):
                return True
        return False


class StepCommitter(Protocol):
    """Decides whether every member of a generation applies a step (reconfig.StepCommit)."""

    members: tuple[str, ...]
    non_finite: str | None
    """after a commit: what some rank found NaN/Inf in the step (runtime/elastic/nonfinite.py), else None"""
    control: Any
    """the coordinator's store connection (`.store`): a rollback agrees on its snapshot step there"""

    def decide(self, generation: int, world_size: int, step: int, non_finite: str | None = None) -> bool: ...


def needs_commit(plan: Plan) -> bool:
    """Whether `plan`'s steps need the all-or-nothing decision: unless every stage holds every layer whole."""
    return any(
        (stage.start, stage.end, stage.tensor_parallel) != (0, plan.num_layers, 1)
        for pipeline in plan.pipelines
        for stage in pipeline.stages
    )


class CommittingOptimizer:
    """The worker's optimizer when steps commit all-or-nothing: `step()` first asks the committer (an
    aborted decision or a lost coordinator interrupts the step); everything else passes through."""

    def __init__(self, inner, worker: Worker, commit: StepCommitter) -> None:
        self._inner = inner
        self._worker = worker
        self._commit = commit
        self._plan: Plan | None = None
        self._commits = True
        """whether the steps of `_plan` (the plan in force when last asked) go through the decision"""

    def step(self, *args, **kwargs):
        plan = self._worker.plan
        assert plan is not None, "a step runs only under an adopted plan"
        found = self._worker.engine.non_finite if self._worker.engine is not None else None
        if self._plan is not plan:
            self._plan, self._commits = plan, needs_commit(plan)
            self._commit.members = tuple(worker_id(a.node, a.gpu) for a in plan.ranks)
        if not self._commits:
            # Whole replicas (module docstring): every rank holds the same reduced sums, so every rank finds
            # the same NaN/Inf and takes the same branch without asking the others.
            if found is not None:
                return nonfinite.handle(self._worker, found, self._commit.control)
            return self._inner.step(*args, **kwargs)
        try:
            applied = self._commit.decide(plan.generation, plan.world_size, self._worker.step, found)
        except RuntimeError as error:  # the coordinator is gone: nobody can commit, so nobody does
            if not is_store_loss(error):
                raise
            raise Interrupted(f"commit of step {self._worker.step}: coordinator lost: {error}") from error
        if not applied:
            raise Interrupted(
                f"step {self._worker.step} of generation {plan.generation} aborted by the commit decision"
            )
        if self._commit.non_finite is not None:  # every rank takes this branch (the decision said so)
            return nonfinite.handle(self._worker, self._commit.non_finite, self._commit.control)
        return self._inner.step(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)
