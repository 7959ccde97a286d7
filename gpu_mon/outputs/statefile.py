"""The daemon's state file: what `gpu-mon status` shows, written atomically by a round listener, only when
what it shows changed (its times are absolute, so it never goes stale; rewriting it every round was a third
of an idle poll's cost at 1000 processes)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Optional

from gpu_mon import safefile
from gpu_mon.api import procfs
from gpu_mon.outputs import status
from gpu_mon.policy.report import RoundReport

log = logging.getLogger("gpu_mon")


def write(path: str, doc: dict) -> None:
    """Replace the file atomically (safefile.replace); world-readable."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    safefile.replace(path, (json.dumps(doc, separators=(",", ":")) + "\n").encode("utf-8"))


def read_live(path: str) -> Optional[dict]:
    """The state of a running daemon, or None (no file, unreadable, or the daemon that wrote it is gone)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("daemon"), dict):
        return None
    pid, start = doc["daemon"].get("pid"), doc["daemon"].get("start_ticks")
    if not isinstance(pid, int) or not isinstance(start, int):
        return None
    st = procfs.read_stat(pid)
    if st is None or st.start_ticks != start or st.state == "Z":
        return None  # stale: that daemon died (or its pid now names another process)
    return doc


def remove(path: str) -> None:
    """Remove the state file on a clean exit (status then takes its own look)."""
    with contextlib.suppress(OSError):
        os.unlink(path)


class StateFile:
    """Round listener: keeps the state file up to date; removes it when the daemon stops."""

    def __init__(self, path: str):
        self.path = path
        self.published: Optional[dict] = None
        self.error_logged = False

    def on_round(self, report: RoundReport) -> None:
        """Rewrite the file if what it shows changed."""
        doc = status.from_report(report)
        content = {k: v for k, v in doc.items() if k != "updated_wall"}
        if content == self.published:
            return
        self.published = content
        try:
            write(self.path, doc)
            self.error_logged = False
        except OSError as err:
            self.published = None
            if not self.error_logged:
                self.error_logged = True
                log.warning(
                    "cannot write the state file %s: %s (gpu-mon status will not see the daemon)",
                    self.path,
                    err.strerror or err,
                )

    def on_event(self, event: str) -> None:
        """`stopped`: remove the file."""
        if event == "stopped":
            remove(self.path)

    def deadline(self) -> Optional[float]:
        """No timer."""
        return None
