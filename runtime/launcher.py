"""`oobleck launch`: a whole elastic job on one machine, without Kubernetes.

The launcher plays the parts the operator and the cluster play in production:
- it hosts the coordinator (the rendezvous store, heartbeats, abort keys, failure queue);
- it is the plan controller: it plans generation 0 with the planner, and on every failure (a report
  in the store, or a worker process that exited) it computes the next generation on the survivors
  and publishes it atomically to the plan file the workers watch;
- it starts one worker process per (node, GPU) and, for tests and demos, injects faults: SIGKILL a
  worker when it starts step K (`--kill-rank`, `--kill-node`, several at once), or adds a node at
  step K (its worker starts with the job and waits outside every plan until then).
Every child dies with the launcher: each runs in a process group of its own with
PR_SET_PDEATHSIG=SIGKILL, and the launcher kills every group on exit, Ctrl-C included.

Planning: generation 0 comes from `oobleck.planner` (`plan_job`). Later generations come from the
planner's reconfiguration (`oobleck.planner.reconfigure`: Oobleck's minimal-movement moves or a
re-instantiation of generation 0's templates, degraded if fewer than f + 1 pipelines fit, priced by
copy bytes / `copy_bandwidth` + iteration time), with a LayerCopy for every layer a worker must hold
but does not, from a survivor that reported holding it (`held/{worker}` in the store): what workers
report, not what the plan in force says, since a reconfiguration may have been interrupted.

More than f failures: when some layer has no surviving live replica, the controller rolls back
(runtime/snapshot.py): it picks the newest step whose every layer a survivor holds in its in-memory
snapshots or the checkpoint directory holds, and publishes a generation with `restore_step` and a
source for every layer; the summary records it (`restore_step`, `restore_sources`). Without any such
step the job fails as before ("more than f failures; restore from a checkpoint").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from oobleck.processes import die_with_parent

log = logging.getLogger("oobleck.launcher")


# -- planning (pure) -----------------------------------------------------------------------------


DEFAULT_COPY_BANDWIDTH = 10e9
"""bytes/s a layer copy is priced at when re-planning: the inter-node bandwidth generation 0 is planned with"""


def _worker_holdings(holdings: dict[str, set[int]]) -> dict[tuple[str, int], frozenset[int]]:
    """The launcher's `node:gpu` worker names as the planner's (node, gpu) keys."""
    out = {}
    for worker, layers in holdings.items():
        node, _, gpu = worker.rpartition(":")
        out[(node, int(gpu))] = frozenset(layers)
    return out


def _no_holder(error) -> str:
    """A LostLayersError in the launcher's words: which layers no surviving worker holds."""
    layers = error.layers
    named = (
        f"layer {layers[0]}: no surviving worker holds it"
        if len(layers) == 1
        else f"layers {layers}: no surviving worker holds them"
    )
    return f"{named} (more than f failures; restore from a checkpoint)"


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
        raise PlanningError(_no_holder(error)) from error


def replan(
    previous,
    nodes: list[str],
    holdings: dict[str, set[int]],
    profile,
    *,
    lost: list[str] = (),
    added: list[str] = (),
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
    from oobleck.planner.reconfigure import LostLayersError, reconfigure

    expected = [n for n in previous.nodes if n not in set(lost)] + [n for n in added if n not in previous.nodes]
    if sorted(nodes) != sorted(expected):
        raise PlanningError(f"nodes: {sorted(nodes)} is not the previous nodes less {list(lost)} plus {list(added)}")
    try:
        plan = reconfigure(
            previous, previous.templates, profile, lost, added, bandwidth=bandwidth, holdings=_worker_holdings(holdings)
        )
    except LostLayersError as error:
        raise PlanningError(_no_holder(error)) from error
    if not lost and not added:
        plan = plan.model_copy(update={"reason": reason})
    return plan


def layout_holdings(plan) -> dict[str, set[int]]:
    """What each worker holds once it has adopted `plan` (used when a worker has not reported)."""
    return {f"{a.node}:{a.gpu}": set(range(a.start, a.end)) for a in plan.ranks}


# -- options ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """SIGKILL the workers named by `ranks` (ranks of the plan in force) and `nodes` when they start `at_step`."""

    at_step: int
    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    delay_s: float = 0.0
    """wait this long after the step started: lands the kill in forward, backward, the reduction or the update"""


@dataclass(frozen=True)
class LaunchOptions:
    nodes: int
    gpus_per_node: int = 1
    f: int = 1
    steps: int = 20
    model: str = "tiny-gpt"
    microbatch_size: int = 4
    microbatches: int = 8
    """global microbatches per step (the global batch is microbatches * microbatch_size samples)"""
    seed: int = 0
    device: str = "cpu"
    config: Path | None = None
    """a WorkerConfig file; the options above override its fields"""
    profile: Path | None = None
    """the model's profile JSON (`oobleck profile`); default: measure it at start (timings vary per run)"""
    copy_bandwidth: float = DEFAULT_COPY_BANDWIDTH
    """bytes/s between nodes: the planner's inter-node bandwidth, and the price of layer copies when re-planning"""
    gpu_memory: int = 80 << 30
    """bytes per GPU the planner may use (small values force multi-node pipeline templates)"""
    faults: tuple[Fault, ...] = ()
    add_node_at_step: tuple[int, ...] = ()
    restart_coordinator_at_step: int | None = None
    """stop the coordinator when a worker starts this step and bring it back (empty) 0.5 s later"""
    workdir: Path = Path("oobleck-launch")
    timeout_s: float = 600.0
    comm_timeout_s: float = 60.0
    heartbeat_period_s: float = 0.1
    dead_after_s: float = 1.5
    detect_exits: bool = True
    """also treat a worker process's exit as its failure (the local analogue of a pod's status);
    False leaves detection to the workers' heartbeats alone"""
    controller: str = "reports"
    """what the plan controller bases copies on: "reports" (the workers' holdings in the store) or
    "layouts" (only the plans, as the operator: the workers settle the sources among themselves)"""
    settle_s: float = 0.1
    """after the first failure signal, how long to gather more (simultaneous failures) before replanning"""
    job: str = "local"
    snapshot_interval: int | None = None
    """in-memory snapshots every this many steps (0: off); None: the config's `snapshot.interval_steps`"""
    checkpoint_dir: Path | None = None
    """checkpoint directory (None: the config's `checkpoint.path`)"""
    checkpoint_interval: int | None = None
    """checkpoint every this many steps (None: the config's `checkpoint.interval_steps`)"""
    gradient_sum_dtype: str | None = None
    """float32 or float64 (None: the config's `gradient_sum_dtype`)"""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "microbatch_size", "microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not self.copy_bandwidth > 0:
            raise ValueError(f"copy_bandwidth: must be > 0 bytes/s, got {self.copy_bandwidth}")
        for name in ("f", "steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for fault in self.faults:
            if not 0 <= fault.at_step < self.steps:
                raise ValueError(f"at_step: {fault.at_step} is outside the job's steps 0..{self.steps - 1}")
            if not fault.ranks and not fault.nodes:
                raise ValueError("kill: name at least one rank (--kill-rank) or node (--kill-node)")
        for step in self.add_node_at_step:
            if not 0 <= step < self.steps:
                raise ValueError(f"add_node_at_step: {step} is outside the job's steps 0..{self.steps - 1}")
        if self.controller not in ("reports", "layouts"):
            raise ValueError(f"controller: must be 'reports' or 'layouts', got {self.controller!r}")
        restart = self.restart_coordinator_at_step
        if restart is not None and not 0 <= restart < self.steps:
            raise ValueError(f"restart_coordinator_at_step: {restart} is outside the job's steps 0..{self.steps - 1}")


# -- processes -------------------------------------------------------------------------------------


@dataclass
class Child:
    worker: str
    node: str
    gpu: int
    process: subprocess.Popen
    log_path: Path
    losses_path: Path
    dump_path: Path
    killed_at: float | None = None
    code: int | None = None

    def kill(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@dataclass
class Reconfiguration:
    generation: int
    reason: str
    """what triggered it: lost, retry, add, coordinator-restart"""
    lost: list[str]
    added: list[str]
    copies: int
    copy_bytes: int
    kill_at: float | None = None
    detected_at: float | None = None
    published_at: float = 0.0
    first_step_at: float | None = None
    """time the first step of this generation completed (loss record), once known"""
    moves: str = ""
    """what the planner did about it (the plan's reason: shrink, merge, borrow, reinstantiate, ...)"""
    restore_step: int | None = None
    """a rollback: the step every worker reset to and replayed from (runtime/snapshot.py)"""
    restore_sources: dict[str, int] = field(default_factory=dict)
    """a rollback: layer restores by source (own-snapshot, peer-snapshot, checkpoint)"""

    def as_dict(self) -> dict:
        out = self.__dict__.copy()
        if self.kill_at is not None:
            for name in ("detected_at", "published_at", "first_step_at"):
                value = getattr(self, name)
                out[name.replace("_at", "_s")] = None if value is None else round(value - self.kill_at, 4)
        return out


@dataclass
class Summary:
    ok: bool
    steps: int
    target_steps: int
    generations: int
    losses: dict[int, float]
    reconfigurations: list[Reconfiguration] = field(default_factory=list)
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    failure_reports: list[dict] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0
    workdir: str = ""

    def as_dict(self) -> dict:
        return {
            "ok": self.ok,
            "steps": self.steps,
            "target_steps": self.target_steps,
            "generations": self.generations,
            "losses": {str(k): v for k, v in sorted(self.losses.items())},
            "reconfigurations": [r.as_dict() for r in self.reconfigurations],
            "exit_codes": self.exit_codes,
            "failure_reports": self.failure_reports,
            "error": self.error,
            "seconds": round(self.seconds, 3),
            "workdir": self.workdir,
        }


class JobFailed(RuntimeError):
    pass


class StepsDisagree(JobFailed):
    """Survivors hold layers at different steps: only a rollback to a common snapshot can continue."""


class Launcher:
    """Runs one local job to completion (see the module docstring)."""

    def __init__(self, options: LaunchOptions) -> None:
        self.options = options
        self.workdir = Path(options.workdir).resolve()
        self.children: dict[str, Child] = {}
        self.reconfigurations: list[Reconfiguration] = []
        self.plan = None
        self.coordinator = None
        self.store = None
        self.kills: list[tuple[float, str]] = []  # (time, worker)
        self.failure_log: list[dict] = []  # every failure report that led to a reconfiguration
        self._fault_due: dict[int, tuple[float, list[str]]] = {}

    # -- setup -------------------------------------------------------------------------------------

    def _config(self):
        from oobleck.runtime.config import WorkerConfig, load_config

        o = self.options
        base = load_config(o.config).model_dump() if o.config else WorkerConfig().model_dump()
        base.update(job=o.job, microbatch_size=o.microbatch_size, steps=o.steps, seed=o.seed, device=o.device)
        base["model"] = {**base["model"], "name": o.model}
        base["timeouts"] = {**base["timeouts"], "connect": o.comm_timeout_s, "step": o.comm_timeout_s}
        if o.snapshot_interval is not None:
            base["snapshot"] = {**base["snapshot"], "interval_steps": o.snapshot_interval}
        if o.checkpoint_dir is not None:
            base["checkpoint"] = {**base["checkpoint"], "path": str(Path(o.checkpoint_dir).resolve())}
        if o.checkpoint_interval is not None:
            base["checkpoint"] = {**base["checkpoint"], "interval_steps": o.checkpoint_interval}
        if o.gradient_sum_dtype is not None:
            base["gradient_sum_dtype"] = o.gradient_sum_dtype
        return WorkerConfig.model_validate(base)

    def _profile(self, config):
        import torch

        from oobleck.api.profile import ModelProfile

        if self.options.profile is not None:
            return ModelProfile.model_validate_json(Path(self.options.profile).read_text())
        from oobleck.runtime.config import build_model
        from oobleck.runtime.profiler import profile_model

        torch.set_num_threads(config.threads)
        return profile_model(
            build_model(config), config.microbatch_size, torch.device("cpu"), 1, 2, config.precision, config.recompute
        )

    def _initial_plan(self, profile, nodes: list[str]):
        from oobleck.api.profile import ClusterShape
        from oobleck.planner.instantiate import plan_job

        o = self.options
        cluster = ClusterShape(
            nodes=len(nodes),
            gpus_per_node=o.gpus_per_node,
            gpu_memory_bytes=o.gpu_memory,
            intra_node_bandwidth=100e9,
            inter_node_bandwidth=o.copy_bandwidth,
        )
        return plan_job(profile, cluster, o.f, o.microbatches, o.job, nodes=nodes)

    def _spawn(self, node: str, gpu: int) -> Child:
        worker = f"{node}:{gpu}"
        stem = self.workdir / f"{node}-gpu{gpu}"
        log_path, losses, dump = stem.with_suffix(".log"), stem.with_suffix(".losses.jsonl"), stem.with_suffix(".pt")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR")
        o = self.options
        command = [
            sys.executable,
            "-m",
            "oobleck.runtime.reconfig",
            "--config",
            str(self.workdir / "config.json"),
            "--plan-file",
            str(self.plan_path),
            "--store",
            f"127.0.0.1:{self.coordinator.port}",
            "--node",
            node,
            "--gpu",
            str(gpu),
            "--losses",
            str(losses),
            "--dump",
            str(dump),
            "--heartbeat-period",
            str(o.heartbeat_period_s),
            "--dead-after",
            str(o.dead_after_s),
        ]
        with open(log_path, "ab") as out:
            process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=die_with_parent(os.getpid()),
                process_group=0,
            )
        child = Child(worker, node, gpu, process, log_path, losses, dump)
        self.children[worker] = child
        return child

    def _publish(self, plan) -> None:
        from oobleck.runtime import coordinator as keys
        from oobleck.runtime.plansource import write_plan

        write_plan(self.plan_path, plan)
        keys.set_generation(self.store, plan.generation)
        if self.plan is not None:
            # Every worker leaves the old generation after the same step: a step in flight is
            # aborted for all (the commit decision is common), then redone under the new plan.
            keys.post_abort(self.store, self.plan.generation, {"kind": "new-generation", "generation": plan.generation})
        self.plan = plan
        log.info(
            "published generation %d (%s): %d pipelines %s, %d copies",
            plan.generation,
            plan.reason,
            len(plan.pipelines),
            [[(s.start, s.end) for s in p.stages] for p in plan.pipelines],
            len(plan.copies),
        )

    # -- run ---------------------------------------------------------------------------------------

    def run(self) -> Summary:
        from oobleck.runtime.coordinator import Coordinator

        started = time.monotonic()
        o = self.options
        self.workdir.mkdir(parents=True, exist_ok=True)
        for stale in self.workdir.glob("*.losses.jsonl"):
            stale.unlink()
        self.plan_path = self.workdir / "plan.json"
        config = self.worker_config = self._config()
        (self.workdir / "config.json").write_text(config.model_dump_json(indent=2))
        profile = self._profile(config)
        from oobleck.runtime.config import build_model

        layers = build_model(config).num_layers
        if len(profile.layers) != layers:
            raise ValueError(f"profile: has {len(profile.layers)} layers, model {config.model.name!r} has {layers}")
        self.profile = profile  # generation 0's: the planner prices later generations' copies with it
        self.coordinator = Coordinator("127.0.0.1").start()
        self.store = self.coordinator.store()
        error = ""
        try:
            nodes = [f"node{i}" for i in range(o.nodes)]
            self._publish(self._initial_plan(profile, nodes))
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
        return self._summary(error, time.monotonic() - started)

    def _supervise(self, started: float) -> None:
        from oobleck.runtime import coordinator as keys
        from oobleck.runtime.health import FailureReport
        from oobleck.runtime.reconfig import EXIT_DONE, EXIT_DROPPED

        o = self.options
        faults = list(o.faults)
        restart_at = o.restart_coordinator_at_step
        additions = sorted(o.add_node_at_step)
        # Nodes to add are started with the job (a provisioned node; torch takes seconds to import)
        # and wait, outside every plan, until the controller adds them at their step.
        spares = [f"node{o.nodes + i}" for i in range(len(additions))]
        for node in spares:
            for gpu in range(o.gpus_per_node):
                self._spawn(node, gpu)
        self.reports: list = []
        while True:
            if time.monotonic() - started > o.timeout_s:
                raise JobFailed(f"timeout: the job did not finish within {o.timeout_s:.0f} s")
            in_plan = {f"{a.node}:{a.gpu}" for a in self.plan.ranks}
            exited = self._reap()
            progress = keys.get_progress(self.store, sorted(in_plan))
            finished = [
                w for w in in_plan if self.children[w].code == EXIT_DONE or progress.get(w, {}).get("phase") == "done"
            ]
            if finished:
                # The last step is committed (a worker only exits 0 after it): wait for the others to
                # exit; failures after that point (a peer dying on its way out) change nothing.
                if all(self.children[w].code is not None for w in in_plan):
                    return
                time.sleep(0.01)
                continue
            self.reports += [FailureReport.from_dict(r) for r in keys.pop_failures(self.store)]
            unexpected = [w for w, code in exited if code not in (EXIT_DONE, EXIT_DROPPED) and w in in_plan]
            if o.detect_exits and unexpected:
                self._on_failure(unexpected)
                continue
            if keys.aborted(self.store, self.plan.generation) or any(
                r.generation == self.plan.generation for r in self.reports
            ):
                self._on_failure([])
                continue
            step = max((p["step"] for p in progress.values()), default=0)
            faults = self._inject(faults, progress)
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
            time.sleep(0.005 if faults or restart_at is not None or spares else 0.02)

    def _last_error(self, worker: str) -> str:
        """The error a worker logged last (its "unrecoverable" event), for the job's failure message."""
        for line in reversed(self.children[worker].log_path.read_text(errors="replace").splitlines()):
            if line.startswith("{") and '"error"' in line:
                try:
                    return json.loads(line)["error"]
                except (ValueError, KeyError):
                    continue
        return "exited: no layer source left"

    def _restart_coordinator(self, outage_s: float = 0.5) -> None:
        """Lose the store (every key with it) and recreate it on the same port; then re-plan.

        The workers' groups survive the outage; their clients reconnect, see the new epoch and
        leave the generation; the next generation rendezvouses under the new epoch's prefix.
        """
        from oobleck.runtime import coordinator as keys
        from oobleck.runtime.coordinator import Coordinator

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
        from oobleck.runtime.reconfig import EXIT_UNRECOVERABLE

        exited = []
        for child in self.children.values():
            if child.code is None and (code := child.process.poll()) is not None:
                child.code = code
                exited.append((child.worker, code))
                log.info("worker %s exited with %s", child.worker, code)
                if code == EXIT_UNRECOVERABLE:
                    raise JobFailed(f"{child.worker}: {self._last_error(child.worker)}")
        return exited

    def _inject(self, faults: list[Fault], progress: dict[str, dict]) -> list[Fault]:
        """Kill a fault's targets `delay_s` after all of them have started its step (never blocks)."""
        remaining = []
        now = time.monotonic()
        for fault in faults:
            due = self._fault_due.get(id(fault))
            if due is None:
                targets = self._targets(fault)
                reached = [w for w in targets if progress.get(w, {}).get("step", -1) >= fault.at_step]
                if targets and len(reached) == len(targets):
                    # Resolve targets now: ranks are renumbered by the next generation.
                    self._fault_due[id(fault)] = due = (now + fault.delay_s, targets)
            if due is not None and now >= due[0]:
                killed_at = time.time()
                for worker in due[1]:
                    self.children[worker].killed_at = killed_at
                    self.children[worker].kill()
                    self.kills.append((killed_at, worker))
                log.info("fault: SIGKILL %s at step %d (+%.3f s)", due[1], fault.at_step, fault.delay_s)
            else:
                remaining.append(fault)
        return remaining

    def _targets(self, fault: Fault) -> list[str]:
        ranks = [self.plan.ranks[r] for r in fault.ranks if r < self.plan.world_size]
        targets = [f"{a.node}:{a.gpu}" for a in ranks]
        targets += [w for w, c in self.children.items() if c.node in fault.nodes and c.code is None]
        return targets

    def _on_failure(self, exited: list[str]) -> None:
        """Gather who is dead for a short settle window, then publish the next generation."""
        from oobleck.runtime import coordinator as keys
        from oobleck.runtime.health import FailureReport

        o = self.options
        generation = self.plan.generation
        in_plan = {f"{a.node}:{a.gpu}" for a in self.plan.ranks}
        dead = set(exited)
        suspects: set[str] = set()  # named by a heartbeat verdict only: confirmed below
        exit_seen = time.time() if exited else None
        reports: list[FailureReport] = []
        if exited:
            keys.post_abort(self.store, generation, {"kind": "process-exit", "dead": sorted(exited)})
        first_signal = time.monotonic()
        deadline = first_signal + o.dead_after_s + 1.0
        while True:
            self.reports += [FailureReport.from_dict(r) for r in keys.pop_failures(self.store)]
            for report in self.reports:
                if report.generation == generation:
                    reports.append(report)
                    named = {d for d in report.dead if d in in_plan}
                    (suspects if report.kind == "heartbeat" else dead).update(named)
            self.reports = []
            self._reap()
            if o.detect_exits:
                dead.update(w for w in in_plan if self.children[w].code not in (None, 0))
            now = time.monotonic()
            if (dead or suspects) and now - first_signal >= o.settle_s:
                break
            if now > deadline:
                break  # nobody identified: a transient error; redo the generation on the same nodes
            time.sleep(0.005)
        dead |= self._confirm_silent(suspects - dead)
        self.failure_log += [r.to_dict() for r in reports]
        for worker in dead:  # fence: a worker declared dead must not come back
            self.children[worker].kill()
        kill_at = min((t for t, w in self.kills if w in dead), default=None)
        detected = min(
            [r.detected_at for r in reports if set(r.dead) & dead] + ([exit_seen] if exit_seen else []), default=None
        )
        lost_nodes = sorted({w.split(":")[0] for w in dead})
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
        from oobleck.runtime import coordinator as keys

        o = self.options
        if not o.detect_exits or not suspects:
            return suspects
        dead = {w for w in suspects if self.children[w].process.poll() is not None}
        alive = sorted(suspects - dead)
        if not alive:
            return dead
        read = lambda: self.store.multi_get([keys.heartbeat_key(w) for w in alive])  # noqa: E731
        before = dict(zip(alive, read()))
        deadline = time.monotonic() + 2 * o.dead_after_s
        while alive and time.monotonic() < deadline:
            time.sleep(o.heartbeat_period_s)
            now = dict(zip(alive, read()))
            alive = [w for w in alive if now[w] == before[w] and self.children[w].process.poll() is None]
        spared = sorted(suspects - dead - set(alive))
        if spared:
            log.warning("heartbeat verdict on %s not confirmed: they beat again (a slow, not a dead worker)", spared)
        return dead | set(alive)

    def _holdings(self, survivors: list[str], generation: int, wait_s: float) -> dict[str, set[int]]:
        """Survivors' layers as they report them on leaving `generation` (waiting up to `wait_s`).

        A survivor that reports "pending" was waiting for a step's commit decision when the
        coordinator was lost: once every survivor has reported, the decision is re-posted ("commit"
        if any survivor has applied that step) and the pending ones report again after following it.
        A survivor that has not reported leaving (a slow machine) is taken at its newest report (see
        `_newest_holdings`), never at the layout of a plan it may not have finished adopting.
        """
        from oobleck.runtime import coordinator as keys

        deadline = time.monotonic() + wait_s
        hard_deadline = deadline + 10 * wait_s
        reposted = False
        while True:
            reports: dict[str, dict] = {}
            for worker in survivors:
                if self.store.check([keys.held_key(worker)]):
                    value = json.loads(self.store.get(keys.held_key(worker)))
                    if value["generation"] == generation and value.get("phase") in ("left", "pending"):
                        reports[worker] = value
            pending = {w: r for w, r in reports.items() if r["phase"] == "pending"}
            missing = [w for w in survivors if w not in reports]
            now = time.monotonic()
            # A survivor whose process runs will report (reconnecting to a recreated coordinator
            # can take several 5 s connection attempts on a loaded machine): wait for it longer.
            waiting = missing and now < hard_deadline and any(self.children[w].process.poll() is None for w in missing)
            if pending and not reposted and (not missing or (now > deadline and not waiting)):
                reposted = True
                step = next(iter(pending.values()))["step"]
                applied = any(r["phase"] == "left" and r["step"] == step + 1 for r in reports.values())
                decision = keys.commit_prefix(generation, step) + "decision"
                verdict = self.store.compare_set(decision, "", "commit" if applied else "abort").decode()
                log.info("re-posted the lost commit decision of step %d: %s", step, verdict)
                deadline = max(deadline, time.monotonic() + wait_s)  # the pending ones report again
            elif (not missing and not pending) or (now > deadline and not waiting):
                break
            time.sleep(0.002)
        # A worker still pending was committing a step of this generation: it holds its layout.
        left = {w: r for w, r in reports.items() if r["phase"] == "left"}
        fallback = self._newest_holdings([w for w in survivors if w not in reports])
        layout = layout_holdings(self.plan)
        holdings = {
            w: set(left[w]["layers"]) if w in left else layout.get(w, set()) if w in reports else fallback[w]
            for w in survivors
        }
        steps = {reports[w]["step"] for w in reports if holdings[w]}
        if len(steps) > 1:
            raise StepsDisagree(f"survivors disagree on the step they hold: {sorted(steps)}")
        return holdings

    def _newest_holdings(self, workers: list[str]) -> dict[str, set[int]]:
        """What `workers` hold by their newest report (`held/{worker}`, any generation or phase).

        Safe when that report is older than the plan in force: a worker frees layers only once an
        adoption has completed, and reports right after it, so an adoption interrupted since (a
        kill during a reconfiguration, a slow rendezvous) leaves it holding at least the reported
        layers. A worker that never reported holds nothing - unless no step has been trained yet,
        when every layer is a pure function of the seed and the plan's layout stands.
        """
        from oobleck.runtime import coordinator as keys

        newest: dict[str, dict] = {}
        for worker in workers:
            if self.store.check([keys.held_key(worker)]):
                newest[worker] = json.loads(self.store.get(keys.held_key(worker)))
        layout = layout_holdings(self.plan)
        untrained = not any(c.losses_path.exists() and c.losses_path.stat().st_size for c in self.children.values())
        return {
            w: set(newest[w]["layers"]) if w in newest else (layout.get(w, set()) if untrained else set())
            for w in workers
        }

    def _reconfigure(
        self,
        *,
        lost: list[str],
        added: list[str],
        reason: str,
        kill_at: float | None = None,
        detected_at: float | None = None,
    ) -> None:
        from oobleck.planner.errors import PlanningError
        from oobleck.planner.reconfigure import LostLayersError

        previous = self.plan
        nodes = [n for n in previous.nodes if n not in lost] + [n for n in added if n not in previous.nodes]
        survivors = [f"{a.node}:{a.gpu}" for a in previous.ranks if a.node not in lost]
        if self.options.controller == "layouts":
            self._record(
                self._layout_plan(previous, nodes, survivors, lost, added, reason),
                reason,
                lost,
                added,
                kill_at,
                detected_at,
            )
            return
        try:
            if reason == "add":  # nobody leaves the generation before the new plan: use what they adopted
                holdings = self._newest_holdings(survivors)
            else:
                holdings = self._holdings(survivors, previous.generation, wait_s=3.0)
            plan = replan(
                previous,
                nodes,
                holdings,
                self.profile,
                lost=lost,
                added=added,
                reason=reason,
                bandwidth=self.options.copy_bandwidth,
            )
        except (PlanningError, StepsDisagree) as error:
            # Some layer has no live replica (or the survivors' live states differ): roll back to
            # the newest step that snapshots or the checkpoint directory still hold entirely.
            if not (isinstance(error, StepsDisagree) or isinstance(error.__cause__, LostLayersError)):
                raise JobFailed(f"cannot plan generation {previous.generation + 1}: {error}") from error
            plan = self._rollback_plan(previous, survivors, lost, added)
            if plan is None:
                raise JobFailed(
                    f"cannot plan generation {previous.generation + 1}: {error}; no in-memory "
                    f"snapshot or checkpoint holds every layer at one step"
                ) from error
        self._record(plan, reason, lost, added, kill_at, detected_at)

    def _layout_plan(
        self, previous, nodes: list[str], survivors: list[str], lost: list[str], added: list[str], reason: str
    ):
        """The next generation as a controller that sees only plans proposes it (the operator's view).

        Survivors are taken to hold their layout of `previous`; when that leaves a layer without a
        holder, every survivor is priced as holding everything (any layout will do: the layers come
        from snapshots). The members settle the real sources themselves (runtime/resolve.py)."""
        from oobleck.planner.errors import PlanningError
        from oobleck.planner.reconfigure import LostLayersError

        layout = layout_holdings(previous)
        try:
            return replan(
                previous,
                nodes,
                {w: layout.get(w, set()) for w in survivors},
                self.profile,
                lost=lost,
                added=added,
                reason=reason,
                bandwidth=self.options.copy_bandwidth,
            )
        except PlanningError as error:
            if not isinstance(error.__cause__, LostLayersError):
                raise JobFailed(f"cannot plan generation {previous.generation + 1}: {error}") from error
        everything = set(range(previous.num_layers))
        return replan(
            previous,
            nodes,
            {w: everything for w in survivors},
            self.profile,
            lost=lost,
            added=added,
            reason=reason,
            bandwidth=self.options.copy_bandwidth,
        )

    def _record(
        self, plan, reason: str, lost: list[str], added: list[str], kill_at: float | None, detected_at: float | None
    ) -> None:
        """Publish `plan` and note the reconfiguration for the summary."""
        self._publish(plan)
        sources: dict[str, int] = {}
        if plan.restore_step is not None:
            for c in plan.copies:
                kind = (
                    "checkpoint"
                    if c.source_kind == "checkpoint"
                    else "own-snapshot"
                    if c.src_rank == c.dst_rank
                    else "peer-snapshot"
                )
                sources[kind] = sources.get(kind, 0) + 1
        moved = [c for c in plan.copies if c.src_rank != c.dst_rank]  # a rollback also lists local restores
        self.reconfigurations.append(
            Reconfiguration(
                generation=plan.generation,
                reason=reason,
                moves=plan.reason,
                lost=lost,
                added=added,
                copies=len(moved),
                copy_bytes=sum(c.bytes for c in moved),
                kill_at=kill_at,
                detected_at=detected_at,
                published_at=time.time(),
                restore_step=plan.restore_step,
                restore_sources=sources,
            )
        )

    def _rollback_plan(self, previous, survivors: list[str], lost: list[str], added: list[str]):
        """The rollback generation from the survivors' snapshot reports and the checkpoint directory, or None."""
        from oobleck.planner.errors import PlanningError
        from oobleck.runtime import coordinator as keys
        from oobleck.runtime.snapshot import checkpoint_holdings, rollback_plan

        memory: dict[str, dict[int, set[int]]] = {}
        latest = None  # the newest step a survivor reached: older runs' checkpoints may lie in the directory
        for worker in survivors:
            if not self.store.check([keys.held_key(worker)]):
                continue
            report = json.loads(self.store.get(keys.held_key(worker)))
            # Only reports made on leaving `previous`: a worker's snapshots are frozen from then on.
            if report.get("generation") == previous.generation and report.get("phase") in ("left", "pending"):
                memory[worker] = {int(step): set(layers) for step, layers in report.get("snapshots", {}).items()}
                latest = max(latest or 0, report["step"])
        disk = checkpoint_holdings(self.worker_config.checkpoint.path)
        try:
            plan = rollback_plan(
                previous, self.profile, lost, added, memory, disk, bandwidth=self.options.copy_bandwidth, latest=latest
            )
        except PlanningError as error:
            raise JobFailed(f"cannot plan the rollback generation {previous.generation + 1}: {error}") from error
        if plan is not None:
            log.info("rollback: generation %d restores step %d (%s)", plan.generation, plan.restore_step, plan.reason)
        return plan

    # -- results -----------------------------------------------------------------------------------

    def _summary(self, error: str, seconds: float) -> Summary:
        records = []
        for child in self.children.values():
            if child.losses_path.exists():
                records += [json.loads(line) for line in child.losses_path.read_text().splitlines() if line.strip()]
        losses: dict[int, float] = {}
        for record in sorted(records, key=lambda r: r["time"]):
            step = record["step"]
            if step in losses and losses[step] != record["loss"]:
                error = error or f"step {step} logged twice with different losses: {losses[step]} != {record['loss']}"
            losses[step] = record["loss"]
        for reconfiguration in self.reconfigurations:
            after = [r["time"] for r in records if r["generation"] == reconfiguration.generation]
            reconfiguration.first_step_at = min(after, default=None)
        steps = len(losses)
        final = {f"{a.node}:{a.gpu}" for a in self.plan.ranks} if self.plan else set()
        if not error and sorted(losses) != list(range(self.options.steps)):
            error = f"steps: logged {sorted(losses)}, expected 0..{self.options.steps - 1}"
        if not error and any(self.children[w].code != 0 for w in final if w in self.children):
            bad = {w: self.children[w].code for w in final if self.children[w].code != 0}
            error = f"workers of the final generation failed: {bad}"
        return Summary(
            ok=not error,
            steps=steps,
            target_steps=self.options.steps,
            generations=(self.plan.generation + 1) if self.plan else 0,
            losses=losses,
            reconfigurations=self.reconfigurations,
            exit_codes={w: c.code for w, c in self.children.items()},
            failure_reports=self.failure_log,
            error=error,
            seconds=seconds,
            workdir=str(self.workdir),
        )


# -- command line ----------------------------------------------------------------------------------


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("launch", help="run an elastic job locally: coordinator, plan controller, workers")
    parser.add_argument("--nodes", type=int, required=True, help="nodes to start with (one worker per GPU)")
    parser.add_argument("--gpus-per-node", type=int, default=1)
    parser.add_argument("--f", type=int, default=1, help="pipeline failures to tolerate")
    parser.add_argument("--steps", type=int, default=20, help="global steps to train")
    parser.add_argument("--model", default="tiny-gpt", help="model name or module:function")
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8, help="global microbatches per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu")
    parser.add_argument("--config", type=Path, default=None, help="base worker config (JSON or YAML)")
    parser.add_argument("--gpu-memory", type=int, default=80 << 30, help="bytes per GPU for the planner")
    parser.add_argument(
        "--copy-bandwidth",
        type=float,
        default=DEFAULT_COPY_BANDWIDTH,
        help="bytes/s between nodes: prices layer copies when re-planning",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="model profile JSON (from `oobleck profile`); default: measure at start",
    )
    parser.add_argument("--kill-rank", type=int, action="append", default=[], help="SIGKILL this rank (repeatable)")
    parser.add_argument("--kill-node", action="append", default=[], help="SIGKILL this node's workers (repeatable)")
    parser.add_argument("--at-step", type=int, default=None, help="... when it starts this step (all kills at once)")
    parser.add_argument("--kill-delay", type=float, default=0.0, help="... this many seconds into the step")
    parser.add_argument("--add-node-at-step", type=int, action="append", default=[], help="add a node at this step")
    parser.add_argument(
        "--restart-coordinator-at-step",
        type=int,
        default=None,
        help="lose the coordinator (store) at this step and recreate it",
    )
    parser.add_argument("--workdir", type=Path, default=Path("oobleck-launch"), help="logs, plan, losses, dumps")
    parser.add_argument("--timeout", type=float, default=600.0, help="fail the job after this many seconds")
    parser.add_argument(
        "--dead-after",
        type=float,
        default=1.5,
        help="heartbeat silence that means dead, seconds (margin for a loaded machine)",
    )
    parser.add_argument(
        "--heartbeats-only",
        action="store_true",
        help="detect failures only through the workers' heartbeats, not process exits",
    )
    parser.add_argument(
        "--snapshot-interval",
        type=int,
        default=None,
        help="in-memory peer snapshots every this many steps (0: off; default: the config's)",
    )
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="write checkpoints to this directory")
    parser.add_argument("--checkpoint-interval", type=int, default=None, help="... every this many steps")
    parser.add_argument(
        "--controller",
        choices=["reports", "layouts"],
        default="reports",
        help="base copies on the workers' reported holdings, or on plans alone as the operator "
        "does (the workers then settle the sources among themselves)",
    )
    parser.add_argument(
        "--gradient-sum-dtype",
        choices=["float32", "float64"],
        default=None,
        help="accumulator of the gradient sums (default: the config's, float32); float64 matches "
        "single-process training to rounding",
    )
    parser.add_argument("--summary", type=Path, default=None, help="also write the summary here (JSON)")
    parser.set_defaults(func=run_launch)


def options_from_args(args: argparse.Namespace) -> LaunchOptions:
    faults: tuple[Fault, ...] = ()
    if args.kill_rank or args.kill_node:
        if args.at_step is None:
            raise ValueError("--at-step: required with --kill-rank / --kill-node")
        faults = (
            Fault(
                at_step=args.at_step, ranks=tuple(args.kill_rank), nodes=tuple(args.kill_node), delay_s=args.kill_delay
            ),
        )
    elif args.at_step is not None:
        raise ValueError("--at-step: given without --kill-rank or --kill-node")
    return LaunchOptions(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        f=args.f,
        steps=args.steps,
        model=args.model,
        microbatch_size=args.microbatch_size,
        microbatches=args.microbatches,
        seed=args.seed,
        device=args.device,
        config=args.config,
        profile=args.profile,
        gpu_memory=args.gpu_memory,
        copy_bandwidth=args.copy_bandwidth,
        faults=faults,
        add_node_at_step=tuple(args.add_node_at_step),
        restart_coordinator_at_step=args.restart_coordinator_at_step,
        workdir=args.workdir,
        timeout_s=args.timeout,
        dead_after_s=args.dead_after,
        controller=args.controller,
        detect_exits=not args.heartbeats_only,
        snapshot_interval=args.snapshot_interval,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_interval=args.checkpoint_interval,
        gradient_sum_dtype=args.gradient_sum_dtype,
    )


def run_launch(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(message)s", stream=sys.stderr)
    try:
        options = options_from_args(args)
    except ValueError as error:
        print(f"oobleck launch: {error}", file=sys.stderr)
        return 2
    # SIGTERM takes the Ctrl-C path: every child is killed before the launcher exits.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    summary = Launcher(options).run()
    print(format_summary(summary))
    if args.summary:
        args.summary.write_text(json.dumps(summary.as_dict(), indent=2))
    return 0 if summary.ok else 1


def format_summary(summary: Summary) -> str:
    lines = [
        f"job {'finished' if summary.ok else 'FAILED'}: {summary.steps}/{summary.target_steps} steps, "
        f"{summary.generations} generation(s), {summary.seconds:.1f} s"
    ]
    if summary.losses:
        first, last = min(summary.losses), max(summary.losses)
        lines.append(f"loss: step {first} {summary.losses[first]:.5f} -> step {last} {summary.losses[last]:.5f}")
    for r in summary.reconfigurations:
        parts = [f"generation {r.generation} ({r.reason}; planner: {r.moves})"]
        if r.lost:
            parts.append(f"lost {r.lost}")
        if r.added:
            parts.append(f"added {r.added}")
        parts.append(f"{r.copies} copies, {r.copy_bytes} bytes")
        if r.restore_step is not None:
            parts.append(f"rolled back to step {r.restore_step} from {r.restore_sources}")
        timing = r.as_dict()
        if r.kill_at is not None:
            parts.append(
                "after the kill: "
                + ", ".join(
                    f"{name[:-2]} {timing[name]:.3f} s"
                    for name in ("detected_s", "published_s", "first_step_s")
                    if timing.get(name) is not None
                )
            )
        lines.append("  " + "; ".join(parts))
    if summary.error:
        lines.append(f"error: {summary.error}")
    lines.append(f"workdir: {summary.workdir}")
    return "\n".join(lines)


def register(subparsers) -> None:
    """Add `oobleck launch` to the command line."""
    add_parser(subparsers)
