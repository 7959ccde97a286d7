"""`gpu-mon status` as text: what a newcomer reads first."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import time

from conftest import GPU_MON, SimHost, write_config

from gpu_mon.api import logins
from gpu_mon.outputs import status


def doc(**over: object) -> dict:
    base = {
        "gpu_mon": "0.1.0",
        "daemon": {"pid": 10, "started_wall": time.time() - 60, "containment": "cgroup (...)"},
        "config": "/etc/gpu_mon.conf",
        "updated_wall": time.time(),
        "gpus": [],
        "terminals": [],
        "workloads": [],
        "decisions": [],
    }
    base.update(over)
    return base


def test_terminals_all_idle_say_so_in_one_line():
    old = time.time() - 3 * 86400
    terms = [
        {"device": f"/dev/pts/{i}", "user": "bob", "active_wall": old, "pauses_work": False}
        for i in range(64)
    ]
    text = status.render(doc(terminals=terms))
    assert "Terminals: 64, all idle for over a day" in text
    assert "more idle" not in text and "/dev/pts/3 " not in text


def test_recent_terminals_are_listed_under_a_plain_header():
    now = time.time()
    terms = [
        {"device": "/dev/pts/1", "user": "alice", "active_wall": now - 5, "pauses_work": True},
        {"device": "/dev/pts/2", "user": "bob", "active_wall": now - 3 * 86400, "pauses_work": False},
    ]
    lines = status.render(doc(terminals=terms)).splitlines()
    assert "Terminals: (1 more idle for over a day)" in lines
    assert any(line.strip().startswith("/dev/pts/1") and "<- pauses work" in line for line in lines)


def test_a_workload_line_names_its_session_and_its_command_pid():
    w = {
        "label": "miner@0",
        "state": "running",
        "pid": 9001,
        "command_pid": 9002,
        "started_wall": time.time() - 30,
        "restarts": 0,
    }
    text = status.render(doc(workloads=[w]))
    assert "miner@0" in text and "running  session 9001, command pid 9002, up 30 s" in text


def test_no_daemon_says_where_it_looked():
    text = status.render(
        doc(
            daemon=None,
            looked_for="/run/gpu_mon/state.json",
            other_daemons=[{"pid": 77, "config": "/srv/demo.conf"}],
        )
    )
    assert "no daemon: a single look" in text
    assert "(looked for a daemon holding /run/gpu_mon/state.json.lock)" in text
    assert "gpu-mon --config /srv/demo.conf status" in text


def test_idle_holders_are_listed_with_how_long():
    h = {"pid": 4242, "user": "alice", "program": "python3", "gpu": "GPU-a", "memory_mib": 40960}
    h["idle_since_wall"] = time.time() - 3 * 3600
    text = status.render(doc(idle_holders=[h]))
    assert "Idle holders" in text and "alice python3[4242] on GPU-a: 40960 MiB, idle 3 h 0 min" in text
    with_seconds = status.with_idle_seconds(doc(idle_holders=[dict(h)]), time.time())
    assert abs(with_seconds["idle_holders"][0]["idle_seconds"] - 3 * 3600) <= 2


# ------------------------------------------------------------------------- what `gpu-mon status` shows


def utmp_entry(kind: int, pid: int, line: str, user: str) -> bytes:
    """One record of glibc's struct utmp (64-bit Linux)."""
    return struct.pack(
        "<hxxi32s4s32s256shhiii4i20s",
        kind,
        pid,
        line.encode(),
        b"",
        user.encode(),
        b"",
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        b"",
    )


def test_utmp_names_the_terminals_with_a_live_login(tmp_path):
    utmp = tmp_path / "utmp"
    gone = subprocess.Popen(["true"])
    gone.wait()
    utmp.write_bytes(
        utmp_entry(7, os.getpid(), "pts/4", "root")  # a live login session
        + utmp_entry(8, os.getpid(), "pts/5", "root")  # DEAD_PROCESS: logged out
        + utmp_entry(7, gone.pid, "tty2", "root")  # its session is gone: a stale record
        + utmp_entry(6, os.getpid(), "tty1", "LOGIN")  # a getty waiting on a console
    )
    assert logins.logged_in_lines(str(utmp)) == {"pts/4"}
    assert logins.logged_in_lines(str(tmp_path / "none")) == set()
    assert logins.logged_in("/dev/pts/4", 0, {"pts/4"}) and logins.logged_in("/dev/pts/9", 1000, set())
    assert not logins.logged_in("/dev/tty5", 0, {"pts/4"})


def test_status_lists_only_terminals_someone_is_logged_in_on(tmp_path):
    """64 root-owned consoles with nobody on them are not listed; a user's terminal is."""
    sim = SimHost(tmp_path, 1)
    terms = tmp_path / "dev"
    for i in range(64):
        (terms / f"tty{i}").touch()  # root's, as the consoles are
    users = terms / "tty-alice"
    users.touch()
    os.chown(users, 65534, 65534)
    conf = write_config(tmp_path / "c.conf", f"[gpu-all]\ngpus = ALL\n[tty]\ndevices = {terms}/tty*\n")
    r = subprocess.run(
        [*GPU_MON, "--config", str(conf), "--sim", str(sim.path), "status"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert str(users) in r.stdout and "nobody" in r.stdout
    assert re.search(rf"{terms}/tty[0-9]", r.stdout) is None


def test_without_a_daemon_status_says_so_and_counts_nothing_down(tmp_path):
    sim = SimHost(tmp_path, 1)
    conf = write_config(
        tmp_path / "c.conf",
        "[defaults]\nstart_delay_seconds = 5\n[gpu-all]\ngpus = ALL\n[process-burn]\ncmd = sleep 60\n",
    )
    r = subprocess.run(
        [*GPU_MON, "--config", str(conf), "--sim", str(sim.path), "status"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "no daemon: a single look" in r.stdout
    assert "s left" not in r.stdout and "start delay" not in r.stdout and "free for" not in r.stdout
    assert "not running: no daemon (its GPUs are free now)" in r.stdout


def test_occupiers_are_listed_with_user_phase_gpus_and_manner():
    now = time.time()
    found = [
        {
            "user": "alice",
            "pid": 11,
            "phase": "occupying",
            "since_wall": now - 600,
            "polite": False,
            "gpus": ["GPU-a"],
            "gpus_asked": [],
        },
        {
            "user": "bob",
            "pid": 12,
            "phase": "waiting",
            "since_wall": now - 5,
            "polite": True,
            "gpus": [],
            "gpus_asked": ["1"],
        },
        {
            "user": "carol",
            "pid": 13,
            "phase": "yielded",
            "since_wall": now - 5,
            "polite": True,
            "gpus": [],
            "gpus_asked": [],
        },
    ]
    assert "Occupiers (gpu-mon occupy, every user's):" in status.render(doc(occupiers=found)).splitlines()
    lines = status.occupier_lines(found, [{"index": 0, "uuid": "GPU-a"}], now)
    alice, bob, carol = (
        next(line for line in lines if line.strip().startswith(u)) for u in ("alice", "bob", "carol")
    )
    assert "occupying" in alice and "(10 min), GPU 0, firm, pid 11" in alice
    assert "waiting" in bob and "GPU 1, polite (--yield), pid 12" in bob
    assert "yielded" in carol and "every GPU, polite" in carol
    assert "Occupiers" not in status.render(doc())
