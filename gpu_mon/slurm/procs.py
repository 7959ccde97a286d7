"""Which process belongs to which Slurm job, from /proc only (no call to Slurm).

A job's cgroup names it where Slurm contains jobs in cgroups (`.../job_42/step_0`, v1 and v2). Elsewhere
(proctrack/linuxproc) a job's processes descend from a root-owned `slurmstepd`, whose command line names
the job (`slurmstepd: [42.batch]`); when it does not, the job id is the `SLURM_JOB_ID` in the process's
environment. The answer is cached per process (pid and start time), so a round costs one read per new
process at most.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple

from gpu_mon.api.procfs import PROC, read_stat

_CGROUP_JOB = re.compile(r"/job_(\d+)(?:/|$)")
_STEPD_JOB = re.compile(rb"^slurmstepd: \[(\d+)[.\]]")
_MAX_ENVIRON = 1 << 20


@dataclass(frozen=True)
class Member:
    """A process of a Slurm job."""

    job: int
    node: str = ""  # SLURMD_NODENAME from its environment: this node as Slurm names it ("" unknown)
    how: str = "cgroup"  # "cgroup" or "slurmstepd"


def job_of_cgroup(text: str) -> Optional[int]:
    """The job named by a /proc/PID/cgroup text (any hierarchy), or None."""
    for line in text.splitlines():
        m = _CGROUP_JOB.search(line.partition(":")[2].partition(":")[2])
        if m:
            return int(m.group(1))
    return None


def _read(path: str, limit: int = 65536) -> Optional[bytes]:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


def read_environ(pid: int, names: Iterable[str], proc: str = PROC) -> Dict[str, str]:
    """These variables of a process's environment (those it has); {} when it cannot be read."""
    raw = _read(f"{proc}/{pid}/environ", _MAX_ENVIRON) or b""
    wanted = {n.encode() for n in names}
    out: Dict[str, str] = {}
    for item in raw.split(b"\0"):
        name, eq, value = item.partition(b"=")
        if eq and name in wanted:
            out[name.decode()] = value.decode(errors="replace")
    return out


def _stepd_job(pid: int, proc: str) -> Tuple[bool, Optional[int]]:
    """(whether pid is a root-owned slurmstepd, the job its command line names)."""
    st = read_stat(pid, proc)
    if st is None or st.comm != "slurmstepd":
        return False, None
    try:
        if os.stat(f"{proc}/{pid}").st_uid != 0:
            return False, None
    except OSError:
        return False, None
    m = _STEPD_JOB.match(_read(f"{proc}/{pid}/cmdline") or b"")
    return True, int(m.group(1)) if m else None


def _int(text: str) -> Optional[int]:
    return int(text) if text.isdigit() and len(text) < 19 else None


class JobMembers:
    """Slurm job membership of processes, cached per (pid, start ticks)."""

    def __init__(self, proc: str = PROC, depth: int = 64) -> None:
        self.proc, self.depth = proc, depth
        self.cache: Dict[Tuple[int, int], Optional[Member]] = {}
        self.clean: Set[Tuple[int, int]] = set()  # processes with no slurmstepd among their ancestors

    def of(self, pid: int, start_ticks: int) -> Optional[Member]:
        """The job this process belongs to, or None (not a job's, or gone)."""
        key = (pid, start_ticks)
        if key not in self.cache:
            self.cache[key] = self._find(pid)
        return self.cache[key]

    def keep_only(self, live: Iterable[Tuple[int, int]]) -> None:
        """Forget processes not in `live` (call with the holders of a round, now and then)."""
        keep = set(live)
        self.cache = {k: v for k, v in self.cache.items() if k in keep}

    def _find(self, pid: int) -> Optional[Member]:
        text = _read(f"{self.proc}/{pid}/cgroup")
        job = job_of_cgroup(text.decode(errors="replace")) if text else None
        how = "cgroup"
        if job is None:
            job, how = self._by_ancestry(pid), "slurmstepd"
        if job is None:
            return None
        env = read_environ(pid, ("SLURMD_NODENAME",), self.proc)
        return Member(job=job, node=env.get("SLURMD_NODENAME", ""), how=how)

    def _by_ancestry(self, pid: int) -> Optional[int]:
        """One read of /proc/PID/stat per ancestor, up to the first slurmstepd, or to an ancestor already
        known to have none above it (most of a round's new processes share their ancestors)."""
        walked: List[Tuple[int, int]] = []
        p = pid
        for _ in range(self.depth):
            st = read_stat(p, self.proc)
            if st is None or (st.pid, st.start_ticks) in self.clean:
                break
            if st.comm == "slurmstepd":
                is_stepd, job = _stepd_job(p, self.proc)
                if is_stepd:
                    if job is not None:
                        return job
                    env = read_environ(pid, ("SLURM_JOB_ID",), self.proc)
                    return _int(env.get("SLURM_JOB_ID", ""))
            walked.append((st.pid, st.start_ticks))
            if st.ppid <= 1:
                break
            p = st.ppid
        if len(self.clean) > 100_000:
            self.clean.clear()
        self.clean.update(walked)
        return None
