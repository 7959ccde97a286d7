"""gpu_mon.safefile: log files opened for append without following planted symlinks, never blocking.

open_append() resolves the directory part once (os.path.realpath, so /var/log -> /somewhere works), then
walks it component by component with O_NOFOLLOW and opens the final name with O_NOFOLLOW: a symlink at the
final name is refused, and so is a directory component swapped for a symlink after the resolution.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat

import pytest

from gpu_mon import safefile
from gpu_mon.safefile import UnsafeFile

# A call that blocks (a FIFO opened without O_NONBLOCK) fails its test after 5 s instead of hanging.
pytestmark = pytest.mark.usefixtures("alarm")


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def append(path, data):
    fd = safefile.open_append(str(path))
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def refusal(path):
    with pytest.raises(UnsafeFile) as info:
        fd = safefile.open_append(str(path))
        os.close(fd)  # not reached when refused; closes it if the test fails
    message = str(info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------------------------------------
# What it opens


def test_creates_with_mode_0640(tmp_path, umask022):
    path = tmp_path / "w.log"
    append(path, b"one\n")
    st = os.stat(path)
    assert stat.S_ISREG(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o640
    assert path.read_bytes() == b"one\n"


def test_mode_argument_and_umask(tmp_path):
    old = os.umask(0o077)
    try:
        fd = safefile.open_append(str(tmp_path / "a.log"), mode=0o644)
        os.close(fd)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a.log").st_mode) == 0o600


def test_appends_and_keeps_existing_content_and_mode(tmp_path, umask022):
    path = tmp_path / "w.log"
    path.write_bytes(b"old\n")
    os.chmod(path, 0o600)
    append(path, b"two\n")
    append(path, b"three\n")
    assert path.read_bytes() == b"old\ntwo\nthree\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_descriptor_is_append_only_blocking_and_close_on_exec(tmp_path):
    fd = safefile.open_append(str(tmp_path / "w.log"))
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        assert flags & os.O_APPEND
        assert flags & os.O_ACCMODE == os.O_WRONLY
        assert os.get_blocking(fd)
        assert not os.get_inheritable(fd)
    finally:
        os.close(fd)


def test_writes_land_at_the_end_even_after_another_writer(tmp_path):
    path = tmp_path / "w.log"
    fd = safefile.open_append(str(path))
    try:
        os.write(fd, b"a")
        with open(path, "ab") as other:
            other.write(b"b")
        os.write(fd, b"c")
    finally:
        os.close(fd)
    assert path.read_bytes() == b"abc"


def test_dev_null_is_accepted():
    fd = safefile.open_append("/dev/null")
    try:
        assert stat.S_ISCHR(os.fstat(fd).st_mode)
        assert os.write(fd, b"discarded") == 9
    finally:
        os.close(fd)


def test_relative_path_is_taken_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    append("rel.log", b"x")
    assert (tmp_path / "rel.log").read_bytes() == b"x"


# ---------------------------------------------------------------------------------------------------------
# What it refuses (each refusal one line naming the path and why)


def test_symlink_at_the_final_component_is_refused(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"precious\n")
    link = tmp_path / "w.log"
    link.symlink_to(target)
    assert refusal(link) == f"{link}: is a symlink (refused: it could be redirected)"
    assert target.read_bytes() == b"precious\n"


def test_dangling_symlink_is_refused_and_nothing_is_created(tmp_path):
    link = tmp_path / "w.log"
    link.symlink_to(tmp_path / "created-through-the-link")
    assert refusal(link) == f"{link}: is a symlink (refused: it could be redirected)"
    assert not (tmp_path / "created-through-the-link").exists()


def test_symlink_to_dev_null_is_refused(tmp_path):
    link = tmp_path / "w.log"
    link.symlink_to("/dev/null")
    assert "is a symlink" in refusal(link)


def test_symlinked_directory_in_a_log_path_is_refused(tmp_path):
    """A user who owns a directory of the log path could point root's appends anywhere with a symlink."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "logs").symlink_to(real)
    assert refusal(tmp_path / "logs" / "w.log") == (
        f"{tmp_path / 'logs'}: a path component is not a directory (or is a symlink)"
    )
    assert os.listdir(real) == []


def test_hard_linked_log_file_is_refused(tmp_path):
    """A hard link to a file the user does not own (protected_hardlinks off) must not be appended to."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    os.link(victim, tmp_path / "w.log")
    assert (
        refusal(tmp_path / "w.log")
        == f"{tmp_path / 'w.log'}: has 2 hard links (refused: it could be another file)"
    )
    assert victim.read_bytes() == b"precious\n"


def test_directory_swapped_for_a_symlink_during_the_walk_is_refused(tmp_path, monkeypatch):
    """The race open_parent defends against (for configs, whose directories must also be root's): after the
    parent was resolved, an attacker replaces a directory of the path by a symlink. The O_NOFOLLOW walk
    refuses that component."""
    logs = tmp_path / "logs"
    logs.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    resolve = os.path.realpath

    def resolve_then_swap(path, *args, **kwargs):
        resolved = resolve(path, *args, **kwargs)
        if os.path.isdir(logs) and not os.path.islink(logs):
            os.rename(logs, tmp_path / "logs.old")
            logs.symlink_to(elsewhere)
        return resolved

    monkeypatch.setattr(safefile.os.path, "realpath", resolve_then_swap)
    with pytest.raises(UnsafeFile) as info:
        safefile.open_parent(str(logs / "w.log"))
    monkeypatch.undo()
    assert str(info.value) == f"{logs}: a path component is not a directory (or is a symlink)"
    assert os.listdir(elsewhere) == []
    assert os.listdir(tmp_path / "logs.old") == []


def test_fifo_without_a_reader_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "w.log"
    os.mkfifo(fifo)
    message = refusal(fifo)
    assert message.startswith(f"{fifo}: not a regular file")
    assert "FIFO" in message


def test_fifo_with_a_reader_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "w.log"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert refusal(fifo) == f"{fifo}: not a regular file or character device"
    finally:
        os.close(reader)


def test_socket_is_refused(tmp_path):
    path = tmp_path / "w.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        assert refusal(path).startswith(f"{path}: not a regular file")


def test_directory_is_refused(tmp_path):
    (tmp_path / "d").mkdir()
    assert refusal(tmp_path / "d") == f"{tmp_path / 'd'}: Is a directory"


def test_missing_directory_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "missing" / "w.log"
    assert refusal(path) == f"{path}: No such file or directory"


def test_file_as_a_directory_component_is_refused(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    message = refusal(tmp_path / "f" / "w.log")
    assert message == f"{tmp_path / 'f'}: a path component is not a directory (or is a symlink)"


def test_root_is_not_a_file_name():
    assert refusal("/") == "/: not a file name"


# ---------------------------------------------------------------------------------------------------------
# read_trusted and open_parent directly (config.load covers the root-safety checks in depth)


def test_read_trusted_reads_the_whole_file(tmp_path):
    path = tmp_path / "c"
    path.write_bytes(b"x" * 200_000)
    assert safefile.read_trusted(str(path), None, 200_000) == b"x" * 200_000


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda p: p.write_bytes(b"x" * 11), "too large (11 bytes; at most 10)"),
        (lambda p: p.mkdir(), "not a regular file"),
        (lambda p: os.mkfifo(p), "not a regular file"),
        (lambda p: p.symlink_to("/etc/passwd"), "is a symlink (refused: it could be redirected)"),
        (lambda p: None, "No such file or directory"),
    ],
    ids=["too-large", "directory", "fifo", "symlink", "missing"],
)
def test_read_trusted_refusals(tmp_path, make, fragment):
    path = tmp_path / "c"
    make(path)
    with pytest.raises(UnsafeFile) as info:
        safefile.read_trusted(str(path), None, 10)
    assert str(info.value) == f"{path}: {fragment}"


def test_read_trusted_stops_at_the_limit_for_files_that_lie_about_their_size():
    """/proc files report size 0 but have content: the read loop still enforces the limit."""
    with pytest.raises(UnsafeFile) as info:
        safefile.read_trusted("/proc/self/status", None, 10)
    assert str(info.value) == "/proc/self/status: too large (at most 10 bytes)"


def test_open_parent_returns_the_directory_and_the_name(tmp_path):
    (tmp_path / "sub").mkdir()
    fd, name = safefile.open_parent(str(tmp_path / "sub" / "f.log"))
    try:
        assert name == "f.log"
        assert os.path.samestat(os.fstat(fd), os.stat(tmp_path / "sub"))
    finally:
        os.close(fd)


def test_open_parent_closes_its_descriptors_on_refusal(tmp_path):
    before = set(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with contextlib.suppress(UnsafeFile):
            safefile.open_parent(str(tmp_path / "missing" / "x"))
        with contextlib.suppress(UnsafeFile):
            safefile.open_append(str(tmp_path))
    assert set(os.listdir("/proc/self/fd")) == before


def test_open_parent_checks_every_directory_with_a_trusted_uid(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(UnsafeFile) as info:
        safefile.open_parent(str(d / "x"), os.geteuid())
    assert str(info.value).startswith(
        f"{d}: directory is writable by group or others (refused); chmod go-w it"
    )
    fd, _ = safefile.open_parent(str(d / "x"))  # no trusted uid: no check
    os.close(fd)
