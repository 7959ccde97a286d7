"""On a real NVIDIA GPU only (marked `gpu`): `gpu-mon sentinel --kill-action command` arming on a real torch
load and acting once after it ends. Run by bench/gpu_proof.py (check sentinel)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import List

import gpujobs
import pytest
from conftest import GPU_MON, wait_for

ARM_S, KILL_S, TICK_S = 3, 5, 1


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.gpu
def test_sentinel_fires_once_after_a_torch_load(tmp_path, record_property):
    fired = tmp_path / "fired"
    with gpujobs.nvml() as reader:
        gpu_uuid = reader.uuid
    argv = [
        *GPU_MON,
        "sentinel",
        "--gpu-devices",
        gpu_uuid,
        "--arm-duration",
        str(ARM_S),
        "--kill-duration",
        str(KILL_S),
        "--interval",
        str(TICK_S),
        "--kill-action",
        "command",
        "--command",
        f"sh -c 'echo fired >> {fired}'",
    ]
    sentinel = subprocess.Popen(
        argv, stderr=subprocess.PIPE, text=True, env=gpujobs.real_env(), start_new_session=True
    )
    log: List[str] = []
    threading.Thread(target=lambda: log.extend(sentinel.stderr or ()), daemon=True).start()
    job = gpujobs.Job(gpujobs.BUSY, gpujobs.on_gpu(gpu_uuid))
    try:
        job.ready()
        loaded = time.monotonic()
        wait_for(lambda: any("armed after" in line for line in log), timeout=60, what=f"armed: {log}")
        record_property("armed_after_s", round(time.monotonic() - loaded, 1))
        job.stop()
        ended = time.monotonic()
        wait_for(lambda: _lines(fired), timeout=KILL_S + 30, what=f"the command: {log}")
        record_property("fired_after_end_s", round(time.monotonic() - ended, 1))
        # Once: the GPU stays idle for another kill duration and a few ticks, and it must not act again.
        quiet_until = time.monotonic() + KILL_S + 3 * TICK_S
        while time.monotonic() < quiet_until and _lines(fired) == 1:
            time.sleep(0.1)
        record_property("fired_count", _lines(fired))
        record_property("kill_duration_s", KILL_S)
        record_property("interval_s", TICK_S)
        assert _lines(fired) == 1, log
        assert sentinel.poll() is None, f"the sentinel ended (exit {sentinel.returncode}): {log}"
    finally:
        job.stop()
        if sentinel.poll() is None:
            os.killpg(sentinel.pid, signal.SIGTERM)
        try:
            sentinel.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(sentinel.pid, signal.SIGKILL)
            sentinel.wait()
