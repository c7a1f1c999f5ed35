"""`oobleck launch`'s plan controller: the generation after a failure, an addition or a coordinator restart.

Later generations come from the planner's reconfiguration (`oobleck.planner.reconfigure`: Oobleck's
minimal-movement moves or a re-instantiation of generation 0's templates, degraded if fewer than f + 1
pipelines fit, priced by copy bytes / `copy_bandwidth` + iteration time), with a LayerCopy for every
layer a worker must hold but does not, from a survivor that reported holding it (`held/{worker}` in the
store): what workers report, not what the plan in force says, since a reconfiguration may have been
interrupted. With controller "layouts" it sees only plans, as the operator does, and the workers settle
the sources among themselves (runtime/elastic/sources.py).

Every generation comes from the planner's one next-generation function (planner_cy/nextgen.py). More
than f failures: when some layer has no surviving live replica, it rolls back: it picks the newest step whose every layer a survivor holds in its in-memory
snapshots or the checkpoint directory holds, and plans a generation with `restore_step` and a source
for every layer. Without any such step the job fails ("more than f failures; restore from a checkpoint").
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from oobleck.api.addresses import parse_worker_id, worker_id
from oobleck.planner.nextgen import lost_layers_message
from oobleck.runtime.backends.local.config import DEFAULT_COPY_BANDWIDTH
from oobleck.runtime.elastic.signing import NO_KEY, Signer

log = logging.getLogger("oobleck.launcher")


def _worker_holdings(holdings: dict[str, set[int]]) -> dict[tuple[str, int], frozenset[int]]:
    """The launcher's `node:gpu` worker names as the planner's (node, gpu) keys."""
    out = {}
    for worker, layers in holdings.items():
        out[parse_worker_id(worker)] = frozenset(layers)
    return out


def copy_plan(plan, holdings: dict[str, set[int]], state_bytes: list[int]):
    """LayerCopies so that every rank of `plan` holds its layers, taken from `holdings` (worker -> layers).

    The planner's copy plan (`oobleck.planner.reconfigure.layout_copies`) for a layout already fixed.
    Raises PlanningError naming the layers no worker holds.
    """
    from oobleck.planner.errors import PlanningError
    from oobleck.planner.reconfigure import LostLayersError, layout_copies

    try:
        return layout_copies(plan, _worker_holdings(holdings), state_bytes)
    except LostLayersError as error:
        raise PlanningError(lost_layers_message(error)) from error


def replan(
    previous,
    nodes: list[str],
    holdings: dict[str, set[int]],
    profile,
    *,
    lost: Sequence[str] = (),
    added: Sequence[str] = (),
    reason: str,
    bandwidth: float = DEFAULT_COPY_BANDWIDTH,
):
    """The generation after `previous` on `nodes` (its nodes less `lost`, plus `added`), with its copies.

    The planner's reconfiguration (minimal-movement moves or a re-instantiation of the same templates,
    whichever costs least) from what the survivors report holding (`holdings`, worker -> layers): a
    worker whose previous reconfiguration was interrupted may hold more or less than `previous` says.
    `profile` is the ModelProfile generation 0 was planned with, or just its per-layer state bytes.
    With nothing lost or added (a retry, a coordinator restart) the plan keeps the layout and
    `reason`; otherwise its reason names the planner's moves. Raises PlanningError (LostLayersError
    naming the layers no survivor holds; the job cannot continue without a checkpoint).
    """
    from oobleck.planner.errors import PlanningError
    from oobleck.planner.nextgen import next_generation
    from oobleck.planner.reconfigure import LostLayersError

    expected = [n for n in previous.nodes if n not in set(lost)] + [n for n in added if n not in previous.nodes]
    if sorted(nodes) != sorted(expected):
        raise PlanningError(f"nodes: {sorted(nodes)} is not the previous nodes less {list(lost)} plus {list(added)}")
    try:
        return next_generation(
            previous,
            profile,
            lost,
            added,
            reason=reason,
            holdings=_worker_holdings(holdings),
            bandwidth=bandwidth,
        )
    except LostLayersError as error:
        raise PlanningError(lost_layers_message(error)) from error


def layout_holdings(plan) -> dict[str, set[int]]:
    """What each worker holds once it has adopted `plan` (used when a worker has not reported)."""
    return {worker_id(a.node, a.gpu): set(range(a.start, a.end)) for a in plan.ranks}


def reported_layers(report: dict) -> set[int]:
    """The layers a worker's report says it holds live: whole ones and tensor-parallel shards alike. The
    planner places and prices layers, not shards; the generation's members then settle which shards are
    copied, or roll back when no complete set survives (runtime/elastic/shard_sources.py, sources.py)."""
    return set(report["layers"]) | {int(layer) for layer in report.get("shards", {})}


class JobFailed(RuntimeError):
    pass


class StepsDisagree(JobFailed):
    """Survivors hold layers at different steps and those at the newest do not hold every layer: only a
    rollback to a common snapshot can continue."""


def at_newest_step(holdings: dict[str, set[int]], steps: dict[str, int], num_layers: int) -> dict[str, set[int]]:
    """`holdings` (worker -> layers) as the next generation may copy from them, given the step each reporting
    worker holds (`steps`). When they disagree, only the workers at the newest step hold anything: the others
    are behind (a data-parallel rank that did not apply a step its replicas applied) and catch up by copy
    (runtime/elastic/sources.py). Raises StepsDisagree when the newest do not hold every layer."""
    held_at = {steps[w] for w, layers in holdings.items() if w in steps and layers}
    if len(held_at) <= 1:
        return holdings
    newest = max(held_at)
    current = {w: layers if steps.get(w) == newest else set() for w, layers in holdings.items()}
    if not set(range(num_layers)) <= set().union(*current.values()):
        raise StepsDisagree(
            f"survivors disagree on the step they hold ({sorted(held_at)}) and those at step {newest} "
            "do not hold every layer"
        )
    return current


class PlanController:
    """Plans the next generation from the survivors' reports in the store (see the module docstring).

    Collaborators: `store()` the coordinator's store now (it changes when the coordinator restarts),
    `alive(worker)` whether a worker's process runs, `trained()` whether any step has been trained."""

    def __init__(
        self,
        profile,
        *,
        store: Callable[[], Any],
        alive: Callable[[str], bool],
        trained: Callable[[], bool],
        checkpoint_path: str | Path | None,
        bandwidth: float = DEFAULT_COPY_BANDWIDTH,
        kind: str = "reports",
        signer: Signer = NO_KEY,
    ) -> None:
        self.profile = profile
        """generation 0's ModelProfile: the planner prices later generations' copies with it"""
        self.store, self.alive, self.trained = store, alive, trained
        self.checkpoint_path, self.bandwidth, self.kind = checkpoint_path, bandwidth, kind
        self.signer = signer
        """the job key's: the workers' reports are verified with it"""

    def next_plan(self, previous, *, lost: list[str], added: list[str], reason: str):
        """The generation after `previous` without the nodes `lost`, with the nodes `added`; JobFailed if none."""
        from oobleck.planner.errors import PlanningError
        from oobleck.planner.nextgen import WORKERS_CHOOSE, NoRestorePoint, next_generation

        survivors = [worker_id(a.node, a.gpu) for a in previous.ranks if a.node not in lost]
        plan_next = functools.partial(
            next_generation, previous, self.profile, lost, added, reason=reason, bandwidth=self.bandwidth
        )
        disagree: StepsDisagree | None = None
        try:
            if self.kind == "layouts":  # the operator's view: the members settle sources and rollbacks
                return plan_next(restorable=WORKERS_CHOOSE)
            try:
                if reason == "add":  # nobody leaves the generation before the new plan: use what they adopted
                    holdings = self._newest_holdings(previous, survivors)
                else:
                    holdings = self._holdings(previous, survivors, wait_s=3.0)
            except StepsDisagree as error:
                # The survivors at the newest step do not hold every layer: only a rollback can continue.
                disagree, holdings = error, {}
            restorable = self._restorable(previous, survivors)
            plan = plan_next(holdings=_worker_holdings(holdings), restorable=restorable, rollback=disagree is not None)
        except NoRestorePoint as error:
            cause = (
                f"{disagree}; no in-memory snapshot or checkpoint holds every layer at one step" if disagree else error
            )
            raise JobFailed(f"cannot plan generation {previous.generation + 1}: {cause}") from error
        except PlanningError as error:
            raise JobFailed(f"cannot plan generation {previous.generation + 1}: {error}") from error
        if plan.restore_step is not None:
            log.info("rollback: generation %d restores step %d (%s)", plan.generation, plan.restore_step, plan.reason)
        return plan

    def _restorable(self, previous, survivors: list[str]):
        """What a rollback may restore from: the survivors' snapshots as they reported them on leaving
        `previous` (frozen from then on), and the checkpoint directory."""
        from oobleck.planner.nextgen import Restorable
        from oobleck.runtime.elastic import keys
        from oobleck.runtime.snapshot.checkpoint_dir import checkpoint_holdings

        memory: dict[str, dict[int, set[int]]] = {}
        latest = None  # the newest step a survivor reached: older runs' checkpoints may lie in the directory
        for worker in survivors:
            report = keys.get_held(self.store(), worker, self.signer)
            if report is None:
                continue
            if report.get("generation") == previous.generation and report.get("phase") in ("left", "pending"):
                memory[worker] = {int(step): set(layers) for step, layers in report.get("snapshots", {}).items()}
                latest = max(latest or 0, report["step"])
        return Restorable(memory, checkpoint_holdings(self.checkpoint_path), latest)

    def _holdings(self, previous, survivors: list[str], wait_s: float) -> dict[str, set[int]]:
        """Survivors' layers as they report them on leaving `previous` (waiting up to `wait_s`).

        A survivor that reports "pending" was waiting for a step's commit decision when the
        coordinator was lost: once every survivor has reported, the decision is re-posted ("commit"
        if any survivor has applied that step) and the pending ones report again after following it.
        A survivor that has not reported leaving (a slow machine) is taken at its newest report (see
        `_newest_holdings`), never at the layout of a plan it may not have finished adopting.
        """
        from oobleck.runtime.elastic import keys

        generation = previous.generation
        deadline = time.monotonic() + wait_s
        hard_deadline = deadline + 10 * wait_s
        reposted = False
        while True:
            reports: dict[str, dict] = {}
            for worker in survivors:
                value = keys.get_held(self.store(), worker, self.signer)
                if (
                    value is not None
                    and value.get("generation") == generation
                    and value.get("phase") in ("left", "pending")
                ):
                    reports[worker] = value
            pending = {w: r for w, r in reports.items() if r["phase"] == "pending"}
            missing = [w for w in survivors if w not in reports]
            now = time.monotonic()
            # A survivor whose process runs will report (reconnecting to a recreated coordinator
            # can take several 5 s connection attempts on a loaded machine): wait for it longer.
            waiting = missing and now < hard_deadline and any(self.alive(w) for w in missing)
            if pending and not reposted and (not missing or (now > deadline and not waiting)):
                reposted = True
                step = next(iter(pending.values()))["step"]
                applied = any(r["phase"] == "left" and r["step"] == step + 1 for r in reports.values())
                verdict = keys.propose_decision(
                    self.store(), generation, step, "commit" if applied else "abort", self.signer
                )
                log.info("re-posted the lost commit decision of step %d: %s", step, verdict)
                deadline = max(deadline, time.monotonic() + wait_s)  # the pending ones report again
            elif (not missing and not pending) or (now > deadline and not waiting):
                break
            time.sleep(0.002)
        # A worker still pending was committing a step of this generation: it holds its layout.
        left = {w: r for w, r in reports.items() if r["phase"] == "left"}
        fallback = self._newest_holdings(previous, [w for w in survivors if w not in reports])
        layout = layout_holdings(previous)
        holdings = {
            w: reported_layers(left[w]) if w in left else layout.get(w, set()) if w in reports else fallback[w]
            for w in survivors
        }
        return at_newest_step(holdings, {w: r["step"] for w, r in reports.items()}, previous.num_layers)

    def _newest_holdings(self, previous, workers: list[str]) -> dict[str, set[int]]:
        """What `workers` hold by their newest report (`held/{worker}`, any generation or phase).

        Safe when that report is older than the plan in force: a worker frees layers only once an
        adoption has completed, and reports right after it, so an adoption interrupted since (a
        kill during a reconfiguration, a slow rendezvous) leaves it holding at least the reported
        layers. A worker that never reported holds nothing - unless no step has been trained yet,
        when every layer is a pure function of the seed and the plan's layout stands.
        """
        from oobleck.runtime.elastic import keys

        newest: dict[str, dict] = {}
        for worker in workers:
            value = keys.get_held(self.store(), worker, self.signer)
            if value is not None:
                newest[worker] = value
        layout = layout_holdings(previous)
        untrained = not self.trained()
        return {
            w: reported_layers(newest[w]) if w in newest else (layout.get(w, set()) if untrained else set())
            for w in workers
        }
