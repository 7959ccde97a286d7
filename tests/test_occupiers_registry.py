"""The occupiers' registry cannot be squatted: a directory another user made first (and so owns, and may
empty) is not trusted: no occupier writes there, no record in it is believed, one line says why."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import uuid
from pathlib import Path
from typing import Dict, Iterator

import pytest
from conftest import GPU_MON, SimHost, kill_marked, wait_for

from gpu_mon.api import occupiers, procfs

SQUATTER = "gmsquat"


@pytest.fixture
def squatter() -> Iterator[pwd.struct_passwd]:
    """A plain user made for the test (removed afterwards, with every process of theirs)."""
    subprocess.run(["userdel", "-r", SQUATTER], capture_output=True)
    subprocess.run(
        ["useradd", "-M", "-d", "/nonexistent", "-s", "/bin/sh", SQUATTER], check=True, capture_output=True
    )
    try:
        yield pwd.getpwnam(SQUATTER)
    finally:
        subprocess.run(["pkill", "-KILL", "-u", SQUATTER], capture_output=True)  # only the test's user
        subprocess.run(["userdel", SQUATTER], capture_output=True)


def as_user(pw: pwd.struct_passwd, argv: list, **kw) -> subprocess.Popen:
    """argv run as that user, from /."""
    return subprocess.Popen(argv, user=pw.pw_uid, group=pw.pw_gid, extra_groups=[], cwd="/", **kw)


def test_which_registry_is_trusted(tmp_path):
    base = tmp_path / "r"
    assert occupiers.registry_problem(str(base)) is None  # missing: nothing to believe, nothing wrong
    base.mkdir()
    for mode, trusted in ((0o1777, True), (0o755, True), (0o777, False), (0o775, False), (0o1770, True)):
        os.chmod(base, mode)
        assert (occupiers.registry_problem(str(base)) is None) is trusted, oct(mode)
    os.chmod(base, 0o1777)
    os.chown(base, 65534, 65534)
    assert "owned by nobody, not root" in (occupiers.registry_problem(str(base)) or "")
    link = tmp_path / "link"
    os.chown(base, 0, 0)
    link.symlink_to(base)
    assert "not a directory" in (occupiers.registry_problem(str(link)) or "")


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a user to squat the registry: needs root")
def test_a_squatted_registry_is_neither_written_nor_believed(tmp_path, public_dir, squatter):
    public = public_dir
    os.chmod(public, 0o1777)  # as /tmp
    sim = SimHost(public, 2)
    registry = public / "occupiers"
    made = as_user(squatter, ["mkdir", "-m", "1777", str(registry)])  # first, as a plain user could
    assert made.wait(30) == 0
    assert os.stat(registry).st_uid == squatter.pw_uid
    # The squatter's own live process, with a record that would be believed in a trusted registry.
    sleeper = as_user(squatter, ["sleep", "600"])
    try:
        wait_for(lambda: procfs.read_uid(sleeper.pid) == squatter.pw_uid, what="the squatter's sleeper")
        st = procfs.read_stat(sleeper.pid)
        assert st is not None
        record = registry / occupiers.record_name(squatter.pw_uid, sleeper.pid)
        doc = {
            "uid": squatter.pw_uid,
            "pid": sleeper.pid,
            "start_ticks": st.start_ticks,
            "phase": "occupying",
        }
        record.write_text(json.dumps(doc))
        os.chown(record, squatter.pw_uid, squatter.pw_gid)
        env: Dict[str, str] = dict(
            os.environ,
            GPU_MON_SIM=str(sim.path),
            XDG_STATE_HOME=str(tmp_path / "state"),
            GPU_MON_SYSTEM_CONFIG=str(tmp_path / "no-limits.conf"),
            GPU_MON_OCCUPIERS_DIR=str(registry),
        )

        def gpu_mon(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([*GPU_MON, *args], capture_output=True, text=True, env=env, timeout=60)

        listed = gpu_mon("occupy", "status", "--all")
        assert listed.returncode == 3, listed.stdout + listed.stderr
        assert listed.stderr.strip() == (
            f"gpu-mon occupy: warning: no record believed: {registry} is owned by {SQUATTER}, not root, who "
            "may remove any record (root must remove it; systemd-tmpfiles --create makes it again, 1777 "
            "root:root)"
        )
        shown = gpu_mon("--sim", str(sim.path), "status")
        assert shown.returncode == 0 and "Occupiers" not in shown.stdout, shown.stdout

        marker = f"gmreg-{uuid.uuid4().hex}"
        cmd = ["--", "/usr/bin/python3", "-c", "import time; time.sleep(600)", marker]
        try:
            on = gpu_mon("occupy", "on", "--wait-minutes", "0.01", "--refresh-minutes", "0.002", *cmd)
            assert on.returncode == 0, on.stderr
            log = Path(on.stdout.split("log: ", 1)[1].strip())
            wait_for(lambda: "not listed for other users" in log.read_text(), what="the occupier's warning")
            said = [line for line in log.read_text().splitlines() if "not listed for other users" in line]
            assert len(said) == 1 and f"{registry} is owned by {SQUATTER}, not root" in said[0], said
            assert sorted(p.name for p in registry.iterdir()) == [record.name]  # nothing of root's there
        finally:
            gpu_mon("occupy", "off")
            kill_marked(marker)
    finally:
        sleeper.kill()
        sleeper.wait()
