"""Who else opened the GPU during a check: the stops a daemon's log reports, told apart into the check's own
openers (the newcomers a benchmark starts) and foreign ones (a host's monitor opening the GPU every few
seconds, say through a second node path), and whether a handoff trial began too soon after such a stop to
be averaged in. Pure: log text and pids in, data out (bench/gpu_preempt.py reads the log; the judges and
the tables read what it wrote)."""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from typing import Any, Collection, Dict, Iterable, List, Optional, Tuple

# A trial that begins within this many seconds after a foreign stop (the workload may have just
# restarted, or may not hold its memory yet), or during which one comes, is not averaged in.
SETTLE_S = 5.0

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?) ")
# `alice python3[4242] holds /dev/nvidia0` or `alice python3[4242] has a compute context on it`
_WHO = re.compile(
    r"(?P<user>[^\s;:]+) (?P<name>[^;\[\]]+?)\[(?P<pid>\d+)\] (?:holds (?P<node>[^\s;]+)|has a )"
)
_STOPPING = re.compile(r"stopping (?P<workload>[^\s;]+)")


@dataclass(frozen=True)
class Opener:
    """A process a stop names as making the GPU busy."""

    user: str
    name: str
    pid: int
    node: Optional[str]  # the node path it holds, None when NVML listed it (a context)

    @property
    def label(self) -> str:
        """`root ld-linux-x86-64.so.2[2467] via /usr/local/nvidia/dev/nvidia0`."""
        return f"{self.user} {self.name}[{self.pid}]" + (f" via {self.node}" if self.node else "")


@dataclass(frozen=True)
class Stop:
    """One line of the daemon's log that stops a workload for a busy GPU."""

    time: float  # wall clock, seconds since the epoch (the log's local time)
    workload: str
    openers: Tuple[Opener, ...]


def _wall(stamp: str) -> Optional[float]:
    for fmt in ("%Y-%m-%d %H:%M:%S.%f", "%Y-%m-%d %H:%M:%S"):
        try:
            return datetime.datetime.strptime(stamp, fmt).timestamp()
        except ValueError:
            continue
    return None


def stops(log: str) -> List[Stop]:
    """Every stop for a busy GPU in a daemon's log (`TIME gpu-mon[PID] LEVEL ... busy: WHO ...; stopping
    W`), in order; lines without a time, or that say `stopping` before `busy:`, are not stops."""
    found = []
    for line in log.splitlines():
        stamp = _STAMP.match(line)
        busy = line.find(" busy: ")
        if stamp is None or busy < 0:
            continue
        stopping = _STOPPING.search(line, busy)
        when = _wall(stamp.group(1))
        if stopping is None or when is None:
            continue
        who = tuple(
            Opener(m["user"], m["name"].strip(), int(m["pid"]), m["node"])
            for m in _WHO.finditer(line, busy, stopping.start())
        )
        found.append(Stop(when, stopping["workload"], who))
    return found


def foreign(found: Iterable[Stop], own: Collection[int]) -> List[Stop]:
    """The stops that name at least one opener that is not one of `own` pids (the check's newcomers)."""
    return [s for s in found if any(o.pid not in own for o in s.openers)]


def disturbed(found: Iterable[Stop], own: Collection[int], start: float, end: float) -> Optional[str]:
    """Why a trial from `start` to `end` (wall clock) is not averaged in: a foreign stop within SETTLE_S
    before it began, or during it; None when there was none."""
    for s in foreign(found, own):
        if start - SETTLE_S <= s.time <= end:
            who = ", ".join(o.label for o in s.openers if o.pid not in own)
            when = f"{start - s.time:.1f} s before it began" if s.time < start else "during it"
            return f"{s.workload} was stopped for {who} {when}"
    return None


def summary(found: Iterable[Stop], own: Collection[int]) -> List[Dict[str, Any]]:
    """Per foreign opener (user, program, node): how many stops it caused and how many processes it was,
    most stops first."""
    by: Dict[Tuple[str, str, Optional[str]], Dict[str, Any]] = {}
    for s in foreign(found, own):
        for o in {(o.user, o.name, o.node): o for o in s.openers if o.pid not in own}.values():
            entry = by.setdefault((o.user, o.name, o.node), {"who": f"{o.user} {o.name}", "node": o.node})
            entry["stops"] = entry.get("stops", 0) + 1
            entry.setdefault("pids", set()).add(o.pid)
    out = [{**e, "pids": len(e["pids"])} for e in by.values()]
    return sorted(out, key=lambda e: (-e["stops"], e["who"]))


def words(openers: Iterable[Dict[str, Any]]) -> str:
    """`root ld-linux-x86-64.so.2 via /usr/local/nvidia/dev/nvidia0 (15 stops, 15 processes)`; '' if none."""
    parts = []
    for e in openers:
        node = f" via {e['node']}" if e.get("node") else ""
        parts.append(f"{e['who']}{node} ({e['stops']} stops, {e['pids']} processes)")
    return "; ".join(parts)
