"""What Slurm says about a job: `scontrol show job -d -o ID`, one line of `Key=Value` words, parsed into
the few fields gpu-mon uses. Pure (the call itself is control.py's)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_:/.]*$")
_USER = re.compile(r"^(.*)\((\d+)\)$")
NULL = "(null)"


@dataclass(frozen=True)
class JobInfo:
    """One Slurm job as scontrol shows it."""

    job: int
    user: str = "?"
    uid: Optional[int] = None
    partition: str = ""
    qos: str = ""
    state: str = ""
    exc_nodes: str = ""  # ExcNodeList as the user set it ("" none)
    restarts: int = 0
    gres: str = ""  # the GPUs Slurm allocated on its nodes, e.g. "gpu:1(IDX:0)"
    nodes: str = ""


@dataclass(frozen=True)
class Preemptible:
    """Whose jobs yield: [slurm] preemptible_partitions and preemptible_qos."""

    partitions: Tuple[str, ...] = ()
    qos: Tuple[str, ...] = ()

    def __call__(self, info: JobInfo) -> bool:
        """Whether this job is preemptible (its partition, or its QOS, is named)."""
        parts = [p for p in info.partition.split(",") if p]  # a pending job may list several
        return any(p in self.partitions for p in parts) or (bool(info.qos) and info.qos in self.qos)


def fields(line: str) -> Dict[str, str]:
    """`A=1 B=x y C=` -> {"A": "1", "B": "x y", "C": ""}: a word without `=` continues the last value;
    the first of a repeated key wins (the -d detail repeats Nodes=)."""
    out: Dict[str, str] = {}
    last = ""
    for word in line.split():
        key, eq, value = word.partition("=")
        if eq and _KEY.match(key):
            last = key if key not in out else ""
            if last:
                out[key] = value
        elif last:
            out[last] += " " + word
    return out


def _value(f: Dict[str, str], key: str) -> str:
    v = f.get(key, "")
    return "" if v in (NULL, "N/A") else v


def parse_job(text: str) -> Optional[JobInfo]:
    """The first job in `scontrol show job -d -o` output, or None when there is none."""
    for line in text.splitlines():
        f = fields(line)
        if not f.get("JobId", "").isdigit():
            continue
        m = _USER.match(f.get("UserId", ""))
        restarts = f.get("Restarts", "0")
        return JobInfo(
            job=int(f["JobId"]),
            user=m.group(1) if m else f.get("UserId", "?") or "?",
            uid=int(m.group(2)) if m else None,
            partition=_value(f, "Partition"),
            qos=_value(f, "QOS"),
            state=_value(f, "JobState"),
            exc_nodes=_value(f, "ExcNodeList"),
            restarts=int(restarts) if restarts.isdigit() else 0,
            gres=_value(f, "GRES"),
            nodes=_value(f, "NodeList"),
        )
    return None
