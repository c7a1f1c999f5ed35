"""runtime/causes.py: which exceptions are the job's, and what they say."""

from __future__ import annotations

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
