"""`gpu-mon show ID [--json]`: everything the daemon knows of a job (queue/show.py gathers it), as Slurm's
`scontrol show job`, `sacct` and `seff` say it: what was submitted, where it stands and why (whole), each
run with its GPUs, how it ended and its energy, the totals, and a running job's processes on its GPUs."""

from __future__ import annotations

import argparse
import json
import shlex
import time
from typing import Callable, Dict, List, Optional

from gpu_mon.api.text import sanitize

MJ_PER_KWH = 3.6e9


def add_arguments(
    sub: argparse._SubParsersAction, add_common: Callable[..., None], job_id: Callable[[str], object]
) -> None:
    """`show`'s parser."""
    p = sub.add_parser(
        "show",
        help="everything about a job: as submitted, why it waits, each run, its energy",
        description="Show a job (17; a whole array: each of its elements, the first 100; 17_5: one "
        "element): every field as submitted, its state and the whole reason, each run (start, end, GPUs, "
        "how it ended, who preempted it, the energy its GPUs used), the total run time and GPU-hours, the "
        "wait, and a running job's processes with their GPU memory and utilization. Anyone's job; its "
        "environment only to its owner and root (--json).",
    )
    add_common(p, top=False, sim=False)
    p.add_argument("id", type=job_id, metavar="ID")
    p.add_argument("--json", action="store_true", help="the daemon's answer as JSON")


def run(args: argparse.Namespace, socket: str, ask: Callable[[str, dict], dict]) -> int:
    """Ask the daemon, print the answer."""
    answer = ask(socket, {"op": "show", "id": args.id})
    if args.json:
        print(json.dumps({"jobs": answer["jobs"], "more": answer.get("more", 0)}, indent=2))
        return 0
    blocks = ["\n".join(lines(j)) for j in answer["jobs"]]
    if answer.get("more"):
        blocks.append(f"... and {answer['more']} more element(s): name one (ID_INDEX)")
    print("\n\n".join(blocks))
    return 0


def lines(j: dict) -> List[str]:
    """One job, as text."""
    ref = f"{j['array_id']}_{j['array_index']}" if j.get("array_id") else str(j["id"])
    name = f" {sanitize(j['name'])}" if j.get("name") else ""
    out = [f"Job {ref}{name} of {sanitize(j['user'])}: {j['state']}"]
    if j.get("reason"):
        out.append(f"  Reason: {sanitize(j['reason'])}")
    wait = j.get("wait_seconds")
    est = j.get("estimated_start")  # (where the placement knows one)
    out.append(
        f"  Submitted: {j['submitted']}   Waited: {_duration(wait) if wait is not None else '-'}"
        + (f"   Estimated start: {est}" if est else "")
    )
    if j.get("started"):
        out.append(f"  Started: {j['started']}" + (f"   Ended: {j['ended']}" if j.get("ended") else ""))
    if j.get("gpus"):
        out.append(f"  GPUs: {_gpus(j.get('gpu_indices') or [], j['gpus'])}")
    out.append(f"  Output: {sanitize(j['output'])}")
    out += _submitted(j.get("submitted_as") or {}, j.get("command"))
    out += _totals(j)
    out += _runs(j.get("runs") or [])
    out += _processes(j.get("processes") or [])
    return out


def _submitted(fields: Dict[str, object], command: Optional[List[str]]) -> List[str]:
    cmd = command if command is not None else fields.get("command")
    out = ["  Submitted with:"]
    if isinstance(cmd, list):
        out.append(f"    command: {sanitize(shlex.join(str(c) for c in cmd))}")
    for key, value in fields.items():
        if key in ("command", "env", "submitted"):
            continue
        out.append(f"    {key}: {sanitize(_value(value))}")
    env = fields.get("env")
    if isinstance(env, list):
        out.append(f"    env: {len(env)} variable(s) (--json lists them)")
    return out


def _value(value: object) -> str:
    if value is None or value == [] or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return str(value)


def _totals(j: dict) -> List[str]:
    runs = j.get("runs") or []
    energy = kwh(j.get("energy_mj"))
    unknown = j.get("energy_runs_unknown") or 0
    if unknown and j.get("energy_mj") is not None:
        energy += f" ({unknown} run(s) without a figure)"
    return [
        f"  Runs: {len(runs)}   Run time: {_duration(j.get('run_seconds_total') or 0)} in all   "
        f"GPU-hours: {(j.get('gpu_seconds_total') or 0) / 3600:.2f}",
        f"  Energy: {energy}",
    ]


def kwh(mj: Optional[float]) -> str:
    """Millijoules as kWh, three significant digits (`0.0123 kWh`), `-` when not known."""
    return "-" if mj is None else f"{mj / MJ_PER_KWH:.3g} kWh"


def _runs(runs: List[dict]) -> List[str]:
    if not runs:
        return []
    out = ["  RESTART  STARTED      ENDED        TIME     HOW        ENERGY"]
    for r in runs:
        end = _when(r["end"]) if r.get("end") is not None else "-" if r["how"] == "running" else "unknown"
        secs = r["end"] - r["start"] if r.get("end") is not None else None
        reset = any(g.get("reset") for g in (r.get("energy") or {}).values())
        energy = kwh(r.get("energy_mj")) + (" (driver reloaded: at least)" if reset else "")
        time_text = _duration(secs) if secs is not None else "-"
        start = _when(r["start"])
        out.append(f"  {r['restart']:<8} {start:<12} {end:<12} {time_text:<8} {r['how']:<10} {energy}")
        if r.get("preempted_by"):
            out.append(f"    preempted: {sanitize(r['preempted_by'])}")
    return out


def _when(wall: float) -> str:
    """A run's start or end, local time (`11-24 13:19`; the whole date: --json)."""
    return time.strftime("%m-%d %H:%M", time.localtime(wall))


def _processes(procs: List[dict]) -> List[str]:
    out = []
    for p in procs:
        mem = f"{p['used_memory_mib']} MiB" if p.get("used_memory_mib") is not None else "? MiB"
        util = f"{p['utilization_pct']}%" if p.get("utilization_pct") is not None else "?%"
        out.append(f"  GPU {p['gpu_index']}: {sanitize(p['name'])}[{p['pid']}] {mem} {util}")
    return ["  Processes on its GPUs:", *out] if out else []


def _gpus(indices: List[object], uuids: List[str]) -> str:
    return ", ".join(
        f"{i} ({u})" if i is not None else u for i, u in zip(indices or [None] * len(uuids), uuids)
    )


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    return f"{s / 3600:.1f} h"
