"""Sections -> dataclasses: the sections that turn on a feature ([history], [metrics], [sentinel],
[occupy], [queue], [slurm]), with the checks that need more than one key. The keys are in the schema."""

from __future__ import annotations

import grp
from typing import Dict, List

from gpu_mon.config.model import (
    HistorySection,
    MetricsSection,
    OccupySection,
    QueueSection,
    SentinelSection,
    SlurmSection,
)
from gpu_mon.config.sections import Section, key_lines, user_names_warning


def history_section(sec: Section) -> HistorySection:
    """The [history] section."""
    values = sec.values("history")
    return HistorySection(**{k: v for k, (v, _) in values.items()})


def metrics_section(sec: Section) -> MetricsSection:
    """The [metrics] section."""
    values = sec.values("metrics")
    if not values and not sec.raw.items:
        sec.error(sec.raw.line, None, "empty: set textfile = PATH, listen = [ADDRESS:]PORT, or both")
    textfile = values.get("textfile", (None, 0))[0]
    if isinstance(textfile, str) and not textfile.endswith(".prom"):
        sec.error(values["textfile"][1], "textfile", f"{textfile!r}: node-exporter reads only *.prom files")
    return MetricsSection(line=sec.raw.line, **{k: v for k, (v, _) in values.items()})


def sentinel_section(sec: Section) -> SentinelSection:
    """The [sentinel] section."""
    values = sec.values("sentinel")
    fields = {k: v for k, (v, _) in values.items() if v is not None}
    found = SentinelSection(line=sec.raw.line, key_lines=key_lines(values), **fields)
    if found.kill_action == "command" and not found.command:
        sec.error(values["kill_action"][1], "command", "missing: kill_action = command needs command = CMD")
    elif found.command and found.kill_action != "command":
        sec.error(
            values["command"][1],
            "command",
            f"is only used with kill_action = command, not {found.kill_action}",
        )
    return found


def occupy_section(sec: Section, warn: List[str]) -> OccupySection:
    """The [occupy] section."""
    values = sec.values("occupy")
    _who_warnings(sec, values, "occupy", warn)
    return OccupySection(line=sec.raw.line, **{k: v for k, (v, _) in values.items()})


def _who_warnings(sec: Section, values: Dict[str, tuple], section: str, warn: List[str]) -> None:
    """`users` and `groups` of a section that limits who may use it: names unknown on this host."""
    if "users" in values:
        user_names_warning(values["users"][0], "users", sec, values["users"][1], warn)
    for name in values.get("groups", ((), 0))[0]:
        try:
            grp.getgrnam(name)
        except KeyError:
            where = sec.where(values["groups"][1], "groups")
            warn.append(f"{where}: [{section}] groups: no group {name!r} on this host")


def queue_section(sec: Section, warn: List[str]) -> QueueSection:
    """The [queue] section."""
    values = sec.values("queue")
    _who_warnings(sec, values, "queue", warn)
    queue = QueueSection(line=sec.raw.line, **{k: v for k, (v, _) in values.items()})
    if queue.grace_seconds > queue.max_grace_seconds:
        line = values.get("grace_seconds", values.get("max_grace_seconds", (0, sec.raw.line)))[1]
        sec.error(
            line,
            "grace_seconds",
            f"{queue.grace_seconds:g} is over max_grace_seconds ({queue.max_grace_seconds:g})",
        )
    longest, default = queue.max_time_limit, queue.default_time_limit
    if longest is not None and default is not None and default > longest:
        line = values.get("default_time_limit", (0, sec.raw.line))[1]
        sec.error(line, "default_time_limit", f"{default:g} s is over max_time_limit ({longest:g} s)")
    return queue


def slurm_section(sec: Section) -> SlurmSection:
    """The [slurm] section."""
    values = sec.values("slurm")
    slurm = SlurmSection(line=sec.raw.line, **{k: v for k, (v, _) in values.items()})
    if not slurm.preemptible_partitions and not slurm.preemptible_qos:
        sec.error(
            sec.raw.line, None, "name preemptible_partitions or preemptible_qos (whose jobs yield to others)"
        )
    return slurm
