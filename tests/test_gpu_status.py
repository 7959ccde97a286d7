"""On a real NVIDIA GPU only (marked `gpu`): `gpu-mon status` against `nvidia-smi` for a running torch job,
and the daemon's [metrics] endpoint showing that GPU's memory and utilization. Run by bench/gpu_proof.py
(check status). Config, state file and log stay in the test's temp dir; history is off."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Dict, Optional

import gpujobs
import pytest
from conftest import GPU_MON, dies_with_the_run

from gpu_mon.api.nvml import NvmlBackend


def config(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "gpu_mon.conf"
    path.write_text(
        f"[defaults]\ninterval_seconds = 1\nstate_file = {tmp_path}/state.json\n"
        f"[gpu-all]\ngpus = ALL\n[history]\nenabled = no\n{extra}"
    )
    os.chmod(path, 0o600)
    return path


def nvidia_smi_apps(gpu_uuid: str) -> Dict[int, Optional[float]]:
    """pid -> MiB of the compute apps nvidia-smi lists on this GPU (None where it shows no figure)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    apps: Dict[int, Optional[float]] = {}
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 3 and fields[0] == gpu_uuid:
            apps[int(fields[1])] = float(fields[2]) if fields[2].isdigit() else None
    return apps


@pytest.mark.gpu
def test_status_agrees_with_nvidia_smi(tmp_path, record_property):
    with gpujobs.nvml() as reader:
        gpu_uuid = reader.uuid
    conf = config(tmp_path)
    with gpujobs.Job(gpujobs.HOLD.format(mib=2048), gpujobs.on_gpu(gpu_uuid)) as job:
        job.ready()
        r = subprocess.run(
            [*GPU_MON, "--config", str(conf), "status", "--json"],
            capture_output=True,
            text=True,
            env=gpujobs.real_env(),
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        theirs = nvidia_smi_apps(gpu_uuid)
    (gpu,) = [g for g in json.loads(r.stdout)["gpus"] if g["uuid"] == gpu_uuid]
    ours = {p["pid"]: p.get("used_memory_mib") for p in gpu["nvml_processes"]}
    node = any(h["pid"] == job.pid for h in gpu["holders"])
    diffs = [abs(ours[p] - m) for p, m in theirs.items() if m is not None and ours.get(p) is not None]
    record_property("pids_agree", int(set(ours) == set(theirs)))
    record_property("memory_diff_mib", max(diffs) if diffs else float("nan"))
    record_property("node_holder", int(node))
    assert job.pid in theirs, theirs
    assert set(ours) == set(theirs), (ours, theirs)
    assert diffs and max(diffs) <= 8, (ours, theirs)
    assert node, gpu["holders"]


def metric(text: str, name: str, gpu_uuid: str) -> Optional[float]:
    found = re.search(rf'^{name}\{{[^}}]*uuid="{re.escape(gpu_uuid)}"[^}}]*\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else None


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as answer:
            return answer.read().decode()
    except OSError:
        return ""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.gpu
def test_metrics_endpoint_shows_the_gpu(tmp_path, record_property):
    pytest.importorskip("prometheus_client")
    with gpujobs.nvml() as reader:
        gpu_uuid = reader.uuid
    port = free_port()
    conf = config(tmp_path, f"[metrics]\nlisten = {port}\n")
    with (
        gpujobs.Job(gpujobs.BUSY, gpujobs.on_gpu(gpu_uuid)) as job,
        open(tmp_path / "daemon.log", "wb") as log,
    ):
        job.ready()
        daemon = subprocess.Popen(
            [*GPU_MON, "--config", str(conf), "run"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=gpujobs.real_env(),
            start_new_session=True,
            preexec_fn=dies_with_the_run(),
        )
        try:
            memory = utilization = None
            deadline = time.monotonic() + 60  # the daemon's start, then its rounds a second apart
            while time.monotonic() < deadline and not (utilization is not None and utilization >= 0.5):
                text = scrape(port)
                memory = metric(text, "gpu_mon_gpu_memory_used_bytes", gpu_uuid)
                utilization = metric(text, "gpu_mon_gpu_utilization_ratio", gpu_uuid)
                time.sleep(0.5)
            backend = NvmlBackend()
            try:
                used_mib = backend.read().gpus[0].memory_used_mib
            finally:
                backend.close()
        finally:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait()
    assert memory is not None and utilization is not None, (tmp_path / "daemon.log").read_text()[-2000:]
    assert used_mib
    diff_pct = abs(memory / (1 << 20) - used_mib) / used_mib * 100
    record_property("metrics_memory_diff_pct", round(diff_pct, 2))
    record_property("metrics_utilization", utilization)
    assert diff_pct <= 2, (memory, used_mib)
    assert utilization >= 0.5, utilization
