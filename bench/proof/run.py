"""Running one check: its command in a session of its own with a time budget, and nothing of ours left
running after it, whether it ended, ran past its budget, or the proof was interrupted.

The proof makes itself a child subreaper, so every process a check starts stays its descendant even when
it leaves the check's session (the daemon's workloads do, by design): whatever is still running when a
check is over is found, reported and ended. Nothing that the proof did not start is ever signalled.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import psutil

PR_SET_CHILD_SUBREAPER = 36
INTERRUPT_GRACE_S = 20.0  # SIGINT first: pytest tears its fixtures down, a benchmark stops its daemon
TERM_GRACE_S = 5.0


class Interrupted(Exception):
    """SIGINT or SIGTERM reached the proof."""


@dataclass
class Outcome:
    """How a check's command ended."""

    code: Optional[int]
    seconds: float
    why: Optional[str] = None  # set when it did not end by itself: budget, interruption
    left: List[str] = field(default_factory=list)  # processes of ours still running after it (ended)
    interrupted: bool = False


def become_subreaper() -> None:
    """Orphans of our checks are reparented to us (Linux 3.4+)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _raise(signum: int, frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


def catch_signals() -> None:
    """SIGINT and SIGTERM interrupt the proof (cleanly: see run)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise)


def run(argv: List[str], budget: float, log: Path, env: Dict[str, str], cwd: Path) -> Outcome:
    """Run argv with stdout and stderr to `log`; stop it at `budget` seconds or when interrupted."""
    start = time.monotonic()
    outcome = Outcome(code=None, seconds=0.0)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        outcome.code = proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        outcome.why = f"ran past its budget of {budget:g} s"
    except Interrupted as sig:
        outcome.why, outcome.interrupted = f"interrupted ({sig})", True
    finally:
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if proc.poll() is None:
                stop_group(proc)
            outcome.left = sweep()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    outcome.seconds = time.monotonic() - start
    return outcome


def stop_group(proc: subprocess.Popen) -> None:
    """SIGINT to the check's process group, then SIGTERM, then SIGKILL, each after a grace."""
    for sig, grace in (
        (signal.SIGINT, INTERRUPT_GRACE_S),
        (signal.SIGTERM, TERM_GRACE_S),
        (signal.SIGKILL, 5),
    ):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def sweep() -> List[str]:
    """End every descendant of ours still running (SIGTERM, then SIGKILL); reap; say who they were."""
    alive = [p for p in psutil.Process().children(recursive=True) if _running(p)]
    left = [_describe(p) for p in alive]
    for p in alive:
        _signal(p, signal.SIGTERM)
    _, still = psutil.wait_procs(alive, timeout=TERM_GRACE_S)
    for p in still:
        _signal(p, signal.SIGKILL)
    psutil.wait_procs(still, timeout=TERM_GRACE_S)
    reap()
    return left


def reap() -> None:
    """Collect the exit status of every child that has ended (orphans reparented to us included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {' '.join(p.cmdline())[:80]}"
    except psutil.Error:
        return str(p.pid)


def _signal(p: psutil.Process, sig: int) -> None:
    with contextlib.suppress(psutil.Error):
        p.send_signal(sig)
