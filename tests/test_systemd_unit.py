"""systemd/gpu-mon.service: systemd's own checker finds nothing to say, the sandbox scores well, and the
settings the daemon depends on are there.

`systemd-analyze verify` and `systemd-analyze security --offline=true` work without a running systemd
(CI has none). They come from the Debian package `systemd`; a missing tool is a failure, not a skip.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from gpu_mon.config import Defaults

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "gpu-mon.service"
EXEC_START = "ExecStart=/usr/bin/gpu-mon run"
# systemd 252 (Debian 12): 3.1 for the hardened unit, 3.3 since Delegate=yes (cgroup containment of
# workloads needs it and ProtectControlGroups=no). The [metrics] endpoint changes nothing in the unit: the
# score must not rise above this.
MAX_EXPOSURE = 3.3
# What gpu-mon does, and the capability each needs (see the unit's comments).
CAPABILITIES = {"CAP_DAC_READ_SEARCH", "CAP_SYS_PTRACE", "CAP_KILL", "CAP_SETUID", "CAP_SETGID"}


def _systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze") or (
        "/usr/bin/systemd-analyze" if os.access("/usr/bin/systemd-analyze", os.X_OK) else None
    )
    if tool is None:
        pytest.fail(
            "systemd-analyze not found: install the Debian package `systemd` (apt-get install -y systemd)",
            pytrace=False,
        )
    return tool


def _run(args: List[str], cwd: Path) -> subprocess.CompletedProcess:
    # Default log level (warnings and errors are printed), no pager, no colors, plain ASCII-safe locale.
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "SYSTEMD_LOG_LEVEL": "info",
        "SYSTEMD_PAGER": "",
        "SYSTEMD_COLORS": "0",
    }
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _gpu_mon_executable() -> str:
    """An existing `gpu-mon` to stand in for /usr/bin/gpu-mon (verify checks that ExecStart= exists)."""
    candidate = Path(sys.executable).with_name("gpu-mon")
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("gpu-mon")
    if found:
        return found
    pytest.fail(
        "no gpu-mon executable found next to the test interpreter: pip install -e . first", pytrace=False
    )
    raise AssertionError  # not reached


def _testable_copy(tmp_path: Path, extra: str = "") -> Path:
    """The unit, unchanged except that ExecStart names an existing gpu-mon, as tmp/gpu-mon.service."""
    text = UNIT.read_text(encoding="utf-8")
    assert text.count(EXEC_START + "\n") == 1, f"the unit must contain exactly one line {EXEC_START!r}"
    text = text.replace(EXEC_START + "\n", f"ExecStart={_gpu_mon_executable()} run\n")
    if extra:
        text = text.replace("[Service]\n", "[Service]\n" + extra, 1)
    path = tmp_path / "gpu-mon.service"
    path.write_text(text, encoding="utf-8")
    return path


def _settings() -> Dict[str, List[str]]:
    """key -> every value assigned in [Service] (and [Unit]/[Install]), in order; comments dropped."""
    out: Dict[str, List[str]] = {}
    for raw in UNIT.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {raw!r}"
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def _one(settings: Dict[str, List[str]], key: str) -> str:
    values = settings.get(key)
    assert values is not None, f"{key}= is not set"
    assert len(values) == 1, f"{key}= is set more than once: {values}"
    return values[0]


def _seconds(value: str) -> float:
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "ms": 0.001}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value)
    assert m and m.group(2) in units, f"unexpected time span {value!r}"
    return float(m.group(1)) * units[m.group(2)]


# ------------------------------------------------------------------------------------ systemd-analyze


def test_verify_is_silent(tmp_path: Path) -> None:
    if not os.access("/bin/kill", os.X_OK):
        pytest.fail(
            "/bin/kill (ExecReload=) is missing, so verify would fail: install the Debian package `procps`",
            pytrace=False,
        )
    unit = _testable_copy(tmp_path)
    # --man=no: whether the Documentation= pages are installed on this host is not the unit's business
    # (tests/test_reference.py checks that each is in docs/man/).
    result = _run([_systemd_analyze(), "verify", "--man=no", str(unit)], cwd=tmp_path)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and not output, (
        f"systemd-analyze verify (rc {result.returncode}):\n{output}"
    )


def test_verify_would_report_a_problem(tmp_path: Path) -> None:
    """The check above can fail: an unknown key and a missing executable are both reported."""
    unit = _testable_copy(tmp_path, extra="NoSuchSetting=yes\nExecStartPost=/nonexistent/gpu-mon-x\n")
    result = _run([_systemd_analyze(), "verify", "--man=no", str(unit)], cwd=tmp_path)
    output = result.stdout + result.stderr
    assert "NoSuchSetting" in output, output
    assert "/nonexistent/gpu-mon-x" in output, output


def test_security_exposure(tmp_path: Path) -> None:
    unit = _testable_copy(tmp_path)
    result = _run([_systemd_analyze(), "security", "--offline=true", "--no-pager", str(unit)], cwd=tmp_path)
    output = result.stdout + result.stderr
    m = re.search(r"Overall exposure level for gpu-mon\.service:\s*(\d+(?:\.\d+)?)", output)
    assert m, f"no overall exposure level in the output of systemd-analyze security:\n{output}"
    level = float(m.group(1))
    assert level <= MAX_EXPOSURE, f"exposure level {level} is worse than {MAX_EXPOSURE}:\n{output}"


# ------------------------------------------------------------------------------- what gpu-mon relies on


def test_service_runs_gpu_mon_the_way_it_expects() -> None:
    s = _settings()
    assert _one(s, "Type") == "notify"
    assert _one(s, "NotifyAccess") == "main"
    assert _one(s, "ExecStart") == "/usr/bin/gpu-mon run"
    assert _one(s, "ExecReload") == "/bin/kill -HUP $MAINPID"
    assert _seconds(_one(s, "WatchdogSec")) >= 10
    assert _one(s, "Restart") == "on-failure"
    assert "2" in _one(s, "RestartPreventExitStatus").split(), "a bad config (exit 2) must not restart-loop"
    assert _one(s, "OOMPolicy") == "continue"
    assert _one(s, "RuntimeDirectory") == "gpu_mon"
    # kept at a stop: the jobs' units outlive gpu-mon, and systemd reads their files there as each ends
    assert _one(s, "RuntimeDirectoryPreserve") == "yes"
    assert _one(s, "LogsDirectory") == "gpu-mon"
    assert _one(s, "StateDirectory") == "gpu_mon"  # [history]'s default /var/lib/gpu_mon/history.sqlite
    assert _one(s, "WantedBy") == "multi-user.target"
    # The default state file lives in the runtime directory the unit creates.
    assert Defaults().state_file.startswith("/run/gpu_mon/")


def test_stop_leaves_gpu_mon_time_to_stop_its_workloads() -> None:
    s = _settings()
    # SIGTERM to gpu-mon only, which stops its workloads itself; and nothing from systemd to the rest, ever:
    # should gpu-mon die, each workload's leader gives it its stop signal and grace (mixed: SIGKILL at once).
    assert _one(s, "KillMode") == "process", "only gpu-mon and its leaders signal its workloads"
    stop_timeout = _seconds(_one(s, "TimeoutStopSec"))
    assert stop_timeout >= Defaults().stop_timeout_seconds + 10


def test_capabilities_are_exactly_what_gpu_mon_uses() -> None:
    s = _settings()
    assert set(_one(s, "CapabilityBoundingSet").split()) == CAPABILITIES
    assert _one(s, "AmbientCapabilities") == ""
    assert _one(s, "NoNewPrivileges") == "yes"


def test_sandbox_keeps_gpus_processes_and_network_usable() -> None:
    s = _settings()
    # GPUs: device nodes stay visible; the NVIDIA device classes are allowed.
    assert s.get("PrivateDevices", ["no"]) == ["no"]
    assert _one(s, "DevicePolicy") == "closed"
    allowed = {v.split()[0] for v in s.get("DeviceAllow", [])}
    for group in (
        "char-nvidia",
        "char-nvidiactl",
        "char-nvidia-frontend",
        "char-nvidia-uvm",
        "char-nvidia-caps",
    ):
        assert group in allowed, f"DeviceAllow= lacks {group}"
    # Every process must stay visible: seeing who holds a GPU is the daemon's job.
    assert s.get("ProtectProc", ["default"]) == ["default"]
    assert s.get("ProcSubset", ["all"]) == ["all"]
    # CUDA, PyTorch and ctypes need writable+executable memory.
    assert "MemoryDenyWriteExecute" not in s
    # Workloads (miners, distributed training) need the network; gpu-mon needs AF_UNIX.
    families = set(_one(s, "RestrictAddressFamilies").split())
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= families
    assert not any(f.startswith("~") for f in families)
    assert s.get("PrivateNetwork", ["no"]) == ["no"]
    assert s.get("PrivateUsers", ["no"]) == ["no"], "a user namespace would break switching to workload users"
    assert _one(s, "SystemCallFilter") == "@system-service"


def test_file_system_protection() -> None:
    s = _settings()
    assert _one(s, "ProtectSystem") == "strict"
    assert _one(s, "ProtectHome") == "read-only"
    assert _one(s, "PrivateTmp") == "yes"
    for key in (
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectClock",
        "ProtectHostname",
        "RestrictNamespaces",
        "RestrictRealtime",
        "RestrictSUIDSGID",
        "LockPersonality",
    ):
        assert _one(s, key) == "yes", f"{key}=yes expected"
    assert _one(s, "SystemCallArchitectures") == "native"
    # The one exception: workloads get cgroups of their own in the delegated subtree (containment).
    assert _one(s, "Delegate") == "yes" and _one(s, "ProtectControlGroups") == "no"


# ------------------------------------------------------------------------------------ the sentinel unit

SENTINEL_UNIT = ROOT / "systemd" / "gpu-mon-sentinel.service"


def test_sentinel_unit_verifies_and_is_tightly_sandboxed(tmp_path: Path) -> None:
    text = SENTINEL_UNIT.read_text(encoding="utf-8")
    start = "ExecStart=/usr/bin/gpu-mon sentinel $GPU_MON_SENTINEL_OPTS\n"
    assert text.count(start) == 1
    unit = tmp_path / "gpu-mon-sentinel.service"
    unit.write_text(
        text.replace(start, f"ExecStart={_gpu_mon_executable()} sentinel $GPU_MON_SENTINEL_OPTS\n")
    )
    result = _run([_systemd_analyze(), "verify", "--man=no", str(unit)], cwd=tmp_path)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and not output, (
        f"systemd-analyze verify (rc {result.returncode}):\n{output}"
    )
    result = _run([_systemd_analyze(), "security", "--offline=true", "--no-pager", str(unit)], cwd=tmp_path)
    m = re.search(r"Overall exposure level for gpu-mon-sentinel\.service:\s*(\d+(?:\.\d+)?)", result.stdout)
    assert m and float(m.group(1)) <= MAX_EXPOSURE, result.stdout + result.stderr
    assert "RestartPreventExitStatus=2" in text and "[Install]" in text
