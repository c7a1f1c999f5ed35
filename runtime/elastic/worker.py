"""The per-process worker: holds layers and optimizer state across plan generations and trains.

The control side (coordinator, failure detection, plan source) drives it through three calls:
- `adopt(plan)`: build the generation's groups, execute its layer copies, free layers no longer held;
- `train_step()`: one global step; raises `Interrupted`/`CommError` with state untouched, so the
  caller can `abandon()` the generation, adopt the next plan, and call `train_step()` again: the
  step counter did not advance, so the same step is redone;
- `abandon()`: drop the generation's groups without waiting.
`run_static` is the loop for a fixed plan (no reconfiguration); elastic/loop.py's `run_elastic` is the
loop across generations.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from oobleck.api.causes import make_cause
from oobleck.api.plan import Plan
from oobleck.runtime.causes import JobFault, blame, model_field
from oobleck.runtime.elastic.commit import CommittingOptimizer, StepCommitter
from oobleck.runtime.train.config import WorkerConfig, build_dataset, build_model
from oobleck.runtime.train.engine import Engine, StepOutcome
from oobleck.runtime.train.groups import GenerationGroups, Layout, layout
from oobleck.runtime.train.layer_state import state_nbytes, transfer, unflatten
from oobleck.runtime.train.metrics import WorkerMetrics
from oobleck.runtime.train.optim import LayerAdamW
from oobleck.runtime.train.pace import Pace, expected_compute_seconds
from oobleck.runtime.train.shard_copy import assemble, sharding
from oobleck.runtime.train.tensor_parallel import TensorParallelGroup
from oobleck.runtime.train.tp_stage import Channel, bind, build_split, gather_state, tp_group

if TYPE_CHECKING:
    from oobleck.runtime.snapshot.agent import Snapshotter

log = logging.getLogger("oobleck.runtime.elastic.worker")


class NotInPlan(RuntimeError):
    """This worker's (node, gpu) has no rank in the plan."""


class _FencedOptimizer:
    """The worker's optimizer: `step` first waits until a snapshot capture in flight is ordered ahead of
    the update (it reads the state this update overwrites); everything else passes through."""

    def __init__(self, inner: LayerAdamW, worker: Worker) -> None:
        self._inner = inner
        self._worker = worker

    def step(self, *args, **kwargs):
        if self._worker.snapshots is not None:
            self._worker.snapshots.ordered()
        return self._inner.step(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def choose_device(config: WorkerConfig, gpu: int) -> torch.device:
    """cuda:<gpu> when asked for (or auto and available), else cpu."""
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            # The spec's choice, unless only this node lacks its GPUs: CudaError fails the job once two pods agree.
            raise JobFault(
                make_cause(
                    "CudaError",
                    "device: cuda, but CUDA is not available on this node (torch.cuda.is_available() is False): "
                    "run on GPU nodes, or set device: cpu",
                    field="spec.device",
                )
            )
        # Recover in-process: NCCL's watchdog must not tear the process down on a peer's death,
        # and groups are aborted explicitly when a generation is abandoned.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        os.environ.setdefault("TORCH_NCCL_RETHROW_CUDA_ERRORS", "0")
        torch.cuda.set_device(gpu)
        return torch.device("cuda", gpu)
    return torch.device("cpu")


class Worker:
    """One process (one GPU) of a job."""

    def __init__(
        self,
        config: WorkerConfig,
        store,
        node: str,
        gpu: int,
        failed: threading.Event | None = None,
        losses_path: str | Path | None = None,
        metrics: WorkerMetrics | None = None,
        *,
        commit: StepCommitter | None = None,
        snapshots: Snapshotter | None = None,
        epoch: str | None = None,
    ) -> None:
        """`commit`: agrees with the generation's other members on applying each step (reconfig.StepCommit;
        None: every step applies, as in a static job). `snapshots`: the snapshot agent (None: off).
        `epoch`: the coordinator incarnation whose prefix `store` carries (reconfig._ensure_epoch)."""
        torch.set_num_threads(config.threads)
        self.config, self.store, self.node, self.gpu = config, store, node, gpu
        self.failed = failed if failed is not None else threading.Event()
        self.device = choose_device(config, gpu)
        # Errors here are the job's (runtime/causes.py): the worker reports them and the job fails with them.
        with blame("ModelLoadFailed", field=model_field(config)):
            self.model = build_model(config)
        with blame("DataUnavailable", field="spec.data", path=config.data.path):
            self.data = build_dataset(config, self.model)
        optimizer = _FencedOptimizer(LayerAdamW(config.optim), self)
        # The wrappers pass everything but step() through: to the engine and transfers, a LayerAdamW.
        self.optimizer = cast(LayerAdamW, optimizer if commit is None else CommittingOptimizer(optimizer, self, commit))
        self.snapshots = snapshots
        self.epoch = epoch
        self.layers: dict[int, nn.Module] = {}
        self.channel = Channel()
        """the collectives of this rank's tensor-parallel split layers (rebound each generation)"""
        self.step = 0
        """the next global step to run (= steps completed)"""
        self.started = False
        """True once this worker holds trained (or received) state"""
        self.plan: Plan | None = None
        self.rank: int | None = None
        self.groups: GenerationGroups | None = None
        self.engine: Engine | None = None
        self.failure_time: float | None = None
        """time.monotonic() of the failure being recovered from; set by the backend when a
        generation breaks (the control side may set an earlier one, e.g. the kill it detected)"""
        self.losses_path = Path(losses_path) if losses_path else None
        self.metrics = metrics or WorkerMetrics(config.job, node, gpu)
        self.pace = Pace()
        """this rank's compute against its profile (runtime/train/pace.py); kept across generations: a
        ratio does not depend on the share of the batch a plan gives the rank, nor on its stage's layers"""
        self._expected_compute: float | None = None
        # Sized now, at start-up, not on the first reconfiguration's critical path (runtime/elastic/sources.py
        # needs them): the first meta-device build takes ~1 s of lazy set-up. Not on a thread: layer
        # builders reseed the global RNG, which a training step running beside them would feel.
        with blame("ModelLoadFailed", field=model_field(config)), torch.device("meta"):
            self._state_bytes = [state_nbytes(self.model.build_layer(i)) for i in range(self.model.num_layers)]

    # -- generations -------------------------------------------------------------------------------

    def adopt(self, plan: Plan) -> int:
        """Join `plan`'s generation: groups, layer copies, frees. Returns this worker's rank.

        Its order (checks, groups, copies, frees, engine) is the recovery protocol, and each step's
        comment says why it comes where it does."""
        rank = self._rank_in(plan)
        reconfiguring = self.plan is not None
        mine = layout(plan, rank)
        if self.engine is not None:
            self.engine.release()  # its gradient buffers are freed with it, not kept by the layers' `.grad`s
        if self.snapshots is not None:
            self.snapshots.fence()  # a capture in flight reads the layers this adoption replaces
        if plan.restore_step is not None:
            # Before the rendezvous: a rollback interrupted from here on still leaves this worker
            # wholly at the restore step (never half old step, half restored).
            self._restore_local(plan, rank, (mine.tensor_parallel, mine.tp_index))
        self.groups = self._generation_groups(plan, rank)
        bind(self.channel, mine, self.groups, self.failed, self.config.timeouts.poll, self.config.timeouts.step)
        # A live copy to itself is a piece this rank holds, re-sharded with the ones it receives.
        incoming = {
            c.layer for c in plan.copies if c.dst_rank == rank and (c.src_rank != rank or c.source_kind == "live")
        }
        self._build_fresh_layers(mine, incoming, rank)
        moved = transfer(
            plan.copies,
            rank,
            self.groups,
            self.model,
            self.layers,
            self.optimizer,
            self.device,
            self.failed,
            self.config.timeouts.poll,
            self.config.timeouts.step,
            snapshot=self._snapshot_source(plan),
            want=(mine.tensor_parallel, mine.tp_index),
            build=self._build_split,
        )
        self.metrics.bytes_copied.inc(moved)
        for layer in [layer for layer in self.layers if layer not in mine.layers]:
            del self.layers[layer]
            self.optimizer.drop_layer(layer)
        if incoming and not self.started:
            self.step = self._step_from_state()
        self._check_steps(rank)
        self.started = True
        self.plan, self.rank = plan, rank
        self.engine = Engine(
            self.config,
            self.model,
            self.data,
            self.optimizer,
            self.layers,
            plan,
            rank,
            self.groups,
            self.device,
            self.failed,
            self.channel,
        )
        self._expected_compute = expected_compute_seconds(plan, rank)
        # The calibration carries to another stage with a profiled cost: a node moved while slow still reads slow.
        self.pace.on_stage(
            (mine.stage.start, mine.stage.end, len(mine.stage.ranks)), self._expected_compute is not None
        )
        self.metrics.generation.set(plan.generation)
        self.metrics.pipelines.set(len(plan.pipelines))
        self.metrics.rank.set(rank)
        if reconfiguring:
            self.metrics.reconfigurations.inc()
        if self.snapshots is not None:
            self.snapshots.store.thaw()
        self._log("adopted", layers=list(mine.layers), copied_bytes=moved, reason=plan.reason)
        return rank

    def _rank_in(self, plan: Plan) -> int:
        """This worker's rank in `plan`; NotInPlan or a ValueError when the plan does not fit it."""
        rank = plan.rank_of(self.node, self.gpu)
        if rank is None:
            raise NotInPlan(f"plan generation {plan.generation} has no rank for node {self.node!r} gpu {self.gpu}")
        if plan.num_layers != self.model.num_layers:
            raise ValueError(
                f"num_layers: plan has {plan.num_layers}, model {self.model.name!r} has {self.model.num_layers}"
            )
        return rank

    def _generation_groups(self, plan: Plan, rank: int) -> GenerationGroups:
        timeout = max(self.config.timeouts.connect, self.config.timeouts.step)
        return GenerationGroups(
            self.store,
            plan,
            rank,
            self.config.microbatch_size,
            self.device,
            timeout,
            self.failed,
            self.config.timeouts.poll,
            ties=[tuple(layer for layer, _ in tie) for tie in self.model.tied_parameters()],
            everyone=self.config.max_grad_norm is not None,
        )

    def _build_fresh_layers(self, mine: Layout, incoming: set[int], rank: int) -> None:
        """Build the layers this rank holds that it neither has nor receives: only a fresh job may have such.
        A layer it keeps must already be the shard (t, k) its new stage needs."""
        want = (mine.tensor_parallel, mine.tp_index)
        for layer in mine.layers:
            if layer in incoming:
                continue
            if layer in self.layers:
                if sharding(self.layers[layer]) != want:
                    raise ValueError(
                        f"copies: rank {rank} holds layer {layer} as shard {sharding(self.layers[layer])} (t, k), "
                        f"its new stage needs {want}, and the plan copies it from nowhere"
                    )
                continue
            if self.started:
                raise ValueError(
                    f"copies: rank {rank} (node {self.node!r} gpu {self.gpu}) needs layer {layer} but the plan "
                    f"copies it from nowhere"
                )
            # A fresh job: every layer's initial weights are a pure function of (seed, layer).
            module = build_split(self.model, layer, tp_group(mine, self.channel), self.device)
            self.optimizer.ensure_layer(layer, module)
            self.layers[layer] = module

    def _build_split(self, layer: int, t: int, k: int) -> nn.Module:
        """Layer `layer` built whole from (seed, index) and split as shard k of t (whole when t = 1)."""
        return build_split(self.model, layer, TensorParallelGroup(self.channel, k, t), self.device)

    def _restore_local(self, plan: Plan, rank: int, want: tuple[int, int]) -> None:
        """Reset to `plan.restore_step`: drop every live layer, restore those whose source is this rank
        (its own host snapshot, or the checkpoint directory: whole layers, cut to shard `want`); the others
        arrive by `transfer`."""
        from oobleck.runtime.snapshot.checkpoint_dir import read_checkpoint_layer

        step = plan.restore_step
        assert step is not None, "a rollback plan"
        self.layers.clear()
        self.optimizer.state.clear()
        self.step = step
        self.started = True  # every layer of the new range must now come from the plan's copies
        for copy in plan.copies:
            if copy.dst_rank != rank or copy.src_rank != rank:
                continue
            if copy.source_kind == "snapshot":
                if self.snapshots is None:
                    raise ValueError(f"copies: layer {copy.layer} from this rank's snapshot, but it keeps none")
                data = self.snapshots.store.get(step, copy.layer)
            elif copy.source_kind == "checkpoint":
                if not self.config.checkpoint.path:
                    raise ValueError(f"copies: layer {copy.layer} from the checkpoint, but checkpoint.path is not set")
                data = read_checkpoint_layer(self.config.checkpoint.path, step, copy.layer)
            else:
                continue
            module, scratch = self.model.build_layer(copy.layer).to(self.device), LayerAdamW(self.optimizer.config)
            unflatten(data.to(self.device), copy.layer, module, scratch)
            self.layers[copy.layer] = assemble(copy.layer, [(module, scratch)], want, self.optimizer, self._build_split)
        self._log("restored", for_generation=plan.generation, restore_step=step, local=sorted(self.layers))

    def _snapshot_source(self, plan: Plan):
        """What `transfer` sends for a copy from a snapshot: this rank's host copy at the restore step."""
        if plan.restore_step is None or self.snapshots is None:
            return None
        store, step = self.snapshots.store, plan.restore_step
        return lambda layer: store.get(step, layer)

    def live_layers(self) -> list[int]:
        """The layers this worker holds whole: what layer-level copy planners may name it the source of."""
        return sorted(layer for layer, module in self.layers.items() if sharding(module) == (1, 0))

    def live_shards(self) -> dict[int, tuple[int, int]]:
        """The layers this worker holds as tensor-parallel shards, each with its (t, k): reported beside the
        whole ones, so that a generation's members copy shards (runtime/elastic/shard_sources.py)."""
        return {layer: sharding(module) for layer, module in sorted(self.layers.items()) if sharding(module) != (1, 0)}

    def layer_state_bytes(self) -> list[int]:
        """Every layer's full state in bytes (`state.flatten`'s size): what a copy of it moves.
        Measured at start-up on the meta device: sizes without allocating the whole model."""
        return self._state_bytes

    def _step_from_state(self) -> int:
        """A joining worker learns the job's step from the optimizer state it received."""
        steps = {int(state.step.item()) for (layer, _), state in self.optimizer.state.items() if layer in self.layers}
        if len(steps) != 1:
            raise ValueError(f"copies: received layers disagree on the step counter: {sorted(steps)}")
        return steps.pop()

    def _check_steps(self, rank: int) -> None:
        """Every held layer must have taken exactly `self.step` optimizer steps (a copy from a replica
        that is a step ahead or behind would silently fork the model)."""
        behind = {
            layer
            for (layer, _), state in self.optimizer.state.items()
            if layer in self.layers and int(state.step.item()) != self.step
        }
        if behind:
            raise ValueError(
                f"copies: rank {rank} is at step {self.step} but holds layers {sorted(behind)} at other steps"
            )

    def catch_up(self, step: int) -> None:
        """Behind the generation's newest step (its replicas applied a step it did not): drop every layer and
        go on from `step`. The plan's copies bring the layers at that step (runtime/elastic/sources.py), and
        `adopt` checks that they are; a layer the copies miss fails the adoption, it is never rebuilt."""
        if self.snapshots is not None:
            self.snapshots.fence()  # a capture in flight reads the layers dropped here
        self._log("catching-up", to_step=step, dropped=sorted(self.layers))
        self.layers.clear()
        self.optimizer.state.clear()
        self.step = step

    def abandon(self) -> None:
        """Drop the current generation without waiting for anything in flight."""
        if self.groups is not None:
            self.groups.abandon()
        if self.engine is not None:
            self.engine.release()
        self.groups = self.engine = None
        if self.snapshots is not None:
            self.snapshots.store.freeze()  # what the next report lists must stay until the next plan

    def bench(self) -> None:
        """Left out of training for its slowness: hold nothing, as a warm spare, until a plan takes this worker
        back (its layers then come from their holders and its step from their state, as a newcomer's). The pace
        calibration stays, so that once back it reads slow if it still is (runtime/train/pace.py)."""
        self.abandon()
        for layer in list(self.layers):
            del self.layers[layer]
            self.optimizer.drop_layer(layer)
        self.started = False
        self.plan = self.rank = None
        self._expected_compute = None
        self.pace.on_stage(())

    # -- steps -------------------------------------------------------------------------------------

    def train_step(self) -> StepOutcome:
        """Run global step `self.step` under the adopted plan; advances the counter only on success."""
        if self.engine is None:
            raise RuntimeError("train_step: no plan adopted (call adopt(plan) first)")
        assert self.plan is not None and self.rank is not None, "an engine runs an adopted plan"
        if self.snapshots is not None and self.snapshots.due(self.plan.generation, self.step):
            # The state before this step (the last committed one), captured while the step runs;
            # the optimizer update waits for the capture (_FencedOptimizer).
            layers, optimizer = self.layers, self.optimizer
            mine = layout(self.plan, self.rank)
            if mine.tensor_parallel > 1:  # snapshots hold whole layers: a stage of any t restores from them
                layers, optimizer = gather_state(self.model, layers, mine, self.channel, self.device, optimizer)
            self.snapshots.begin(self.plan, self.rank, self.step, layers, optimizer)
        outcome = self.engine.train_step(self.step)
        self.step += 1
        if self.failure_time is not None:
            self.metrics.recovery_seconds.observe(time.monotonic() - self.failure_time)
            self.failure_time = None
        self.metrics.observe_step(outcome.seconds, outcome.samples, outcome.tokens, self.step, outcome.loss)
        self.pace.add(outcome.compute_seconds, self._expected_compute, outcome.step)
        self.metrics.observe_pace(outcome.compute_seconds, self.pace.profile_ratio, self.pace.slowdown)
        if self.logs_loss:
            self._append_loss(outcome)
        self._log(
            "step",
            step=outcome.step,
            loss=outcome.loss,
            seconds=round(outcome.seconds, 6),
            compute=round(outcome.compute_seconds, 6),
        )
        return outcome

    @property
    def logs_loss(self) -> bool:
        """The first rank of the last stage of the first pipeline writes the global loss."""
        if self.plan is None:
            return False
        return self.rank == self.plan.pipelines[0].stages[-1].ranks[0]

    def run_static(self, plan: Plan, steps: int | None = None) -> list[StepOutcome]:
        """Adopt `plan` and train until `steps` (default: config.steps) global steps are done."""
        self.adopt(plan)
        target = self.config.steps if steps is None else steps
        outcomes = []
        while self.step < target:
            outcomes.append(self.train_step())
        return outcomes

    # -- output ------------------------------------------------------------------------------------

    def _append_loss(self, outcome: StepOutcome) -> None:
        if self.losses_path is None:
            return
        # process_time: this process's CPU (all threads) so far; its growth per step holds on a loaded machine
        record = {
            "job": self.config.job,
            "rank": self.rank,
            **asdict(outcome),
            "time": time.time(),
            "cpu": time.process_time(),
        }
        with self.losses_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def _log(self, event: str, **fields) -> None:
        generation = self.plan.generation if self.plan is not None else None
        log.info(
            json.dumps(
                {
                    "event": event,
                    "job": self.config.job,
                    "node": self.node,
                    "gpu": self.gpu,
                    "rank": self.rank,
                    "generation": generation,
                    "step": self.step,
                    "pid": os.getpid(),
                    **fields,
                }
            )
        )

    def export_huggingface(self, directory: str | Path) -> list[int]:
        """For a transformers model: write the layers this rank is the lowest-ranked holder of as shards of
        a Hugging Face directory (the holder of layer 0 adds config.json and the index; runtime/models/hf_checkpoint.py).
        Every worker calls it when training completes; returns the layers written."""
        from oobleck.runtime.models.hf import TransformersModel
        from oobleck.runtime.models.hf_checkpoint import write_checkpoint

        if not isinstance(self.model, TransformersModel) or self.plan is None or self.rank is None:
            return []
        held, mine_layout = self.layers, layout(self.plan, self.rank)
        if mine_layout.tensor_parallel > 1:  # the group's shards glued whole (every rank of the group takes part)
            held = gather_state(self.model, self.layers, mine_layout, self.channel, self.device, self.optimizer)[0]
        mine = {layer: module for layer, module in held.items() if min(self.plan.holders(layer)) == self.rank}
        write_checkpoint(self.model, directory, mine)
        self._log("huggingface_export", directory=str(directory), layers=sorted(mine))
        return sorted(mine)

    def final_export(self) -> None:
        """On success: the Hugging Face directory `<checkpoint.path>/huggingface` (transformers models)."""
        if self.config.checkpoint.path:
            self.export_huggingface(Path(self.config.checkpoint.path) / "huggingface")

    def layer_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """Parameters of every held layer (CPU copies), for checks and dumps."""
        return {
            layer: {name: p.detach().cpu().clone() for name, p in module.named_parameters()}
            for layer, module in sorted(self.layers.items())
        }
