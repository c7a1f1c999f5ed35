"""Model profile and cluster shape: the planner's inputs.

A profile is measured by the runtime's profiler (`oobleck profile`) or generated synthetically
(`oobleck.planner.synthetic`); the planner never measures anything itself.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorParallelTimes(_Strict):
    """A layer's times measured at tensor-parallel degree t: one whole microbatch on t GPUs, collectives included."""

    degree: int = Field(ge=2, description="t: the tensor-parallel degree measured (a power of two >= 2)")
    forward_ms: float = Field(ge=0, allow_inf_nan=False, description="forward time of one microbatch on t GPUs")
    backward_ms: float = Field(ge=0, allow_inf_nan=False, description="backward time of one microbatch on t GPUs")

    @field_validator("degree")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"must be a power of two, got {value}")
        return value


class LayerProfile(_Strict):
    """One layer, for one microbatch on one GPU (and, optionally, on t tensor-parallel GPUs)."""

    name: str = ""
    forward_ms: float = Field(ge=0, allow_inf_nan=False, description="forward time of one microbatch")
    backward_ms: float = Field(ge=0, allow_inf_nan=False, description="backward time of one microbatch")
    state_bytes: int = Field(ge=0, description="weights + gradients + optimizer state")
    activation_bytes: int = Field(ge=0, description="kept per in-flight microbatch until its backward")
    output_bytes: int = Field(ge=0, description="sent to the next layer per microbatch")
    replicated_activation_bytes: int = Field(
        default=0,
        ge=0,
        description="the part of activation_bytes that tensor parallelism does not split (every one of the t GPUs "
        "keeps it: layer-norm inputs, dropout masks); the rest is divided by t",
    )
    tensor_parallel: list[TensorParallelTimes] = Field(
        default_factory=list,
        description="times measured at tensor-parallel degrees t >= 2; a degree not listed is estimated by the "
        "planner (forward_ms / t plus the Megatron all-reduces over the intra-node bandwidth)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> LayerProfile:
        if self.replicated_activation_bytes > self.activation_bytes:
            raise ValueError(
                f"replicated_activation_bytes: {self.replicated_activation_bytes} exceeds activation_bytes = "
                f"{self.activation_bytes} (it is a part of them)"
            )
        degrees = [entry.degree for entry in self.tensor_parallel]
        if len(set(degrees)) != len(degrees):
            raise ValueError(f"tensor_parallel: each degree at most once, got {degrees}")
        return self

    def measured_at(self, degree: int) -> TensorParallelTimes | None:
        """The times measured at tensor-parallel degree `degree` (>= 2), None if not measured."""
        return next((entry for entry in self.tensor_parallel if entry.degree == degree), None)


class ModelProfile(_Strict):
    """Per-layer costs of a model, in layer order; the planner's layers are these layers."""

    model: str = Field(min_length=1, description="model name, for humans and plan summaries")
    microbatch_size: int = Field(ge=1, description="samples per microbatch the figures were taken at")
    device: str = Field(default="", description="what the figures were measured on")
    layers: list[LayerProfile] = Field(min_length=1)

    @model_validator(mode="after")
    def _some_work(self) -> ModelProfile:
        if sum(layer.forward_ms + layer.backward_ms for layer in self.layers) <= 0:
            raise ValueError("layers: forward_ms + backward_ms summed over all layers must be > 0")
        return self


class ClusterShape(_Strict):
    """The machines a job plans for. Bandwidths are in bytes per second."""

    nodes: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1, description="a power of two")
    gpu_memory_bytes: int = Field(gt=0)
    intra_node_bandwidth: float = Field(gt=0, allow_inf_nan=False, description="bytes/s between GPUs of a node")
    inter_node_bandwidth: float = Field(gt=0, allow_inf_nan=False, description="bytes/s between nodes")

    @field_validator("gpus_per_node")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"must be a power of two, got {value}")
        return value
