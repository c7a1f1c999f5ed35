"""The job's `spec.model`: the built-in GPT, a Hugging Face `transformers` model, or an entry point."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field

from oobleck.api.schema import ABSOLUTE_PATH_PATTERN, ENTRY_POINT_PATTERN, CrdModel, DnsName, Rule, mount_rule


class GPTModel(CrdModel):
    """A built-in GPT-style decoder: token and position embeddings, `layers` transformer blocks
    (pre-norm attention + MLP), a final norm and a language-model head."""

    layers: int = Field(ge=1, le=1024, description="Number of transformer blocks.")
    hidden_size: int = Field(ge=8, le=65536, description="Width of the residual stream; a multiple of heads.")
    heads: int = Field(ge=1, le=512, description="Attention heads per block.")
    sequence_length: int = Field(ge=2, le=131072, description="Tokens per sample (the context length).")
    vocab_size: int = Field(ge=2, le=1048576, description="Vocabulary size (token ids are 0..vocabSize-1).")
    ffn_hidden_size: int | None = Field(
        default=None, ge=8, le=262144, description="Width of the MLP's hidden layer; absent means 4 * hiddenSize."
    )

    _RULES = (
        Rule(
            cel="self.heads == 0 || self.hiddenSize % self.heads == 0",
            message="hiddenSize (%d) must be divisible by heads (%d): remainder %d",
            cel_args=("self.hiddenSize", "self.heads", "self.hiddenSize % self.heads"),
            args=lambda m: (m.hidden_size, m.heads, m.hidden_size % m.heads),
            check=lambda m: m.hidden_size % m.heads == 0,
            field_path=".heads",
        ),
    )


TransformersFamily = Literal["llama", "mistral", "qwen2", "gpt2"]
TransformersPreset = Literal["gpt3-350m", "gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b", "llama-tiny"]
TRANSFORMERS_FAMILIES: tuple[str, ...] = get_args(TransformersFamily)
TRANSFORMERS_PRESETS: tuple[str, ...] = get_args(TransformersPreset)


class ModelConfigMap(CrdModel):
    """A ConfigMap key holding a Hugging Face config.json."""

    name: DnsName = Field(description="ConfigMap name, in the job's namespace.")
    key: str = Field(
        default="config.json",
        min_length=1,
        max_length=253,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="Key within the ConfigMap.",
    )


class InitFrom(CrdModel):
    """Initial weights from a Hugging Face safetensors directory (model.safetensors, or shards with
    model.safetensors.index.json); each worker reads only its own layers' tensors."""

    path: str = Field(
        min_length=2,
        max_length=1024,
        pattern=ABSOLUTE_PATH_PATTERN,
        description="Absolute directory in the worker container.",
    )
    claim_name: DnsName | None = Field(
        default=None,
        description="PersistentVolumeClaim mounted read-only at `path`; absent means the directory is in the image.",
    )

    _RULES = (mount_rule("model.transformers.initFrom.path", "self.path", lambda m: m.path),)


class TransformersModel(CrdModel):
    """A causal language model of the `transformers` package, split into the planner's layers (embeddings,
    each decoder block, final norm + head). The config comes from exactly one of `preset`, `config` and
    `configMap`; nothing is downloaded: weights start from training.seed, or from `initFrom`."""

    family: TransformersFamily | None = Field(
        default=None,
        description="Model family: llama (also mistral and qwen2, split the same way) or gpt2. Required "
        "unless preset is set (the preset names its family).",
    )
    preset: TransformersPreset | None = Field(
        default=None,
        description="A built-in config: gpt3-350m, gpt3-1.3b, gpt3-2.7b, gpt3-6.7b (the GPT-3 paper's sizes as "
        "GPT-2 models, context 2048) or llama-tiny (trains on a laptop CPU).",
    )
    config: dict[str, Any] | None = Field(
        default=None,
        description="config.json fields inline (e.g. hidden_size, num_hidden_layers, vocab_size).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    config_map: ModelConfigMap | None = Field(default=None, description="A ConfigMap key holding config.json.")
    sequence_length: int | None = Field(
        default=None,
        ge=2,
        le=1048576,
        description="Tokens per sample; absent means the config's max_position_embeddings (n_positions).",
    )
    attn_implementation: Literal["sdpa", "eager"] = Field(
        default="sdpa", description="Attention kernel: sdpa (torch scaled_dot_product_attention) or eager."
    )
    init_from: InitFrom | None = Field(
        default=None, description="Initial weights from a safetensors directory (e.g. a finished job's checkpoint)."
    )

    _RULES = (
        Rule(
            cel="(has(self.preset) ? 1 : 0) + (has(self.config) ? 1 : 0) + (has(self.configMap) ? 1 : 0) == 1",
            message="set exactly one of model.transformers.preset, config and configMap",
            check=lambda m: sum(x is not None for x in (m.preset, m.config, m.config_map)) == 1,
        ),
        Rule(
            cel="has(self.preset) != has(self.family)",
            message="model.transformers.family is required with config or configMap, and comes from the preset "
            "with preset",
            check=lambda m: (m.preset is None) != (m.family is None),
            field_path=".family",
        ),
    )


class ModelSpec(CrdModel):
    """What to train: the built-in GPT with its sizes, a Hugging Face `transformers` model, or your own
    layers from an entry point. Set exactly one of `gpt`, `transformers` and `entryPoint`."""

    gpt: GPTModel | None = Field(default=None, description="The built-in GPT-style model with these sizes.")
    entry_point: str | None = Field(
        default=None,
        max_length=256,
        pattern=ENTRY_POINT_PATTERN,
        description="`module:function` importable in the worker image; the function takes no arguments and "
        "returns the model as a list of torch.nn.Module layers (the planner's unit of placement).",
    )

    transformers: TransformersModel | None = Field(
        default=None, description="A Hugging Face transformers causal LM (Llama, Mistral, Qwen2 or GPT-2 family)."
    )

    _RULES = (
        Rule(
            cel="(has(self.gpt) ? 1 : 0) + (has(self.entryPoint) ? 1 : 0) + (has(self.transformers) ? 1 : 0) == 1",
            message="set exactly one of model.gpt, model.transformers and model.entryPoint",
            check=lambda m: sum(x is not None for x in (m.gpt, m.entry_point, m.transformers)) == 1,
        ),
    )
