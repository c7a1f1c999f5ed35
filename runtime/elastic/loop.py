"""The elastic worker: train under the newest plan, and reconfigure in place when it changes.

This is the control loop around the execution engine (`oobleck.runtime.elastic.worker.Worker`):

    plan = newest plan containing this worker
    loop:
        watch(plan) -> adopt(plan)       groups under e{epoch}/{job}/gen{g}/, layer copies, frees
        train_step() until done          every step ends in a store-decided commit (below)
        on a failure (heartbeat, abort key, collective error, coordinator restart) or a newer plan:
            abandon() -> report holdings (held/{worker}) -> wait for the next plan -> adopt it
            -> redo the interrupted step (the step counter only advances on a committed step)

A newer plan interrupts like a failure, even one that only adds a node: ranks must leave a
generation after the same step, and the commit decision is what makes that step common. Data-parallel
ranks (each holding the whole model) skip the decision: one left a step behind its replicas takes its
layers from them as the next generation settles its sources (runtime/elastic/sources.py).

The step commit is `commit.StepCommit`.

One worker of `oobleck launch` runs as `python -m oobleck.runtime.backends.local.worker`; a pod's as
`python -m oobleck.runtime.backends.pod`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field

import torch.distributed as dist

from oobleck.api.addresses import parse_worker_id, worker_id
from oobleck.api.contract import ExitCode
from oobleck.api.plan import Plan
from oobleck.api.reports import FailureKind
from oobleck.runtime.causes import classify
from oobleck.runtime.elastic import keys
from oobleck.runtime.elastic.health import FailureDetector
from oobleck.runtime.elastic.plans import PlanSource, PlanWatcher
from oobleck.runtime.elastic.signing import job_signer
from oobleck.runtime.elastic.store import ControlStore, is_store_loss

log = logging.getLogger("oobleck.runtime.elastic.loop")


@dataclass(frozen=True)
class ElasticTimeouts:
    first_plan_s: float = 300.0
    """How long a starting worker waits for a plan that includes it (a joining node may wait long)."""
    next_plan_s: float = 120.0
    """How long a worker waits for the plan that follows a failure."""


@dataclass
class ElasticResult:
    steps: int
    generations: list[int] = field(default_factory=list)
    interruptions: int = 0
    exit_code: int = ExitCode.DONE
    """an oobleck.api.contract.ExitCode (the launcher and the pod read it)"""


def run_elastic(
    worker,
    source: PlanSource,
    detector: FailureDetector,
    control: ControlStore,
    steps: int,
    timeouts: ElasticTimeouts = ElasticTimeouts(),
) -> ElasticResult:
    """Train `worker` to `steps` global steps across plan generations (see the module docstring).
    Before every step it posts `progress/{worker}` (the local launcher's view of the job)."""
    me = worker_id(worker.node, worker.gpu)
    result = ElasticResult(steps=worker.step)
    signer = job_signer()
    if signer.enabled and getattr(worker, "metrics", None) is not None:
        signer.on_reject(worker.metrics.count_rejected)  # oobleck_worker_rejected_messages_total{kind}
    # A newer plan interrupts like a failure (backstop for the controller's abort key).
    watcher = PlanWatcher(source, signal=detector.failure).start()
    plan = _wait_for_plan(source, -1, me, timeouts.first_plan_s, joined=False)
    try:
        while plan is not None:
            if plan.rank_of(worker.node, worker.gpu) is None and worker.node in plan.benched:
                # Benched for its slowness (stragglers.mitigation spare): a spare until a plan takes it back.
                log.warning(json.dumps({"event": "benched", "worker": me, "generation": plan.generation}))
                worker.bench()
                detector.watch(-1, ())
                _publish_held(control, me, worker, generation=plan.generation, phase="left")  # holds nothing now
                plan = _wait_for_plan(source, plan.generation, me, timeouts.first_plan_s, joined=False)
                continue
            if plan.rank_of(worker.node, worker.gpu) is None:
                log.warning(json.dumps({"event": "dropped", "worker": me, "generation": plan.generation}))
                result.exit_code = ExitCode.DROPPED
                return result
            result.generations.append(plan.generation)
            watcher.adopt(plan.generation)  # first: the watcher must not flag this generation as newer
            _ensure_epoch(worker, control)
            # The epoch tells the detector that a coordinator restart it notices later is older news.
            detector.watch(plan.generation, [worker_id(a.node, a.gpu) for a in plan.ranks], epoch=control.epoch)
            interrupted = False
            try:
                _train_generation(plan, worker, control, me, detector, steps)
            except RuntimeError as error:
                _interrupted(error, detector, me, plan.generation, worker.step)
                interrupted = True
                result.interruptions += 1
            result.steps = worker.step
            if worker.step >= steps and not interrupted:
                _quietly(control, lambda store: keys.set_progress(store, me, plan.generation, worker.step, "done"))
                return result
            worker.abandon()
            _ensure_epoch(worker, control)  # after a coordinator loss the report must reach the new one
            _publish_held(control, me, worker, generation=plan.generation, phase="left")
            plan = _wait_for_plan(source, plan.generation, me, timeouts.next_plan_s, joined=True)
        result.exit_code = ExitCode.NO_PLAN
        return result
    finally:
        watcher.stop()


def _train_generation(
    plan: Plan, worker, control: ControlStore, me: str, detector: FailureDetector, steps: int
) -> None:
    """Settle the generation's copy sources, adopt it and train until `steps` (or a RuntimeError ends it)."""
    adopt_started = time.time()
    plan = _settle_sources(plan, worker, control, me, detector)
    worker.adopt(plan)
    # Timestamped (wall clock) so that recovery can be split into its parts across processes.
    log.info(
        json.dumps(
            {
                "event": "generation-ready",
                "worker": me,
                "generation": plan.generation,
                "step": worker.step,
                "adopt_started": adopt_started,
                "time": time.time(),
            }
        )
    )
    _publish_held(control, me, worker)
    detector.ready()
    while worker.step < steps:
        keys.set_progress(control.store, me, plan.generation, worker.step, "step")
        outcome = worker.train_step()
        if outcome.loss is not None and not worker.logs_loss:
            _append_loss(worker, outcome)


def _interrupted(error: RuntimeError, detector: FailureDetector, me: str, generation: int, step: int) -> None:
    """A generation ended by `error`: make sure every member leaves it too (or re-raise a job's own error)."""
    from oobleck.runtime.train.groups import CommError, Interrupted

    if classify(error) is not None:
        raise error  # out of memory, a CUDA error: the job's (runtime/causes.py), not a peer's
    # Interrupted / CommError, a lost coordinator, or a rendezvous that failed (gloo raises plain
    # RuntimeErrors there): all end this generation, none ends the worker.
    if not isinstance(error, (Interrupted, CommError)):
        kind = FailureKind.COORDINATOR_LOST if is_store_loss(error) else FailureKind.RENDEZVOUS
        detector.trigger(kind, (), str(error)[:500])
    if isinstance(error, CommError):
        detector.signal(error.__cause__ or error)
        if not detector.failure.is_set():  # not a peer loss: still a failure of this generation
            detector.trigger(FailureKind.COLLECTIVE, (), str(error))
    log.warning(
        json.dumps(
            {"event": "interrupted", "worker": me, "generation": generation, "step": step, "error": str(error)[:300]}
        )
    )


def _settle_sources(plan: Plan, worker, control: ControlStore, me: str, detector: FailureDetector) -> Plan:
    """`plan` with copies that the members' actual holdings can serve (runtime/elastic/sources.py).

    Every member posts what it holds and waits for the others, so each computes the same plan: the
    proposal when sound, else the copies (or a rollback) recomputed from the records. Interrupted
    or timed out like any rendezvous of the generation (a RuntimeError ends the generation)."""
    from oobleck.runtime.elastic.sources import Holding, catch_up_step, exchange, resolve
    from oobleck.runtime.snapshot.checkpoint_dir import checkpoint_holdings
    from oobleck.runtime.train.groups import Interrupted

    snapshots = worker.snapshots
    mine = Holding(
        step=worker.step,
        layers=tuple(worker.live_layers()),
        shards=worker.live_shards(),
        started=worker.started,
        snapshots={int(k): tuple(v) for k, v in snapshots.store.holdings().items()} if snapshots is not None else {},
        checkpoint={k: tuple(sorted(v)) for k, v in checkpoint_holdings(worker.config.checkpoint.path).items()},
    )
    timeout = max(worker.config.timeouts.connect, worker.config.timeouts.step)
    try:
        holdings = exchange(control.store, plan, me, mine, detector.failure, timeout)
    except InterruptedError as error:
        raise Interrupted(str(error)) from error
    except TimeoutError as error:
        raise RuntimeError(str(error)) from error
    settled = resolve(plan, holdings, worker.layer_state_bytes())  # Unrecoverable ends the worker
    behind = catch_up_step(settled, holdings, me)
    if behind is not None:
        worker.catch_up(behind)
    if settled is not plan:
        log.warning(
            json.dumps(
                {
                    "event": "sources-resolved",
                    "worker": me,
                    "generation": plan.generation,
                    "restore_step": settled.restore_step,
                    "copies": len(settled.copies),
                }
            )
        )
    return settled


def _append_loss(worker, outcome) -> None:
    """Every rank that knows the step's loss records it (the worker's designated logger may die
    right after the step's commit); the launcher merges the records and checks they agree."""
    if worker.losses_path is None:
        return
    record = {
        "job": worker.config.job,
        "rank": worker.rank,
        **asdict(outcome),
        "time": time.time(),
        "cpu": time.process_time(),  # as Worker._append_loss
    }
    with open(worker.losses_path, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def _wait_for_plan(source: PlanSource, after: int, me: str, timeout_s: float, joined: bool) -> Plan | None:
    """The newest plan after generation `after`; a worker that has not joined yet waits to be in one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        plan = source.wait_newer(after, deadline - time.monotonic())
        if plan is None:
            return None
        node, gpu = parse_worker_id(me)
        if joined or plan.rank_of(node, gpu) is not None:
            return plan
        after = plan.generation  # not for us (yet): a later generation will add this node
    return None


def _ensure_epoch(worker, control: ControlStore) -> None:
    """After a coordinator restart, rendezvous through a new connection under the new epoch's prefix."""
    try:
        keys.current_generation(control.store)  # a cheap round trip: is the connection alive?
    except RuntimeError as error:
        if not is_store_loss(error):
            raise
        control.reconnect()
    if worker.epoch != control.epoch:
        # Group names must not repeat within a store incarnation, and a new incarnation may have
        # seen half of a rendezvous: the epoch in the prefix makes every name new.
        worker.store = dist.PrefixStore(keys.epoch_prefix(control.epoch), control.store)
        worker.epoch = control.epoch


def _quietly(control: ControlStore, action) -> None:
    """Best-effort bookkeeping: a lost coordinator must not turn a finished step into a crash."""
    try:
        action(control.store)
    except RuntimeError as error:
        if not is_store_loss(error):
            raise


def _publish_held(
    control: ControlStore, me: str, worker, generation: int | None = None, phase: str = "adopted"
) -> None:
    """phase "adopted": after joining `generation`; "left": after leaving it (final for that generation)."""
    generation = worker.plan.generation if generation is None and worker.plan is not None else generation
    value = {"generation": generation, "step": worker.step, "layers": worker.live_layers(), "phase": phase}
    value["shards"] = {str(layer): list(sharding) for layer, sharding in worker.live_shards().items()}
    snapshots = worker.snapshots
    if snapshots is not None:
        # What a rollback may restore from (frozen while the worker is between generations), and
        # where its buddy pushes (runtime/snapshot/agent.py).
        value |= {"snapshots": snapshots.store.holdings(), "snapshot_address": snapshots.address}
    _quietly(control, lambda store: keys.set_held(store, me, value))
