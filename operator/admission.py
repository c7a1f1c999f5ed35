"""Memory admission before any pod is created: a job whose model cannot fit fails InvalidSpec with both numbers.

- Per GPU (device cuda): the planner fills at most `spec.gpuMemory` bytes per GPU (else the operator's
  --gpu-memory-gib). A plan puts at least the heaviest layer's state + activations / G on one GPU, and
  the whole model's state + activations over all nodes.max x gpusPerNode GPUs; if even that lower
  bound exceeds the GPU memory no plan exists (the planner's own check, planning.check_spec, then
  catches the layouts in between).
- Per worker (device cpu): the model is built and measured whole in one worker process (profile:
  measure), and every process of a pod holds its stages in the pod's memory: the whole model's state
  + one microbatch's activations must fit in the pod's memory limit (resources.memory).
The numbers come from the profile (state_bytes: weights + gradients + AdamW moments).
"""

from __future__ import annotations

import math
import re

from oobleck.api.profile import ModelProfile
from oobleck.api.spec import OobleckJobSpec

_SUFFIX = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "m": 1e-3,
    "u": 1e-6,
    "n": 1e-9,
}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[KMGTPE]i|[numkMGTPE])?$")


def quantity_bytes(value: int | str, field: str) -> int:
    """A Kubernetes quantity in bytes (rounded up); ValueError names `field`."""
    if isinstance(value, int):
        return value
    match = _QUANTITY.match(value)
    if match is None:
        raise ValueError(f"{field}: {value!r} is not a Kubernetes quantity")
    number, suffix = match.groups()
    if suffix and suffix[0] in "eE" and suffix not in _SUFFIX:
        return math.ceil(float(number + suffix))
    return math.ceil(float(number) * _SUFFIX[suffix or ""])


def gpu_memory_bytes(spec: OobleckJobSpec, tuning) -> int:
    """The memory per GPU the planner may fill: spec.gpuMemory, else the operator's."""
    if spec.gpu_memory is None:
        return tuning.gpu_memory_bytes
    return quantity_bytes(spec.gpu_memory, "spec.gpuMemory")


def _gib(n: float) -> str:
    return f"{n} bytes ({n / 2**30:.2f} GiB)"


def admit(spec: OobleckJobSpec, profile: ModelProfile, tuning) -> str | None:
    """Why this job's model cannot fit (both numbers named), or None."""
    layers = profile.layers
    state = sum(layer.state_bytes for layer in layers)
    activations = sum(layer.activation_bytes for layer in layers)
    if spec.device == "cpu":
        limit = quantity_bytes(spec.resources.memory, "spec.resources.memory")
        need = state + activations
        if need > limit:
            return (
                f"spec.resources.memory: the model needs {_gib(need)} per worker (state {state} + activations "
                f"{activations} of its {len(layers)} layers, built whole in one worker process), more than the pod's "
                f"memory limit {spec.resources.memory} = {_gib(limit)}"
            )
        return None
    memory = gpu_memory_bytes(spec, tuning)
    g = spec.gpus_per_node
    gpus = spec.nodes.max * g
    heaviest = max(range(len(layers)), key=lambda i: layers[i].state_bytes + layers[i].activation_bytes / g)
    one = layers[heaviest].state_bytes + layers[heaviest].activation_bytes / g
    spread = (state + activations) / gpus
    need = math.ceil(max(one, spread))
    if need > memory:
        where = (
            f"layer {heaviest} alone (state + activations / gpusPerNode)"
            if one >= spread
            else f"the model's state + activations spread over nodes.max x gpusPerNode = {gpus} GPUs"
        )
        source = "spec.gpuMemory" if spec.gpu_memory is not None else "the operator's --gpu-memory-gib"
        return (
            f"spec.gpuMemory: a plan needs at least {_gib(need)} per GPU for {where}, more than the "
            f"{_gib(memory)} per GPU the planner assumes ({source})"
        )
    return None
