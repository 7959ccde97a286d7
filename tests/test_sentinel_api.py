"""The Python API of seed 001: `Sentinel` (pure, ticks not seconds) and `get_gpu_usage`, plus the usage rules
the daemon, `sentinel` and `watch` share."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpu_mon import GpuUsageError, Sentinel, get_gpu_usage
from gpu_mon.api import usage
from gpu_mon.api.model import Gpu, GpuProcess
from gpu_mon.api.sim import SimBackend


def run(usages, **kw):
    fired = []
    params = {"arm_duration": 2, "arm_threshold": 0.7, "kill_duration": 3, "kill_threshold": 0.1}
    params.update(kw)
    s = Sentinel(kill_fn=lambda: fired.append(1), **params)
    states = [s.tick(u) for u in usages]
    return states, len(fired)


W, A, F = "waiting", "armed", "fired"


@pytest.mark.parametrize(
    "usages, states, fired",
    [
        # arms after 2 busy ticks in a row, fires after 3 idle ticks in a row, once
        ([0.9, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0], [W, A, A, A, F, F, F], 1),
        # a dip breaks the arming streak
        ([0.9, 0.5, 0.9, 0.9], [W, W, W, A], 0),
        # thresholds at the boundary: >= arms, < idles (0.1 is not idle)
        ([0.7, 0.7, 0.1, 0.1, 0.1, 0.1], [W, A, A, A, A, A], 0),
        ([0.7, 0.7, 0.09, 0.09, 0.09], [W, A, A, A, F], 1),
        # activity resets the idle count
        ([1, 1, 0, 0, 0.5, 0, 0, 0], [W, A, A, A, A, A, A, F], 1),
        # after firing it re-arms on activity and can fire again (once per episode)
        ([1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0], [W, A, A, A, F, F, F, A, A, A, F], 2),
        # unknown usage (None) never counts as idle, and never arms
        ([1, 1, 0, 0, None, 0, 0, None, 0], [W, A, A, A, A, A, A, A, A], 0),
        ([None, None, None], [W, W, W], 0),
    ],
)
def test_state_machine(usages, states, fired):
    assert run(usages) == (states, fired)


def test_zero_arm_duration_starts_armed_and_zero_kill_duration_fires_on_the_first_idle_tick():
    assert run([0.5, 0.0], arm_duration=0, kill_duration=0) == ([A, F], 1)


@pytest.mark.parametrize(
    "kw",
    [
        {"arm_duration": -1},
        {"kill_duration": 1.5},
        {"arm_threshold": 1.5},
        {"kill_threshold": -0.1},
        {"arm_threshold": True},
    ],
)
def test_bad_parameters_are_refused(kw):
    with pytest.raises(ValueError):
        run([], **kw)


def test_seed_keyword_names_and_state_attribute():
    s = Sentinel(arm_duration=10, arm_threshold=0.7, kill_duration=60, kill_threshold=0.7, kill_fn=print)
    assert s.state == "waiting"


def write_sim(tmp_path, gpus):
    path = tmp_path / "sim.json"
    path.write_text(json.dumps({"gpus": gpus}))
    return str(path)


def sim_gpu(i, util, **extra):
    return {"uuid": f"GPU-{i}", "utilization_pct": util, "device": f"dev/nvidia{i}", **extra}


def test_get_gpu_usage_mean_of_the_chosen_gpus(tmp_path):
    b = SimBackend(write_sim(tmp_path, [sim_gpu(0, 20), sim_gpu(1, 60), sim_gpu(2, 100)]))
    assert get_gpu_usage(backend=b) == pytest.approx(0.6)
    assert get_gpu_usage([0, 1], backend=b) == pytest.approx(0.4)
    assert get_gpu_usage(["GPU-2"], backend=b) == 1.0
    assert get_gpu_usage([0, 2], backend=b, how="max") == 1.0


@pytest.mark.parametrize(
    "gpus, ids, match",
    [
        ([sim_gpu(0, 20), sim_gpu(1, 60, error="GPU is lost")], None, "GPU 1 .*GPU is lost"),
        ([sim_gpu(0, None)], None, "GPU 0 .*utilization"),
        ([sim_gpu(0, 20)], [3], "no GPU 3"),
        ([], None, "no GPU found"),
    ],
)
def test_get_gpu_usage_raises_instead_of_returning_zero(tmp_path, gpus, ids, match):
    b = SimBackend(write_sim(tmp_path, gpus))
    with pytest.raises(GpuUsageError, match=match):
        get_gpu_usage(ids, backend=b)


def test_get_gpu_usage_bad_sim_file_raises(tmp_path):
    path = tmp_path / "sim.json"
    path.write_text("{")
    with pytest.raises(GpuUsageError, match="not valid JSON"):
        get_gpu_usage(backend=SimBackend(str(path)))


def test_get_gpu_usage_reads_gpu_mon_sim_from_a_plain_interpreter(tmp_path):
    path = write_sim(tmp_path, [sim_gpu(0, 30), sim_gpu(1, 50)])
    code = "from gpu_mon import get_gpu_usage; print(get_gpu_usage(device_ids=[0, 1]))"
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"GPU_MON_SIM": path}, check=True
    )
    assert float(r.stdout) == pytest.approx(0.4)


def gpu(util, procs=(), **kw):
    return Gpu(index=0, uuid="GPU-0", utilization_pct=util, processes=tuple(procs), **kw)


@pytest.mark.parametrize(
    "g, pids, expected",
    [
        # per-process samples: the sum of those processes' own
        (gpu(90, [GpuProcess(1, 10, utilization_pct=30), GpuProcess(2, 10, utilization_pct=60)]), {1}, 0.3),
        # the tree's process has no sample but others do: 0 (not sampled in the period)
        (gpu(90, [GpuProcess(1, 10, utilization_pct=0), GpuProcess(2, 10, utilization_pct=90)]), {1}, 0.0),
        # no per-process samples: the whole GPU's
        (gpu(90, [GpuProcess(1, 10), GpuProcess(2, 10)]), {1}, 0.9),
        (gpu(None, [GpuProcess(1, 10)]), {1}, None),
        (Gpu(index=0, uuid="GPU-0", utilization_pct=5, processes=None), {1}, None),
    ],
)
def test_process_usage(g, pids, expected):
    assert usage.process_usage(g, pids) == (pytest.approx(expected) if expected is not None else None)


@pytest.mark.parametrize(
    "g, ours, occupied, expected",
    [
        (gpu(80, [GpuProcess(1, 10, utilization_pct=80)]), {1}, True, 0.0),  # only ours: idle for others
        (
            gpu(80, [GpuProcess(1, 10, utilization_pct=50), GpuProcess(2, 1, utilization_pct=30)]),
            {1},
            True,
            0.3,
        ),
        (gpu(80, [GpuProcess(1, 10)]), {1}, True, 0.0),  # no samples, our workload on it: 0
        (gpu(80, [GpuProcess(1, 10)]), set(), False, 0.8),  # no samples, not ours: the GPU's
        (gpu(None, [GpuProcess(1, 10)]), {1}, True, None),  # unreadable stays unreadable
    ],
)
def test_foreign_usage(g, ours, occupied, expected):
    assert usage.foreign_usage(g, ours, occupied) == (
        pytest.approx(expected) if expected is not None else None
    )


def test_aggregate():
    assert usage.aggregate([0.2, 0.4]) == pytest.approx(0.3)
    assert usage.aggregate([0.2, 0.4], "max") == 0.4
    assert usage.aggregate([0.2, None]) is None
    assert usage.aggregate([]) is None
