"""`gpu-mon status` as text: what a newcomer reads first."""

from __future__ import annotations

import time

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
    assert "no daemon running" in text
    assert "(looked for a daemon holding /run/gpu_mon/state.json.lock)" in text
    assert "gpu-mon --config /srv/demo.conf status" in text


def test_idle_holders_are_listed_with_how_long():
    h = {"pid": 4242, "user": "alice", "program": "python3", "gpu": "GPU-a", "memory_mib": 40960}
    h["idle_since_wall"] = time.time() - 3 * 3600
    text = status.render(doc(idle_holders=[h]))
    assert "Idle holders" in text and "alice python3[4242] on GPU-a: 40960 MiB, idle 3 h 0 min" in text
    with_seconds = status.with_idle_seconds(doc(idle_holders=[dict(h)]), time.time())
    assert abs(with_seconds["idle_holders"][0]["idle_seconds"] - 3 * 3600) <= 2
