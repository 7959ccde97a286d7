"""A run's record as the table: plain text for the terminal, Markdown for docs/measured.md, JSON as recorded.

Every verdict is judged again from the recorded figures, so the same record always renders the same table
and a recorded run can be rendered again later (`--from-json`)."""

from __future__ import annotations

import json
import textwrap
from typing import Any, Dict, List, Tuple

from proof import openers
from proof.checks import CHECKS, FAILED, Judged, by_name

HEADERS = ("check", "the docs claim", "measured", "verdict")
WIDTHS = (16, 44, 56, 7)


def judged(entry: Dict[str, Any]) -> Judged:
    """The verdict and measured text of one recorded check."""
    figures, why = entry.get("figures") or {}, entry.get("why")
    if not figures:
        return FAILED, why or "it wrote no figures"
    try:
        (check,) = by_name([entry["name"]])
    except (KeyError, ValueError):
        return FAILED, f"unknown check {entry.get('name')!r}"
    verdict, measured = check.judge(figures)
    return verdict, f"{measured}; {why}" if why else measured


def rows(record: Dict[str, Any]) -> List[Tuple[str, str, str, str]]:
    """One row per recorded check: name, claim, measured, verdict."""
    claims = {c.name: c.claim for c in CHECKS}
    out = []
    for entry in record.get("checks", []):
        verdict, measured = judged(entry)
        claim = entry.get("claim") or claims.get(entry.get("name", ""), "")
        out.append((str(entry.get("name")), claim, measured, verdict))
    return out


def header_lines(record: Dict[str, Any]) -> List[str]:
    """What ran where, and when."""
    host = record.get("host") or {}
    lines = [f"GPU {g}" for g in host.get("gpus", [])]
    lines.append(
        f"driver {host.get('driver')}, CUDA {host.get('cuda')}, torch {host.get('torch')}, "
        f"kernel {host.get('kernel')}"
    )
    mode = "--quick" if record.get("quick") else "full"
    took = f", {record['seconds']:.0f} s" if "seconds" in record else ""
    lines.append(f"{mode} run started {record.get('started')}{took}")
    if record.get("ignored_openers"):
        lines.append(f"the handoff checks' daemon ignored these openers: {record['ignored_openers']}")
    if record.get("synthetic"):
        lines.insert(0, f"SYNTHETIC DATA, NOT A MEASUREMENT: {record['synthetic']}")
    return lines


def footer_lines(record: Dict[str, Any]) -> List[str]:
    """Other openers of the GPU during each check (not the check's own), what was left running or on the
    GPU after the run."""
    lines = []
    for entry in record.get("checks", []):
        seen = openers.words((entry.get("figures") or {}).get("foreign_openers") or ())
        if seen:
            lines.append(f"{entry['name']}: foreign openers made the daemon stop the workload: {seen}")
    for entry in record.get("checks", []):
        for left in entry.get("left", []):
            lines.append(f"{entry['name']} left a process running (ended by the proof): {left}")
    on_gpu = record.get("left_on_gpu")
    if on_gpu is None:
        lines.append("GPU after the run: not checked")
    elif not on_gpu:
        lines.append("GPU after the run: no process that was not there before (NVML)")
    for p in on_gpu or []:
        if "error" in p:
            lines.append(f"GPU after the run: {p['error']}")
            continue
        whose = "ours, killed" if p.get("ours") else "not ours"
        lines.append(f"GPU after the run: pid {p['pid']} {p.get('name')} holds {p['mib']} MiB ({whose})")
    return lines


def text(record: Dict[str, Any]) -> str:
    """The terminal table, long cells wrapped."""
    table = [HEADERS, *rows(record)]
    lines = [*header_lines(record), ""]
    for index, row in enumerate(table):
        cells = [textwrap.wrap(cell, width) or [""] for cell, width in zip(row, WIDTHS)]
        for depth in range(max(len(c) for c in cells)):
            parts = [(c[depth] if depth < len(c) else "").ljust(w) for c, w in zip(cells, WIDTHS)]
            lines.append("  ".join(parts).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in WIDTHS))
    return "\n".join([*lines, "", *footer_lines(record)]) + "\n"


def markdown(record: Dict[str, Any]) -> str:
    """The same as a Markdown table, for docs/measured.md."""

    def cell(value: str) -> str:
        return value.replace("|", "\\|").replace("\n", " ")

    lines = [f"{line}  " for line in header_lines(record)] + [""]
    lines.append("| " + " | ".join(HEADERS) + " |")
    lines.append("|" + "---|" * len(HEADERS))
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows(record)]
    lines += [""] + [f"- {line}" for line in footer_lines(record)]
    return "\n".join(lines) + "\n"


def as_json(record: Dict[str, Any]) -> str:
    """The record, with each check's verdict and measured text as rendered now."""
    checks = []
    for entry in record.get("checks", []):
        verdict, measured = judged(entry)
        checks.append({**entry, "verdict": verdict, "measured": measured})
    return json.dumps({**record, "checks": checks}, indent=1, default=str) + "\n"


FORMATS = {"text": text, "markdown": markdown, "json": as_json}
