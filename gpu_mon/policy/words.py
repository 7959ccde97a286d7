"""The engine's decisions in English: the only place reasons, waits, stops and exits become words.

The log and `gpu-mon status` (through the state file) use these; the policy itself returns data. Untrusted
parts (process and user names, paths) are escaped here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional, Sequence

from gpu_mon.api.model import Exited, Holder, gpu_label
from gpu_mon.api.text import sanitize
from gpu_mon.policy.decisions import Busy, Reason, Restarting, Start, Stop, TerminalUse, Wait, Who

if TYPE_CHECKING:
    from gpu_mon.policy.report import RoundReport


def gpu(uuid: str, index_of: Dict[str, int]) -> str:
    """`GPU 0 (GPU-5a1c...)`, or the bare UUID when its index is unknown."""
    index = index_of.get(uuid)
    return gpu_label(index, uuid) if index is not None else uuid


def who(w: Who) -> str:
    """`alice python3[4242]`."""
    return f"{sanitize(w.user)} {sanitize(w.name)}[{w.pid}]"


def _context(r: Reason) -> str:
    name = who(r.who) if r.who else f"pid {r.pid} (not visible here)"
    used = f", {r.mib} MiB" if r.mib is not None else ""
    return f"{name} has a {r.context} context on it (NVML{used})"


def reason(r: Reason) -> str:
    """Why a GPU is busy, in one phrase."""
    if r.kind == Busy.BACKEND:
        return f"GPUs cannot be read: {sanitize(r.detail)}"
    if r.kind == Busy.MISSING:
        return "not found on this host (lost or removed?)"
    if r.kind == Busy.UNREADABLE:
        return f"cannot be read: {sanitize(r.detail)}"
    if r.kind == Busy.NODE:
        return f"device node cannot be watched: {sanitize(r.detail)}"
    if r.kind == Busy.HIDDEN and r.who is not None:
        more = f" and {r.count - 1} more" if r.count > 1 else ""
        return f"cannot see the open files of {who(r.who)}{more}, which may hold it"
    if r.kind == Busy.HOLDER and r.who is not None:
        return f"{who(r.who)} holds {sanitize(r.path or 'its device node')}"
    if r.kind == Busy.UNSEEN and r.who is not None:
        more = f", or one of {r.count - 1} others" if r.count > 1 else ""
        return f"opened by a process whose files cannot be read here ({who(r.who)}{more})"
    if r.kind == Busy.OPENS and r.who is not None:
        more = f" and {r.count - 1} more" if r.count > 1 else ""
        return f"opened and closed again and again by {who(r.who)}{more}"
    if r.kind == Busy.CONTEXT:
        return _context(r)
    if r.kind == Busy.QUEUE_JOB and r.who is not None:
        return f"runs queue job {r.job} of {sanitize(r.who.user)}"
    if r.kind == Busy.QUEUE_UNKNOWN:
        return f"the queue's running jobs cannot be known: {sanitize(r.detail)}"
    if r.kind == Busy.SLURM_JOB and r.who is not None:
        return f"Slurm has allocated it to job {r.job} of {sanitize(r.who.user)}"
    if r.kind == Busy.SLURM_UNKNOWN:
        return f"Slurm's allocations are not known yet: {sanitize(r.detail)}"
    if r.kind == Busy.MEMORY:
        return f"{r.mib} MiB used by others (more than busy_memory_mib = {r.limit_mib})"
    return r.kind


def brief_opens(gpu_label: str, seconds: float, by: Sequence[Holder], looks: int) -> str:
    """The end of a GPU's opens again and again (engine/floods.py): `GPU 0 (GPU-...): opened and closed
    again and again for 20 s by alice python3[4242] (21 of its opens looked at)`."""
    names = ", ".join(f"{sanitize(h.user)} {sanitize(h.name)}[{h.pid}]" for h in by) or "a process not seen"
    return (
        f"{gpu_label}: opened and closed again and again for {seconds:.0f} s by {names} "
        f"({looks} of its opens looked at)"
    )


def terminal(t: TerminalUse) -> str:
    """`bob at pts/3 (active 5 s ago)`."""
    device = sanitize(t.device.replace("/dev/", ""))
    return f"{sanitize(t.user)} at {device} (active {t.idle_seconds:.0f} s ago)"


def stop(s: Stop, index_of: Dict[str, int]) -> str:
    """Why a workload is being stopped."""
    if s.why == "terminal" and s.terminal is not None:
        return f"paused for terminal user {terminal(s.terminal)}"
    if s.why == "removed":
        return "no longer in the config"
    return "; ".join(f"{gpu(u, index_of)} busy: {reason(r)}" for u, r in s.busy)


def start(s: Start, index_of: Dict[str, int]) -> str:
    """`GPU 0 (GPU-...) free for 61 s`."""
    gpus = ", ".join(gpu(u, index_of) for u in s.instance.gpus)
    return f"{gpus} free for {s.free_seconds:.0f} s"


def exit_status(code: int, killed_by: Optional[int] = None) -> str:
    """`exited with status 1`, `was killed by signal 9`, `could not start (command not found, ...)`.
    killed_by: the signal that ended it, 0 when it exited (a command that traps SIGTERM and exits 143 did not
    die of it); None when not known, then a status over 128 is read as a signal."""
    if killed_by is None and code > 128:
        killed_by = code - 128
    if killed_by:
        return f"was killed by signal {killed_by}"
    if code == 127:
        return "could not start (command not found, status 127)"
    if code == 126:
        return "could not start (permission denied or not executable, status 126)"
    return f"exited with status {code}"


def last_exit(ex: Optional[Exited]) -> str:
    """How an instance last ended: `exited with status 3 after 1.2 s (detail)`."""
    if ex is None:
        return ""
    if ex.stopped_by_us:
        return f"stopped by gpu-mon ({exit_status(ex.returncode, ex.signal)})"
    ran = max(0.0, ex.ended_at - ex.started_at)
    detail = f" ({sanitize(ex.detail)})" if ex.detail else ""
    return f"{exit_status(ex.returncode, ex.signal)} after {ran:.1f} s{detail}"


def restarting(e: Restarting) -> str:
    """The log line for an instance that ended by itself."""
    text = f"{e.exited.key} {last_exit(e.exited)}; restarting in {e.delay:g} s"
    if e.failing:
        text += f" ({e.failures} quick failures in a row; check its command and log)"
    return text


def wait_state(w: Wait) -> str:
    """One word for `status`: paused, waiting, restarting or stopping."""
    return {"paused": "paused", "backoff": "restarting", "stopping": "stopping"}.get(w.kind, "waiting")


def wait(w: Wait, index_of: Dict[str, int], now: float) -> str:
    """Why an instance is not running now."""
    if w.kind == "paused" and w.terminal is not None:
        return f"paused: {terminal(w.terminal)}"
    if w.kind == "busy" and w.reason is not None:
        return f"waiting: {gpu(w.gpu, index_of)} busy: {reason(w.reason)}"
    if w.kind == "taken":
        return f"waiting: {gpu(w.gpu, index_of)} runs {w.by}"
    left = (w.until or now) - now
    if w.kind == "backoff":
        return f"restarting in {left:.0f} s ({last_exit(w.last)})"
    if w.kind == "start_delay":
        return f"waiting: start delay ({left:.0f} s left)"
    return w.kind


def status_line(report: RoundReport) -> str:
    """One line for systemd's STATUS= and SIGUSR1: `1/2 GPUs running work; GPU 1 busy (alice)`."""
    plan, decision, snap = report.plan, report.decision, report.snapshot
    running = {u for w in report.workloads for u in w["gpus"]}
    watched = list(plan.rules)  # type: ignore[attr-defined]
    parts = [f"{sum(1 for u in watched if u in running)}/{len(watched)} GPUs running work"]
    for uuid in watched:
        v = decision.verdicts.get(uuid)
        if v is not None and v.busy and uuid not in running:
            first = v.reasons[0]
            who_ = sanitize(first.who.user) if first.who else reason(first)
            parts.append(f"GPU {plan.index_of.get(uuid, '?')} busy ({who_})")  # type: ignore[attr-defined]
    if decision.paused_by:
        parts.append(f"paused: {terminal(decision.paused_by[0])}")
    if snap.reading.error:
        parts.append(f"GPUs unreadable: {sanitize(snap.reading.error)}")
    return "; ".join(parts)


def duration(seconds: Optional[float]) -> str:
    """`45 s`, `12 min`, `3 h`, `5 days`."""
    if seconds is None:
        return "?"
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    if seconds < 172800:
        return f"{seconds // 3600} h {seconds % 3600 // 60} min"
    return f"{seconds // 86400} d"
