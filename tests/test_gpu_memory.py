"""On a real NVIDIA GPU only (marked `gpu`): NVML's memory info v1 and v2 on an idle GPU, and which one
gpu-mon reads. Run by bench/gpu_proof.py (check memory-v2)."""

from __future__ import annotations

import pytest
from gpujobs import MIB, nvml

from gpu_mon.api.nvml import NvmlBackend


@pytest.mark.gpu
def test_idle_gpu_memory_v2_reports_the_reserve_apart(record_property):
    with nvml() as reader:
        if reader.processes():
            pytest.skip(f"GPU 0 is not idle: NVML lists {sorted(reader.processes())}")
        pynvml = reader.nvml
        if not hasattr(pynvml, "nvmlMemory_v2"):
            pytest.skip("these NVML bindings have no memory info v2 (nvidia-ml-py 11.515 or later has)")
        v1_used = pynvml.nvmlDeviceGetMemoryInfo(reader.handle).used / MIB
        v2 = pynvml.nvmlDeviceGetMemoryInfo(reader.handle, version=pynvml.nvmlMemory_v2)
    backend = NvmlBackend()
    try:
        gpu = backend.read().gpus[0]
    finally:
        backend.close()
    used, reserved = v2.used / MIB, v2.reserved / MIB
    record_property("v1_used_mib", round(v1_used, 1))
    record_property("v2_used_mib", round(used, 1))
    record_property("v2_reserved_mib", round(reserved, 1))
    record_property("gpu_mon_used_mib", gpu.memory_used_mib)
    record_property("gpu_mon_reserved_mib", gpu.memory_reserved_mib)
    assert gpu.memory_reserved_mib is not None, "gpu-mon read v1: the driver or bindings lack v2"
    assert abs(v1_used - used - reserved) <= 16, (v1_used, used, reserved)
    assert gpu.memory_used_mib is not None and abs(gpu.memory_used_mib - used) <= 16, (gpu, used)
    assert reserved > 0 and used < v1_used, (used, reserved, v1_used)
