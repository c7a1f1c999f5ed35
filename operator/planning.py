"""The operator's planner calls: the machines a job plans for, a profile estimated from the model's sizes, the
check of a new spec and generation 0. Pure functions of the spec, the profile and the operator-wide `Tuning`;
`check_spec` and `first_plan` run in the planner processes of operator/planpool.py (JSON in, JSON out), off the
event loop, under time and memory limits."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from oobleck.api.hfpresets import PRESETS
from oobleck.api.hfpresets import sizes as hf_sizes
from oobleck.api.plan import Plan, Template
from oobleck.api.profile import ClusterShape, ModelProfile
from oobleck.api.spec import OobleckJobSpec
from oobleck.operator.admission import gpu_memory_bytes
from oobleck.operator.planpool import IN_PROCESS, Planner, PlanningLimitExceeded
from oobleck.planner import instantiate
from oobleck.planner.errors import PlanningError
from oobleck.planner.synthetic import GPTShape, gpt_profile
from oobleck.planner.templates import generate_templates


@dataclass(frozen=True)
class Tuning:
    """The operator-wide numbers the planner needs and a spec does not carry (see settings.py)."""

    gpu_memory_bytes: int = 80 << 30
    intra_node_bandwidth: float = 300e9
    inter_node_bandwidth: float = 25e9
    gpu_flops: float = 300e12
    hbm_bandwidth: float = 2e12
    horizon: int = 100
    gpu_failure_conditions: tuple[str, ...] = ("GPUUnhealthy", "GpuUnhealthy", "NVIDIAGPUUnhealthy")
    measure_timeout_s: float = 120.0
    """`profile: measure`: how long the running workers may take to report their measurement before
    generation 0 is planned with the synthetic estimate of the model instead (with a warning event)"""


def cluster_shape(spec: OobleckJobSpec, tuning: Tuning) -> ClusterShape:
    """The machines the job plans for: nodes.max nodes of gpusPerNode GPUs."""
    return ClusterShape(
        nodes=spec.nodes.max,
        gpus_per_node=spec.gpus_per_node,
        gpu_memory_bytes=gpu_memory_bytes(spec, tuning),
        intra_node_bandwidth=tuning.intra_node_bandwidth,
        inter_node_bandwidth=tuning.inter_node_bandwidth,
    )


def synthetic_profile(spec: OobleckJobSpec, tuning: Tuning) -> ModelProfile:
    """The profile of the model estimated from its sizes (what `profile.source: measure` uses until the
    runtime's profiling phase runs in pods): the built-in GPT, or a transformers model given by preset or
    inline config. Raises PlanningError for an entry-point model or a config in a ConfigMap."""
    gpt = spec.model.gpt
    hf = spec.model.transformers
    if hf is not None and hf.config_map is None:
        # A transformers model estimated as the GPT of its sizes (embedding / blocks / head alike).
        family = hf.family or PRESETS[str(hf.preset)]["model_type"]
        size = hf_sizes(hf.config if hf.config is not None else PRESETS[str(hf.preset)], family)
        shape = GPTShape(blocks=size.blocks, hidden=size.hidden, heads=size.heads, vocab=size.vocab)
        seq_len = hf.sequence_length or size.positions
        name = hf.preset or f"{family}-{size.blocks}x{size.hidden}"
    elif gpt is not None:
        shape = GPTShape(blocks=gpt.layers, hidden=gpt.hidden_size, heads=gpt.heads, vocab=gpt.vocab_size)
        seq_len, name = gpt.sequence_length, f"gpt-{gpt.layers}x{gpt.hidden_size}"
    else:
        what = "model.entryPoint" if hf is None else "model.transformers.configMap (its sizes are in the ConfigMap)"
        raise PlanningError(
            f"profile.source: measure needs the runtime's profiler for {what}, and no worker reported a measured "
            "profile; measure with `oobleck profile` and use profile.source: configMap"
        )
    try:
        return gpt_profile(
            shape,
            seq_len=seq_len,
            microbatch_size=spec.training.microbatch_size,
            gpu_flops=tuning.gpu_flops,
            hbm_bandwidth=tuning.hbm_bandwidth,
            name=name,
        )
    except ValueError as error:
        raise PlanningError(f"model: no size estimate for this model: {error}") from error


def check_spec(
    spec: OobleckJobSpec, profile: ModelProfile, tuning: Tuning, planner: Planner = IN_PROCESS
) -> str | None:
    """Why the planner cannot serve this (API-valid) spec, or None: templates for nodes.max, a full
    plan on the wanted node count, and a (possibly degraded) plan on nodes.min must all exist; a check
    over the planner's time or memory limit (operator/planpool.py) says so. Memoised: a job waiting for
    1000 pods is reconciled many times with the same spec."""
    return _check_spec(spec.model_dump_json(), profile.model_dump_json(), tuning, planner)


@functools.lru_cache(maxsize=256)
def _check_spec(spec_json: str, profile_json: str, tuning: Tuning, planner: Planner) -> str | None:
    try:
        return planner.run(check_planned, spec_json, profile_json, tuning)
    except PlanningLimitExceeded as error:
        return str(error)


def job_templates(spec: OobleckJobSpec, profile: ModelProfile, tuning: Tuning) -> list[Template]:
    """The job's pipeline templates on nodes.max nodes; raises PlanningError."""
    return generate_templates(
        profile,
        cluster_shape(spec, tuning),
        spec.f,
        spec.training.reference_microbatches,
        global_microbatches=spec.training.global_microbatches,
        microbatch_size=spec.training.microbatch_size,
        max_tp=spec.max_tensor_parallel,
    )


def check_planned(spec_json: str, profile_json: str, tuning: Tuning) -> str | None:
    """check_spec's work (run by a Planner, so in a planner process: JSON in, a message out)."""
    spec = OobleckJobSpec.model_validate_json(spec_json)
    profile = ModelProfile.model_validate_json(profile_json)
    try:
        templates = job_templates(spec, profile, tuning)
        # A stage of g GPUs at tensor-parallel degree t splits every microbatch in g / t parts: each needs at
        # least one sample. The planner
        # only makes stages whose GPU count divides the microbatch size; this stays as a guard.
        split = max((stage.gpus // stage.tensor_parallel for t in templates for stage in t.stages), default=1)
        if split > spec.training.microbatch_size:
            return (
                f"training.microbatchSize: {spec.training.microbatch_size} sample(s) cannot be split over the "
                f"{split} GPUs of a pipeline stage the planner needs; use a microbatchSize of at least {split}"
            )
        mb = spec.training.global_microbatches
        instantiate(
            templates, [str(i) for i in range(spec.nodes.wanted)], spec.f, mb, "check", gpus_per_node=spec.gpus_per_node
        )
        instantiate(
            templates,
            [str(i) for i in range(spec.nodes.min)],
            spec.f,
            mb,
            "check",
            gpus_per_node=spec.gpus_per_node,
            allow_degraded=True,
        )
    except PlanningError as error:
        return str(error)
    return None


def first_plan(spec: OobleckJobSpec, profile: ModelProfile, tuning: Tuning, nodes: list[str], job: str) -> Plan:
    """Generation 0 on `nodes` (run by a Planner); raises PlanningError."""
    templates = job_templates(spec, profile, tuning)
    return instantiate(
        templates,
        nodes,
        spec.f,
        spec.training.global_microbatches,
        job,
        gpus_per_node=spec.gpus_per_node,
        allow_degraded=True,
    )
