"""The local GPUs' health, for the failure detector's GPU probe: NVML if importable, else nvidia-smi."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuHealth:
    index: int
    healthy: bool
    detail: str = ""


def probe_gpus() -> list[GpuHealth]:
    """Health of the local GPUs: NVML through `pynvml` if importable, else `nvidia-smi`, else none.

    No GPU (a CPU node) is an empty list, i.e. healthy. A GPU is unhealthy if it cannot be queried
    or reports uncorrected volatile ECC errors.
    """
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return _probe_nvidia_smi()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return _probe_nvidia_smi()
    try:
        result = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                pynvml.nvmlDeviceGetMemoryInfo(handle)  # fails on a GPU that fell off the bus
                try:
                    ecc = pynvml.nvmlDeviceGetTotalEccErrors(
                        handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
                    )
                except pynvml.NVMLError_NotSupported:
                    ecc = 0
                result.append(GpuHealth(index, ecc == 0, f"uncorrected ECC errors: {ecc}" if ecc else ""))
            except pynvml.NVMLError as error:
                result.append(GpuHealth(index, False, f"NVML: {error}"))
        return result
    finally:
        pynvml.nvmlShutdown()


def _probe_nvidia_smi() -> list[GpuHealth]:
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return []
    query = "index,ecc.errors.uncorrected.volatile.total"
    try:
        out = subprocess.run(
            [binary, f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (subprocess.SubprocessError, OSError) as error:
        # nvidia-smi present but failing: the driver or a GPU is in trouble.
        return [GpuHealth(-1, False, f"nvidia-smi failed: {error}")]
    result = []
    for line in out.strip().splitlines():
        index_text, ecc_text = (part.strip() for part in line.split(",", 1))
        ecc = int(ecc_text) if ecc_text.isdigit() else 0  # "[N/A]" where ECC is off or unsupported
        result.append(GpuHealth(int(index_text), ecc == 0, f"uncorrected ECC errors: {ecc}" if ecc else ""))
    return result
