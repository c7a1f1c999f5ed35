"""The OobleckJob custom resource: spec and status, defined once as pydantic models.

These models are the single source of the CRD schema: `oobleck.api.crd` renders them into the
OpenAPI schema in `crds/`, so every `description` here is what `kubectl explain oj.spec...` shows.
Cross-field rules are declared once per model (`_RULES`) and enforced twice: by the API server as
CEL (`x-kubernetes-validations`) and by pydantic when the operator or a test parses a spec, with the
same wording, so an invalid job is rejected with the same message either way.

Field names are snake_case in Python and camelCase in Kubernetes (aliases); both are accepted, and
dumps use the Kubernetes names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from pydantic.alias_generators import to_camel

GROUP = "oobleck.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "OobleckJob"
PLURAL = "oobleckjobs"
SINGULAR = "oobleckjob"
SHORT_NAMES = ("oj",)

# Child objects are named `<job>-<suffix>` (pods `<job>-worker-<n>`, a Service, a ConfigMap) and
# Services need DNS-1035 labels of at most 63 characters: 40 leaves room for the suffixes.
MAX_NAME_LENGTH = 40
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# Labels and environment variables the operator and runtime set themselves; overrides may not.
RESERVED_LABEL_PREFIX = f"{GROUP}/"
RESERVED_ENV_PREFIX = "OOBLECK_"
# The label on every worker pod naming its job; status.selector (the scale subresource's label
# selector) is `worker_selector(job_name)`.
JOB_LABEL = f"{GROUP}/job"
# Every pod of a job also carries its role: `worker` (one per node) or `coordinator`.
ROLE_LABEL = f"{GROUP}/role"
WORKER_ROLE = "worker"
COORDINATOR_ROLE = "coordinator"

MAX_NODES = 4096
# Warm spares each keep a node (its GPUs) idle: a few cover the failures a reconfiguration meets at once.
MAX_SPARES = 64
# The planner's cost grows with nodes and layers (measured: 1024 nodes x 512 GPT layers 7 s, 1024 x 1024
# 14 s and 744 MB): the API server refuses GPT shapes beyond this product up front; the operator's
# planner limits (time, memory per call) bound the rest (entry points, transformers configs).
MAX_NODES_TIMES_LAYERS = 524288
# An absolute path with no empty, trailing or root-only component: /a, /a/b.
ABSOLUTE_PATH_PATTERN = r"^(/[^/]+)+$"
# Kubernetes resource quantity, unsigned (e.g. "500m", "2", "8Gi", "1e3"): the apimachinery grammar.
QUANTITY_PATTERN = (
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
# A Kubernetes label or annotation key, or a resource name: [prefix/]name.
QUALIFIED_NAME_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ENTRY_POINT_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"

Quantity = Annotated[int, Field(ge=0)] | Annotated[str, StringConstraints(pattern=QUANTITY_PATTERN, max_length=64)]
DnsName = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)]
LabelValue = Annotated[str, StringConstraints(max_length=63)]
AnnotationValue = Annotated[str, StringConstraints(max_length=4096)]


def _no_args(model: Any) -> tuple[Any, ...]:
    return ()


@dataclass(frozen=True)
class Rule:
    """A cross-field rule of one model, enforced by the API server (CEL) and by pydantic (`check`).

    `message` is one printf-style template (%d, %s) for both sides, filled from `cel_args` (CEL
    expressions: the API server runs `'<message>'.format([...])`, whose cost it can bound, unlike
    `string(int)` concatenation) and from `args(model)` in Python. `field_path` is relative to the
    model (".min"); the API server reports the error at that field.
    """

    cel: str | None  # None: the API server enforces it another way (a list-map key, a field's own rule)
    message: str
    check: Callable[[Any], bool]
    cel_args: tuple[str, ...] = ()
    args: Callable[[Any], tuple[Any, ...]] = _no_args
    field_path: str | None = None
    reason: Literal["FieldValueInvalid", "FieldValueForbidden", "FieldValueRequired"] = "FieldValueInvalid"

    def python_message(self, model: Any) -> str:
        return self.message % self.args(model) if self.cel_args else self.message

    def to_cel(self) -> dict[str, str]:
        """The x-kubernetes-validations entry."""
        assert self.cel is not None and "'" not in self.message
        rule = {"rule": self.cel}
        if self.cel_args:
            rule["messageExpression"] = f"'{self.message}'.format([{', '.join(self.cel_args)}])"
        else:
            rule["message"] = self.message
        if self.field_path:
            rule["fieldPath"] = self.field_path
        rule["reason"] = self.reason
        return rule


def immutable(what: str) -> dict[str, Any]:
    """Schema extra that makes a field unchangeable after creation (a CEL transition rule)."""
    message = f"{what} is immutable: create a new OobleckJob to change it"
    return {
        "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": message, "reason": "FieldValueForbidden"}]
    }


def _add_rules(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    # pydantic hook: put the model's CEL rules into its JSON schema, which crd.py keeps.
    rules = [rule.to_cel() for rule in getattr(cls, "_RULES", ()) if rule.cel is not None]
    if rules:
        schema["x-kubernetes-validations"] = rules
    schema.pop("title", None)


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        json_schema_extra=_add_rules,
    )
    _RULES: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> Any:
        for rule in self._RULES:
            if not rule.check(self):
                raise ValueError(rule.python_message(self))
        return self

    def to_kubernetes(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase names, unset optional fields left out."""
        return self.model_dump(mode="json", exclude_none=True)


def defaulted(model: type[_Model]) -> dict[str, Any]:
    """Schema extra for a field whose model has a default for every field: the API server fills the
    whole object in when it is absent, so `kubectl get -o yaml` shows what the job will use. (The
    full object, not `{}`: the API server checks a default against the CEL rules as it is.)"""
    return {"default": model().to_kubernetes()}


# --- spec ------------------------------------------------------------------------------------------


class GPTModel(_Model):
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
MODEL_CONFIG_DIR = "/etc/oobleck/model"
"""Where worker pods see the model's config.json ConfigMap key (model.transformers.configMap)."""
SHM_DIR = "/dev/shm"
"""Where worker pods get a memory-backed emptyDir (NCCL and the data loader need more than 64 MiB)."""
RESERVED_MOUNT_PATHS = (SHM_DIR, MODEL_CONFIG_DIR)
"""Directories the operator mounts volumes at: no user volume may be mounted at one or above one."""
_RESERVED_CEL = "[" + ", ".join(f"'{p}'" for p in RESERVED_MOUNT_PATHS) + "]"


def _clear_of_reserved(path: str) -> bool:
    return all(path != r and not r.startswith(path + "/") for r in RESERVED_MOUNT_PATHS)


def _clear_of_reserved_cel(path: str) -> str:
    return f"{_RESERVED_CEL}.all(r, {path} != r && !r.startsWith({path} + '/'))"


def _mount_rule(field: str, cel_path: str, python_path: Callable[[Any], str | None]) -> Rule:
    """The rule that a user path (`field`) is not a directory the operator mounts, nor above one."""
    return Rule(
        cel=_clear_of_reserved_cel(cel_path),
        message=f"{field} %s: the operator mounts volumes at {' and '.join(RESERVED_MOUNT_PATHS)} in worker "
        "containers; use a directory that is neither one of them nor above one",
        cel_args=(cel_path,),
        args=lambda m: (python_path(m),),
        check=lambda m: python_path(m) is None or _clear_of_reserved(str(python_path(m))),
        field_path=f".{field.rsplit('.', 1)[-1]}",
    )


def data_directory(path: str) -> str:
    """The directory of a token file, where its claim is mounted ("" for a file at /)."""
    return path.rsplit("/", 1)[0]


_DATA_DIR_CEL = "self.data.path.substring(0, self.data.path.lastIndexOf('/'))"


class ModelConfigMap(_Model):
    """A ConfigMap key holding a Hugging Face config.json."""

    name: DnsName = Field(description="ConfigMap name, in the job's namespace.")
    key: str = Field(
        default="config.json",
        min_length=1,
        max_length=253,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="Key within the ConfigMap.",
    )


class InitFrom(_Model):
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

    _RULES = (_mount_rule("model.transformers.initFrom.path", "self.path", lambda m: m.path),)


class TransformersModel(_Model):
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


class ModelSpec(_Model):
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


class NodeRange(_Model):
    """How many nodes the job runs on: one worker pod per node, `gpusPerNode` GPUs each."""

    min: int = Field(ge=1, le=MAX_NODES, description="Fewest nodes the job keeps training on; with fewer it fails.")
    max: int = Field(ge=1, le=MAX_NODES, description="Most nodes the job uses.")
    target: int | None = Field(
        default=None,
        ge=1,
        le=MAX_NODES,
        description="Nodes the job asks for, between min and max; `kubectl scale oj/NAME --replicas=N` sets it. "
        "Absent means max.",
    )
    spares: int = Field(
        default=0,
        ge=0,
        le=MAX_SPARES,
        description="Warm spare worker pods kept beyond the wanted nodes: started, the runtime imported and "
        "connected to the job's store, holding no layers. A lost node is replaced by a spare in the very "
        "generation that drops it, and a new pod becomes the spare.",
    )

    @property
    def wanted(self) -> int:
        """The node count the job asks for: `target`, or `max` when unset."""
        return self.max if self.target is None else self.target

    _RULES = (
        Rule(
            cel="self.min <= self.max",
            message="nodes.min (%d) must be <= nodes.max (%d)",
            cel_args=("self.min", "self.max"),
            args=lambda m: (m.min, m.max),
            check=lambda m: m.min <= m.max,
            field_path=".min",
        ),
        Rule(
            cel="!has(self.target) || (self.min <= self.target && self.target <= self.max)",
            message="nodes.target (%d) must be between nodes.min (%d) and nodes.max (%d)",
            cel_args=("self.target", "self.min", "self.max"),
            args=lambda m: (m.target, m.min, m.max),
            check=lambda m: m.target is None or m.min <= m.target <= m.max,
            field_path=".target",
        ),
    )


class PodResources(_Model):
    """CPU and memory each worker pod requests. Memory is also its limit; CPU is not limited (a CPU
    limit throttles the data loader and collectives). GPUs are requested separately (`gpusPerNode`)."""

    cpu: Quantity = Field(default="1", description="CPU per worker pod, a Kubernetes quantity (e.g. 2, 500m).")
    memory: Quantity = Field(default="2Gi", description="Memory per worker pod, a Kubernetes quantity (e.g. 8Gi).")


class TrainingSpec(_Model):
    """The optimisation: steps, batch sizes and AdamW hyper-parameters. A step consumes one global batch,
    split into microbatches that the pipelines share."""

    steps: int = Field(ge=1, le=1_000_000_000, description="Optimizer steps to run; the job succeeds after the last.")
    global_batch_size: int = Field(
        ge=1,
        le=16_777_216,
        description="Samples per optimizer step, summed over all pipelines; a multiple of microbatchSize.",
        json_schema_extra=immutable("training.globalBatchSize"),
    )
    microbatch_size: int = Field(
        ge=1,
        le=65536,
        description="Samples per microbatch, the unit a pipeline stage processes at a time.",
        json_schema_extra=immutable("training.microbatchSize"),
    )
    reference_microbatches: int | None = Field(
        default=None,
        ge=1,
        le=16_777_216,
        description="Microbatches per pipeline the planner's templates are optimised for (m_ref). Absent: derived "
        "from the batch, the global microbatches spread over the most pipelines nodes.max can form. Set it higher "
        "when pipelines run more microbatches than that (templates then keep more in flight within memory). "
        "Read when generation 0 is planned.",
    )
    learning_rate: float = Field(default=3e-4, gt=0, le=10, description="Peak learning rate of AdamW.")
    warmup_steps: int = Field(
        default=0, ge=0, le=1_000_000_000, description="Steps of linear warmup from 0 to learningRate."
    )
    schedule: Literal["constant", "linear", "cosine"] = Field(
        default="cosine", description="Learning-rate decay after warmup, down to 10% of learningRate at the last step."
    )
    weight_decay: float = Field(default=0.0, ge=0, le=1, description="AdamW decoupled weight decay.")
    seed: int = Field(
        default=0,
        ge=0,
        le=2**31 - 1,
        description="Seed for weight initialisation and synthetic data.",
        json_schema_extra=immutable("training.seed"),
    )
    precision: Literal["fp32", "bf16"] = Field(
        default="fp32",
        description="fp32, or bf16: the forward under bfloat16 autocast with float32 master weights, gradients and "
        "AdamW state. The measured profile reflects it.",
    )
    recompute: Literal["none", "full"] = Field(
        default="none",
        description="full: each layer keeps only its input and recomputes its activations in the backward (less "
        "activation memory, about one more forward of time). The measured profile reflects it.",
    )
    max_grad_norm: float | None = Field(
        default=None,
        gt=0,
        le=1e6,
        description="Clip gradients to this global L2 norm over all layers (as torch.nn.utils.clip_grad_norm_); "
        "unset: no clipping.",
    )
    gradient_sum_dtype: Literal["float32", "float64"] = Field(
        default="float32",
        description="Accumulator of the gradient sums over microbatches and replicas: float32 (as DDP), or float64 "
        "so that every layout matches single-process training to rounding (8 bytes per parameter, slower sums).",
    )

    on_non_finite: Literal["fail", "skipStep", "rollback"] = Field(
        default="fail",
        description="What a step whose loss or gradients are NaN or Inf does (every rank agrees before the "
        "update): fail ends the job Failed/NonFiniteLoss; skipStep drops that update and goes on with the next "
        "step's data; rollback restores the newest in-memory snapshot (snapshots must be on) and goes on with "
        "the next step's data.",
    )

    @property
    def global_microbatches(self) -> int:
        return self.global_batch_size // self.microbatch_size

    _RULES = (
        Rule(
            cel="self.microbatchSize == 0 || self.globalBatchSize % self.microbatchSize == 0",
            message="globalBatchSize (%d) must be a multiple of microbatchSize (%d): remainder %d",
            cel_args=("self.globalBatchSize", "self.microbatchSize", "self.globalBatchSize % self.microbatchSize"),
            args=lambda m: (m.global_batch_size, m.microbatch_size, m.global_batch_size % m.microbatch_size),
            check=lambda m: m.global_batch_size % m.microbatch_size == 0,
            field_path=".globalBatchSize",
        ),
        Rule(
            cel="self.warmupSteps <= self.steps",
            message="warmupSteps (%d) must be <= steps (%d)",
            cel_args=("self.warmupSteps", "self.steps"),
            args=lambda m: (m.warmup_steps, m.steps),
            check=lambda m: m.warmup_steps <= m.steps,
            field_path=".warmupSteps",
        ),
    )


class DataSpec(_Model):
    """Where training samples come from."""

    source: Literal["synthetic", "tokenFile"] = Field(
        default="synthetic",
        description="synthetic: random token ids from training.seed (for tests and benchmarks); tokenFile: "
        "consecutive windows of sequenceLength + 1 tokens read from `path`.",
    )
    path: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        pattern=ABSOLUTE_PATH_PATTERN,
        description="Absolute path of the token file in the worker container: little-endian token ids of `dtype`, "
        "back to back (the nanoGPT train.bin layout; `oobleck tokenize` writes one). Required for tokenFile.",
    )
    dtype: Literal["uint16", "uint32"] = Field(
        default="uint16",
        description="Width of the token ids in the file: uint16 for vocabularies up to 65536, uint32 beyond "
        "(Llama 3's 128k).",
    )
    claim_name: DnsName | None = Field(
        default=None,
        description="PersistentVolumeClaim mounted read-only at the token file's directory; absent means the "
        "file is in the image.",
    )

    _RULES = (
        Rule(
            cel="self.source != 'tokenFile' || has(self.path)",
            message="data.path is required when data.source is tokenFile",
            check=lambda m: m.source != "tokenFile" or m.path is not None,
            field_path=".path",
            reason="FieldValueRequired",
        ),
        Rule(
            cel="self.source == 'tokenFile' || (!has(self.path) && !has(self.claimName))",
            message="data.path and data.claimName are only for data.source tokenFile",
            check=lambda m: m.source == "tokenFile" or (m.path is None and m.claim_name is None),
            field_path=".source",
            reason="FieldValueForbidden",
        ),
        Rule(
            cel="!has(self.claimName) || !has(self.path) || self.path.lastIndexOf('/') > 0",
            message="data.path %s: with data.claimName the claim is mounted at the directory of the file, which cannot "
            "be /; put the file in a directory, e.g. /data/train.bin",
            cel_args=("self.path",),
            args=lambda m: (m.path,),
            check=lambda m: m.claim_name is None or m.path is None or data_directory(m.path) != "",
            field_path=".path",
        ),
        Rule(
            cel="!has(self.claimName) || !has(self.path) || "
            + _clear_of_reserved_cel("self.path.substring(0, self.path.lastIndexOf('/'))"),
            message=f"data.path %s: with data.claimName the claim is mounted at the directory of the file, and the "
            f"operator mounts volumes at {' and '.join(RESERVED_MOUNT_PATHS)}; use a directory that is neither one "
            "of them nor above one",
            cel_args=("self.path",),
            args=lambda m: (m.path,),
            check=lambda m: m.claim_name is None or m.path is None or _clear_of_reserved(data_directory(m.path)),
            field_path=".path",
        ),
    )


class FailurePolicy(_Model):
    """How worker failures that follow the job itself, not a node, are bounded (like a Job's backoffLimit)."""

    backoff_limit: int = Field(
        default=3,
        ge=0,
        le=1000,
        description="Worker pods that may fail by themselves (a job cause such as an import error or OOM, or an "
        "exit before the runtime started) before the job fails; status.workerFailures counts them.",
    )
    start_timeout_seconds: int = Field(
        default=120,
        ge=10,
        le=86400,
        description="How long a worker container may wait to start (ImagePullBackOff, CrashLoopBackOff, "
        "CreateContainerConfigError, ...) before the job fails with that reason.",
    )


class StragglerPolicy(_Model):
    """When a slow node counts as a straggler (oobleck.operator.stragglers): its compute against its own
    pace when it started on its stage (oobleck.runtime.train.pace), divided by the median of the other nodes'
    (so a host slowing everyone counts no one), stays at or over `threshold` for `window` steps."""

    threshold: float = Field(
        default=1.5,
        gt=1,  # not ge=1.05: the API server checks a whole number against int(minimum), so 1 would pass
        le=100,
        description="Slowdown against the other nodes (1.5: half again as long for the same profiled work) from "
        "which a node is slow.",
    )
    window: int = Field(
        default=20,
        ge=1,
        le=100_000,
        description="Steps a node must stay slow before a Straggler event and status.stragglers confirm it.",
    )
    mitigation: Literal["none", "resplit", "rebalance"] = Field(
        default="resplit",
        description="resplit: a new plan generation gives a confirmed straggler's pipeline fewer microbatches (no "
        "layer moves, losses exact), and the profile's split back once it recovers; rebalance: the cheaper by "
        "the planner's price (copy time + horizon x step time) of that and moving layers off the slow node within "
        "its pipeline (copied from their holders, losses exact), and the template's layout back once it recovers; "
        "none: only report it.",
    )


class ConfigMapKey(_Model):
    """A key of a ConfigMap in the job's namespace."""

    name: DnsName = Field(description="ConfigMap name.")
    key: str = Field(
        default="profile.json",
        min_length=1,
        max_length=253,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="Key within the ConfigMap.",
    )


class ProfileSpec(_Model):
    """The model profile (per-layer time and memory) the planner plans with."""

    source: Literal["measure", "configMap"] = Field(
        default="measure",
        description="measure: the workers profile the model on their own hardware before the first plan; "
        "configMap: use a profile measured earlier (`oobleck profile` writes one).",
    )
    config_map: ConfigMapKey | None = Field(
        default=None, description="Where the profile JSON (oobleck.api.profile.ModelProfile) is; for source configMap."
    )

    _RULES = (
        Rule(
            cel="self.source != 'configMap' || has(self.configMap)",
            message="profile.configMap is required when profile.source is configMap",
            check=lambda m: m.source != "configMap" or m.config_map is not None,
            field_path=".configMap",
            reason="FieldValueRequired",
        ),
        Rule(
            cel="self.source == 'configMap' || !has(self.configMap)",
            message="profile.configMap is only for profile.source configMap",
            check=lambda m: m.source == "configMap" or m.config_map is None,
            field_path=".configMap",
            reason="FieldValueForbidden",
        ),
    )


class CheckpointSpec(_Model):
    """Periodic checkpoints: the fallback when a failure leaves some layer with no surviving replica."""

    path: str = Field(
        min_length=2,
        max_length=1024,
        pattern=ABSOLUTE_PATH_PATTERN,
        description="Absolute directory in the worker container; a job writes its checkpoints below "
        "`<path>/<job name>/`, so jobs sharing a volume never restore or prune each other's steps.",
    )
    claim_name: DnsName | None = Field(
        default=None,
        description="PersistentVolumeClaim mounted at `path` on every worker (ReadWriteMany across nodes); "
        "absent means `path` must already be shared storage.",
    )
    interval_steps: int = Field(ge=1, le=1_000_000_000, description="Write a checkpoint every this many steps.")
    keep: int = Field(default=2, ge=1, le=100, description="Newest checkpoints to keep; older ones are deleted.")
    format: Literal["native", "huggingface"] = Field(
        default="native",
        description="native: the runtime's own layer files (for rollback). huggingface (model.transformers only): "
        "also a Hugging Face directory `huggingface-step<N>` at every checkpoint. A transformers job always "
        "writes `<path>/<job name>/huggingface` (config.json + sharded model.safetensors) when it succeeds.",
    )

    _RULES = (_mount_rule("checkpoint.path", "self.path", lambda m: m.path),)


class Toleration(_Model):
    """A pod toleration (the Kubernetes fields, typed)."""

    key: str | None = Field(
        default=None,
        max_length=317,
        pattern=QUALIFIED_NAME_PATTERN,
        description="Taint key; absent with operator Exists tolerates every taint.",
    )
    operator: Literal["Exists", "Equal"] = Field(
        default="Equal", description="Exists matches any value; Equal matches `value`."
    )
    value: str | None = Field(default=None, max_length=63, description="Taint value, for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate; absent means all effects."
    )
    toleration_seconds: int | None = Field(
        default=None,
        ge=0,
        le=2**31 - 1,
        description="For NoExecute: how long the pod stays bound after the taint appears.",
    )

    _RULES = (
        Rule(
            cel="self.operator != 'Exists' || !has(self.value)",
            message="value must be empty when operator is Exists",
            check=lambda m: m.operator != "Exists" or m.value is None,
            field_path=".value",
            reason="FieldValueForbidden",
        ),
        Rule(
            cel="has(self.key) || self.operator == 'Exists'",
            message="a toleration without key must use operator Exists",
            check=lambda m: m.key is not None or m.operator == "Exists",
            field_path=".operator",
        ),
    )


class KeySelector(_Model):
    """A key of a Secret or ConfigMap in the job's namespace (the kubelet reads it; the operator never does)."""

    name: DnsName = Field(description="The Secret's or ConfigMap's name.")
    key: str = Field(
        min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$", description="The key whose value to use."
    )
    optional: bool | None = Field(default=None, description="Start the container even if the key is missing.")


class EnvVarSource(_Model):
    """Where a variable's value comes from, read by the kubelet when it starts the container: the value
    never passes through the operator, the plan ConfigMap or the pod's annotations."""

    secret_key_ref: KeySelector | None = Field(default=None, description="A key of a Secret.")
    config_map_key_ref: KeySelector | None = Field(default=None, description="A key of a ConfigMap.")

    _RULES = (
        Rule(
            cel="has(self.secretKeyRef) != has(self.configMapKeyRef)",
            message="valueFrom: set exactly one of secretKeyRef and configMapKeyRef",
            check=lambda m: (m.secret_key_ref is None) != (m.config_map_key_ref is None),
        ),
    )


class EnvVar(_Model):
    """An environment variable for the worker container: a literal `value`, or `valueFrom` a Secret or
    ConfigMap key (use this for tokens and passwords)."""

    name: str = Field(min_length=1, max_length=128, pattern=ENV_NAME_PATTERN, description="Variable name.")
    value: str | None = Field(
        default=None,
        max_length=32768,
        description="Variable value (stored in the job, its plan ConfigMap and the pods: never a secret).",
    )
    value_from: EnvVarSource | None = Field(default=None, description="The value from a Secret or ConfigMap key.")

    _RULES = (
        Rule(
            cel="!has(self.value) || !has(self.valueFrom)",
            message="name %s: set value or valueFrom, not both",
            cel_args=("self.name",),
            args=lambda m: (m.name,),
            check=lambda m: m.value is None or m.value_from is None,
            field_path=".valueFrom",
            reason="FieldValueForbidden",
        ),
        Rule(
            cel=f"!self.name.startsWith('{RESERVED_ENV_PREFIX}')",
            message=f"name %s: names starting with {RESERVED_ENV_PREFIX} are set by the runtime",
            cel_args=("self.name",),
            args=lambda m: (m.name,),
            check=lambda m: not m.name.startswith(RESERVED_ENV_PREFIX),
            field_path=".name",
            reason="FieldValueForbidden",
        ),
    )


class PodOverrides(_Model):
    """The few pod settings a job may change. Everything else about worker pods is the operator's."""

    node_selector: dict[str, LabelValue] = Field(
        default_factory=dict, max_length=32, description="Node labels a worker's node must have."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Taints worker pods tolerate."
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=64,
        description="Extra environment variables for the worker container (not OOBLECK_*).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    priority_class_name: DnsName | None = Field(default=None, description="PriorityClass of the worker pods.")
    labels: dict[str, LabelValue] = Field(
        default_factory=dict,
        max_length=32,
        description=f"Extra labels on worker pods (not {RESERVED_LABEL_PREFIX}*, which the operator selects on).",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"self.all(k, !k.startsWith('{RESERVED_LABEL_PREFIX}'))",
                    "message": f"label keys starting with {RESERVED_LABEL_PREFIX} are set by the operator",
                    "reason": "FieldValueForbidden",
                }
            ]
        },
    )
    annotations: dict[str, AnnotationValue] = Field(
        default_factory=dict,
        max_length=32,
        description=f"Extra annotations on worker pods (not {RESERVED_LABEL_PREFIX}*, which the operator and the "
        "workers write).",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"self.all(k, !k.startsWith('{RESERVED_LABEL_PREFIX}'))",
                    "message": f"annotation keys starting with {RESERVED_LABEL_PREFIX} are set by the operator and "
                    "the workers",
                    "reason": "FieldValueForbidden",
                }
            ]
        },
    )

    _RULES = (
        Rule(
            cel=None,  # the API server rejects it through the env list's map type (Duplicate value)
            message="env: a name appears twice",
            check=lambda m: len({e.name for e in m.env}) == len(m.env),
        ),
        Rule(
            cel=None,  # the API server applies the rule on the labels field itself
            message=f"labels: label keys starting with {RESERVED_LABEL_PREFIX} are set by the operator",
            check=lambda m: not any(k.startswith(RESERVED_LABEL_PREFIX) for k in m.labels),
        ),
        Rule(
            cel=None,  # the API server applies the rule on the annotations field itself
            message=f"annotations: annotation keys starting with {RESERVED_LABEL_PREFIX} are set by the operator and "
            "the workers",
            check=lambda m: not any(k.startswith(RESERVED_LABEL_PREFIX) for k in m.annotations),
        ),
    )


class OobleckJobSpec(_Model):
    """A resilient pipeline- and data-parallel training job (Oobleck): the model is split into pipeline
    stages over nodes, and f + 1 or more pipelines train data-parallel, so that up to f simultaneous
    node failures are survived by reconfiguring instead of restarting."""

    model: ModelSpec = Field(description="The model to train.", json_schema_extra=immutable("model"))
    image: str | None = Field(
        default=None,
        min_length=1,
        max_length=512,
        description="Worker image; absent means the operator's default runtime image.",
    )
    command: list[Annotated[str, StringConstraints(max_length=4096)]] | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        description="Worker command (entrypoint and arguments); absent means the image's runtime command.",
    )
    nodes: NodeRange = Field(description="Node counts: min, max and the scaled target.")
    gpus_per_node: Literal[1, 2, 4, 8, 16] = Field(
        default=1,
        description="GPUs each worker pod uses (one training process per GPU).",
        json_schema_extra=immutable("gpusPerNode"),
    )
    gpu_resource_name: str = Field(
        default="nvidia.com/gpu",
        min_length=1,
        max_length=317,
        pattern=QUALIFIED_NAME_PATTERN,
        description="Extended resource the worker pods request gpusPerNode of (device cuda only).",
        json_schema_extra=immutable("gpuResourceName"),
    )
    device: Literal["cuda", "cpu"] = Field(
        default="cuda",
        description="cuda: one process per GPU with NCCL; cpu: gpusPerNode CPU processes per pod with gloo and no "
        "GPU requested (tests and laptops).",
        json_schema_extra=immutable("device"),
    )
    resources: PodResources = Field(
        default_factory=PodResources,
        description="CPU and memory per worker pod.",
        json_schema_extra=defaulted(PodResources),
    )
    f: int = Field(
        default=1,
        ge=0,
        le=64,
        description="Fault tolerance: the job keeps f + 1 model replicas (pipelines) so that f simultaneous node "
        "failures are survived without restarting from a checkpoint.",
    )
    training: TrainingSpec = Field(description="Steps, batch sizes and optimizer settings.")
    data: DataSpec = Field(
        default_factory=DataSpec,
        description="The training data.",
        json_schema_extra=immutable("data") | defaulted(DataSpec),
    )
    profile: ProfileSpec = Field(
        default_factory=ProfileSpec,
        description="The model profile the planner uses.",
        json_schema_extra=defaulted(ProfileSpec),
    )
    checkpoint: CheckpointSpec | None = Field(default=None, description="Periodic checkpoints; absent means none.")
    pod: PodOverrides = Field(default_factory=PodOverrides, description="Overrides for the worker pods.")
    clean_pod_policy: Literal["None", "Running", "All"] = Field(
        default="Running",
        description="Worker pods deleted when the job finishes: None keeps all (for logs), Running deletes those "
        "still running, All deletes every one.",
    )
    gpu_memory: Quantity | None = Field(
        default=None,
        description="Memory per GPU the planner may fill (a quantity, e.g. 80Gi); absent means the operator's "
        "--gpu-memory-gib. A job whose plan needs more per GPU fails InvalidSpec before any pod is created.",
    )
    failure_policy: FailurePolicy = Field(
        default_factory=FailurePolicy,
        description="Bounds on worker failures caused by the job itself.",
        json_schema_extra=defaulted(FailurePolicy),
    )
    pending_timeout_seconds: int = Field(
        default=300,
        ge=10,
        le=86400,
        description="How long a worker pod may stay unschedulable before the job plans without its node.",
    )
    stragglers: StragglerPolicy = Field(
        default_factory=StragglerPolicy,
        description="When a slow node is reported as a straggler.",
        json_schema_extra=defaulted(StragglerPolicy),
    )

    _RULES = (
        Rule(
            cel="!has(self.checkpoint) || self.checkpoint.format != 'huggingface' || has(self.model.transformers)",
            message="checkpoint.format huggingface needs a model.transformers model",
            check=lambda m: (
                m.checkpoint is None or m.checkpoint.format != "huggingface" or m.model.transformers is not None
            ),
            field_path=".checkpoint.format",
        ),
        Rule(
            cel="self.f + 1 <= self.nodes.max",
            message="f (%d) needs f + 1 = %d pipelines of at least one node each, but nodes.max is %d",
            cel_args=("self.f", "self.f + 1", "self.nodes.max"),
            args=lambda m: (m.f, m.f + 1, m.nodes.max),
            check=lambda m: m.f + 1 <= m.nodes.max,
            field_path=".f",
        ),
        Rule(
            cel="self.training.microbatchSize == 0 || "
            "self.training.globalBatchSize / self.training.microbatchSize >= self.f + 1",
            message="globalBatchSize / microbatchSize = %d / %d = %d microbatches, fewer than the f + 1 = %d "
            "pipelines that each need one",
            cel_args=(
                "self.training.globalBatchSize",
                "self.training.microbatchSize",
                "self.training.globalBatchSize / self.training.microbatchSize",
                "self.f + 1",
            ),
            args=lambda m: (
                m.training.global_batch_size,
                m.training.microbatch_size,
                m.training.global_microbatches,
                m.f + 1,
            ),
            check=lambda m: m.training.global_microbatches >= m.f + 1,
            field_path=".training.globalBatchSize",
        ),
        Rule(
            cel=f"!has(self.model.gpt) || self.nodes.max * self.model.gpt.layers <= {MAX_NODES_TIMES_LAYERS}",
            message="nodes.max x model.gpt.layers = %d x %d = %d, over the bound of the planner of "
            f"{MAX_NODES_TIMES_LAYERS} (e.g. 4096 nodes x 128 layers, 1024 x 512): use fewer nodes or layers",
            cel_args=("self.nodes.max", "self.model.gpt.layers", "self.nodes.max * self.model.gpt.layers"),
            args=lambda m: (m.nodes.max, m.model.gpt.layers, m.nodes.max * m.model.gpt.layers),
            check=lambda m: m.model.gpt is None or m.nodes.max * m.model.gpt.layers <= MAX_NODES_TIMES_LAYERS,
            field_path=".nodes.max",
        ),
        Rule(
            cel="!has(self.checkpoint) || !has(self.checkpoint.claimName) || !has(self.data.claimName) || "
            f"!has(self.data.path) || self.checkpoint.path != {_DATA_DIR_CEL}",
            message="checkpoint.path %s is also where data.claimName is mounted (the directory of data.path): one "
            "path cannot hold two volumes",
            cel_args=("self.checkpoint.path",),
            args=lambda m: (m.checkpoint.path,),
            check=lambda m: (
                not (
                    m.checkpoint is not None
                    and m.checkpoint.claim_name
                    and m.data.claim_name
                    and m.data.path
                    and m.checkpoint.path == data_directory(m.data.path)
                )
            ),
            field_path=".checkpoint.path",
        ),
        Rule(
            cel="!has(self.checkpoint) || !has(self.checkpoint.claimName) || !has(self.model.transformers) || "
            "!has(self.model.transformers.initFrom) || !has(self.model.transformers.initFrom.claimName) || "
            "self.checkpoint.path != self.model.transformers.initFrom.path",
            message="checkpoint.path %s is also model.transformers.initFrom.path, where its claim is mounted: one "
            "path cannot hold two volumes",
            cel_args=("self.checkpoint.path",),
            args=lambda m: (m.checkpoint.path,),
            check=lambda m: (
                not (
                    m.checkpoint is not None
                    and m.checkpoint.claim_name
                    and (init := _init_from(m)) is not None
                    and init.claim_name
                    and init.path == m.checkpoint.path
                )
            ),
            field_path=".checkpoint.path",
        ),
        Rule(
            cel="!has(self.data.claimName) || !has(self.data.path) || !has(self.model.transformers) || "
            "!has(self.model.transformers.initFrom) || !has(self.model.transformers.initFrom.claimName) || "
            f"self.model.transformers.initFrom.path != {_DATA_DIR_CEL}",
            message="data.path %s: its directory, where data.claimName is mounted, is also "
            "model.transformers.initFrom.path, where its claim is mounted: one path cannot hold two volumes",
            cel_args=("self.data.path",),
            args=lambda m: (m.data.path,),
            check=lambda m: (
                not (
                    m.data.claim_name
                    and m.data.path
                    and (init := _init_from(m)) is not None
                    and init.claim_name
                    and init.path == data_directory(m.data.path)
                )
            ),
            field_path=".data.path",
        ),
    )


def _init_from(spec: OobleckJobSpec) -> InitFrom | None:
    return spec.model.transformers.init_from if spec.model.transformers is not None else None


# --- status ----------------------------------------------------------------------------------------


class Phase(StrEnum):
    """The job's phase: a one-word summary of its conditions (see oobleck.api.conditions.phase_of)."""

    PENDING = "Pending"
    RUNNING = "Running"
    RECONFIGURING = "Reconfiguring"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class Condition(_Model):
    """A status condition, shaped like metav1.Condition."""

    type: str = Field(
        max_length=316,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
        description="Condition type, e.g. Running.",
    )
    status: Literal["True", "False", "Unknown"] = Field(description="Whether the condition holds.")
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation the condition was set for."
    )
    last_transition_time: datetime = Field(description="When status last changed.")
    reason: str = Field(
        min_length=1,
        max_length=1024,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        description="CamelCase reason, one of oobleck.api.conditions.Reason.",
    )
    message: str = Field(default="", max_length=32768, description="Human-readable details.")


class TemplateUse(_Model):
    """A pipeline template of the current plan and how many pipelines instantiate it."""

    nodes: int = Field(ge=1, le=MAX_NODES, description="Nodes per pipeline of this template.")
    pipelines: int = Field(ge=0, le=MAX_NODES, description="Pipelines built from this template.")


class PlanSummary(_Model):
    """The current plan in brief; the full plan is in the ConfigMap `configMap`."""

    generation: int = Field(ge=0, description="Plan generation; it increases with every reconfiguration.")
    config_map: str | None = Field(default=None, max_length=253, description="ConfigMap holding the full plan.")
    templates: list[TemplateUse] = Field(
        default_factory=list, max_length=64, description="Templates and their pipeline counts."
    )
    pipelines: int = Field(ge=0, le=MAX_NODES, description="Pipelines (model replicas) training.")
    nodes: int = Field(ge=0, le=MAX_NODES, description="Nodes the plan uses.")
    degraded: bool = Field(default=False, description="True when fewer than f + 1 pipelines remain.")
    iteration_ms: float | None = Field(
        default=None, ge=0, description="The planner's estimate of one step, in milliseconds."
    )


class Progress(_Model):
    """Training progress, as the workers last reported it."""

    step: int = Field(default=0, ge=0, description="Optimizer steps completed.")
    samples_per_second: float | None = Field(default=None, ge=0, description="Recent training throughput.")
    loss: float | None = Field(default=None, description="Recent training loss.")
    last_checkpoint_step: int | None = Field(default=None, ge=0, description="Step of the newest complete checkpoint.")


class WorkerFailure(_Model):
    """A worker pod that failed by itself, as the operator counted it."""

    pod: str = Field(max_length=253, description="The pod's name.")
    uid: str = Field(max_length=64, description="The pod's uid (names of replacements can repeat).")
    reason: str = Field(max_length=128, description="The cause's kind, or the container's reason.")
    message: str = Field(default="", max_length=4096, description="What the worker or its container said.")


class Straggler(_Model):
    """A node slower than spec.stragglers.threshold, as the operator last measured it."""

    node: str = Field(max_length=253, description="The worker pod (plan node).")
    slowdown: float = Field(
        ge=0, description="Its compute against its own starting pace, over the other nodes' median."
    )
    since_step: int = Field(ge=0, description="The step from which it has been over the threshold.")
    confirmed: bool = Field(
        default=False, description="Slow for spec.stragglers.window steps or more (a Straggler event was raised)."
    )


class OobleckJobStatus(_Model):
    """What the operator observed: written through the status subresource only."""

    phase: Phase = Field(default=Phase.PENDING, description="One-word summary of the conditions.")
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        description="Created, Running, Reconfiguring, Degraded, Succeeded, Failed (reasons in oobleck.api.conditions).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    observed_generation: int | None = Field(default=None, ge=0, description="metadata.generation the status reflects.")
    nodes: int = Field(
        default=0, ge=0, le=MAX_NODES, description="Nodes in use (the scale subresource's status replicas)."
    )
    selector: str | None = Field(
        default=None, max_length=1024, description="Label selector of the worker pods (for the scale subresource)."
    )
    plan: PlanSummary | None = Field(default=None, description="The current plan in brief.")
    progress: Progress | None = Field(default=None, description="Training progress.")
    failures_survived: int = Field(default=0, ge=0, description="Node failures recovered from without a restart.")
    reconfigurations: int = Field(
        default=0, ge=0, description="Plans after the first (failures, scaling, nodes returning)."
    )
    worker_failures: int = Field(
        default=0,
        ge=0,
        description="Worker pods that failed by themselves (a job cause, or before the runtime started); the job "
        "fails once this exceeds spec.failurePolicy.backoffLimit.",
    )
    last_worker_failures: list[WorkerFailure] = Field(
        default_factory=list, max_length=8, description="The newest worker failures counted, oldest first."
    )
    stragglers: list[Straggler] = Field(
        default_factory=list, max_length=MAX_NODES, description="Nodes now slower than spec.stragglers.threshold."
    )
    spares: int = Field(
        default=0, ge=0, le=MAX_NODES, description="Warm spare worker pods ready to be folded in (spec.nodes.spares)."
    )
    spare_pods: list[str] = Field(
        default_factory=list,
        max_length=MAX_NODES,
        description="Those spares' pod names: running, their runtime up, in no plan (not members).",
    )
    start_time: datetime | None = Field(default=None, description="When the first plan started training.")
    completion_time: datetime | None = Field(default=None, description="When the job succeeded or failed.")


def worker_selector(job_name: str) -> str:
    """The label selector of a job's worker pods (not its coordinator), as status.selector holds it."""
    return f"{JOB_LABEL}={job_name},{ROLE_LABEL}={WORKER_ROLE}"


def parse_spec(spec: dict[str, Any]) -> OobleckJobSpec:
    """Validate a job's `spec` (as read from the API server or a manifest); raises pydantic.ValidationError."""
    return OobleckJobSpec.model_validate(spec)


def parse_status(status: dict[str, Any] | None) -> OobleckJobStatus:
    """Validate a job's `status`; an absent status is the initial one."""
    return OobleckJobStatus.model_validate(status or {})
