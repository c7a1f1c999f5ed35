"""The elastic worker: train under the newest plan, and reconfigure in place when it changes.

This is the control loop around the execution engine (`oobleck.runtime.worker.Worker`):

    plan = newest plan containing this worker
    loop:
        watch(plan) -> adopt(plan)       groups under e{epoch}/{job}/gen{g}/, layer copies, frees
        train_step() until done          every step ends in a store-decided commit (below)
        on a failure (heartbeat, abort key, collective error, coordinator restart) or a newer plan:
            abandon() -> report holdings (held/{worker}) -> wait for the next plan -> adopt it
            -> redo the interrupted step (the step counter only advances on a committed step)

A newer plan interrupts like a failure, even one that only adds a node: ranks must leave a
generation after the same step, and the commit decision is what makes that step common.

Commit: a global step must be applied by every rank or by none, otherwise replicas of a layer
diverge (a rank whose gradient sum completed would update while a neighbour, interrupted a moment
earlier, would not). So before the optimizer update each rank arrives at
`gen{g}/commit/{step}/arrived`; the rank that completes the count writes "commit" to
`.../decision`, a rank that sees the failure Event first writes "abort" (compare-and-set: the first
writer wins) and everyone follows the decision. Arriving means "my gradient sums completed", so a
commit is safe even if some rank dies right after it. The hook is the optimizer's `step` (the
engine calls it right after the sums and before touching any state).

Run one worker: `python -m oobleck.runtime.reconfig --config C --plan-file P --store H:P --node N --gpu G`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from oobleck.api.contract import ExitCode
from oobleck.api.plan import Plan
from oobleck.runtime import coordinator as keys
from oobleck.runtime.causes import JobFault, classify
from oobleck.runtime.coordinator import StoreTimeouts, connect, is_store_loss, worker_id
from oobleck.runtime.health import FailureDetector, HealthTimeouts
from oobleck.runtime.plansource import FilePlanSource, PlanSource, PlanWatcher

log = logging.getLogger("oobleck.runtime.reconfig")


class ControlStore:
    """The main thread's connection to the coordinator; replaced after a coordinator restart."""

    def __init__(self, host: str, port: int, timeouts: StoreTimeouts = StoreTimeouts()) -> None:
        self.address = (host, port)
        self.timeouts = timeouts
        self.store, self.epoch = connect(host, port, timeouts)

    def reconnect(self) -> None:
        self.store, self.epoch = connect(*self.address, self.timeouts)


NON_FINITE_MARK = 1 << 24
"""Added to a commit's arrival count by a rank that found a NaN/Inf (world sizes stay far below it)."""
COMMIT_NON_FINITE = "commit-nonfinite"
"""The decision when some rank found a NaN/Inf: every rank applies the job's policy (runtime/nonfinite.py)."""


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
    next generation's members see the disagreement and roll back (runtime/resolve.py), never mix.
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
        decision = prefix + "decision"
        if non_finite is not None:  # the slow path only: the detail first, then the marked arrival
            store.compare_set(prefix + "nonfinite", "", non_finite)
        arrived = store.add(prefix + "arrived", 1 + (NON_FINITE_MARK if non_finite is not None else 0))
        count, marked = arrived % NON_FINITE_MARK, arrived >= NON_FINITE_MARK
        if count == world_size:
            # The last arrival decides: compare_set's reply is the decision in force ("commit", or an
            # "abort" posted first), so waiting for the key and reading it back would only add two
            # round trips to the step's critical path (every other rank is waiting on this one).
            # A marked count carries "some rank saw NaN/Inf" at no extra round trip.
            value = store.compare_set(decision, "", COMMIT_NON_FINITE if marked else "commit").decode()
            if world_size == 1:
                self._collect(store, generation, step - 2)
            return self._read(store, prefix, value)
        if count == 1:
            # The first arrival waits for the others anyway: it drops old keys meanwhile.
            self._collect(store, generation, step - 2)
        while True:
            if self.failed.is_set():
                # compare_set returns the value in force: ours if we were first, else the winner's.
                return self._read(store, prefix, store.compare_set(decision, "", "abort").decode())
            try:
                store.wait([decision], datetime.timedelta(seconds=self.poll_s))
                return self._read(store, prefix, store.get(decision).decode())
            except RuntimeError as error:
                if is_store_loss(error):
                    raise
                # A wait timeout: look at the failure Event again.

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
        store.set(
            keys.held_key(self.worker),
            json.dumps({"generation": generation, "step": step, "layers": [], "phase": "pending"}),
        )
        decision = keys.commit_prefix(generation, step) + "decision"
        began = time.monotonic()
        while not store.check([decision]):
            waited = time.monotonic() - began
            if waited > self.recover_timeout_s:
                raise RuntimeError(f"commit of step {step}: no decision within {self.recover_timeout_s:.0f} s")
            if waited > self.self_decide_s:
                store.compare_set(
                    decision, "", "commit" if self._applied_by_a_peer(store, generation, step) else "abort"
                )
            else:
                time.sleep(self.poll_s)
        return self._read(store, keys.commit_prefix(generation, step), store.get(decision).decode())

    def _applied_by_a_peer(self, store, generation: int, step: int) -> bool:
        """Whether a member reported leaving `generation` with `step` applied (its next step is step + 1)."""
        for member in self.members:
            if member != self.worker and store.check([keys.held_key(member)]):
                report = json.loads(store.get(keys.held_key(member)))
                if (
                    report.get("generation") == generation
                    and report.get("phase") == "left"
                    and report.get("step") == step + 1
                ):
                    return True
        return False


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
    progress: bool = True,
) -> ElasticResult:
    """Train `worker` to `steps` global steps across plan generations (see the module docstring).

    `progress`: post `progress/{worker}` before every step (the launcher's view of the job); False
    only to measure what it costs (bench/overhead.py)."""
    from oobleck.runtime.groups import CommError, Interrupted

    me = worker_id(worker.node, worker.gpu)
    result = ElasticResult(steps=worker.step)
    # A newer plan interrupts like a failure (backstop for the controller's abort key).
    watcher = PlanWatcher(source, signal=detector.failure).start()
    plan = _wait_for_plan(source, -1, me, timeouts.first_plan_s, joined=False)
    try:
        while plan is not None:
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
                    if progress:
                        keys.set_progress(control.store, me, plan.generation, worker.step, "step")
                    outcome = worker.train_step()
                    if outcome.loss is not None and not worker.logs_loss:
                        _append_loss(worker, outcome)
            except RuntimeError as error:
                if classify(error) is not None:
                    raise  # out of memory, a CUDA error: the job's (runtime/causes.py), not a peer's
                # Interrupted / CommError, a lost coordinator, or a rendezvous that failed (gloo
                # raises plain RuntimeErrors there): all end this generation, none ends the worker.
                if not isinstance(error, (Interrupted, CommError)):
                    detector.trigger("coordinator-lost" if is_store_loss(error) else "rendezvous", (), str(error)[:500])
                interrupted = True
                result.interruptions += 1
                if isinstance(error, CommError):
                    detector.signal(error.__cause__ or error)
                    if not detector.failure.is_set():  # not a peer loss: still a failure of this generation
                        detector.trigger("collective", (), str(error))
                log.warning(
                    json.dumps(
                        {
                            "event": "interrupted",
                            "worker": me,
                            "generation": plan.generation,
                            "step": worker.step,
                            "error": str(error)[:300],
                        }
                    )
                )
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


def _settle_sources(plan: Plan, worker, control: ControlStore, me: str, detector: FailureDetector) -> Plan:
    """`plan` with copies that the members' actual holdings can serve (runtime/resolve.py).

    Every member posts what it holds and waits for the others, so each computes the same plan: the
    proposal when sound, else the copies (or a rollback) recomputed from the records. Interrupted
    or timed out like any rendezvous of the generation (a RuntimeError ends the generation)."""
    from oobleck.runtime.checkpoint import checkpoint_holdings
    from oobleck.runtime.groups import Interrupted
    from oobleck.runtime.resolve import Holding, exchange, resolve

    snapshots = worker.snapshots
    mine = Holding(
        step=worker.step,
        layers=tuple(sorted(worker.layers)),
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
    record = {"job": worker.config.job, "rank": worker.rank, **asdict(outcome), "time": time.time()}
    with open(worker.losses_path, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def _wait_for_plan(source: PlanSource, after: int, me: str, timeout_s: float, joined: bool) -> Plan | None:
    """The newest plan after generation `after`; a worker that has not joined yet waits to be in one."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        plan = source.wait_newer(after, deadline - time.monotonic())
        if plan is None:
            return None
        node, gpu = me.rsplit(":", 1)
        if joined or plan.rank_of(node, int(gpu)) is not None:
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
    value = {"generation": generation, "step": worker.step, "layers": sorted(worker.layers), "phase": phase}
    snapshots = worker.snapshots
    if snapshots is not None:
        # What a rollback may restore from (frozen while the worker is between generations), and
        # where its buddy pushes (runtime/snapshot.py).
        value |= {"snapshots": snapshots.store.holdings(), "snapshot_address": snapshots.address}
    _quietly(control, lambda store: store.set(keys.held_key(me), json.dumps(value)))


def _address(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"--store: expected HOST:PORT, got {value!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m oobleck.runtime.reconfig", description="one elastic training worker"
    )
    parser.add_argument("--config", required=True, help="worker config (JSON or YAML)")
    parser.add_argument("--plan-file", required=True, help="plan JSON the controller replaces atomically")
    parser.add_argument("--store", type=_address, default=os.environ.get("OOBLECK_STORE"), help="coordinator HOST:PORT")
    parser.add_argument("--node", default=os.environ.get("OOBLECK_NODE"), required="OOBLECK_NODE" not in os.environ)
    parser.add_argument("--gpu", type=int, default=int(os.environ.get("OOBLECK_GPU", "0")))
    parser.add_argument("--steps", type=int, default=None, help="override config.steps")
    parser.add_argument("--losses", default=None, help="append per-step global losses here (JSON lines)")
    parser.add_argument("--dump", default=None, help="write the final parameters of held layers here (torch.save)")
    parser.add_argument("--heartbeat-period", type=float, default=HealthTimeouts.heartbeat_period_s)
    parser.add_argument("--dead-after", type=float, default=HealthTimeouts.dead_after_s)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.store is None:
        parser.error("--store: required (or OOBLECK_STORE)")

    from oobleck.runtime.config import load_config
    from oobleck.runtime.worker import Worker

    try:
        config = load_config(args.config)
        health = HealthTimeouts(heartbeat_period_s=args.heartbeat_period, dead_after_s=args.dead_after)
    except (OSError, ValueError) as error:
        print(f"oobleck elastic worker: {error}", file=sys.stderr)
        return 2
    host, port = args.store
    store_timeouts = StoreTimeouts()
    me = worker_id(args.node, args.gpu)
    detector = FailureDetector(config.job, me, host, port, timeouts=health, store_timeouts=store_timeouts).start()
    control = ControlStore(host, port, store_timeouts)
    from oobleck.runtime.snapshot import snapshotter_for

    worker = Worker(
        config,
        dist.PrefixStore(keys.epoch_prefix(control.epoch), control.store),
        args.node,
        args.gpu,
        failed=detector.failure,
        losses_path=args.losses,
        commit=StepCommit(control, detector.failure, worker=me),
        snapshots=snapshotter_for(config, me, lambda: connect(host, port, store_timeouts)[0], host),
        epoch=control.epoch,
    )
    from oobleck.runtime.resolve import Unrecoverable

    try:
        result = run_elastic(
            worker,
            FilePlanSource(args.plan_file),
            detector,
            control,
            config.steps if args.steps is None else args.steps,
        )
    except Unrecoverable as error:
        log.error(json.dumps({"event": "unrecoverable", "worker": me, "error": str(error)}))
        detector.trigger("unrecoverable", (), str(error))
        return ExitCode.UNRECOVERABLE
    except JobFault as error:  # the job's own (runtime/causes.py): the launcher fails the job with it
        log.error(json.dumps({"event": "cause", "worker": me, "error": str(error)}))
        return error.cause.exit_code
    finally:
        detector.stop()
    if worker.snapshots is not None and result.exit_code == ExitCode.DONE:
        worker.snapshots.wait_idle(60.0)  # the last checkpoint files (a push to a buddy gone already just fails)
    if result.exit_code == ExitCode.DONE:
        worker.final_export()
    if args.dump and result.exit_code == ExitCode.DONE:
        torch.save(worker.layer_state(), args.dump)
    log.info(
        json.dumps(
            {
                "event": "exit",
                "worker": me,
                "steps": result.steps,
                "generations": result.generations,
                "interruptions": result.interruptions,
                "code": result.exit_code,
                "snapshots": worker.snapshots.stats if worker.snapshots is not None else None,
            }
        )
    )
    return result.exit_code


if __name__ == "__main__":
    code = main()
    # Abandoned generations may leave gloo threads blocked on dead peers (groups.GRAVEYARD); a normal
    # interpreter teardown would destroy them and abort ("terminate called without an active
    # exception"). Everything this worker owes is written: leave without running destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
