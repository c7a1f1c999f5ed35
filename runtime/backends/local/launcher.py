"""`oobleck launch`: a whole elastic job on one machine, without Kubernetes.

The launcher plays the parts the operator and the cluster play in production:
- it hosts the coordinator (runtime/elastic/coordinator.py: the rendezvous store, heartbeats, abort keys,
  failure queue), and for tests loses and recreates it (`--restart-coordinator-at-step`);
- it supervises one worker process per (node, GPU) (runtime/backends/local/children.py): a worker's exit,
  a failure report in the store or an abort gathers the dead for a short settle window;
- it publishes each generation atomically to the plan file the workers watch; the next generation
  comes from the plan controller (runtime/backends/local/plan_control.py), generation 0 from the planner;
- it injects faults (runtime/backends/local/faults.py: SIGKILL workers at step K) and adds nodes at step K
  (their workers start with the job and wait outside every plan until then);
- it sums the run up (runtime/backends/local/summary.py). Options: runtime/backends/local/config.py; the command
  line: runtime/backends/local/cli.py.
Every child dies with the launcher: each is a fork of the launcher's preloaded server (forkserver.py) in a
process group of its own with PR_SET_PDEATHSIG=SIGKILL, the server ends with the launcher, and the launcher
kills every group on exit, Ctrl-C included.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from oobleck.api.addresses import parse_worker_id, worker_id
from oobleck.api.causes import KIND_OF_EXIT
from oobleck.api.contract import ExitCode
from oobleck.api.reports import FailureKind, FailureReport
from oobleck.runtime.backends.local.children import Child, spawn_worker
from oobleck.runtime.backends.local.config import Fault, LaunchOptions, config_from_options, initial_plan, load_profile
from oobleck.runtime.backends.local.faults import FaultInjector
from oobleck.runtime.backends.local.forkserver import TRANSFORMERS_PRELOAD, WORKER_PRELOAD, start_server
from oobleck.runtime.backends.local.plan_control import JobFailed, PlanController
from oobleck.runtime.backends.local.summary import Reconfiguration, Summary, reconfiguration, summarize
from oobleck.runtime.elastic.signing import NO_KEY, Signer, write_key

__all__ = ["Fault", "JobFailed", "LaunchOptions", "Launcher", "Summary"]

log = logging.getLogger("oobleck.launcher")


class Launcher:
    """Runs one local job to completion (see the module docstring)."""

    def __init__(self, options: LaunchOptions) -> None:
        self.options = options
        self.workdir = Path(options.workdir).resolve()
        self.plan_path = self.workdir / "plan.json"
        self.children: dict[str, Child] = {}
        self.reconfigurations: list[Reconfiguration] = []
        # Set by run(): the plan in force, the coordinator and a client of its store, the controller.
        self.plan: Any = None
        self.coordinator: Any = None
        self.store: Any = None
        self.controller: Any = None
        self.faults = FaultInjector(options.faults, self.children)
        self.failure_log: list[dict] = []  # every failure report that led to a reconfiguration
        self.reports: list = []
        self.key_path = self.workdir / "job.key"
        self.signer = NO_KEY
        """the job key's (set by run): what the launcher posts is sealed, what it reads verified"""
        self.preload: tuple[str, ...] = WORKER_PRELOAD
        """what the workers' forkserver imports (set by run: transformers too for such a model)"""

    def _spawn(self, node: str, gpu: int) -> Child:
        o = self.options
        child = spawn_worker(
            self.workdir,
            self.plan_path,
            self.coordinator.port,
            node,
            gpu,
            o.heartbeat_period_s,
            o.dead_after_s,
            key_path=self.key_path,
            preload=self.preload,
        )
        self.children[child.worker] = child
        return child

    def _trained(self) -> bool:
        """Whether any worker has logged a step's loss."""
        return any(c.losses_path.exists() and c.losses_path.stat().st_size for c in self.children.values())

    def _reconfigure(
        self,
        *,
        lost: list[str],
        added: list[str],
        reason: str,
        kill_at: float | None = None,
        detected_at: float | None = None,
    ) -> None:
        """Plan the next generation, publish it and note it for the summary."""
        plan = self.controller.next_plan(self.plan, lost=lost, added=added, reason=reason)
        self._publish(plan)
        self.reconfigurations.append(reconfiguration(plan, reason, lost, added, kill_at, detected_at))

    def _publish(self, plan) -> None:
        from oobleck.runtime.backends.local.plan_file import write_plan
        from oobleck.runtime.elastic import keys

        write_plan(self.plan_path, plan)
        keys.set_generation(self.store, plan.generation)
        if self.plan is not None:
            # Every worker leaves the old generation after the same step: a step in flight is
            # aborted for all (the commit decision is common), then redone under the new plan.
            keys.post_abort(
                self.store,
                self.plan.generation,
                {"kind": FailureKind.NEW_GENERATION, "generation": plan.generation},
                members=[worker_id(a.node, a.gpu) for a in self.plan.ranks],
                signer=self.signer,
            )
        self.plan = plan
        log.info(
            "published generation %d (%s): %d pipelines %s, %d copies",
            plan.generation,
            plan.reason,
            len(plan.pipelines),
            [[(s.start, s.end) for s in p.stages] for p in plan.pipelines],
            len(plan.copies),
        )

    def run(self) -> Summary:
        from oobleck.runtime.elastic.coordinator import Coordinator

        started = time.monotonic()
        o = self.options
        self.workdir.mkdir(parents=True, exist_ok=True)
        # A fresh job key per run, handed to the workers as a 0600 file (a pod gets it from a Secret).
        self.signer = Signer(write_key(str(self.key_path)))
        for stale in self.workdir.glob("*.losses.jsonl"):
            stale.unlink()
        config = config_from_options(o)
        (self.workdir / "config.json").write_text(config.model_dump_json(indent=2))
        # The workers' forkserver imports torch (and transformers for such a model) while this process plans.
        self.preload = (*WORKER_PRELOAD, *(TRANSFORMERS_PRELOAD if config.model.transformers is not None else ()))
        start_server(self.preload)
        profile = load_profile(o, config)
        from oobleck.runtime.train.config import build_model

        layers = build_model(config).num_layers
        if len(profile.layers) != layers:
            raise ValueError(f"profile: has {len(profile.layers)} layers, model {config.model.name!r} has {layers}")
        self.controller = PlanController(
            profile,  # generation 0's: the planner prices later generations' copies with it
            store=lambda: self.store,
            alive=lambda worker: self.children[worker].alive(),
            trained=self._trained,
            checkpoint_path=config.checkpoint.path,
            bandwidth=o.copy_bandwidth,
            kind=o.controller,
            signer=self.signer,
        )
        self.coordinator = Coordinator("127.0.0.1").start()
        self.store = self.coordinator.store()
        error = ""
        try:
            nodes = [f"node{i}" for i in range(o.nodes)]
            self._publish(initial_plan(o, profile, nodes))
            for assignment in self.plan.ranks:
                self._spawn(assignment.node, assignment.gpu)
            self._supervise(started)
        except JobFailed as failure:
            error = str(failure)
        except KeyboardInterrupt:
            error = "interrupted"
        finally:
            for child in self.children.values():
                child.kill()
            for child in self.children.values():
                child.code = child.process.wait() if child.code is None else child.code
            self.coordinator.stop()
        return summarize(
            self.children,
            self.plan,
            self.reconfigurations,
            self.failure_log,
            o.steps,
            error,
            time.monotonic() - started,
            str(self.workdir),
        )

    def _supervise(self, started: float) -> None:
        from oobleck.runtime.elastic import keys

        o = self.options
        restart_at = o.restart_coordinator_at_step
        additions = sorted(o.add_node_at_step)
        # Nodes to add are started with the job (a provisioned node; torch takes seconds to import)
        # and wait, outside every plan, until the controller adds them at their step.
        spares = [f"node{o.nodes + i}" for i in range(len(additions))]
        for node in spares:
            for gpu in range(o.gpus_per_node):
                self._spawn(node, gpu)
        self.reports = []
        while True:
            if time.monotonic() - started > o.timeout_s:
                raise JobFailed(f"timeout: the job did not finish within {o.timeout_s:.0f} s")
            in_plan = {worker_id(a.node, a.gpu) for a in self.plan.ranks}
            exited = self._reap()
            progress = keys.get_progress(self.store, sorted(in_plan))
            finished = [
                w
                for w in in_plan
                if self.children[w].code == ExitCode.DONE or progress.get(w, {}).get("phase") == "done"
            ]
            if finished:
                # The last step is committed (a worker only exits 0 after it): wait for the others to
                # exit; failures after that point (a peer dying on its way out) change nothing.
                if all(self.children[w].code is not None for w in in_plan):
                    return
                time.sleep(0.01)
                continue
            self.reports += [FailureReport.model_validate(r) for r in keys.pop_failures(self.store, self.signer)]
            unexpected = [w for w, code in exited if code not in (ExitCode.DONE, ExitCode.DROPPED) and w in in_plan]
            if o.detect_exits and unexpected:
                self._on_failure(unexpected)
                continue
            if keys.aborted(self.store, self.plan.generation, self.signer) or any(
                r.generation == self.plan.generation for r in self.reports
            ):
                self._on_failure([])
                continue
            step = max((p["step"] for p in progress.values()), default=0)
            self.faults.inject(self.plan, progress)
            if restart_at is not None and step >= restart_at:
                restart_at = None
                self._restart_coordinator()
                continue
            if (
                spares
                and step >= additions[0]
                and self.store.check([keys.heartbeat_key(f"{spares[0]}:{g}") for g in range(o.gpus_per_node)])
            ):
                additions.pop(0)
                self._reconfigure(lost=[], added=[spares.pop(0)], reason="add")
                continue
            if not any(c.code is None for c in self.children.values()):
                raise JobFailed("every worker exited before the job finished")
            # Each pass costs the coordinator ~5 store round trips, which the workers' steps feel
            # (measured: +4.7 % per step at a 5 ms period). Poll finely only while a fault is to be
            # injected at a precise moment; the workers themselves detect failures without us.
            time.sleep(0.005 if self.faults.pending or restart_at is not None or spares else 0.02)

    def _restart_coordinator(self, outage_s: float = 0.5) -> None:
        """Lose the store (every key with it) and recreate it on the same port; then re-plan.

        The workers' groups survive the outage; their clients reconnect, see the new epoch and
        leave the generation; the next generation rendezvouses under the new epoch's prefix.
        """
        from oobleck.runtime.elastic import keys
        from oobleck.runtime.elastic.coordinator import Coordinator

        port = self.coordinator.port
        self.coordinator.stop()
        lost_at = time.time()
        time.sleep(outage_s)
        self.coordinator = Coordinator("127.0.0.1", port).start()
        self.store = self.coordinator.store()
        keys.set_generation(self.store, self.plan.generation)
        log.info("coordinator restarted on port %d (epoch %s)", port, self.coordinator.epoch)
        self._reconfigure(lost=[], added=[], reason="coordinator-restart", kill_at=lost_at)

    def _reap(self) -> list[tuple[str, int]]:
        """Workers that exited since the last call; a worker that found a layer unrecoverable ends the job."""
        exited = []
        for child in self.children.values():
            if child.code is None and (code := child.process.poll()) is not None:
                child.code = code
                exited.append((child.worker, code))
                log.info("worker %s exited with %s", child.worker, code)
                if code == ExitCode.UNRECOVERABLE:
                    raise JobFailed(f"{child.worker}: {child.last_error()}")
                if code in KIND_OF_EXIT:  # a failure of the job itself (oobleck.api.causes): it would repeat anywhere
                    raise JobFailed(f"{child.worker}: {KIND_OF_EXIT[code]}: {child.last_error()}")
        return exited

    def _on_failure(self, exited: list[str]) -> None:
        """Gather who is dead for a short settle window, then publish the next generation."""
        from oobleck.runtime.elastic import keys

        o = self.options
        generation = self.plan.generation
        in_plan = {worker_id(a.node, a.gpu) for a in self.plan.ranks}
        dead = set(exited)
        suspects: set[str] = set()  # named by a heartbeat verdict only: confirmed below
        exit_seen = time.time() if exited else None
        reports: list[FailureReport] = []
        if exited:
            keys.post_abort(
                self.store,
                generation,
                {"kind": FailureKind.PROCESS_EXIT, "dead": sorted(exited)},
                members=in_plan,
                signer=self.signer,
            )
        first_signal = time.monotonic()
        deadline = first_signal + o.dead_after_s + 1.0
        while True:
            self.reports += [FailureReport.model_validate(r) for r in keys.pop_failures(self.store, self.signer)]
            for report in self.reports:
                if report.generation == generation:
                    reports.append(report)
                    named = {d for d in report.dead if d in in_plan}
                    (suspects if report.kind == FailureKind.HEARTBEAT else dead).update(named)
            self.reports = []
            if self._reap() and exit_seen is None:
                exit_seen = time.time()  # a peer's report came first; the exit is a signal all the same
            if o.detect_exits:  # an exited worker is dead, and so is one this launcher SIGKILLed (a fault)
                dead.update(
                    w
                    for w in in_plan
                    if self.children[w].code not in (None, 0) or self.children[w].killed_at is not None
                )
            now = time.monotonic()
            if (dead or suspects) and now - first_signal >= o.settle_s:
                break
            if now > deadline:
                break  # nobody identified: a transient error; redo the generation on the same nodes
            time.sleep(0.005)
        dead |= self._confirm_silent(suspects - dead)
        self.failure_log += [r.model_dump(mode="json") for r in reports]
        for worker in dead:  # fence: a worker declared dead must not come back
            self.children[worker].kill()
        kill_at = self.faults.first_kill(dead)
        # When the failure was first known: a report naming the dead, else any report of the generation (a
        # peer that saw its link break may not know whom it lost), or the process exit.
        naming = [r.detected_at for r in reports if set(r.dead) & dead] or [r.detected_at for r in reports]
        detected = min(naming + ([exit_seen] if exit_seen else []), default=None)
        lost_nodes = sorted({parse_worker_id(w)[0] for w in dead})
        self._reconfigure(
            lost=lost_nodes, added=[], reason="lost" if dead else "retry", kill_at=kill_at, detected_at=detected
        )

    def _confirm_silent(self, suspects: set[str]) -> set[str]:
        """Those of `suspects` (workers a peer found silent) that are really dead.

        A heartbeat verdict cannot tell a dead worker from one starved of CPU (a loaded machine can
        hold a process off the CPU for over a second). The controller knows more: a worker whose
        process exited is dead; one whose process runs must beat again within the confirmation
        window (two verdict periods) to be spared, else it is hung and dead. Without exit detection
        (`--heartbeats-only`, which measures the heartbeat path alone) verdicts are taken as they are.
        A spared worker simply joins the next generation: the interrupted step is redone by all.
        """
        from oobleck.runtime.elastic import keys

        o = self.options
        if not o.detect_exits or not suspects:
            return suspects
        dead = {w for w in suspects if not self.children[w].alive()}
        alive = sorted(suspects - dead)
        if not alive:
            return dead
        read = lambda: self.store.multi_get([keys.heartbeat_key(w) for w in alive])  # noqa: E731
        before = dict(zip(alive, read()))
        deadline = time.monotonic() + 2 * o.dead_after_s
        while alive and time.monotonic() < deadline:
            time.sleep(o.heartbeat_period_s)
            now = dict(zip(alive, read()))
            alive = [w for w in alive if now[w] == before[w] and self.children[w].alive()]
        spared = sorted(suspects - dead - set(alive))
        if spared:
            log.warning("heartbeat verdict on %s not confirmed: they beat again (a slow, not a dead worker)", spared)
        return dead | set(alive)
