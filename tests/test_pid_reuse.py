"""The subreaper's kills never reach a pid reused by a stranger: a pid that a children list names is
signalled only while /proc says it is still that parent's child, through a pidfd, start time checked."""

from __future__ import annotations

import subprocess
import sys

from conftest import pid_alive, wait_for

from gpu_mon.api import procfs
from gpu_mon.engine.workloads import linux

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
FORKER = """
import os, time
if os.fork() == 0:
    time.sleep(60)
print("forked", flush=True)
time.sleep(60)
"""


def test_a_pid_the_children_list_named_but_now_a_strangers_is_not_killed(monkeypatch):
    # A leader (`root`) has reaped its child between our look at its children list and the kill, and the
    # pid now names another process: stand in for that with a children list that names a stranger.
    root = subprocess.Popen(SLEEPER)
    stranger = subprocess.Popen(SLEEPER)
    try:
        real = procfs.children
        monkeypatch.setattr(
            procfs, "children", lambda pid, *a: [stranger.pid] if pid == root.pid else real(pid, *a)
        )
        assert linux.kill_until_gone(root.pid)  # (nothing of root's left: done)
        assert pid_alive(stranger.pid) and stranger.poll() is None  # before: SIGKILLed
    finally:
        for p in (root, stranger):
            p.kill()
            p.wait()


def test_a_real_child_is_still_killed():
    root = subprocess.Popen([sys.executable, "-c", FORKER], stdout=subprocess.PIPE, text=True)
    try:
        assert root.stdout is not None and root.stdout.readline() == "forked\n"
        (child,) = procfs.children(root.pid)
        assert linux.kill_until_gone(root.pid)
        wait_for(lambda: not pid_alive(child), 10, "the child killed")  # (a zombie until root reaps it)
    finally:
        root.kill()
        root.wait()
