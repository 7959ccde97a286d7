"""The only module that runs Slurm's commands (`scontrol`, `scancel`), each with a timeout: a slow or dead
slurmctld never blocks the daemon's loop. Commands are started by the caller's thread (the loop's: a
fraction of a millisecond, and the daemon knows its own children) through `spawn`; a thread per command
waits for it, and `poke` wakes the loop, whose next `pump()` starts a call's next command or hands its
result over. Results come back as data.
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional, Tuple

# What scontrol and scancel print when slurmctld cannot be reached (22.05 and later).
_UNREACHABLE = (
    "unable to contact slurm controller",
    "socket timed out",
    "connection refused",
    "zero bytes were transmitted",
    "communication connection failure",
)
_GONE = ("invalid job id", "job has already finished", "already completing or completed")
# The job is already back in the queue (an earlier call that timed out did reach Slurm): what was wanted.
_ALREADY = ("job is pending execution",)
OK, FAILED, UNREACHABLE, GONE = "ok", "failed", "unreachable", "gone"


@dataclass(frozen=True)
class Call:
    """Commands for one job, run one after the other until one fails."""

    job: int
    kind: str  # lookup, signal, requeue, cancel, lift
    argvs: Tuple[Tuple[str, ...], ...]
    at: float = 0.0  # monotonic: when it was asked for
    # Run after the others succeeded, each whatever the one before did (a release after a hold): their
    # failures are only noted.
    after: Tuple[Tuple[str, ...], ...] = ()


@dataclass(frozen=True)
class Result:
    """How a Call went."""

    call: Call
    result: str  # ok, failed, unreachable, gone
    issued: float  # monotonic: when its first command was started (0: never)
    done: float  # monotonic: when the last one ended
    output: str = ""  # the last command's standard output
    error: str = ""  # one line: what went wrong
    note: str = ""  # what went wrong in the `after` commands


def classify(returncode: int, stderr: str) -> str:
    """ok, or why not: Slurm unreachable, the job gone, or another failure."""
    if returncode == 0:
        return OK
    low = stderr.lower()
    if any(m in low for m in _ALREADY):
        return OK
    if any(m in low for m in _UNREACHABLE):
        return UNREACHABLE
    return GONE if any(m in low for m in _GONE) else FAILED


def _what(argv: Tuple[str, ...]) -> str:
    return f"{argv[0]} {argv[1] if len(argv) > 1 else ''}".strip()


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


Spawn = Callable[[List[str], Dict[str, str]], "subprocess.Popen[bytes]"]


def popen(argv: List[str], env: Dict[str, str]) -> subprocess.Popen[bytes]:
    """A plain start (outside the daemon, whose supervisor starts its helpers)."""
    return subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )


@dataclass
class _Step:
    call: Call
    index: int  # which command: argvs first, then after
    issued: float
    notes: Tuple[str, ...] = ()
    out: str = ""  # the standard output of the call's last main command
    done: Optional[Tuple[int, str, str]] = None  # (exit status, stdout, stderr) once it ended


class Control:
    """Runs Calls; `pump()` (in the loop's thread) moves them on, `take()` returns the finished ones."""

    def __init__(
        self,
        poke: Callable[[], None],
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
        spawn: Spawn = popen,
    ) -> None:
        self.poke, self.timeout, self.clock, self.spawn = poke, timeout, clock, spawn
        self.ended: Deque[_Step] = collections.deque()  # filled by the waiting threads
        self.results: List[Result] = []
        self.running = 0

    def submit(self, call: Call) -> None:
        """Start its first command now."""
        self._start(_Step(call, 0, self.clock()))

    def pump(self) -> bool:
        """Start the next command of each call whose command ended; whether anything ended."""
        moved = False
        while self.ended:
            step = self.ended.popleft()
            self.running -= 1
            moved = True
            self._next(step)
        return moved

    def take(self) -> List[Result]:
        """The calls finished since the last take."""
        self.pump()
        out, self.results = self.results, []
        return out

    def busy(self) -> bool:
        """Whether a command is under way or waits for `pump`."""
        return self.running > 0 or bool(self.ended)

    def close(self) -> None:
        """Nothing to release: a command under way ends by its timeout, its thread with it."""

    def _argv(self, step: _Step) -> Tuple[str, ...]:
        n = len(step.call.argvs)
        return step.call.argvs[step.index] if step.index < n else step.call.after[step.index - n]

    def _start(self, step: _Step) -> None:
        argv = self._argv(step)
        try:
            p = self.spawn(list(argv), dict(os.environ))
        except OSError as err:
            step.done = (127, "", f"cannot run it: {err.strerror or err}")
            self.running += 1
            self.ended.append(step)
            return
        self.running += 1
        threading.Thread(target=self._wait, args=(p, step), name="gpu-mon-slurm", daemon=True).start()

    def _wait(self, p: subprocess.Popen[bytes], step: _Step) -> None:
        try:
            out, err = p.communicate(timeout=self.timeout)
            text = err.decode(errors="replace").strip()
            step.done = (p.returncode, out.decode(errors="replace"), text or f"exit status {p.returncode}")
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            step.done = (1, "", f"no answer within {self.timeout:g} s (socket timed out)")
        except Exception as err:  # (a thread must not die silently: the loop would wait for it forever)
            step.done = (1, "", f"cannot wait for it: {err}")
        self.ended.append(step)
        self.poke()

    def _next(self, step: _Step) -> None:
        call, n = step.call, len(step.call.argvs)
        code, out, err = step.done or (1, "", "")
        argv = self._argv(step)
        if step.index < n:
            result = classify(code, err)
            if result != OK:
                self._result(step, result, out, _one_line(f"{_what(argv)}: {err}"))
                return
        elif code != 0:
            step.notes += (_one_line(f"{_what(argv)}: {err}"),)
        kept = out if step.index < n else step.out
        if step.index + 1 < n + len(call.after):
            self._start(_Step(call, step.index + 1, step.issued, step.notes, kept))
            return
        self._result(step, OK, kept, "")

    def _result(self, step: _Step, result: str, out: str, error: str) -> None:
        self.results.append(
            Result(step.call, result, step.issued, self.clock(), out, error, "; ".join(step.notes))
        )


def _found(program: str) -> bool:
    if "/" in program:
        return os.path.isfile(program) and os.access(program, os.X_OK)
    return shutil.which(program) is not None


def ask(argv: List[str], timeout: float) -> Tuple[int, str]:
    """Run one command now, in this thread (`check`, a stopping daemon): (exit status, its output, or why
    it failed)."""
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 1, f"no answer within {timeout:g} s"
    except OSError as err:
        return 127, err.strerror or str(err)
    return p.returncode, (p.stdout if p.returncode == 0 else _one_line(p.stderr or p.stdout))


def probe(
    scontrol: str, scancel: str, partitions: Tuple[str, ...], qos: Tuple[str, ...], timeout: float
) -> List[Tuple[str, str, bool]]:
    """What `check` finds wrong with these settings on this host: (key, what, whether it is an error rather
    than a warning). The commands must exist, slurmctld answer, the partitions exist; QOS are checked
    where `sacctmgr` (accounting) answers, else a warning says they could not be."""
    out = [(key, f"{prog!r} is not found (install slurm-client, or give its path)", True)
           for key, prog in (("scontrol", scontrol), ("scancel", scancel)) if not _found(prog)]  # fmt: skip
    if any(key == "scontrol" for key, _w, _e in out):
        return out
    code, text = ask([scontrol, "ping"], timeout)
    if code != 0 or " is UP" not in text:
        out.append(("scontrol", f"Slurm does not answer `scontrol ping`: {_one_line(text)}", True))
        return out
    for name in partitions:
        code, text = ask([scontrol, "show", "partition", "-o", name], timeout)
        if code != 0 or f"PartitionName={name} " not in text + " ":
            out.append(("preemptible_partitions", f"Slurm has no partition {name!r}", True))
    if qos:
        sacctmgr = os.path.join(os.path.dirname(scontrol), "sacctmgr") if "/" in scontrol else "sacctmgr"
        code, text = (
            ask([sacctmgr, "-n", "-P", "show", "qos", "format=name"], timeout)
            if _found(sacctmgr)
            else (1, "")
        )
        if code != 0:
            out.append(
                ("preemptible_qos", "cannot list Slurm's QOS (sacctmgr: no accounting?): not checked", False)
            )
        else:
            known = set(text.split())
            out += [("preemptible_qos", f"Slurm has no QOS {q!r}", True) for q in qos if q not in known]
    return out
