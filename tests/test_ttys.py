"""Terminal users from real files standing in for tty devices, with os.utime and chown."""

from __future__ import annotations

import os
import time

from gpu_mon.api import ttys as sessions


def make_tty(path, uid: int, idle: float) -> None:
    path.touch()
    os.chown(path, uid, uid)
    then = time.time() - idle
    os.utime(path, (then, then))


def test_owner_and_idle_time(tmp_path):
    make_tty(tmp_path / "1", 65534, 30)
    make_tty(tmp_path / "2", 0, 7200)
    now = time.time()
    got = {t.device.rsplit("/", 1)[1]: t for t in sessions.scan_ttys([f"{tmp_path}/*"], now)}
    assert got["1"].user == "nobody" and got["1"].uid == 65534 and 29 <= got["1"].idle_seconds <= 32
    assert got["2"].user == "root" and 7199 <= got["2"].idle_seconds <= 7202


def test_future_atime_is_not_negative(tmp_path):
    make_tty(tmp_path / "1", 0, -100)
    (t,) = sessions.scan_ttys([f"{tmp_path}/*"], time.time())
    assert t.idle_seconds == 0.0


def test_unknown_uid_shows_the_number(tmp_path):
    make_tty(tmp_path / "1", 54321, 1)
    (t,) = sessions.scan_ttys([f"{tmp_path}/*"], time.time())
    assert t.user == "54321"


def test_vanishing_devices_and_odd_entries_are_skipped(tmp_path):
    make_tty(tmp_path / "1", 0, 1)
    os.symlink(tmp_path / "gone", tmp_path / "dangling")  # matched by the glob, stat fails
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    got = sessions.scan_ttys([f"{tmp_path}/*", f"{tmp_path}/1"], time.time())
    assert [t.device for t in got] == [str(tmp_path / "1")]  # once, although two globs match it


def test_ptmx_console_and_tty_are_not_terminals_of_anyone():
    got = sessions.scan_ttys(["/dev/ptmx", "/dev/tty", "/dev/console", "/dev/null"], time.time())
    assert [t.device for t in got] == ["/dev/null"]


def test_active_filters_idle_and_whitelisted(tmp_path):
    make_tty(tmp_path / "a", 0, 10)
    make_tty(tmp_path / "b", 65534, 10)
    make_tty(tmp_path / "c", 65534, 1000)
    ttys = sessions.scan_ttys([f"{tmp_path}/*"], time.time())
    active = sessions.active(ttys, idle_seconds=300, whitelist=["root"])
    assert [t.device[-1] for t in active] == ["b"]


def _pty_aged(seconds: float):
    """A real pseudo-terminal (master, slave, its /dev/pts path) whose stamps are `seconds` old."""
    master, slave = os.openpty()
    path = os.ttyname(slave)
    then = time.time() - seconds
    os.utime(path, (then, then))
    return master, slave, path


def _active_ptys(path: str):
    ttys = sessions.scan_ttys([path], time.time())
    return sessions.active(ttys, idle_seconds=300, whitelist=[])


def test_input_on_a_real_terminal_makes_its_user_active():
    master, slave, path = _pty_aged(3600)
    try:
        assert _active_ptys(path) == ()
        os.write(master, b"ls\n")  # the user types ...
        assert os.read(slave, 16) == b"ls\n"  # ... and the shell reads it: the kernel stamps atime
        st = os.stat(path)
        assert time.time() - st.st_atime < 10 and time.time() - st.st_mtime > 3000
        assert [t.device for t in _active_ptys(path)] == [path]
    finally:
        os.close(slave)
        os.close(master)


def test_output_to_a_real_terminal_is_not_its_user():
    master, slave, path = _pty_aged(3600)
    try:
        os.write(slave, b"epoch 3/90 loss 0.41\n")  # a job prints to the terminal: the kernel stamps mtime
        assert os.read(master, 64).startswith(b"epoch 3/90")
        st = os.stat(path)
        assert time.time() - st.st_mtime < 10 and time.time() - st.st_atime > 3000
        assert _active_ptys(path) == ()
    finally:
        os.close(slave)
        os.close(master)
