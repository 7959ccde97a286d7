"""`gpu-mon show JOB`: everything about one job (or each element an id names), as Slurm's `scontrol show
job`, `sacct` and `seff` say it together: every field as submitted, the state and its whole reason, every
run (runrecords.py: its GPUs, how it ended, who preempted it, its energy), the total run time and the wait,
and for a running job its processes on each of its GPUs (NVML's per-process memory and utilization, as the
round's look saw them). No words here: the client (commands/queue_show.py) says it.

Anyone may show any job, as `jobs` lists anyone's; its environment only to its owner and root.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from gpu_mon.api.model import Snapshot
from gpu_mon.queue import jobs as J
from gpu_mon.queue.jobs import Job
from gpu_mon.queue.listing import iso
from gpu_mon.queue.runrecords import so_far, with_energy

MAX_SHOWN = 100  # jobs one answer shows (an array's elements: the first ones, and how many more)
# Fields of a job that say where it stands, not what was submitted (the answer has them in its own words)
_NOT_SUBMITTED = frozenset(
    [
        "id",
        "env",
        "state",
        "gpus",
        "started",
        "ended",
        "restarts",
        "exit_status",
        "signal",
        "reason",
        "gpu_seconds",
        "ran_seconds",
        "leader_pid",
        "leader_ticks",
        "queued_at",
        "stopped_by",
        "preempted_at",
        "preempted_reason",
        "array_id",
        "array_index",
    ]
)


@dataclass(frozen=True)
class Live:
    """What the daemon's loop knows now: its last look, and the records of the runs going on."""

    look: Callable[[], Optional[Snapshot]]
    runs: Callable[[int], List[dict]]


def shown(
    jobs: Sequence[Job],
    asker: int,
    described: Callable[[Job], dict],
    output: Callable[[Job], str],
    stored: Callable[[int], List[Tuple[float, Optional[float], str, str]]],
    live: Optional[Live],
) -> dict:
    """The answer: `{"jobs": [...], "more": N}` (see show_one)."""
    now = time.time()
    look = live.look() if live is not None else None
    out = [show_one(j, asker, described(j), output(j), stored, live, look, now) for j in jobs[:MAX_SHOWN]]
    return {"jobs": out, "more": max(0, len(jobs) - MAX_SHOWN)}


def show_one(
    j: Job,
    asker: int,
    described: dict,
    output: str,
    stored: Callable[[int], List[Tuple[float, Optional[float], str, str]]],
    live: Optional[Live],
    look: Optional[Snapshot],
    now: float,
) -> dict:
    """One job: what `jobs --json` says of it (whole), its fields as submitted, its runs and totals."""
    runs = _runs(j, stored, live, look)
    ran = sum(max(0.0, (r["end"] if r["end"] is not None else now) - r["start"]) for r in runs if r["start"])
    energies = [r["energy_mj"] for r in runs if r["energy_mj"] is not None]
    return {
        **described,
        "submitted_as": _submitted(j, asker),
        "output": output,
        "runs": runs,
        "run_seconds_total": round(ran, 1),
        "gpu_seconds_total": round(sum(_run_seconds(r, now) * len(r["gpus"]) for r in runs), 1),
        "wait_seconds": _wait(j, now),
        "energy_mj": round(sum(energies), 1) if energies else None,
        "energy_runs_unknown": len(runs) - len(energies),
        "processes": _processes(j, look) if j.state in J.LIVE else [],
    }


def _run_seconds(r: dict, now: float) -> float:
    return max(0.0, (r["end"] if r["end"] is not None else now) - r["start"])


def _submitted(j: Job, asker: int) -> Dict[str, object]:
    """Every field of the job as submitted (a field another helper adds to Job shows here too), by the
    name Job gives it; times as ISO text; its environment only to its owner and root (else null)."""
    out: Dict[str, object] = {}
    for name in J.FIELDS:
        if name in _NOT_SUBMITTED:
            continue
        value = getattr(j, name)
        if name == "submitted":
            value = iso(value)
        elif name == "stop_signal":
            value = _signal_name(value)
        out[name] = list(value) if isinstance(value, tuple) else value
    out["env"] = [list(kv) for kv in j.env] if asker in (0, j.uid) else None
    return json.loads(json.dumps(out, default=str))


def _signal_name(number: object) -> object:
    try:
        return signal.Signals(number).name  # type: ignore[arg-type]
    except ValueError:
        return number


def _runs(
    j: Job,
    stored: Callable[[int], List[Tuple[float, Optional[float], str, str]]],
    live: Optional[Live],
    look: Optional[Snapshot],
) -> List[dict]:
    """The job's runs as recorded, oldest first; one going on with its energy so far (the look's
    counters as its end)."""
    records: Dict[float, dict] = {}
    for start, _end, _how, data in stored(j.id):
        try:
            record = json.loads(data)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("energy"), dict):
            records[start] = record
    for record in live.runs(j.id) if live is not None else ():
        records[record["start"]] = so_far(record, look.reading.gpus) if look is not None else record
    return [_run(records[s]) for s in sorted(records)]


def _run(record: dict) -> dict:
    out = with_energy(record)
    out["started"] = iso(record.get("start"))
    out["ended"] = iso(record.get("end"))
    return out


def _wait(j: Job, now: float) -> Optional[float]:
    """Seconds it waited for its current (or last) run since its submission or last requeue; waiting
    now: so far. None: it ended without a run since."""
    since = J.waited_since(j)
    if j.state in (J.QUEUED, J.HELD):
        return round(max(0.0, now - since), 1)
    if j.started is not None and j.started >= since:
        return round(j.started - since, 1)
    return None


def _processes(j: Job, look: Optional[Snapshot]) -> List[dict]:
    """The job's processes on each of its GPUs, as the round's look saw them: NVML's processes there that
    are ours (a GPU a job holds is given to no other workload: ours there is the job's, whatever session
    or unit the process is in), with their memory and utilization (None: not reported)."""
    if look is None:
        return []
    owners = {(h.pid, u): h for h in look.nvml_procs for u in h.gpus}
    out = []
    for gpu in look.reading.gpus:
        if gpu.uuid not in j.gpus:
            continue
        for p in gpu.processes or ():
            h = owners.get((p.pid, gpu.uuid))
            if h is None or not h.ours_on(gpu.uuid):
                continue
            out.append(
                {
                    "gpu": gpu.uuid,
                    "gpu_index": gpu.index,
                    "pid": p.pid,
                    "name": h.name,
                    "user": h.user,
                    "used_memory_mib": p.used_memory_mib,
                    "utilization_pct": p.utilization_pct,
                }
            )
    return out
