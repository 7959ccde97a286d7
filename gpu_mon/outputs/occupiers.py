"""This occupier's record in the host-wide registry that `gpu-mon status` and `occupy status --all` read
(api/occupiers.py says why a record cannot be forged). A round listener: it writes the record when the
phase or the GPUs held change, and again every hour so that a cleaner of old files in /tmp never takes it,
and removes it when the occupier stops."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import time
from typing import List, Optional

from gpu_mon import safefile
from gpu_mon.api import occupiers
from gpu_mon.outputs.phase import next_phase
from gpu_mon.policy.report import RoundReport

log = logging.getLogger("gpu_mon")
_REFRESH_SECONDS = 3600.0


def ensure_registry(directory: str) -> None:
    """The registry directory, trusted (api/occupiers.registry_problem) and world-writable and sticky; root
    makes it when it is missing. OSError, saying why, when it cannot be used: a plain user never makes it
    (whoever makes it owns it, and could remove every other user's record)."""
    if os.geteuid() == 0:
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
    problem = occupiers.registry_problem(directory)
    if problem:
        raise OSError(f"{problem}; not written there")
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        raise OSError(
            f"{directory} does not exist (root makes it: systemd-tmpfiles --create, with the gpu-mon package)"
        ) from None
    if os.geteuid() == 0 and stat.S_IMODE(st.st_mode) != 0o1777:
        os.chmod(directory, 0o1777)
    elif not st.st_mode & stat.S_ISVTX:
        raise OSError(f"{directory}: not sticky (chmod 1777 {directory})")


class PublicRecord:
    """`base` is what does not change: pid, start_ticks, started_wall, gpus_asked, gpu_count, polite..."""

    def __init__(self, directory: str, base: dict, polite: bool):
        self.directory, self.base, self.polite = directory, base, polite
        self.path = os.path.join(directory, occupiers.record_name(os.getuid(), os.getpid()))
        self.phase, self.occupied = "waiting", False
        self.gpus: List[str] = []
        self.since, self.written = 0.0, 0.0
        self.live = False

    def register(self, wall: float) -> None:
        """Write the first record (and remove this user's records of occupiers that are gone)."""
        try:
            ensure_registry(self.directory)
            for path in occupiers.stale_records(self.directory, os.getuid()):
                with contextlib.suppress(OSError):
                    os.unlink(path)
            self.live = True
            self.since = wall
            self._write(wall)
        except OSError as err:
            self._not_listed(err)

    def on_round(self, report: RoundReport) -> None:
        """Rewrite the record when what it says changed, or when it is an hour old."""
        if self.base.get("gpu_count") is None and not report.snapshot.reading.error:
            self.base["gpu_count"] = len(report.snapshot.reading.gpus)  # every GPU
        if not self.live:
            return
        phase, self.occupied = next_phase(report, self.polite, self.occupied)
        gpus = sorted({u for w in report.workloads if not w.get("stopping") for u in w.get("gpus", [])})
        if (phase, gpus) != (self.phase, self.gpus):
            self.phase, self.gpus, self.since = phase, gpus, report.wall
        elif report.wall - self.written < _REFRESH_SECONDS:
            return
        try:
            ensure_registry(self.directory)
            self._write(report.wall)
        except OSError as err:
            self._not_listed(err)

    def _not_listed(self, err: OSError) -> None:
        """Said once: the record is not written again."""
        self.live = False
        log.warning("occupy: not listed for other users (%s)", err.strerror or err)

    def on_event(self, event: str) -> None:
        """Registered when ready; gone with the occupier."""
        if event == "ready" and not self.written:
            self.register(time.time())
        elif event == "stopped":
            self.remove()

    def deadline(self) -> Optional[float]:
        """No watchdog."""
        return None

    def remove(self) -> None:
        """Take the record away (also after a crash)."""
        self.live = False
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def _write(self, wall: float) -> None:
        doc = {
            **self.base,
            "uid": os.getuid(),
            "pid": os.getpid(),
            "phase": self.phase,
            "since_wall": round(self.since, 3),
            "gpus": self.gpus,
        }
        safefile.replace(self.path, (json.dumps(doc) + "\n").encode("utf-8"), 0o644)
        self.written = wall
