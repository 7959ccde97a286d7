"""gpu_mon: run work on idle NVIDIA GPUs and yield the instant anyone else needs them.

The library (seed 001's API): `from gpu_mon import Sentinel, get_gpu_usage`. Imported lazily, so that the
workload leader, which imports this package, starts without loading the library it does not use.
"""

from __future__ import annotations

TYPE_CHECKING = False  # (typing takes 5-10 ms to import: `gpu-mon _job-ids` answers a TAB)
if TYPE_CHECKING:
    from typing import Any

__version__ = "0.1.0"
__all__ = ["GpuUsageError", "Sentinel", "__version__", "get_gpu_usage"]


def __getattr__(name: str) -> Any:
    if name == "Sentinel":
        from gpu_mon.api.sentinel import Sentinel

        return Sentinel
    if name in ("get_gpu_usage", "GpuUsageError"):
        from gpu_mon.api import usage

        return getattr(usage, name)
    raise AttributeError(f"module 'gpu_mon' has no attribute {name!r}")
