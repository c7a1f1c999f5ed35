"""A worker pod's configuration: the operator's environment (PodEnv) and the job spec -> WorkerConfig."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from oobleck.api.contract import WORKER_PORT, PodContract
from oobleck.api.model_spec import TransformersModel
from oobleck.api.schema import MODEL_CONFIG_DIR
from oobleck.api.spec import OobleckJobSpec
from oobleck.runtime.train.config import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    Timeouts,
    TransformersConfig,
    WorkerConfig,
)


class PodEnv(PodContract):
    """A worker pod's environment: the operator's contract (oobleck.api.contract.PodContract) and the
    tunables a job may set through `spec.pod.env` (see runtime/backends/pod/main.py's docstring)."""

    dead_after_s: float = Field(3.0, alias="WORKER_DEAD_AFTER_S", gt=0)
    heartbeat_period_s: float = Field(0.1, alias="WORKER_HEARTBEAT_PERIOD_S", gt=0)
    metrics_port: int = Field(WORKER_PORT, alias="WORKER_METRICS_PORT", ge=-1)
    """-1: off; 0: any free port"""
    progress_interval_s: float = Field(1.0, alias="WORKER_PROGRESS_INTERVAL_S", ge=0)
    compute_device: Literal["cpu"] | None = Field(None, alias="WORKER_DEVICE")
    """"cpu" overrides a cuda spec's compute device (see runtime/backends/pod/main.py's docstring)"""


def job_checkpoint_dir(path: str, job: str) -> str:
    """The job's own folder under spec.checkpoint.path: `<path>/<job>` (a job name is a DNS label)."""
    return f"{path.rstrip('/')}/{job}"


def config_from_spec(
    spec: OobleckJobSpec,
    job: str,
    *,
    connect_timeout_s: float = 120.0,
    compute_device: str | None = None,
) -> WorkerConfig:
    """The runtime's WorkerConfig for a job spec: model, training, data, seed, device, timeouts, checkpoints.

    Paths (token file, checkpoint directory, model config) are the container's, where the pod mounts them.
    `compute_device` "cpu" (WORKER_DEVICE) runs a cuda spec on the CPU. Raises ValueError naming the
    spec field the runtime cannot honour."""

    gpt = spec.model.gpt
    if gpt is not None:
        if gpt.ffn_hidden_size is not None and gpt.ffn_hidden_size != 4 * gpt.hidden_size:
            raise ValueError(
                f"spec.model.gpt.ffnHiddenSize: the built-in GPT's MLP is 4 * hiddenSize = {4 * gpt.hidden_size}, "
                f"got {gpt.ffn_hidden_size}"
            )
        model = ModelConfig(
            name="gpt",
            sizes={
                "blocks": gpt.layers,
                "hidden": gpt.hidden_size,
                "heads": gpt.heads,
                "seq_len": gpt.sequence_length,
                "vocab": gpt.vocab_size,
            },
        )
    elif spec.model.transformers is not None:
        model = ModelConfig(transformers=transformers_config(spec.model.transformers))
    else:
        model = ModelConfig(name=str(spec.model.entry_point))
    training = spec.training
    optim = OptimConfig(
        lr=training.learning_rate,
        warmup_steps=training.warmup_steps,
        weight_decay=training.weight_decay,
        # The spec's schedule decays to 10 % of the learning rate at the last step.
        decay_steps=training.steps,
        min_lr_ratio=0.1,
        schedule=training.schedule,
    )
    if spec.data.source == "tokenFile":
        path = str(spec.data.path)
        data = DataConfig(kind="file", path=path, dtype=spec.data.dtype)
    else:
        data = DataConfig(kind="synthetic")
    checkpoint = CheckpointConfig()
    if spec.checkpoint is not None:
        checkpoint = CheckpointConfig(
            # Scoped per job: jobs sharing a volume never restore or prune each other's steps.
            path=job_checkpoint_dir(spec.checkpoint.path, job),
            interval_steps=spec.checkpoint.interval_steps,
            keep=spec.checkpoint.keep,
            format=spec.checkpoint.format,
        )
    device = "cpu" if compute_device == "cpu" else spec.device
    return WorkerConfig(
        job=job,
        model=model,
        data=data,
        optim=optim,
        microbatch_size=training.microbatch_size,
        steps=training.steps,
        seed=training.seed,
        on_non_finite=training.on_non_finite,
        precision=training.precision,
        recompute=training.recompute,
        max_grad_norm=training.max_grad_norm,
        gradient_sum_dtype=training.gradient_sum_dtype,
        device=device,
        threads=1,
        timeouts=Timeouts(connect=connect_timeout_s),
        checkpoint=checkpoint,
    )


def transformers_config(hf: TransformersModel) -> TransformersConfig:
    """The runtime's view of spec.model.transformers: the ConfigMap key and initFrom as container paths
    (operator/render.py mounts them)."""
    config_path = None
    if hf.config_map is not None:
        config_path = f"{MODEL_CONFIG_DIR}/{hf.config_map.key}"
    return TransformersConfig(
        family=hf.family,
        preset=hf.preset,
        config=hf.config,
        config_path=config_path,
        sequence_length=hf.sequence_length,
        attn_implementation=hf.attn_implementation,
        init_from=hf.init_from.path if hf.init_from is not None else None,
    )
