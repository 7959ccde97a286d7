"""A poll's look does not ask for per-process utilization (1.4 ms a GPU on an H200's driver, 90% of the
look); the daemon asks for it every few polls and carries what it found between, for its consumers
(`status` through the state file, idle holders, [sentinel]). Unknown stays unknown (None), never 0.

Counting stand-ins: test_process_utilization's NVML stub records every per-process utilization call; a
SimBackend whose sample_processes counts its calls stands in for the sim file's samples.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from test_nvml import UNKNOWN
from test_process_utilization import StubUtil, sample

from gpu_mon import config as config_mod
from gpu_mon.api.model import Gpu
from gpu_mon.api.nvml import NvmlBackend
from gpu_mon.api.observe import Observer
from gpu_mon.api.sim import SimBackend
from gpu_mon.engine import daemon as daemon_mod

UTIL_CALL = "nvmlDeviceGetProcessesUtilizationInfo"


class CountingSim(SimBackend):
    """The sim backend, counting the looks that read per-process samples."""

    def __init__(self, path: str):
        super().__init__(path)
        self.samples = 0

    def sample_processes(self, gpu: Gpu) -> Gpu:
        self.samples += 1
        return super().sample_processes(gpu)


def util_calls(stub: StubUtil) -> int:
    return sum(1 for name, _index, _seen in stub.stamps if name == UTIL_CALL)


def test_nvml_poll_look_makes_no_per_process_utilization_call():
    stub = StubUtil()
    stub.samples[0] = [sample(1000, 40, 10)]
    b = NvmlBackend(module=stub)
    g0 = b.read(process_utilization=False).gpus[0]
    assert util_calls(stub) == 0
    assert UTIL_CALL not in {name for name, _i in b.last_timings}
    assert [p.utilization_pct for p in g0.processes] == [None, None]  # unknown, never 0
    g0 = b.read().gpus[0]
    assert util_calls(stub) == 2  # one per GPU
    assert {p.pid: p.utilization_pct for p in g0.processes} == {1000: 40, 2000: 0}


def test_observer_carries_the_last_samples_and_a_new_process_is_unknown():
    stub = StubUtil()
    stub.samples[0] = [sample(1000, 40, 10)]
    obs = Observer(NvmlBackend(module=stub))
    obs.read_gpus()
    assert util_calls(stub) == 2
    stub.gpus[0]["compute"] = [*stub.gpus[0]["compute"], SimpleNamespace(pid=3000, usedGpuMemory=1 << 20)]
    for _ in range(3):
        g0 = obs.read_gpus(process_utilization=False).gpus[0]
    assert util_calls(stub) == 2
    assert {p.pid: p.utilization_pct for p in g0.processes} == {1000: 40, 2000: 0, 3000: None}
    stub.samples[0] = [sample(3000, 70, 20)]
    g0 = obs.read_gpus().gpus[0]
    assert {p.pid: p.utilization_pct for p in g0.processes} == {1000: 0, 2000: 0, 3000: 70}


def test_a_failed_sample_is_not_carried_as_a_number():
    stub = StubUtil()
    stub.samples[0] = UNKNOWN  # an error this time: unknown
    obs = Observer(NvmlBackend(module=stub))
    obs.read_gpus()
    g0 = obs.read_gpus(process_utilization=False).gpus[0]
    assert [p.utilization_pct for p in g0.processes] == [None, None]


def test_sim_poll_look_leaves_utilization_unknown(sim):
    sim.set(0, processes=[{"pid": 10, "used_memory_mib": 5, "utilization_pct": 35}])
    b = CountingSim(str(sim.path))
    assert [p.utilization_pct for p in b.read(process_utilization=False).gpus[0].processes] == [None]
    assert b.samples == 0
    assert [p.utilization_pct for p in b.read().gpus[0].processes] == [35]
    assert b.samples == 2


def test_daemon_polls_ask_for_samples_every_fifth_poll_and_carry_them(sim, tmp_path: Path):
    sim.set(0, processes=[{"pid": os.getpid(), "used_memory_mib": 300, "utilization_pct": 35}])
    text = f"[defaults]\ninterval_seconds = 2\nstate_file = {tmp_path}/state.json\n[gpu-all]\ngpus = ALL\n"
    cfg = config_mod.parse(text, str(tmp_path / "gpu_mon.conf"))
    backend = CountingSim(str(sim.path))
    d = daemon_mod.Daemon(cfg, backend)
    asked = []
    try:
        for poll in range(11):
            before = backend.samples
            d._poll(1000.0 + 2 * poll, full=poll == 0)
            asked.append(backend.samples > before)
            g0 = d.observer.reading.gpus[0]
            assert [p.utilization_pct for p in g0.processes] == [35]  # carried between the samples
    finally:
        d.loop.close()
    assert asked == [True, False, False, False, False, True, False, False, False, False, True]
