"""The worker's typed configuration: what to train and how. The plan says *where*; this says *what*.

Every worker of a job reads the same config (a JSON or YAML file); `build_model` and `build_dataset`
turn it into the objects the engine and the reference trainer share.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TransformersConfig(_Strict):
    """A Hugging Face `transformers` causal LM (runtime/models/hf.py): exactly one of `preset`, `config`, `config_path`."""

    family: str | None = Field(
        default=None, description="llama, mistral, qwen2 or gpt2; default: the config's model_type"
    )
    preset: str | None = Field(
        default=None, description="a preset of runtime/models/hf.py PRESETS (gpt3-350m, llama-tiny, ...)"
    )
    config: dict[str, Any] | None = Field(default=None, description="config.json fields")
    config_path: str | None = Field(default=None, description="a config.json file (a mounted ConfigMap key)")
    sequence_length: int | None = Field(
        default=None, ge=1, description="tokens per sample; default the config's maximum"
    )
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    init_from: str | None = Field(default=None, description="safetensors directory to read initial weights from")

    @model_validator(mode="after")
    def _one_source(self) -> TransformersConfig:
        given = [n for n in ("preset", "config", "config_path") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of preset, config and config_path (got {given or 'none'})")
        return self


class ModelConfig(_Strict):
    name: str = Field(default="tiny-gpt", description="'gpt', a preset ('tiny-gpt', ...) or 'module:function'")
    sizes: dict[str, int | float] = Field(
        default_factory=dict, description="size overrides (blocks, hidden, heads, seq_len, vocab, dropout)"
    )
    transformers: TransformersConfig | None = Field(
        default=None, description="a Hugging Face model instead of `name` (runtime/models/hf.py)"
    )


class DataConfig(_Strict):
    kind: Literal["synthetic", "file"] = "synthetic"
    path: str | None = Field(default=None, description="token file for kind=file (.npy, .bin, or any file as bytes)")
    dtype: Literal["uint16", "uint32"] | None = Field(
        default=None,
        description="ids of a raw token file (any suffix but .npy); None: by suffix (.bin uint16, .i32.bin int32, "
        "else bytes)",
    )
    noise: float = Field(default=0.1, ge=0, le=1, description="synthetic: probability of a random token")

    @model_validator(mode="after")
    def _path_for_file(self) -> DataConfig:
        if self.kind == "file" and not self.path:
            raise ValueError("path: required when kind is 'file'")
        return self


class OptimConfig(_Strict):
    """AdamW with linear warmup then `schedule` decay (cosine by default) to `min_lr_ratio * lr` at `decay_steps`."""

    lr: float = Field(default=1e-3, gt=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.1, ge=0, description="applied to matrices (ndim >= 2) only")
    warmup_steps: int = Field(default=5, ge=0)
    decay_steps: int = Field(default=1000, ge=1)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    schedule: Literal["cosine", "linear", "constant"] = Field(
        default="cosine", description="decay after warmup; constant keeps lr (the job spec's training.schedule)"
    )


class Timeouts(_Strict):
    """Every wait the runtime does, named and overridable (seconds)."""

    connect: float = Field(default=60.0, gt=0, description="building a generation's process groups")
    poll: float = Field(default=0.05, gt=0, description="granularity of interruptible waits")
    step: float = Field(default=600.0, gt=0, description="one wait inside a step before giving up")


class SnapshotConfig(_Strict):
    """In-memory snapshots on a peer (runtime/snapshot/agent.py): what survives losing every replica of a layer."""

    interval_steps: int = Field(
        default=10,
        ge=0,
        description="snapshot every this many steps into host memory, own and a buddy's on another node "
        "(costs 2 x (own + buddy's) layer state of host memory); 0 disables",
    )


class CheckpointConfig(_Strict):
    """Periodic checkpoints to a directory (a PVC in a pod): used when even the in-memory snapshots lost a layer."""

    path: str | None = Field(default=None, description="directory shared by every worker; None disables")
    interval_steps: int = Field(default=100, ge=1, description="write every this many steps")
    keep: int = Field(default=2, ge=1, description="complete checkpoints to keep")
    format: Literal["native", "huggingface"] = Field(
        default="native",
        description="huggingface: also a Hugging Face directory `huggingface-step<N>` at every checkpoint "
        "(transformers models); they always write `<path>/huggingface` when training completes",
    )


class WorkerConfig(_Strict):
    job: str = Field(default="local", min_length=1)
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    microbatch_size: int = Field(default=4, ge=1, description="samples per microbatch")
    steps: int = Field(default=20, ge=0, description="global steps to train")
    seed: int = Field(default=0, ge=0, description="seeds weights (per layer) and data (per microbatch)")
    on_non_finite: Literal["fail", "skipStep", "rollback"] = Field(
        default="fail", description="a step with a NaN/Inf loss or gradient: runtime/elastic/nonfinite.py"
    )
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto: cuda when available")
    threads: int = Field(default=1, ge=1, description="torch intra-op threads (fixed for determinism)")
    timeouts: Timeouts = Timeouts()
    precision: Literal["fp32", "bf16"] = Field(
        default="fp32",
        description="bf16: forward (and the backward it records) under bfloat16 autocast; weights, gradients and "
        "AdamW state stay float32 (master weights)",
    )
    recompute: Literal["none", "full"] = Field(
        default="none",
        description="full: keep only each layer's input and recompute its activations in the backward "
        "(torch.utils.checkpoint, non-reentrant, the same dropout masks)",
    )
    max_grad_norm: float | None = Field(
        default=None, gt=0, description="clip gradients to this global L2 norm over every layer; None: no clipping"
    )
    gradient_sum_dtype: Literal["float32", "float64"] = Field(
        default="float32",
        description="accumulator of the per-layer gradient sums: float32 (the default, as DDP); float64 makes every "
        "layout agree with the single-process reference to ~1 ulp (costs 8 bytes per parameter and a slower "
        "all-reduce), which the equivalence tests use",
    )
    snapshot: SnapshotConfig = SnapshotConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()


def load_config(path: str | Path) -> WorkerConfig:
    """Read a worker config from JSON or YAML; errors name the file and the field."""
    import yaml

    path = Path(path)
    text = path.read_text()
    try:
        raw = (yaml.safe_load(text) or {}) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as error:
        raise ValueError(
            f"{path}: not valid {'YAML' if path.suffix in ('.yaml', '.yml') else 'JSON'}: {error}"
        ) from error
    try:
        return WorkerConfig.model_validate(raw)
    except ValidationError as error:
        raise ValueError(f"{path}: invalid worker config: {error}") from error


def build_model(config: WorkerConfig):
    """The config's LayeredModel (see oobleck.runtime.models.layered.load_model)."""
    from oobleck.runtime.models.layered import load_model

    hf = config.model.transformers
    if hf is not None:
        from oobleck.runtime.models.hf import load_transformers

        return load_transformers(
            hf.family,
            hf.config,
            preset=hf.preset,
            config_path=hf.config_path,
            seed=config.seed,
            sequence_length=hf.sequence_length,
            attn_implementation=hf.attn_implementation,
            init_from=hf.init_from,
        )
    return load_model(config.model.name, seed=config.seed, sizes=config.model.sizes)


def build_dataset(config: WorkerConfig, model):
    """The config's dataset, shaped for `model` (sequence length and vocabulary from the model)."""
    from oobleck.runtime.train.data import SyntheticTokens, TokenFile

    example = model.example_input(1)
    seq_len = int(example.shape[1])
    vocab = getattr(model, "vocab_size", None) or getattr(getattr(model, "sizes", None), "vocab", None)
    if config.data.kind == "synthetic":
        if vocab is None:
            raise ValueError(
                "data.kind: synthetic data needs a model with sizes.vocab (use kind=file for custom models)"
            )
        return SyntheticTokens(vocab, seq_len, config.microbatch_size, seed=config.seed, noise=config.data.noise)
    if config.data.path is None:
        raise ValueError("data.path: required with kind=file")
    return TokenFile(
        config.data.path, seq_len, config.microbatch_size, seed=config.seed, vocab=vocab, dtype=config.data.dtype
    )
