"""`gpu-mon report`: what the history says (GPU-hours harvested, preemptions, yield latency, idle holders),
as a table, JSON or a plot. Reads the [history] file read-only: works while the daemon writes, as any user
allowed to read it."""

from __future__ import annotations

import argparse
import datetime
import json
import re
import time
from typing import List

from gpu_mon.api import historydb, summary
from gpu_mon.api.text import sanitize
from gpu_mon.commands import base
from gpu_mon.config import HistorySection
from gpu_mon.policy.words import duration

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)\s*([mhdw])$")
_UNIT_SECONDS = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """--since, --until, --by, --json, --plot."""
    p.add_argument(
        "--since", default="7d", metavar="WHEN", help="7d, 12h, 2026-11-01 or 2026-11-01T08:00 (7d)"
    )
    p.add_argument("--until", default=None, metavar="WHEN", help="the same forms (default: now)")
    p.add_argument(
        "--by",
        choices=("gpu", "day", "process", "user", "job"),
        default="gpu",
        help="a row per GPU (the default), per day, per [process-*] section, per user or per queued job",
    )
    p.add_argument("--json", action="store_true", help="everything, machine-readable")
    p.add_argument(
        "--plot", metavar="FILE", help="a timeline per GPU over bars of harvested GPU-hours (.png/.svg)"
    )


def parse_when(text: str, now: float, what: str) -> float:
    """7d (ago), 12h, 30m, 2w, or an ISO date/time (local time unless it says otherwise)."""
    m = _RELATIVE.match(text.strip())
    if m:
        return now - float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
    try:
        when = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise base.CliError(
            f"report: {what} {text!r}: use 7d, 12h, 30m, 2w or a date like 2026-11-01"
        ) from None
    return when.timestamp()


def cmd_report(args: argparse.Namespace) -> int:
    """Print (or plot) the report; exit 1 when there is no history yet."""
    config = base.load_config(args, required=False)
    path = (config.history if config else HistorySection()).path
    now = time.time()
    since = parse_when(args.since, now, "--since")
    until = parse_when(args.until, now, "--until") if args.until else now
    if until <= since:
        raise base.CliError("report: --until must be after --since")
    try:
        conn = historydb.connect_ro(path)
    except FileNotFoundError:
        raise base.CliError(
            f"report: no history yet: {path} does not exist (the daemon writes it)", 1
        ) from None
    except (historydb.NotOurs, historydb.Error, OSError) as err:
        raise base.CliError(f"report: {path}: {err}", 1) from None
    with conn:
        if historydb.extent(conn) is None:
            raise base.CliError(f"report: no history yet in {path}", 1)
        doc = summary.summarize(conn, since, until)
        if args.plot:
            from gpu_mon.commands import plot

            plot.draw(conn, doc, since, until, args.plot)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print("\n".join(render(doc, args.by)))
    if args.plot:
        print(f"plot written to {args.plot}")
    return base.EXIT_OK


def _in(unit: float):
    return lambda seconds: f"{seconds / unit:.1f}"


def _table(headers: List[str], rows: List[List[str]]) -> List[str]:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [headers, *rows]]


def render(doc: dict, by: str) -> List[str]:
    """The report as text: a header and the table `by` asks for (GPU-hours; GPU-minutes for up to 6
    hours). The per-GPU and the per-day tables have the same columns and the same total."""
    span = datetime.datetime.fromisoformat(doc["until"]) - datetime.datetime.fromisoformat(doc["since"])
    minutes = span.total_seconds() <= 6 * 3600
    unit = "GPU-minutes" if minutes else "GPU-hours"
    _hours = _in(60.0 if minutes else 3600.0)
    lines = [f"gpu-mon report: {doc['since']} to {doc['until']} ({unit})", ""]
    if by in ("gpu", "day"):
        return lines + _state_table(doc, by, _hours) + ["", _unknown_note(doc["total"], _hours)]
    if by == "process":
        rows = [[p["name"], str(p["runs"]), _hours(p["gpu_seconds"])] for p in doc["processes"]]
        return lines + _table(["process", "runs", "GPU time"], rows)
    if by == "job":
        return lines + _job_table(doc, _hours)
    rows = [
        [
            u["user"],
            _hours(u["gpu_seconds"]),
            _hours(u["idle_holder_seconds"]),
            str(u.get("jobs", 0)),
            _hours(u.get("job_gpu_seconds", 0.0)),
            str(u.get("job_preemptions", 0)),
            duration(u.get("job_wait_seconds", 0.0)),
            _kwh(u.get("job_energy_kwh", 0.0), u.get("job_energy_runs_unknown", 0)),
        ]
        for u in doc["users"]
    ]
    heads = ["user", "GPU time", "as an idle holder", "jobs", "job GPU time", "preemptions", "waited", "kWh"]
    return lines + _table(heads, rows)


def _job_table(doc: dict, _hours) -> List[str]:
    """A row per queued job: its runs, GPU time, preemptions, time waited before its starts, last end, and
    why each preemption was (who took the GPU)."""
    rows = [
        [
            str(j["job"]),
            sanitize(j["user"]),
            sanitize(j["name"]),
            str(j["runs"]),
            _hours(j["gpu_seconds"]),
            str(j["preemptions"]),
            duration(j["wait_seconds"]),
            j["last"],
            _kwh(j.get("energy_kwh", 0.0), j.get("energy_runs_unknown", 0)),
            "; ".join(sanitize(why) for why in j.get("preempted_by", ())),
        ]
        for j in doc.get("jobs", [])
    ]
    heads = ["job", "user", "name", "runs", "GPU time", "preemptions", "waited", "last run", "kWh"]
    heads.append("preempted by")
    return _table(heads, rows) if rows else [*_table(heads, []), "(no queued job ran in this period)"]


def _kwh(kwh: float, unknown: int) -> str:
    """The energy of the runs that ended in the period, `+?` when some of them have no figure (their
    GPUs report neither NVML's energy counter nor power), `-` when none has one."""
    if unknown and not kwh:
        return "-"
    return f"{kwh:.3g}" + ("+?" if unknown else "")


def _state_table(doc: dict, by: str, _hours) -> List[str]:
    """A row per GPU (with its yield latency) or per day, and a total row when there is more than one."""

    def cells(row: dict) -> List[str]:
        return [*(_hours(row[f"{c}_seconds"]) for c in summary.COLUMNS), str(row["preemptions"])]

    if by == "gpu":
        rows = [[f"{g['index']} {g['uuid']}", *cells(g), _yield(g)] for g in doc["gpus"]]
        total = ["all GPUs", *cells(doc["total"]), _yield(doc["total"])]
        heads = ["GPU", *summary.COLUMNS, "preemptions", "yield ms p50/p99"]
    else:
        rows = [[d["day"], *cells(d)] for d in doc["days"]]
        total = ["total", *cells(doc["total"])]
        heads = ["day", *summary.COLUMNS, "preemptions"]
    return _table(heads, [*rows, total] if len(rows) > 1 else rows)


def _yield(row: dict) -> str:
    return "-" if row["yield_ms_p50"] is None else f"{row['yield_ms_p50']:.0f} / {row['yield_ms_p99']:.0f}"


def _unknown_note(total: dict, _hours) -> str:
    """What unknown is made of, in the table's unit (the two parts add up to the unknown shown)."""
    unknown, missing = _hours(total["unknown_seconds"]), _hours(total["not_recorded_seconds"])
    unread = f"{float(unknown) - float(missing):.1f}"
    return f"unknown: {unread} the GPU could not be read, {missing} not recorded (no daemon was running)"
