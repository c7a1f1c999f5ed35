"""`oobleck launch`'s options and what they set up: the worker config, the model profile, generation 0."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_COPY_BANDWIDTH = 10e9
"""bytes/s a layer copy is priced at when re-planning: the inter-node bandwidth generation 0 is planned with"""


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
    max_tensor_parallel: int = 1
    """the largest tensor-parallel degree the planner may give a stage (a power of two <= gpus_per_node)"""

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
        t = self.max_tensor_parallel
        if t < 1 or t & (t - 1) or t > self.gpus_per_node:
            raise ValueError(
                f"max_tensor_parallel: must be a power of two <= gpus_per_node ({self.gpus_per_node}), got {t}"
            )
        if self.controller not in ("reports", "layouts"):
            raise ValueError(f"controller: must be 'reports' or 'layouts', got {self.controller!r}")
        restart = self.restart_coordinator_at_step
        if restart is not None and not 0 <= restart < self.steps:
            raise ValueError(f"restart_coordinator_at_step: {restart} is outside the job's steps 0..{self.steps - 1}")


def config_from_options(o: LaunchOptions):
    """The workers' WorkerConfig: the options' config file (or the defaults) with the options applied."""
    from oobleck.runtime.train.config import WorkerConfig, load_config

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


def load_profile(o: LaunchOptions, config):
    """The model's profile: the options' file, else measured now on the CPU."""
    import torch

    from oobleck.api.profile import ModelProfile

    if o.profile is not None:
        return ModelProfile.model_validate_json(Path(o.profile).read_text())
    from oobleck.runtime.train.config import build_model
    from oobleck.runtime.train.profiler import profile_model

    torch.set_num_threads(config.threads)
    return profile_model(
        build_model(config), config.microbatch_size, torch.device("cpu"), 1, 2, config.precision, config.recompute
    )


def initial_plan(o: LaunchOptions, profile, nodes: list[str]):
    """Generation 0 on `nodes` (`oobleck.planner.plan_job`)."""
    from oobleck.api.profile import ClusterShape
    from oobleck.planner.instantiate import plan_job

    cluster = ClusterShape(
        nodes=len(nodes),
        gpus_per_node=o.gpus_per_node,
        gpu_memory_bytes=o.gpu_memory,
        intra_node_bandwidth=100e9,
        inter_node_bandwidth=o.copy_bandwidth,
    )
    return plan_job(
        profile,
        cluster,
        o.f,
        o.microbatches,
        o.job,
        nodes=nodes,
        microbatch_size=o.microbatch_size,
        max_tp=o.max_tensor_parallel,
    )
