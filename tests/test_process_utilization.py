"""Per-process SM utilization from NVML (the stub of test_nvml.py stands in for pynvml) and from the sim file.

Unsupported means unknown (None), never 0; NOT_FOUND means no process was sampled in the period (0%); the
timestamp of the newest sample seen is passed back on the next call.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from test_nvml import FUNCTION_NOT_FOUND, NOT_SUPPORTED, UNKNOWN, NVMLError, StubNvml, gpu

from gpu_mon.api.nvml import NvmlBackend
from gpu_mon.api.sim import SimBackend, SimError

NOT_FOUND = 6


def sample(pid, sm, ts):
    return SimpleNamespace(pid=pid, smUtil=sm, timeStamp=ts, memUtil=0)


class StubUtil(StubNvml):
    """A driver that samples processes. `samples[index]` is what the next call returns (or an error code)."""

    NVML_ERROR_NOT_FOUND = NOT_FOUND

    def __init__(self, *args, new_call=True, old_call=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.samples = {}
        self.stamps = []
        if new_call:
            self.nvmlDeviceGetProcessesUtilizationInfo = self._util("nvmlDeviceGetProcessesUtilizationInfo")
        if old_call:
            self.nvmlDeviceGetProcessUtilization = self._util("nvmlDeviceGetProcessUtilization")

    def _util(self, name):
        def call(handle, last_seen):
            self._enter(name, handle.index)
            self.stamps.append((name, handle.index, last_seen))
            got = self.samples.get(handle.index, NOT_FOUND)
            if isinstance(got, int):
                raise NVMLError(got)
            return got

        call.__name__ = name
        return call


def test_per_process_utilization_is_the_mean_of_the_period_and_unlisted_processes_are_idle():
    stub = StubUtil()
    stub.samples[0] = [sample(1000, 40, 10), sample(1000, 60, 20), sample(4242, 99, 20)]
    b = NvmlBackend(module=stub)
    g0, g1 = b.read().gpus
    assert {p.pid: p.utilization_pct for p in g0.processes} == {1000: 50, 2000: 0}
    assert {p.pid: p.utilization_pct for p in g1.processes} == {1001: 0, 2001: 0}  # NOT_FOUND: none sampled
    b.read()
    assert (
        "nvmlDeviceGetProcessesUtilizationInfo",
        0,
        20,
    ) in stub.stamps  # the newest timestamp goes back


@pytest.mark.parametrize("code", [NOT_SUPPORTED, FUNCTION_NOT_FOUND])
def test_falls_back_to_the_older_call(code):
    stub = StubUtil()
    stub.fail["nvmlDeviceGetProcessesUtilizationInfo"] = code
    stub.samples[0] = [sample(1000, 30, 5)]
    b = NvmlBackend(module=stub)
    g0 = b.read().gpus[0]
    assert g0.processes[0].utilization_pct == 30
    b.read()
    assert stub.calls.count("nvmlDeviceGetProcessesUtilizationInfo") == 1  # tried once, then the old one only
    assert [name for name, _i, _t in stub.stamps] == ["nvmlDeviceGetProcessUtilization"] * 4


def test_unsupported_everywhere_is_unknown_not_zero():
    stub = StubUtil()
    stub.fail["nvmlDeviceGetProcessesUtilizationInfo"] = NOT_SUPPORTED
    stub.fail["nvmlDeviceGetProcessUtilization"] = NOT_SUPPORTED
    g0 = NvmlBackend(module=stub).read().gpus[0]
    assert [p.utilization_pct for p in g0.processes] == [None, None]
    assert g0.errors == ()  # not an error: just not known


def test_bindings_without_either_call_leave_utilization_unknown():
    stub = StubUtil(new_call=False, old_call=False)
    g0 = NvmlBackend(module=stub).read().gpus[0]
    assert [p.utilization_pct for p in g0.processes] == [None, None]


def test_an_error_in_one_look_is_unknown_for_that_look_only():
    stub = StubUtil()
    stub.samples[0] = UNKNOWN
    b = NvmlBackend(module=stub)
    assert [p.utilization_pct for p in b.read().gpus[0].processes] == [None, None]
    stub.samples[0] = [sample(1000, 70, 9)]
    assert [p.utilization_pct for p in b.read().gpus[0].processes] == [70, 0]


def test_no_process_no_utilization_call():
    stub = StubUtil(gpus=[gpu(0, compute=[], graphics=[])])
    NvmlBackend(module=stub).read()
    assert stub.stamps == []


def test_sim_process_utilization(tmp_path):
    path = tmp_path / "sim.json"
    procs = [{"pid": 10, "used_memory_mib": 5, "utilization_pct": 35}, {"pid": 11}]
    path.write_text(json.dumps({"gpus": [{"uuid": "GPU-a", "processes": procs}]}))
    (g,) = SimBackend(str(path), create_devices=False).load()
    assert [(p.pid, p.utilization_pct) for p in g.processes] == [(10, 35), (11, None)]


@pytest.mark.parametrize("value", [101, -1, "5", True])
def test_sim_process_utilization_out_of_range(tmp_path, value):
    path = tmp_path / "sim.json"
    procs = [{"pid": 10, "utilization_pct": value}]
    path.write_text(json.dumps({"gpus": [{"uuid": "GPU-a", "processes": procs}]}))
    with pytest.raises(SimError, match=r"processes\[0\]\.utilization_pct"):
        SimBackend(str(path), create_devices=False).load()


def test_status_shows_per_process_utilization(sim):
    import os
    import subprocess

    from conftest import GPU_MON

    sim.set(0, processes=[{"pid": os.getpid(), "used_memory_mib": 300, "utilization_pct": 35}])
    env = {k: v for k, v in os.environ.items() if k != "GPU_MON_SIM"}
    r = subprocess.run([*GPU_MON, "--sim", str(sim.path), "status"], capture_output=True, text=True, env=env)
    line = next(x for x in r.stdout.splitlines() if "NVML processes" in x)
    assert f"[{os.getpid()}] 300 MiB 35%" in line, r.stdout
    r = subprocess.run([*GPU_MON, "--sim", str(sim.path), "status", "--json"], capture_output=True, env=env)
    procs = json.loads(r.stdout)["gpus"][0]["nvml_processes"]
    assert [(p["pid"], p["utilization_pct"]) for p in procs] == [(os.getpid(), 35)]
