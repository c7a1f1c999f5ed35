"""The OobleckJob's spec: what to train, on how many nodes, and how failures are handled.

Its sections live beside it: the model in `oobleck.api.model_spec`, the pod settings in
`oobleck.api.pod_spec`; the rules and field types in `oobleck.api.schema`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints

from oobleck.api.model_spec import InitFrom, ModelSpec
from oobleck.api.pod_spec import PodOverrides, PodResources
from oobleck.api.schema import (
    ABSOLUTE_PATH_PATTERN,
    MAX_NODES,
    QUALIFIED_NAME_PATTERN,
    RESERVED_MOUNT_PATHS,
    CrdModel,
    DnsName,
    Quantity,
    Rule,
    clear_of_reserved,
    clear_of_reserved_cel,
    data_directory,
    defaulted,
    immutable,
    mount_rule,
)

# Warm spares each keep a node (its GPUs) idle: a few cover the failures a reconfiguration meets at once.
MAX_SPARES = 64
# The planner's cost grows with nodes and layers (measured: 1024 nodes x 512 GPT layers 7 s, 1024 x 1024
# 14 s and 744 MB): the API server refuses GPT shapes beyond this product up front; the operator's
# planner limits (time, memory per call) bound the rest (entry points, transformers configs).
MAX_NODES_TIMES_LAYERS = 524288

_DATA_DIR_CEL = "self.data.path.substring(0, self.data.path.lastIndexOf('/'))"


class NodeRange(CrdModel):
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


class TrainingSpec(CrdModel):
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


class DataSpec(CrdModel):
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
            + clear_of_reserved_cel("self.path.substring(0, self.path.lastIndexOf('/'))"),
            message=f"data.path %s: with data.claimName the claim is mounted at the directory of the file, and the "
            f"operator mounts volumes at {' and '.join(RESERVED_MOUNT_PATHS)}; use a directory that is neither one "
            "of them nor above one",
            cel_args=("self.path",),
            args=lambda m: (m.path,),
            check=lambda m: m.claim_name is None or m.path is None or clear_of_reserved(data_directory(m.path)),
            field_path=".path",
        ),
    )


class FailurePolicy(CrdModel):
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


class StragglerPolicy(CrdModel):
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
    mitigation: Literal["none", "resplit", "rebalance", "spare"] = Field(
        default="resplit",
        description="resplit: a new plan generation gives a confirmed straggler's pipeline fewer microbatches (no "
        "layer moves, losses exact), and the profile's split back once it recovers; rebalance: the cheaper by "
        "the planner's price (copy time + horizon x step time) of that and moving layers off the slow node within "
        "its pipeline (copied from their holders, losses exact), and the template's layout back once it recovers; "
        "spare: the cheapest of those two and taking the slow node out of training (the best plan on the other "
        "nodes, above nodes.min): it waits as a warm spare and is taken back after a back-off of window x "
        "2^(n-1) steps, to stay if it computes at pace again; none: only report it.",
    )


class ConfigMapKey(CrdModel):
    """A key of a ConfigMap in the job's namespace."""

    name: DnsName = Field(description="ConfigMap name.")
    key: str = Field(
        default="profile.json",
        min_length=1,
        max_length=253,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="Key within the ConfigMap.",
    )


class ProfileSpec(CrdModel):
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


class CheckpointSpec(CrdModel):
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

    _RULES = (mount_rule("checkpoint.path", "self.path", lambda m: m.path),)


class OobleckJobSpec(CrdModel):
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
    max_tensor_parallel: Literal[1, 2, 4, 8, 16] = Field(
        default=1,
        description="The largest tensor-parallel degree t the planner may give a stage (at most gpusPerNode): a "
        "stage on g GPUs of a node runs g / t groups of t GPUs, each GPU holding 1/t of its layers' state. 1: none.",
        json_schema_extra=immutable("maxTensorParallel"),
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
            cel="self.maxTensorParallel <= self.gpusPerNode",
            message="maxTensorParallel (%d) is over gpusPerNode (%d): tensor parallelism splits a stage within a node",
            cel_args=("self.maxTensorParallel", "self.gpusPerNode"),
            args=lambda m: (m.max_tensor_parallel, m.gpus_per_node),
            check=lambda m: m.max_tensor_parallel <= m.gpus_per_node,
            field_path=".maxTensorParallel",
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


def parse_spec(spec: dict[str, Any]) -> OobleckJobSpec:
    """Validate a job's `spec` (as read from the API server or a manifest); raises pydantic.ValidationError."""
    return OobleckJobSpec.model_validate(spec)
