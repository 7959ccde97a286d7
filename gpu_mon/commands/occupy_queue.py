"""The daemon's queue as `gpu-mon occupy` sees it: a GPU that runs a queue job (anyone's, the user's own too)
is not free to an occupier, even while the job does not touch it yet. The occupier reads the running jobs
from the daemon's state file (world-readable, rewritten whenever they change) every round.

Fail closed, but a missing daemon is no evidence of a job: no lock file beside the state file, or nobody
holding it, means no daemon and so no queue. A daemon that runs (holds the lock) but whose state cannot be
read (permission denied, not written yet, damaged, or not this daemon's) leaves its jobs unknown: every GPU
then counts as busy, and the occupier's status says why.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from typing import List, Optional, Tuple

from gpu_mon.api.model import QueueJob, Snapshot
from gpu_mon.commands import occupy_limits
from gpu_mon.config import Config, ConfigError, Defaults, load
from gpu_mon.engine import lock
from gpu_mon.engine.tiers import Tier

Found = Tuple[Tuple[QueueJob, ...], str]  # (running jobs, why they cannot be known: "" when they can)


def daemon_state_file(named: Optional[Config]) -> str:
    """Where the daemon publishes its state, as `gpu-mon status` finds it: the [defaults] state_file of the
    config named with --config, else of the system config, else the default."""
    if named is not None:
        return named.defaults.state_file
    path = occupy_limits.system_config_path()
    if os.path.lexists(path):
        try:
            return load(path, trusted_uid=0).defaults.state_file
        except ConfigError:
            pass  # `on` refuses such a file anyway (occupy_limits.load_limits)
    return Defaults().state_file


class QueueJobs(Tier):
    """The occupier's tier (engine/tiers.py): each round, the running jobs of the daemon's queue, from the
    daemon's state file (reparsed only when the file changed)."""

    def __init__(self, state_file: str):
        self.state_file = state_file
        self.seen: Optional[tuple] = None  # (inode, mtime, size) of the file last parsed
        self.parsed: Found = ((), "")

    def see(self, snap: Snapshot, quick: bool) -> Snapshot:
        jobs, unknown = self()
        return dataclasses.replace(snap, queue_jobs=jobs, queue_unknown=unknown)

    def __call__(self) -> Found:
        """(jobs, "") or ((), why they cannot be known)."""
        lock_file = lock.lock_path(self.state_file)
        try:
            os.stat(lock_file)
        except OSError as err:
            if err.errno in (errno.ENOENT, errno.ENOTDIR):
                return (), ""  # no daemon has run here
            return (), f"{lock_file}: {err.strerror}"
        holder = lock.holder(self.state_file)  # (a lock this user may not open: /proc/locks tells)
        if holder is None:
            return (), ""  # no daemon runs: nothing of its queue does either
        return self._read(holder)

    def _read(self, holder: int) -> Found:
        try:
            with open(self.state_file, "rb") as f:
                st = os.fstat(f.fileno())
                key = (st.st_ino, st.st_mtime_ns, st.st_size, holder)
                if key != self.seen:
                    self.parsed = _parse(self.state_file, f.read(), holder)
                    self.seen = key
        except OSError as err:
            self.seen = None
            if err.errno == errno.ENOENT:
                return (), f"the daemon (pid {holder}) has not written {self.state_file} yet"
            return (), f"{self.state_file}: {err.strerror}"
        return self.parsed


def _parse(path: str, data: bytes, holder: int) -> Found:
    """The running jobs a state file lists; a file that is not the live daemon's, or damaged, says why."""
    try:
        doc = json.loads(data)
    except ValueError:
        return (), f"{path}: not valid JSON"
    if not isinstance(doc, dict) or not isinstance(doc.get("daemon"), dict):
        return (), f"{path}: not a gpu-mon state file"
    if holder > 0 and doc["daemon"].get("pid") != holder:
        return (), f"{path}: written by another daemon than pid {holder} (not updated yet)"
    queue = doc.get("queue")
    if queue is None:
        return (), ""  # that daemon has no queue
    try:
        return tuple(_job(entry) for entry in queue["running"]), ""
    except (KeyError, TypeError, ValueError):
        return (), f"{path}: the queue's running jobs cannot be read"


def _job(entry: dict) -> QueueJob:
    """One entry of the state file's queue.running (ValueError when it is not one)."""
    gpus: List[str] = entry["gpus"]
    if not isinstance(entry["id"], int) or not all(isinstance(g, str) for g in gpus):
        raise ValueError(entry)
    return QueueJob(
        job=entry["id"], user=str(entry["user"]), name=str(entry.get("name") or ""), gpus=tuple(gpus)
    )
