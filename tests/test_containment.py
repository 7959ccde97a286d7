"""Nothing a workload started outlives its stop, whatever it did: left its session or group, renamed itself,
ignored SIGTERM, stopped itself, kept forking. Tried for every way a stop happens, with a cgroup and with
the subreaper fallback (tests/hostile.py is the workload)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import List

import pytest
from conftest import (
    GPU_MON,
    WORKLOAD_PYTHON,
    idle_terminal,
    kill_marked,
    marked,
    pid_alive,
    tty_section,
    wait_for,
)

HOSTILE = Path(__file__).resolve().parent / "hostile.py"
STOP_TIMEOUT = 1.0
# The requirement is stop_timeout + 1 s; the rest is room for a loaded CI machine to notice.
BOUND = STOP_TIMEOUT + 1.0 + 2.0


def body(tmp_path: Path, marker: str, mode: str, exit_after: float = 0, tty: str = "") -> str:
    script = tmp_path / "hostile.py"
    shutil.copy(HOSTILE, script)
    return (
        "[gpu-all]\ngpus = ALL\n\n[process-miner]\n"
        f"cmd = {WORKLOAD_PYTHON} {script} {marker} {mode} {exit_after} {tmp_path / 'chain.log'}\n"
        f"gpus = 0\nuser = root\n{tty}"
    )


def chain_length(tmp_path: Path) -> int:
    """Links the fork chain has made so far (each appends a byte)."""
    try:
        return (tmp_path / "chain.log").stat().st_size
    except FileNotFoundError:
        return 0


def chain_end(tmp_path: Path, timeout: float, quiet: float = 0.5) -> float:
    """When (monotonic) the fork chain made its last link: once none came for `quiet` seconds."""
    deadline = time.monotonic() + timeout
    size, last_change = chain_length(tmp_path), time.monotonic()
    while time.monotonic() - last_change < quiet:
        assert time.monotonic() < deadline, f"the fork chain still forks after {timeout:g} s"
        time.sleep(0.01)
        now_size = chain_length(tmp_path)
        if now_size != size:
            size, last_change = now_size, time.monotonic()
    return last_change


@pytest.fixture
def cleanup_marked():
    """Kill what is left with these markers (after the daemon's own cleanup: list it before the factory)."""
    markers: List[str] = []
    yield markers
    for marker in markers:
        kill_marked(marker)


def _trigger(how: str, d, sim, tmp_path: Path, term: Path, marker: str, openers: list) -> None:
    if how == "foreign":
        p = subprocess.Popen(
            [WORKLOAD_PYTHON, "-c", "import sys, time; f = open(sys.argv[1]); time.sleep(600)", sim.device(0)]
        )
        openers.append(p)
    elif how == "tty":
        os.utime(term, None)
    elif how == "reload":
        d.write_config(d.body.replace(marker, marker.replace("gm-", "gm2-")))
        d.signal(signal.SIGHUP)
    elif how in ("sigterm", "sigint", "sigquit"):
        d.signal({"sigterm": signal.SIGTERM, "sigint": signal.SIGINT, "sigquit": signal.SIGQUIT}[how])
    elif how == "sigkill-daemon":
        d.proc.kill()
        d.proc.wait()
    elif how == "sigkill-leader":
        os.kill(int(d.workload("miner")["pid"]), signal.SIGKILL)


TRIGGERS = [
    "foreign",
    "tty",
    "reload",
    "sigterm",
    "sigint",
    "sigquit",
    "sigkill-daemon",
    "sigkill-leader",
    "exits-by-itself",
]


@pytest.mark.parametrize("containment", ["cgroup", "subreaper"])
@pytest.mark.parametrize("how", TRIGGERS)
def test_nothing_outlives_a_stop(tmp_path, sim, cleanup_marked, daemon_factory, containment, how):
    marker = f"gm-{uuid.uuid4().hex}"
    cleanup_marked += [marker, marker.replace("gm-", "gm2-")]
    term = idle_terminal(tmp_path)
    tty = tty_section(term)
    exit_after = 2.0 if how == "exits-by-itself" else 0
    d = daemon_factory(
        body(tmp_path, marker, "escape", exit_after, tty),
        defaults={
            "stop_timeout_seconds": STOP_TIMEOUT,
            "containment": containment,
            "restart_delay_seconds": 300,
            "restart_delay_max_seconds": 300,
        },
    )
    d.wait_log(f"containment: {containment}")
    d.wait_log("hostile ready")
    # main, the session escapee and its child, the own-group child, the stopped child
    wait_for(lambda: len(marked(marker)) >= 5, what="every hostile process started")
    main = d.wait_running("miner")
    openers: list = []
    try:
        if how == "exits-by-itself":
            wait_for(lambda: main not in marked(marker), timeout=10, what="the main process to exit")
        else:
            _trigger(how, d, sim, tmp_path, term, marker, openers)
        started = time.monotonic()
        wait_for(lambda: not marked(marker), timeout=BOUND, what=f"every hostile process gone ({how})")
        took = time.monotonic() - started
    finally:
        for p in openers:
            p.kill()
            p.wait()
    assert took < BOUND
    if how not in ("sigkill-daemon", "sigterm", "sigint", "sigquit"):
        assert d.proc.poll() is None, "the daemon itself must go on"


@pytest.mark.parametrize("containment", ["cgroup", "subreaper"])
@pytest.mark.parametrize("how", ["foreign", "sigterm", "sigkill-daemon", "sigkill-leader"])
def test_a_fork_chain_dies_too(tmp_path, sim, cleanup_marked, daemon_factory, how, containment):
    # A process that forks, setsids and exits in a loop has a new pid every millisecond: cgroup.kill takes
    # it at once; the subreaper catches it because each orphan comes back to it as a direct child.
    marker = f"gm-{uuid.uuid4().hex}"
    cleanup_marked.append(marker)
    d = daemon_factory(
        body(tmp_path, marker, "forkchain"),
        defaults={
            "stop_timeout_seconds": STOP_TIMEOUT,
            "containment": containment,
            "restart_delay_seconds": 300,
            "restart_delay_max_seconds": 300,
        },
    )
    d.wait_log("hostile ready")
    wait_for(lambda: chain_length(tmp_path) > 100, what="the chain running")
    openers: list = []
    try:
        _trigger(how, d, sim, tmp_path, tmp_path, marker, openers)
        started = time.monotonic()
        # Gone: no new link for 0.5 s, and no process of it in /proc (which alone can miss a live link).
        assert chain_end(tmp_path, timeout=BOUND + 5) - started < BOUND
        assert not marked(marker)
    finally:
        for p in openers:
            p.kill()
            p.wait()


def test_containment_is_in_status(tmp_path, sim, daemon_factory):
    d = daemon_factory(body(tmp_path, f"gm-{uuid.uuid4().hex}", "escape"), defaults={"containment": "cgroup"})
    d.wait_log("containment: cgroup")
    wait_for(lambda: "cgroup" in str((d.state().get("daemon") or {}).get("containment")), what="state")
    r = subprocess.run(
        [*GPU_MON, "--config", str(d.config_path), "status"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "containment: cgroup" in r.stdout


def test_a_new_daemon_ends_what_a_killed_daemon_and_leader_left(
    tmp_path, sim, cleanup_marked, daemon_factory
):
    # Both the daemon and the leader SIGKILLed at once (nobody is left to clean up): the workload's
    # processes are orphans in their cgroup. The next daemon finds the group of a dead daemon and ends it.
    marker = f"gm-{uuid.uuid4().hex}"
    cleanup_marked.append(marker)
    d = daemon_factory(
        body(tmp_path, marker, "escape"), defaults={"containment": "cgroup", "stop_timeout_seconds": 1}
    )
    d.wait_log("hostile ready")
    wait_for(lambda: len(marked(marker)) >= 5, what="every hostile process started")
    leader = int(d.workload("miner")["pid"])
    os.kill(d.proc.pid, signal.SIGKILL)
    os.kill(leader, signal.SIGKILL)
    d.proc.wait()
    # The leader dead too (a zombie at most): nobody is left who could end its group.
    wait_for(lambda: not pid_alive(leader), timeout=10, what="the killed leader dead")
    assert marked(marker), "the orphans should have outlived both"
    d.write_config(body(tmp_path, f"gm-{uuid.uuid4().hex}", "escape"), defaults={"containment": "cgroup"})
    d.start()
    wait_for(lambda: not marked(marker), timeout=10, what="the dead daemon's workload gone")
