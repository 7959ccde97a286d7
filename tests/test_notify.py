"""systemd integration without systemd: a real AF_UNIX datagram socket as NOTIFY_SOCKET, a real file as the
journal stream."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import List

import pytest
from conftest import GPU_MON, dies_with_the_run, read_reports, wait_for, workload_cmd, write_config

from gpu_mon.outputs import logs, notify


class NotifySocket:
    """What systemd would receive: every datagram, in order."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.messages: List[bytes] = []

    def drain(self) -> List[bytes]:
        while True:
            try:
                self.messages.append(self.sock.recv(65536))
            except BlockingIOError:
                return self.messages

    def wait(self, needle: bytes, after: int = 0, timeout: float = 10.0) -> int:
        """Index of the first message from `after` on that contains `needle`."""

        def found():
            for i, m in enumerate(self.drain()[after:], start=after):
                if needle in m:
                    return i + 1  # +1 so that index 0 is truthy
            return 0

        return int(wait_for(found, timeout, f"notify message {needle!r}")) - 1


@pytest.fixture
def notify_socket(tmp_path):
    s = NotifySocket(tmp_path / "notify.sock")
    yield s
    s.sock.close()


def test_whole_notify_life_cycle(tmp_path, sim, daemon_factory, notify_socket):
    ttys = tmp_path / "终端"
    ttys.mkdir()
    report = tmp_path / "report.jsonl"
    body = (
        f"[gpu-all]\ngpus = ALL\n[process-m]\ncmd = {workload_cmd(tmp_path, '--report', str(report))}\n"
        f"gpus = 0\nuser = root\n[tty]\nenabled = yes\ndevices = {ttys}/*\n"
    )
    d = daemon_factory(body, env={"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "400000"})
    ready = notify_socket.wait(b"READY=1")
    assert all(b"READY" not in m for m in notify_socket.messages[:ready])
    d.wait_running("m")
    notify_socket.wait(b"STATUS=1/2 GPUs running work")
    # The watchdog is pinged every half WATCHDOG_USEC (0.2 s) from the loop itself.
    first = notify_socket.wait(b"WATCHDOG=1")
    notify_socket.wait(b"WATCHDOG=1", after=first + 1)
    # NOTIFY_SOCKET and WATCHDOG_* never reach workloads.
    start = wait_for(lambda: read_reports(report), what="workload report")[0]
    assert start["env"]["NOTIFY_SOCKET"] is None and start["env"]["WATCHDOG_USEC"] is None
    # A status line with characters outside latin-1 is not lost: systemd gets it as UTF-8.
    tty = ttys / "7"
    tty.touch()
    os.chown(tty, 65534, 65534)
    i = notify_socket.wait(b"paused: nobody at")
    assert "终端".encode() in notify_socket.messages[i]
    notify_socket.messages[i].decode("utf-8")  # valid UTF-8
    tty.unlink()
    # A good reload: RELOADING=1 with MONOTONIC_USEC, then READY=1.
    n = len(notify_socket.drain())
    d.signal(signal.SIGHUP)
    r = notify_socket.wait(b"RELOADING=1", after=n)
    assert b"MONOTONIC_USEC=" in notify_socket.messages[r]
    usec = int(notify_socket.messages[r].split(b"MONOTONIC_USEC=")[1].split(b"\n")[0])
    assert abs(usec / 1e6 - time.clock_gettime(time.CLOCK_MONOTONIC)) < 30
    notify_socket.wait(b"READY=1", after=r)
    # A bad reload: still READY afterwards, and still pinging the watchdog.
    d.write_config("[gpu-all]\ngpus = nonsense\n")
    n = len(notify_socket.drain())
    d.signal(signal.SIGHUP)
    r = notify_socket.wait(b"RELOADING=1", after=n)
    r = notify_socket.wait(b"READY=1", after=r)
    w = notify_socket.wait(b"WATCHDOG=1", after=r + 1)
    notify_socket.wait(b"WATCHDOG=1", after=w + 1)
    assert d.proc.poll() is None
    d.wait_log(r"reload failed")
    # Shutdown: STOPPING=1, exit 0.
    n = len(notify_socket.drain())
    assert d.stop() == 0
    notify_socket.wait(b"STOPPING=1", after=n)


def test_status_line_cannot_inject_assignments(notify_socket, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", str(notify_socket.path))
    n = notify.Notifier()
    n.status("GPU 0 busy (evil\nREADY=1\nMAINPID=1)")
    (msg,) = notify_socket.drain()
    assert msg.count(b"\n") == 0 and msg.startswith(b"STATUS=GPU 0 busy (evil\\x0aREADY=1")
    n.status("GPU 0 busy (evil\nREADY=1\nMAINPID=1)")
    assert len(notify_socket.drain()) == 1  # unchanged: not sent again


def test_abstract_socket_address(monkeypatch):
    name = f"gpu-mon-test-{os.getpid()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        notify.Notifier().status("héllo wörld ✓")
        assert s.recv(4096) == "STATUS=héllo wörld ✓".encode()
    finally:
        s.close()


def test_no_notify_socket_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = notify.Notifier()
    assert not n.enabled
    n.ready()
    n.status("x")


@pytest.mark.parametrize(
    "env,expected",
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),  # for another process
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "x"}, None),
        ({}, None),
    ],
    ids=["set", "other-pid", "zero", "garbage", "unset"],
)
def test_watchdog_interval(env, expected):
    assert notify.watchdog_interval(env) == expected


def run_with_journal_stream(tmp_path: Path, *args: str) -> str:
    """Run gpu-mon with stderr to a file that JOURNAL_STREAM names, as systemd does."""
    out = tmp_path / "journal"
    with open(out, "wb") as f:
        st = os.fstat(f.fileno())
        env = dict(os.environ, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")
        env.pop("NOTIFY_SOCKET", None)
        subprocess.run([*GPU_MON, *args], stdout=subprocess.DEVNULL, stderr=f, env=env, timeout=60)
    return out.read_text()


def test_journal_priorities(tmp_path, sim):
    conf = write_config(
        tmp_path / "c.conf",
        f"[defaults]\nstate_file = {tmp_path}/s.json\ninterval_seconds = 0.2\n"
        "start_delay_seconds = 0\n[gpu-all]\ngpus = ALL\n[process-m]\ngpus = 0\nuser = root\n"
        "cmd = sh -c 'printf \"<0>%s\\\\n\" not-an-emergency; exec sleep 600'\n"
        f"[history]\npath = {tmp_path}/history.sqlite\n",
    )
    log = tmp_path / "journal"
    with open(log, "wb") as f:
        st = os.fstat(f.fileno())
        env = dict(os.environ, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")
        env.pop("NOTIFY_SOCKET", None)
        p = subprocess.Popen(
            [*GPU_MON, "--config", str(conf), "--sim", str(sim.path), "run"],
            stderr=f,
            stdout=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=dies_with_the_run(),
        )
        try:
            wait_for(lambda: "]: <0>not-an-emergency" in log.read_text(), what="workload output")
        finally:
            p.send_signal(signal.SIGTERM)
            assert p.wait(20) == 0
    lines = log.read_text().splitlines()
    assert lines and all(line[:3] in ("<3>", "<4>", "<6>", "<7>") for line in lines), lines
    assert any(line.startswith("<4>") and "runs as root (written explicitly)" in line for line in lines)
    (out,) = [line for line in lines if "]: <0>not-an-emergency" in line]
    assert out.startswith("<6>m[")


def test_errors_are_priority_3(tmp_path):
    conf = write_config(tmp_path / "c.conf", "[defaults]\ninterval_seconds = 0\n")
    text = run_with_journal_stream(tmp_path, "--config", str(conf), "run")
    assert text == f"<3>{conf}:2: [defaults] interval_seconds: '0' must be at least 0.1\n"
    text = run_with_journal_stream(tmp_path, "--config", str(tmp_path / "missing.conf"), "check")
    assert text.startswith("<3>") and text.count("\n") == 1


def test_traceback_lines_each_carry_the_prefix():
    formatter = logs.JournalFormatter("%(message)s")
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = logging.LogRecord(
            "gpu_mon", logging.ERROR, __file__, 1, "failed\nsecond line", None, sys.exc_info()
        )
    text = formatter.format(record)
    lines = text.split("\n")
    assert len(lines) > 4 and all(line.startswith("<3>") for line in lines)
    assert "<3>ValueError: boom" in lines


def test_journal_detection(tmp_path):
    with open(tmp_path / "f", "w") as f:
        st = os.fstat(f.fileno())
        assert logs.stderr_is_journal(f, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        assert not logs.stderr_is_journal(f, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"})
        assert not logs.stderr_is_journal(f, {"JOURNAL_STREAM": "garbage"})
        assert not logs.stderr_is_journal(f, {})


def test_terminal_format_has_timestamps(tmp_path, sim):
    conf = write_config(
        tmp_path / "c.conf",
        f"[defaults]\nstate_file = {tmp_path}/s.json\n[gpu-all]\ngpus = ALL\n"
        f"[history]\npath = {tmp_path}/history.sqlite\n",
    )
    r = subprocess.run(
        [*GPU_MON, "--config", str(conf), "--sim", str(sim.path), "check"], capture_output=True, text=True
    )
    assert r.returncode == 0
    p = subprocess.Popen(
        [*GPU_MON, "--config", str(conf), "--sim", str(sim.path), "run"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "GPU_MON_SIM": ""},
        start_new_session=True,
        preexec_fn=dies_with_the_run(),
    )
    try:
        first = p.stderr.readline()
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(20)
    assert first[:4].isdigit() and " gpu-mon[" in first and " INFO " in first
