"""Model profile and cluster shape: the planner's inputs.

A profile is measured by the runtime's profiler (`oobleck profile`) or generated synthetically
(`oobleck.planner.synthetic`); the planner never measures anything itself.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LayerProfile(_Strict):
    """One layer, for one microbatch on one GPU."""

    name: str = ""
    forward_ms: float = Field(ge=0, allow_inf_nan=False, description="forward time of one microbatch")
    backward_ms: float = Field(ge=0, allow_inf_nan=False, description="backward time of one microbatch")
    state_bytes: int = Field(ge=0, description="weights + gradients + optimizer state")
    activation_bytes: int = Field(ge=0, description="kept per in-flight microbatch until its backward")
    output_bytes: int = Field(ge=0, description="sent to the next layer per microbatch")


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
