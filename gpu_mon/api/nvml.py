"""The real GPU backend: NVML through nvidia-ml-py. The only module that imports pynvml.

Initialisation is lazy and retried on every look, so gpu-mon can start before the driver is loaded. A GPU or
a field that cannot be read becomes None plus a line in `Gpu.errors`; it never raises into the daemon.
"""

from __future__ import annotations

import contextlib
import time
from types import ModuleType
from typing import Callable, Dict, List, Optional, Tuple

from gpu_mon.api.model import Gpu, GpuProcess, GpuReading

_MIB = 1 << 20
# Newest first: _v3 needs driver >= 510; older drivers export only _v2 or the unversioned symbol.
_COMPUTE_CALLS = (
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses",
)
_GRAPHICS_CALLS = (
    "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses_v2",
    "nvmlDeviceGetGraphicsRunningProcesses",
)
# Errors after which the library must be initialised again (driver reloaded, or never initialised).
_REINIT_ERRORS = (
    "NVML_ERROR_UNINITIALIZED",
    "NVML_ERROR_DRIVER_NOT_LOADED",
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH",
)


class _Unsupported(Exception):
    """The field is not supported on this GPU: not an error, just absent."""


class NvmlBackend:
    """Reads every GPU through NVML. `last_timings` holds the seconds each call took in the last look."""

    def __init__(self, dev_dir: str = "/dev", module: Optional[ModuleType] = None):
        self._dev_dir = dev_dir.rstrip("/") or "/"
        self._nv = module
        self._ready = False
        self._chosen: Dict[str, str] = {}  # "compute"/"graphics" -> the process call that works here
        self._memory_v2: Optional[bool] = None  # None: not tried yet
        self._samples = _ProcessSamples()
        self.last_timings: Dict[Tuple[str, int], float] = {}

    def _module(self) -> ModuleType:
        if self._nv is None:
            import pynvml

            self._nv = pynvml
        return self._nv

    def _init(self) -> Optional[str]:
        if self._ready:
            return None
        try:
            nv = self._module()
        except ImportError:
            return (
                "NVML: the Python bindings are not installed "
                "(pip install nvidia-ml-py, or Debian's python3-pynvml from contrib)"
            )
        try:
            nv.nvmlInit()
        except nv.NVMLError as err:
            return f"NVML: cannot initialise: {err}"
        except OSError as err:
            return f"NVML: cannot load the library: {err}"
        self._ready = True
        return None

    def _needs_reinit(self, err: Exception) -> bool:
        nv = self._nv
        codes = [getattr(nv, name) for name in _REINIT_ERRORS if hasattr(nv, name)]
        value = getattr(err, "value", None)
        return value is not None and value in codes

    def _call(self, index: int, fn: Callable, *args: object) -> object:
        name = getattr(fn, "__name__", "call")
        started = time.perf_counter()
        try:
            return fn(*args)
        except self._nv.NVMLError as err:
            if getattr(err, "value", None) == getattr(self._nv, "NVML_ERROR_NOT_SUPPORTED", 3):
                raise _Unsupported(name) from None
            raise
        finally:
            self.last_timings[(name, index)] = time.perf_counter() - started

    def read(self, process_utilization: bool = True) -> GpuReading:
        """One look at every GPU; never raises. Without `process_utilization` the per-process samples are
        not asked for (every process's utilization_pct is None): that one call costs 1.4 ms per GPU on an
        H200 with driver 580.159.04, 90% of a whole look (bench/nvml_calls.py)."""
        self.last_timings = {}
        try:
            return self._read(process_utilization)
        except Exception as err:  # a pynvml bug or a surprise: every GPU unreadable (busy), not a crash
            return GpuReading(gpus=(), error=f"NVML: unexpected {type(err).__name__}: {err}")

    def _read(self, process_utilization: bool) -> GpuReading:
        error = self._init()
        if error:
            return GpuReading(gpus=(), error=error)
        nv = self._nv
        try:
            count = int(self._call(-1, nv.nvmlDeviceGetCount))
        except (nv.NVMLError, _Unsupported) as err:
            self._reset_if_needed(err)
            return GpuReading(gpus=(), error=f"NVML: cannot count GPUs: {err}")
        return GpuReading(gpus=tuple(self._read_gpu(i, process_utilization) for i in range(count)))

    def _reset_if_needed(self, err: Exception) -> None:
        if self._needs_reinit(err):
            self._ready = False
            self._chosen.clear()  # a reloaded driver may export other process calls
            self._samples = _ProcessSamples()
            with contextlib.suppress(Exception):
                self._nv.nvmlShutdown()

    def _field(self, index: int, label: str, errors: List[str], fn: Callable, *args: object) -> object:
        try:
            return self._call(index, fn, *args)
        except _Unsupported:
            return None
        except self._nv.NVMLError as err:
            self._reset_if_needed(err)
            errors.append(f"{label}: {err}")
            return None

    def _read_gpu(self, index: int, process_utilization: bool = True) -> Gpu:
        nv = self._nv
        errors: List[str] = []
        handle = self._field(index, "handle", errors, nv.nvmlDeviceGetHandleByIndex, index)
        if handle is None:
            errors = errors or ["handle: not supported"]
            return Gpu(index=index, uuid=None, processes=None, errors=tuple(errors))
        uuid = _text(self._field(index, "uuid", errors, nv.nvmlDeviceGetUUID, handle))
        name = _text(self._field(index, "name", errors, nv.nvmlDeviceGetName, handle))
        minor = self._field(index, "minor number", errors, nv.nvmlDeviceGetMinorNumber, handle)
        memory = self._memory(index, handle, errors)
        util = self._field(index, "utilization", errors, nv.nvmlDeviceGetUtilizationRates, handle)
        energy = self._optional(index, "energy", errors, "nvmlDeviceGetTotalEnergyConsumption", handle)
        power = self._optional(index, "power", errors, "nvmlDeviceGetPowerUsage", handle)
        procs = self._processes(index, handle, errors)
        if procs and process_utilization:
            procs = self._samples.apply(
                procs, index, lambda fn, *a: self._call(index, fn, *a), self._nv, handle
            )
        if uuid is None and not any(e.startswith("uuid:") for e in errors):
            errors.append("uuid: not supported")
        return Gpu(
            index=index,
            uuid=uuid,
            name=name,
            minor=minor if isinstance(minor, int) else None,
            device=f"{self._dev_dir}/nvidia{minor}" if isinstance(minor, int) else None,
            memory_total_mib=int(memory.total) // _MIB if memory is not None else None,
            memory_used_mib=int(memory.used) // _MIB if memory is not None else None,
            memory_reserved_mib=_reserved_mib(memory),
            utilization_pct=int(util.gpu) if util is not None else None,
            processes=procs,
            errors=tuple(errors),
            energy_mj=int(energy) if isinstance(energy, int) else None,
            power_mw=int(power) if isinstance(power, int) else None,
        )

    def _optional(self, index: int, label: str, errors: List[str], name: str, handle: object) -> object:
        """A figure that not every GPU or binding has (energy: Volta and newer data-centre GPUs): None when
        the binding lacks the call or NVML says NOT_SUPPORTED (no figure, never a made-up 0)."""
        fn = getattr(self._nv, name, None)
        return None if fn is None else self._field(index, label, errors, fn, handle)

    def _memory(self, index: int, handle: object, errors: List[str]) -> object:
        """Memory info v2 where the driver has it: v1's `used` counts the driver's reserved memory too
        (about 480 MiB on an idle H100 with no process), so an idle GPU looked used. Else v1."""
        nv = self._nv
        version = getattr(nv, "nvmlMemory_v2", None)
        if version is not None and self._memory_v2 is not False:
            try:
                memory = self._call(index, nv.nvmlDeviceGetMemoryInfo, handle, version)
                self._memory_v2 = True
                return memory
            except (TypeError, _Unsupported):  # bindings without the version argument; a GPU without v2
                self._memory_v2 = False
            except nv.NVMLError as err:
                if getattr(err, "value", None) != getattr(nv, "NVML_ERROR_FUNCTION_NOT_FOUND", 13):
                    self._reset_if_needed(err)
                    errors.append(f"memory: {err}")
                    return None
                self._memory_v2 = False  # a driver older than the call
        return self._field(index, "memory", errors, nv.nvmlDeviceGetMemoryInfo, handle)

    def _processes(self, index: int, handle: object, errors: List[str]) -> Optional[Tuple[GpuProcess, ...]]:
        out: List[GpuProcess] = []
        for kind, calls in (("compute", _COMPUTE_CALLS), ("graphics", _GRAPHICS_CALLS)):
            try:
                listed = self._list_processes(index, handle, kind, calls)
            except _Unsupported:
                continue
            except self._nv.NVMLError as err:
                self._reset_if_needed(err)
                errors.append(f"{kind} processes: {err}")
                return None
            for p in listed:
                used = getattr(p, "usedGpuMemory", None)
                out.append(
                    GpuProcess(
                        pid=int(p.pid),
                        used_memory_mib=int(used) // _MIB if used is not None else None,
                        kind=kind,
                    )
                )
        return tuple(out)

    def _list_processes(self, index: int, handle: object, kind: str, calls: Tuple[str, ...]) -> list:
        """Call the newest process-list function this driver has, remembering which one worked."""
        nv = self._nv
        not_found = getattr(nv, "NVML_ERROR_FUNCTION_NOT_FOUND", 13)
        names = (self._chosen[kind],) if kind in self._chosen else calls
        last: Optional[Exception] = None
        for name in names:
            fn = getattr(nv, name, None)
            if fn is None:
                continue
            try:
                result = self._call(index, fn, handle)
            except nv.NVMLError as err:
                if getattr(err, "value", None) == not_found:
                    last = err
                    continue
                raise
            self._chosen[kind] = name
            return list(result or [])
        if last is not None:
            self._chosen.pop(kind, None)  # try every call again next time
            raise last
        raise _Unsupported(kind)

    def close(self) -> None:
        """Shut NVML down if it was initialised."""
        if self._ready:
            self._ready = False
            with contextlib.suppress(Exception):
                self._nv.nvmlShutdown()


class _ProcessSamples:
    """Per-process SM utilization: nvmlDeviceGetProcessesUtilizationInfo (drivers >= 550), else
    nvmlDeviceGetProcessUtilization. Both return the samples taken since the timestamp passed in, so the
    last one seen is remembered per GPU. NOT_FOUND means no process was sampled in the period (all at 0%);
    a driver or GPU that cannot sample processes leaves every process's utilization unknown (None)."""

    _CALLS = ("nvmlDeviceGetProcessesUtilizationInfo", "nvmlDeviceGetProcessUtilization")

    def __init__(self) -> None:
        self.last_seen: Dict[int, int] = {}  # GPU index -> newest sample timestamp (µs)
        self.calls: Optional[Tuple[str, ...]] = None  # those that work here, newest first

    def apply(
        self, procs: Tuple[GpuProcess, ...], index: int, call: Callable, nv: ModuleType, handle: object
    ) -> Tuple[GpuProcess, ...]:
        """The processes with `utilization_pct` filled in where the driver reports it."""
        by_pid = self._read(index, call, nv, handle)
        if by_pid is None:
            return procs
        return tuple(GpuProcess(p.pid, p.used_memory_mib, p.kind, by_pid.get(p.pid, 0)) for p in procs)

    def _read(self, index: int, call: Callable, nv: ModuleType, handle: object) -> Optional[Dict[int, int]]:
        names = self.calls if self.calls is not None else self._CALLS
        for name in names:
            fn = getattr(nv, name, None)
            if fn is None:
                continue
            try:
                samples = call(fn, handle, self.last_seen.get(index, 0))
            except _Unsupported:
                continue
            except nv.NVMLError as err:
                code = getattr(err, "value", None)
                if code in (getattr(nv, "NVML_ERROR_NOT_FOUND", 6), getattr(nv, "NVML_SUCCESS", 0)):
                    self.calls = (name,)  # no sample since last time: every process idle
                    return {}
                if code == getattr(nv, "NVML_ERROR_FUNCTION_NOT_FOUND", 13):
                    continue
                return None  # an error this time: unknown, never 0
            self.calls = (name,)
            return self._mean(index, samples)
        self.calls = ()  # nothing works on this driver: do not ask again
        return None

    def _mean(self, index: int, samples: list) -> Dict[int, int]:
        """Mean SM utilization per pid over the samples; remember the newest timestamp."""
        total: Dict[int, List[int]] = {}
        newest = self.last_seen.get(index, 0)
        for s in samples:
            total.setdefault(int(s.pid), []).append(min(100, int(s.smUtil)))
            newest = max(newest, int(s.timeStamp))
        self.last_seen[index] = newest
        return {pid: round(sum(v) / len(v)) for pid, v in total.items()}


def _reserved_mib(memory: object) -> Optional[int]:
    reserved = getattr(memory, "reserved", None)
    return int(reserved) // _MIB if reserved is not None else None


def _text(value: object) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
