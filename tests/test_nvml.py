"""gpu_mon.api.nvml.NvmlBackend against a stub that imitates pynvml, and once against the real pynvml.

The backend must never raise: whatever NVML does, read() returns a GpuReading, and every field it could not
read is None with a line `field: message` in Gpu.errors (NOT_SUPPORTED is not an error).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from gpu_mon.api.model import GpuProcess, GpuReading
from gpu_mon.api.nvml import NvmlBackend

MIB = 1 << 20

# Error codes as in pynvml (nvidia-ml-py).
UNINITIALIZED = 1
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NO_PERMISSION = 4
DRIVER_NOT_LOADED = 9
TIMEOUT = 10
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
LIB_RM_VERSION_MISMATCH = 18
UNKNOWN = 999

# Their messages, as pynvml's NVMLError.__str__ gives them.
MESSAGES = {
    UNINITIALIZED: "Uninitialized",
    INVALID_ARGUMENT: "Invalid Argument",
    NOT_SUPPORTED: "Not Supported",
    NO_PERMISSION: "Insufficient Permissions",
    DRIVER_NOT_LOADED: "Driver Not Loaded",
    TIMEOUT: "Timeout",
    LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    FUNCTION_NOT_FOUND: "Function Not Found",
    GPU_IS_LOST: "GPU is lost",
    LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
    UNKNOWN: "Unknown Error",
}

COMPUTE = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2")
COMPUTE += ("nvmlDeviceGetComputeRunningProcesses",)
GRAPHICS = ("nvmlDeviceGetGraphicsRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v2")
GRAPHICS += ("nvmlDeviceGetGraphicsRunningProcesses",)
PROCESS_CALLS = COMPUTE + GRAPHICS


class NVMLError(Exception):
    """Like pynvml.NVMLError: carries the code in `.value`."""

    def __init__(self, value):
        super().__init__(value)
        self.value = value

    def __str__(self):
        return MESSAGES.get(self.value, f"NVML Error with code {self.value}")


def gpu(index, **over):
    g = {
        "uuid": f"GPU-{index:08x}-aaaa-bbbb-cccc-{index:012x}",
        "name": f"NVIDIA Stub {index}",
        "minor": index + 2,  # minor numbers need not match indices
        "total": 81559 * MIB,
        "used": (index + 1) * 100 * MIB + 12345,  # rounds down to MiB
        "util": 10 * index,
        "compute": [SimpleNamespace(pid=1000 + index, usedGpuMemory=512 * MIB)],
        "graphics": [SimpleNamespace(pid=2000 + index, usedGpuMemory=None)],
    }
    g.update(over)
    return g


class StubNvml:
    """A stand-in for the pynvml module.

    `fail` maps a function name, or (function name, GPU index), to an error code that the call raises.
    `module_calls`: the process-list functions this pynvml version has as attributes. `driver_calls`: those
    the driver implements; the rest raise FUNCTION_NOT_FOUND, as pynvml does for a missing symbol.
    """

    NVMLError = NVMLError
    NVML_ERROR_UNINITIALIZED = UNINITIALIZED
    NVML_ERROR_INVALID_ARGUMENT = INVALID_ARGUMENT
    NVML_ERROR_NOT_SUPPORTED = NOT_SUPPORTED
    NVML_ERROR_NO_PERMISSION = NO_PERMISSION
    NVML_ERROR_DRIVER_NOT_LOADED = DRIVER_NOT_LOADED
    NVML_ERROR_TIMEOUT = TIMEOUT
    NVML_ERROR_LIBRARY_NOT_FOUND = LIBRARY_NOT_FOUND
    NVML_ERROR_FUNCTION_NOT_FOUND = FUNCTION_NOT_FOUND
    NVML_ERROR_GPU_IS_LOST = GPU_IS_LOST
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = LIB_RM_VERSION_MISMATCH
    NVML_ERROR_UNKNOWN = UNKNOWN

    def __init__(self, gpus=None, fail=None, module_calls=PROCESS_CALLS, driver_calls=PROCESS_CALLS):
        self.gpus = [gpu(0), gpu(1)] if gpus is None else gpus
        self.fail = dict(fail or {})
        self.calls = []
        self.inits = 0
        self.shutdowns = 0
        self.init_error = None  # an exception nvmlInit raises
        self.driver_calls = set(driver_calls)
        for name in module_calls:
            setattr(self, name, self._process_call(name))

    def _enter(self, name, index=None):
        self.calls.append(name)
        code = self.fail.get((name, index), self.fail.get(name))
        if code is not None:
            raise NVMLError(code)

    def _process_call(self, name):
        kind = "compute" if "Compute" in name else "graphics"

        def call(handle):
            self._enter(name, handle.index)
            if name not in self.driver_calls:
                raise NVMLError(FUNCTION_NOT_FOUND)
            return list(self.gpus[handle.index][kind])

        call.__name__ = name
        return call

    def nvmlInit(self):
        self.calls.append("nvmlInit")
        self.inits += 1
        if self.init_error is not None:
            raise self.init_error
        self._enter("nvmlInit")

    def nvmlShutdown(self):
        self.calls.append("nvmlShutdown")
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._enter("nvmlDeviceGetHandleByIndex", index)
        return SimpleNamespace(index=index)

    def nvmlDeviceGetUUID(self, handle):
        self._enter("nvmlDeviceGetUUID", handle.index)
        return self.gpus[handle.index]["uuid"]

    def nvmlDeviceGetName(self, handle):
        self._enter("nvmlDeviceGetName", handle.index)
        return self.gpus[handle.index]["name"]

    def nvmlDeviceGetMinorNumber(self, handle):
        self._enter("nvmlDeviceGetMinorNumber", handle.index)
        return self.gpus[handle.index]["minor"]

    def nvmlDeviceGetMemoryInfo(self, handle):
        self._enter("nvmlDeviceGetMemoryInfo", handle.index)
        g = self.gpus[handle.index]
        return SimpleNamespace(total=g["total"], used=g["used"], free=g["total"] - g["used"])

    def nvmlDeviceGetUtilizationRates(self, handle):
        self._enter("nvmlDeviceGetUtilizationRates", handle.index)
        return SimpleNamespace(gpu=self.gpus[handle.index]["util"], memory=0)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        self._enter("nvmlDeviceGetTotalEnergyConsumption", handle.index)
        value = self.gpus[handle.index].get("energy")
        if value is None:  # (a GPU older than Volta, or not a data-centre one)
            raise NVMLError(NOT_SUPPORTED)
        return value

    def nvmlDeviceGetPowerUsage(self, handle):
        self._enter("nvmlDeviceGetPowerUsage", handle.index)
        value = self.gpus[handle.index].get("power")
        if value is None:
            raise NVMLError(NOT_SUPPORTED)
        return value


def backend(stub, **kwargs):
    return NvmlBackend(module=stub, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# A healthy read


def test_reads_every_gpu():
    stub = StubNvml()
    reading = backend(stub).read()
    assert reading.error is None
    g0, g1 = reading.gpus
    assert (g0.index, g0.uuid, g0.name) == (0, "GPU-00000000-aaaa-bbbb-cccc-000000000000", "NVIDIA Stub 0")
    assert (g0.minor, g0.device) == (2, "/dev/nvidia2")
    assert (g0.memory_total_mib, g0.memory_used_mib, g0.utilization_pct) == (81559, 100, 0)
    assert g0.processes == (
        GpuProcess(pid=1000, used_memory_mib=512, kind="compute"),
        GpuProcess(pid=2000, used_memory_mib=None, kind="graphics"),
    )
    assert g0.errors == ()
    assert (g1.index, g1.minor, g1.device, g1.memory_used_mib, g1.utilization_pct) == (
        1,
        3,
        "/dev/nvidia3",
        200,
        10,
    )
    assert g1.errors == ()


def test_initialises_once_and_shuts_down_on_close():
    stub = StubNvml()
    b = backend(stub)
    for _ in range(3):
        assert b.read().error is None
    assert (stub.inits, stub.shutdowns) == (1, 0)
    b.close()
    b.close()
    assert stub.shutdowns == 1
    assert b.read().error is None  # used again after close: initialised again
    assert stub.inits == 2


def test_close_before_any_read_does_not_touch_nvml():
    stub = StubNvml()
    backend(stub).close()
    assert stub.calls == []


def test_no_gpus():
    reading = backend(StubNvml(gpus=[])).read()
    assert reading == GpuReading(gpus=())


@pytest.mark.parametrize(
    ("dev_dir", "device"),
    [("/dev", "/dev/nvidia2"), ("/dev/", "/dev/nvidia2"), ("/tmp/sim/dev", "/tmp/sim/dev/nvidia2")],
    ids=["default", "trailing-slash", "other-dir"],
)
def test_device_path_from_minor_number(dev_dir, device):
    assert backend(StubNvml(), dev_dir=dev_dir).read().gpus[0].device == device


def test_minor_zero_is_a_device():
    reading = backend(StubNvml(gpus=[gpu(0, minor=0)])).read()
    assert (reading.gpus[0].minor, reading.gpus[0].device) == (0, "/dev/nvidia0")


@pytest.mark.parametrize(
    ("uuid", "name"),
    [
        (b"GPU-5a1c0f3e-8d2b-4c6a-9f10-3b7e2d4c8a01", b"NVIDIA H100 80GB HBM3"),
        ("GPU-5a1c0f3e-8d2b-4c6a-9f10-3b7e2d4c8a01", "NVIDIA H100 80GB HBM3"),
    ],
    ids=["bytes", "str"],
)
def test_bytes_and_str_uuids_and_names(uuid, name):
    (g,) = backend(StubNvml(gpus=[gpu(0, uuid=uuid, name=name)])).read().gpus
    assert (g.uuid, g.name) == ("GPU-5a1c0f3e-8d2b-4c6a-9f10-3b7e2d4c8a01", "NVIDIA H100 80GB HBM3")


def test_undecodable_bytes_name_does_not_raise():
    (g,) = backend(StubNvml(gpus=[gpu(0, name=b"NVIDIA \xff")])).read().gpus
    assert g.name == "NVIDIA \ufffd" and g.errors == ()


def test_used_gpu_memory_none_and_bytes():
    procs = [SimpleNamespace(pid=7, usedGpuMemory=None), SimpleNamespace(pid=8, usedGpuMemory=3 * MIB + 1)]
    (g,) = backend(StubNvml(gpus=[gpu(0, compute=procs, graphics=[])])).read().gpus
    assert g.processes == (GpuProcess(7, None, "compute"), GpuProcess(8, 3, "compute"))


def test_process_without_used_gpu_memory_attribute():
    (g,) = backend(StubNvml(gpus=[gpu(0, compute=[SimpleNamespace(pid=9)], graphics=[])])).read().gpus
    assert g.processes == (GpuProcess(9, None, "compute"),)


def test_last_timings_are_filled_for_every_call():
    b = backend(StubNvml())
    assert b.last_timings == {}
    b.read()
    keys = set(b.last_timings)
    assert ("nvmlDeviceGetCount", -1) in keys
    for index in (0, 1):
        for name in (
            "nvmlDeviceGetHandleByIndex",
            "nvmlDeviceGetUUID",
            "nvmlDeviceGetName",
            "nvmlDeviceGetMinorNumber",
            "nvmlDeviceGetMemoryInfo",
            "nvmlDeviceGetUtilizationRates",
            COMPUTE[0],
            GRAPHICS[0],
        ):
            assert (name, index) in keys
    assert all(isinstance(t, float) and t >= 0 for t in b.last_timings.values())


def test_last_timings_hold_only_the_last_look():
    stub = StubNvml()
    b = backend(stub)
    b.read()
    stub.gpus = [gpu(0)]
    b.read()
    assert not any(index == 1 for _, index in b.last_timings)
    stub.init_error = NVMLError(DRIVER_NOT_LOADED)
    b.close()
    assert b.read().error
    assert b.last_timings == {}  # nothing was timed in a look that could not start


def test_a_failed_call_is_timed_too():
    b = backend(StubNvml(fail={("nvmlDeviceGetMemoryInfo", 1): UNKNOWN}))
    b.read()
    assert ("nvmlDeviceGetMemoryInfo", 1) in b.last_timings


# ---------------------------------------------------------------------------------------------------------
# Initialisation


INIT_FAILURES = [
    ("driver-not-loaded", NVMLError(DRIVER_NOT_LOADED), "NVML: cannot initialise: Driver Not Loaded"),
    (
        "library-not-found",
        NVMLError(LIBRARY_NOT_FOUND),
        "NVML: cannot initialise: NVML Shared Library Not Found",
    ),
    ("no-permission", NVMLError(NO_PERMISSION), "NVML: cannot initialise: Insufficient Permissions"),
    (
        "os-error",
        OSError("libnvidia-ml.so.1: cannot open shared object file"),
        "NVML: cannot load the library",
    ),
]


@pytest.mark.parametrize(("exc", "error"), [f[1:] for f in INIT_FAILURES], ids=[f[0] for f in INIT_FAILURES])
def test_init_failure_is_an_error_reading_and_is_retried(exc, error):
    stub = StubNvml()
    stub.init_error = exc
    b = backend(stub)
    reading = b.read()
    assert reading.gpus == () and reading.error.startswith(error)
    assert "\n" not in reading.error
    assert b.read().error.startswith(error)
    assert stub.inits == 2  # tried again on the next look
    assert "nvmlDeviceGetCount" not in stub.calls
    stub.init_error = None  # the driver got loaded
    reading = b.read()
    assert reading.error is None and len(reading.gpus) == 2
    assert stub.inits == 3


def test_missing_pynvml_package(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pynvml(name, *args, **kwargs):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    reading = NvmlBackend().read()
    assert reading.gpus == ()
    assert reading.error == (
        "NVML: the Python bindings are not installed "
        "(pip install nvidia-ml-py, or Debian's python3-pynvml from contrib)"
    )


# ---------------------------------------------------------------------------------------------------------
# Counting


@pytest.mark.parametrize(
    ("code", "reinit"),
    [
        (UNKNOWN, False),
        (TIMEOUT, False),
        (UNINITIALIZED, True),
        (DRIVER_NOT_LOADED, True),
        (LIB_RM_VERSION_MISMATCH, True),
    ],
    ids=["unknown", "timeout", "uninitialized", "driver-not-loaded", "version-mismatch"],
)
def test_count_failure(code, reinit):
    stub = StubNvml(fail={"nvmlDeviceGetCount": code})
    b = backend(stub)
    reading = b.read()
    assert reading == GpuReading(gpus=(), error=f"NVML: cannot count GPUs: {MESSAGES[code]}")
    assert stub.shutdowns == (1 if reinit else 0)
    del stub.fail["nvmlDeviceGetCount"]
    assert len(b.read().gpus) == 2
    assert stub.inits == (2 if reinit else 1)


def test_count_not_supported():
    reading = backend(StubNvml(fail={"nvmlDeviceGetCount": NOT_SUPPORTED})).read()
    assert reading.gpus == () and reading.error.startswith("NVML: cannot count GPUs")


# ---------------------------------------------------------------------------------------------------------
# One GPU, one field


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (GPU_IS_LOST, "handle: GPU is lost"),
        (UNKNOWN, "handle: Unknown Error"),
        (NOT_SUPPORTED, "handle: not supported"),
    ],
    ids=["gpu-lost", "unknown", "not-supported"],
)
def test_handle_fails_for_one_gpu_of_two(code, error):
    reading = backend(StubNvml(fail={("nvmlDeviceGetHandleByIndex", 0): code})).read()
    assert reading.error is None
    g0, g1 = reading.gpus
    assert (g0.index, g0.uuid, g0.processes, g0.errors) == (0, None, None, (error,))
    assert g0.device is None and g0.memory_used_mib is None
    assert g1.uuid == "GPU-00000001-aaaa-bbbb-cccc-000000000001" and g1.errors == ()
    assert g1.processes is not None and len(g1.processes) == 2


FIELD_FAILURES = [
    # (id, failing call, label in the error, the Gpu attributes that become None)
    ("uuid", "nvmlDeviceGetUUID", "uuid", ("uuid",)),
    ("name", "nvmlDeviceGetName", "name", ("name",)),
    ("minor", "nvmlDeviceGetMinorNumber", "minor number", ("minor", "device")),
    ("memory", "nvmlDeviceGetMemoryInfo", "memory", ("memory_total_mib", "memory_used_mib")),
    ("utilization", "nvmlDeviceGetUtilizationRates", "utilization", ("utilization_pct",)),
    ("compute-processes", COMPUTE[0], "compute processes", ("processes",)),
    ("graphics-processes", GRAPHICS[0], "graphics processes", ("processes",)),
]
FIELDS = (
    "uuid",
    "name",
    "minor",
    "device",
    "memory_total_mib",
    "memory_used_mib",
    "utilization_pct",
    "processes",
)


@pytest.mark.parametrize(
    "code", [UNKNOWN, NO_PERMISSION, TIMEOUT], ids=["unknown", "no-permission", "timeout"]
)
@pytest.mark.parametrize(
    ("call", "label", "nones"), [f[1:] for f in FIELD_FAILURES], ids=[f[0] for f in FIELD_FAILURES]
)
def test_field_failure_is_none_plus_an_error(call, label, nones, code):
    healthy = backend(StubNvml()).read().gpus[1]
    stub = StubNvml(fail={(call, 1): code})
    reading = backend(stub).read()
    assert reading.error is None
    g0, g1 = reading.gpus
    assert g0.errors == ()
    assert g1.errors == (f"{label}: {MESSAGES[code]}",)
    for name in FIELDS:
        if name in nones:
            assert getattr(g1, name) is None, name
        else:
            assert getattr(g1, name) == getattr(healthy, name), name
    assert stub.shutdowns == 0


@pytest.mark.parametrize(
    ("call", "nones"),
    [
        ("nvmlDeviceGetName", ("name",)),
        ("nvmlDeviceGetMinorNumber", ("minor", "device")),
        ("nvmlDeviceGetMemoryInfo", ("memory_total_mib", "memory_used_mib")),
        ("nvmlDeviceGetUtilizationRates", ("utilization_pct",)),
    ],
    ids=["name", "minor", "memory", "utilization"],
)
def test_not_supported_field_is_none_without_an_error(call, nones):
    (g,) = backend(StubNvml(gpus=[gpu(0)], fail={call: NOT_SUPPORTED})).read().gpus
    assert g.errors == ()
    for name in nones:
        assert getattr(g, name) is None
    assert g.uuid is not None and g.processes is not None


def test_uuid_not_supported_is_an_error():
    """Without a UUID the GPU cannot be named: that is reported (once)."""
    (g,) = backend(StubNvml(gpus=[gpu(0)], fail={"nvmlDeviceGetUUID": NOT_SUPPORTED})).read().gpus
    assert (g.uuid, g.errors) == (None, ("uuid: not supported",))


def test_uuid_failure_is_reported_once():
    (g,) = backend(StubNvml(gpus=[gpu(0)], fail={"nvmlDeviceGetUUID": UNKNOWN})).read().gpus
    assert g.errors == ("uuid: Unknown Error",)


def test_process_lists_not_supported_read_as_empty_without_an_error():
    """Some GPUs cannot list processes: that is 'absent', like any unsupported field (the holder scan and
    busy_memory_mib still see users)."""
    fail = {name: NOT_SUPPORTED for name in PROCESS_CALLS}
    (g,) = backend(StubNvml(gpus=[gpu(0)], fail=fail)).read().gpus
    assert (g.processes, g.errors) == ((), ())


def test_graphics_not_supported_keeps_compute():
    (g,) = backend(StubNvml(gpus=[gpu(0)], fail={GRAPHICS[0]: NOT_SUPPORTED})).read().gpus
    assert g.processes == (GpuProcess(1000, 512, "compute"),) and g.errors == ()


def test_gpu_is_lost_on_every_field():
    fail = {(name, 1): GPU_IS_LOST for name in ("nvmlDeviceGetUUID", "nvmlDeviceGetName")}
    fail.update({(name, 1): GPU_IS_LOST for name in ("nvmlDeviceGetMinorNumber", "nvmlDeviceGetMemoryInfo")})
    fail.update({("nvmlDeviceGetUtilizationRates", 1): GPU_IS_LOST, (COMPUTE[0], 1): GPU_IS_LOST})
    stub = StubNvml(fail=fail)
    reading = backend(stub).read()
    g0, g1 = reading.gpus
    assert g0.errors == () and g0.uuid is not None
    assert all(getattr(g1, name) is None for name in FIELDS)
    assert g1.errors == (
        "uuid: GPU is lost",
        "name: GPU is lost",
        "minor number: GPU is lost",
        "memory: GPU is lost",
        "utilization: GPU is lost",
        "compute processes: GPU is lost",
    )
    assert stub.shutdowns == 0  # a lost GPU is not a reason to re-initialise NVML


def test_errors_on_two_gpus_stay_apart():
    stub = StubNvml(fail={("nvmlDeviceGetName", 0): UNKNOWN, ("nvmlDeviceGetMemoryInfo", 1): TIMEOUT})
    g0, g1 = backend(stub).read().gpus
    assert (g0.errors, g1.errors) == (("name: Unknown Error",), ("memory: Timeout",))


# ---------------------------------------------------------------------------------------------------------
# Re-initialisation after UNINITIALIZED (or a driver reload) in the middle of a look


@pytest.mark.parametrize("code", [UNINITIALIZED, DRIVER_NOT_LOADED, LIB_RM_VERSION_MISMATCH])
def test_reinit_error_on_a_field_reinitialises_on_the_next_read(code):
    stub = StubNvml(fail={("nvmlDeviceGetMemoryInfo", 0): code})
    b = backend(stub)
    g0, _ = b.read().gpus
    assert g0.errors == (f"memory: {MESSAGES[code]}",) and g0.memory_used_mib is None
    assert stub.shutdowns >= 1
    assert stub.inits == 1
    stub.fail.clear()
    g0, _ = b.read().gpus
    assert stub.inits == 2
    assert g0.errors == () and g0.memory_used_mib == 100


def test_uninitialized_on_a_process_call_reinitialises():
    stub = StubNvml(fail={(COMPUTE[0], 0): UNINITIALIZED})
    b = backend(stub)
    g0, _ = b.read().gpus
    assert (g0.processes, g0.errors) == (None, ("compute processes: Uninitialized",))
    stub.fail.clear()
    assert b.read().gpus[0].processes is not None
    assert stub.inits == 2


def test_reinit_forgets_the_chosen_process_call():
    """A reloaded driver may have other symbols: after re-initialising, the newest call is tried again."""
    stub = StubNvml(driver_calls=(COMPUTE[1], GRAPHICS[1]))
    b = backend(stub)
    b.read()
    stub.fail["nvmlDeviceGetCount"] = DRIVER_NOT_LOADED
    b.read()
    del stub.fail["nvmlDeviceGetCount"]
    stub.driver_calls = set(PROCESS_CALLS)
    stub.calls.clear()
    assert b.read().gpus[0].errors == ()
    assert COMPUTE[0] in stub.calls and COMPUTE[1] not in stub.calls


# ---------------------------------------------------------------------------------------------------------
# Process-list fallback: _v3 -> _v2 -> unversioned, remembered


FALLBACKS = [
    ("v3", PROCESS_CALLS, COMPUTE[0], GRAPHICS[0]),
    ("v2", (COMPUTE[1], COMPUTE[2], GRAPHICS[1], GRAPHICS[2]), COMPUTE[1], GRAPHICS[1]),
    ("unversioned", (COMPUTE[2], GRAPHICS[2]), COMPUTE[2], GRAPHICS[2]),
]


@pytest.mark.parametrize(
    ("driver", "compute", "graphics"), [f[1:] for f in FALLBACKS], ids=[f[0] for f in FALLBACKS]
)
def test_process_call_fallback_is_remembered(driver, compute, graphics):
    stub = StubNvml(driver_calls=driver)
    b = backend(stub)
    first = b.read()
    assert all(g.errors == () and len(g.processes) == 2 for g in first.gpus)
    stub.calls.clear()
    second = b.read()
    assert second == first
    process_calls = [c for c in stub.calls if c in PROCESS_CALLS]
    # Only the call that worked, once per GPU and kind: no more FUNCTION_NOT_FOUND probing.
    assert process_calls == [compute, graphics, compute, graphics]


def test_old_pynvml_without_v3_attributes():
    old = (COMPUTE[1], COMPUTE[2], GRAPHICS[1], GRAPHICS[2])
    stub = StubNvml(module_calls=old, driver_calls=old)
    assert not hasattr(stub, COMPUTE[0])
    reading = backend(stub).read()
    assert all(g.errors == () and len(g.processes) == 2 for g in reading.gpus)
    assert COMPUTE[1] in stub.calls


def test_oldest_pynvml_with_only_unversioned_calls():
    old = (COMPUTE[2], GRAPHICS[2])
    stub = StubNvml(module_calls=old, driver_calls=old)
    reading = backend(stub).read()
    assert all(g.errors == () and len(g.processes) == 2 for g in reading.gpus)


def test_no_process_call_in_the_driver_is_an_error_and_retried():
    stub = StubNvml(driver_calls=())
    b = backend(stub)
    for _ in range(2):
        stub.calls.clear()
        g0, g1 = b.read().gpus
        assert (g0.processes, g0.errors) == (None, ("compute processes: Function Not Found",))
        assert g1.processes is None
        assert [c for c in stub.calls if c in COMPUTE][:3] == list(COMPUTE)  # each look tries them all
    stub.driver_calls = set(PROCESS_CALLS)
    assert all(g.errors == () for g in b.read().gpus)


def test_chosen_call_that_disappears_is_probed_again_next_look():
    stub = StubNvml()
    b = backend(stub)
    b.read()
    stub.driver_calls = {COMPUTE[1], GRAPHICS[1]}  # v3 gone without an NVML re-init
    g0, _ = b.read().gpus
    assert (g0.processes, g0.errors) == (None, ("compute processes: Function Not Found",))
    g0, _ = b.read().gpus
    assert g0.errors == () and len(g0.processes) == 2


def test_no_process_functions_in_the_module_read_as_unsupported():
    stub = StubNvml(module_calls=())
    (g, _) = backend(stub).read().gpus
    assert (g.processes, g.errors) == ((), ())


def test_process_call_error_other_than_function_not_found_does_not_fall_back():
    stub = StubNvml(fail={COMPUTE[0]: NO_PERMISSION})
    g0, _ = backend(stub).read().gpus
    assert (g0.processes, g0.errors) == (None, ("compute processes: Insufficient Permissions",))
    assert COMPUTE[1] not in stub.calls


# ---------------------------------------------------------------------------------------------------------
# Never raises


class Weird(Exception):
    pass


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("ctypes exploded"),
        UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
        Weird(),
    ],
    ids=["runtime-error", "unicode-decode-error", "custom"],
)
def test_unexpected_exception_is_an_error_reading(exc):
    stub = StubNvml()

    def broken(handle):
        raise exc

    stub.nvmlDeviceGetName = broken
    reading = backend(stub).read()
    assert reading.gpus == ()
    assert reading.error.startswith(f"NVML: unexpected {type(exc).__name__}")


def test_nvml_error_without_a_value():
    stub = StubNvml()

    def broken(handle):
        raise NVMLError(None)

    stub.nvmlDeviceGetName = broken
    g0, _ = backend(stub).read().gpus
    assert g0.name is None and len(g0.errors) == 1 and g0.errors[0].startswith("name: ")
    assert stub.shutdowns == 0


def test_old_pynvml_without_some_error_constants():
    """An error without a code must not look like a re-init error just because a constant is missing."""
    stub = StubNvml()

    def broken(handle):
        raise NVMLError(None)

    stub.nvmlDeviceGetName = broken
    names = [n for n in dir(stub) if not n.startswith("_") and n != "NVML_ERROR_LIB_RM_VERSION_MISMATCH"]
    module = SimpleNamespace(**{n: getattr(stub, n) for n in names})
    b = backend(module)
    g0, _ = b.read().gpus
    assert g0.name is None and len(g0.errors) == 1
    b.read()
    assert (stub.inits, stub.shutdowns) == (1, 0)


# ---------------------------------------------------------------------------------------------------------
# The real pynvml


def test_real_pynvml_never_raises():
    """On a machine without a GPU or driver this is an error reading; with one, GPUs."""
    b = NvmlBackend()
    try:
        reading = b.read()
        again = b.read()
    finally:
        b.close()
    assert isinstance(reading, GpuReading)
    if reading.error:
        assert reading.gpus == () and reading.error.startswith("NVML: ")
        assert again.error and again.gpus == ()
    else:
        assert reading.gpus


@pytest.mark.gpu
def test_real_gpus_are_read():
    b = NvmlBackend()
    try:
        reading = b.read()
    finally:
        b.close()
    assert reading.error is None and reading.gpus
    for g in reading.gpus:
        assert g.uuid and g.uuid.startswith("GPU-"), g
        assert g.name
        assert g.device == f"/dev/nvidia{g.minor}" and os.path.exists(g.device)
        assert g.memory_total_mib and g.memory_total_mib > 0
        assert g.memory_used_mib is not None and 0 <= g.memory_used_mib <= g.memory_total_mib
        assert g.processes is not None
        assert not any(e.startswith(("uuid:", "memory:", "compute processes:")) for e in g.errors), g.errors
    assert len({g.uuid for g in reading.gpus}) == len(reading.gpus)


class StubNvmlV2(StubNvml):
    """Bindings and a driver with nvmlDeviceGetMemoryInfo_v2: `used` leaves the driver's reserve out."""

    nvmlMemory_v2 = 0x02000028

    def __init__(self, *args, v2_error=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.v2_error = v2_error
        self.versions = []

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        self.versions.append(version)
        g = self.gpus[handle.index]
        if version is None:
            return super().nvmlDeviceGetMemoryInfo(handle)
        self._enter("nvmlDeviceGetMemoryInfo", handle.index)
        if self.v2_error is not None:
            raise NVMLError(self.v2_error)
        reserved = 480 << 20
        used = g["used"] - reserved if g["used"] >= reserved else 0
        return SimpleNamespace(total=g["total"], reserved=reserved, used=used, free=g["total"] - g["used"])


def test_memory_info_v2_reports_the_driver_reserve_apart():
    stub = StubNvmlV2(gpus=[gpu(0, used=480 << 20)])
    (g,) = backend(stub).read().gpus
    assert (g.memory_used_mib, g.memory_reserved_mib) == (0, 480)  # an idle GPU looks idle
    assert stub.versions == [StubNvmlV2.nvmlMemory_v2]


@pytest.mark.parametrize("code", [FUNCTION_NOT_FOUND, NOT_SUPPORTED], ids=["old-driver", "not-supported"])
def test_memory_info_falls_back_to_v1_once(code):
    stub = StubNvmlV2(gpus=[gpu(0, used=480 << 20)], v2_error=code)
    b = backend(stub)
    for _ in range(2):
        (g,) = b.read().gpus
        assert (g.memory_used_mib, g.memory_reserved_mib, g.errors) == (480, None, ())
    assert stub.versions == [StubNvmlV2.nvmlMemory_v2, None, None]  # v2 tried once, then v1 only


def test_memory_info_v2_error_is_an_unreadable_field():
    stub = StubNvmlV2(v2_error=UNKNOWN)
    g0 = backend(stub).read().gpus[0]
    assert g0.memory_used_mib is None and any(e.startswith("memory:") for e in g0.errors)


def test_bindings_without_the_version_argument_use_v1():
    stub = StubNvml(gpus=[gpu(0, used=100 << 20)])
    stub.nvmlMemory_v2 = 0x02000028  # a constant, but a v1-only nvmlDeviceGetMemoryInfo(handle)
    (g,) = backend(stub).read().gpus
    assert g.memory_used_mib == 100 and g.memory_reserved_mib is None


# ---------------------------------------------------------------------------------------------------------
# Energy and power


def test_energy_and_power_are_read_in_nvml_units():
    stub = StubNvml(gpus=[gpu(0, energy=123456789, power=251000), gpu(1)])
    g0, g1 = backend(stub).read().gpus
    assert (g0.energy_mj, g0.power_mw) == (123456789, 251000)
    # NOT_SUPPORTED (a GPU before Volta, a consumer GPU): no figure, never a made-up 0, and no error
    assert (g1.energy_mj, g1.power_mw) == (None, None)
    assert g1.errors == ()


def test_an_energy_error_is_named_and_the_rest_is_read():
    stub = StubNvml(fail={("nvmlDeviceGetTotalEnergyConsumption", 0): TIMEOUT})
    g0 = backend(stub).read().gpus[0]
    assert g0.energy_mj is None
    assert [e for e in g0.errors if e.startswith("energy:")]
    assert g0.memory_used_mib == 100


def test_bindings_without_the_energy_call_leave_it_unknown():
    stub = StubNvml(gpus=[gpu(0, energy=5, power=6)])
    del StubNvml.nvmlDeviceGetTotalEnergyConsumption  # (an old nvidia-ml-py)
    try:
        g0 = backend(stub).read().gpus[0]
    finally:
        StubNvml.nvmlDeviceGetTotalEnergyConsumption = _ENERGY
    assert (g0.energy_mj, g0.power_mw, g0.errors) == (None, 6, ())


_ENERGY = StubNvml.nvmlDeviceGetTotalEnergyConsumption
