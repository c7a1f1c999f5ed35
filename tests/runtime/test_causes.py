"""runtime/causes.py: which exceptions are the job's, and what they say."""

from __future__ import annotations

import json

import pytest
import torch

from oobleck.api.causes import EXIT_CODES, parse_cause
from oobleck.runtime.causes import JobFault, blame, classify
from oobleck.runtime.elastic.worker import Worker
from oobleck.runtime.train.config import ModelConfig, WorkerConfig


def test_memory_and_cuda_errors_say_what_they_are_anywhere():
    assert classify(MemoryError()).kind == "OutOfMemory"
    allocator = RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory: 8 GB")
    assert classify(allocator).kind == "OutOfMemory"
    assert classify(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")).kind == "OutOfMemory"
    assert classify(RuntimeError("CUDA error: an illegal memory access was encountered")).kind == "CudaError"
    assert classify(RuntimeError("Connection closed by peer")) is None  # a lost peer: not the job's
    assert classify(ValueError("x")) is None


def test_blame_names_the_field_and_keeps_what_the_error_says_by_itself():
    with pytest.raises(JobFault) as caught, blame("DataUnavailable", field="spec.data", path="/d/x.bin"):
        open("/d/x.bin")
    cause = caught.value.cause
    assert cause.kind == "DataUnavailable" and cause.path == "/d/x.bin" and "No such file" in cause.message
    assert cause.exit_code == EXIT_CODES["DataUnavailable"] and "(field spec.data, path /d/x.bin)" in cause.describe()
    with pytest.raises(JobFault) as caught, blame("ModelLoadFailed", field="spec.model.entryPoint"):
        raise MemoryError("building layer 3")
    assert caught.value.cause.kind == "OutOfMemory"  # the memory, not the model's code
    assert parse_cause(caught.value.cause.model_dump_json()) == caught.value.cause


def test_a_worker_whose_entry_point_does_not_import_raises_model_load_failed():
    config = WorkerConfig(model=ModelConfig(name="no_such_module_here:build"), device="cpu")
    with pytest.raises(JobFault) as caught:
        Worker(config, store=None, node="n0", gpu=0)
    cause = caught.value.cause
    assert cause.kind == "ModelLoadFailed" and cause.field == "spec.model.entryPoint"
    assert "no_such_module_here" in cause.message


def test_a_worker_whose_token_file_is_missing_raises_data_unavailable(tmp_path):
    from oobleck.runtime.train.config import DataConfig

    config = WorkerConfig(data=DataConfig(kind="file", path=str(tmp_path / "none.bin")), device="cpu")
    with pytest.raises(JobFault) as caught:
        Worker(config, store=None, node="n0", gpu=0)
    assert caught.value.cause.kind == "DataUnavailable" and caught.value.cause.path.endswith("none.bin")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_allocation_beyond_the_device_is_out_of_memory():
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(JobFault) as caught, blame("ModelLoadFailed", field="spec.model.gpt"):
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    assert caught.value.cause.kind == "OutOfMemory" and "out of memory" in caught.value.cause.message.lower()


# -- the audit: every cause kind names what the user has to change ----------------------------------


def _worker_fault(config: WorkerConfig):
    with pytest.raises(JobFault) as caught:
        Worker(config, store=None, node="n0", gpu=0)
    return caught.value.cause


def _entry_point(tmp_path):
    return _worker_fault(WorkerConfig(model=ModelConfig(name="no_such_module_here:build"), device="cpu"))


def _missing_init_from(tmp_path):
    from oobleck.runtime.train.config import TransformersConfig

    hf = TransformersConfig(preset="llama-tiny", init_from=str(tmp_path / "no-weights-here"))
    return _worker_fault(WorkerConfig(model=ModelConfig(transformers=hf), device="cpu"))


def _missing_token_file(tmp_path):
    from oobleck.runtime.train.config import DataConfig

    return _worker_fault(WorkerConfig(data=DataConfig(kind="file", path=str(tmp_path / "none.bin")), device="cpu"))


def _invalid_job_spec(tmp_path):
    """The pod's own parse of OOBLECK_JOB_SPEC (a spec the API server never validated, e.g. hand-made)."""
    from oobleck.runtime.backends.pod.config import PodEnv
    from oobleck.runtime.backends.pod.main import job_spec_config

    env = {
        "OOBLECK_JOB": "tiny",
        "OOBLECK_NAMESPACE": "ns",
        "OOBLECK_NODE": "tiny-worker-0",
        "OOBLECK_PLAN_CONFIGMAP": "tiny-plan",
        "OOBLECK_STORE": "tiny-coordinator.tiny-workers.ns.svc:29400",
        "OOBLECK_GPUS_PER_NODE": "1",
        "OOBLECK_DEVICE": "cpu",
        "OOBLECK_JOB_SPEC": json.dumps({"model": {"gpt": {"layers": 2}}, "nodes": {"min": 1, "max": 1}, "f": -1}),
    }
    with pytest.raises(JobFault) as caught:
        job_spec_config(PodEnv.from_env(env))
    assert "f" in caught.value.cause.message and "greater than or equal" in caught.value.cause.message
    return caught.value.cause


def _host_memory(tmp_path):
    with pytest.raises(JobFault) as caught, blame("ModelLoadFailed", field="spec.model.gpt"):
        raise MemoryError("building layer 3")
    return caught.value.cause


def _gpu_memory(tmp_path):
    with pytest.raises(JobFault) as caught, blame("ModelLoadFailed", field="spec.model.gpt"):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return caught.value.cause


def _non_finite(tmp_path):
    from oobleck.runtime.elastic import nonfinite

    worker = Worker(WorkerConfig(device="cpu"), store=None, node="n0", gpu=0)
    with pytest.raises(JobFault) as caught:
        nonfinite.handle(worker, "the loss is nan")
    return caught.value.cause


def _no_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    return _worker_fault(WorkerConfig(device="cuda"))


AUDIT = [
    # (scenario, kind, the field the user changes)
    (_entry_point, "ModelLoadFailed", "spec.model.entryPoint"),
    (_missing_init_from, "ModelLoadFailed", "spec.model.transformers.initFrom"),
    (_missing_token_file, "DataUnavailable", "spec.data.path"),
    (_invalid_job_spec, "InvalidConfig", None),  # the message names the field (pydantic's location)
    (_host_memory, "OutOfMemory", "spec.resources.memory"),
    (_gpu_memory, "OutOfMemory", "spec.gpuMemory"),
    (_non_finite, "NonFiniteLoss", "spec.training.onNonFinite"),
    (_no_cuda, "CudaError", "spec.device"),
]


@pytest.mark.parametrize(("scenario", "kind", "field"), AUDIT, ids=[a[0].__name__.strip("_") for a in AUDIT])
def test_every_cause_kind_names_the_field_the_user_must_change(tmp_path, scenario, kind, field):
    cause = scenario(tmp_path)
    assert (cause.kind, cause.field) == (kind, field), cause.describe()
    if field is not None:
        assert f"field {field}" in cause.describe()


def test_the_audit_covers_every_cause_kind():
    from typing import get_args

    from oobleck.api.causes import CauseKind

    assert {kind for _, kind, _ in AUDIT} == set(get_args(CauseKind))
