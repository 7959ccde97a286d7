"""The daemon's state file: written atomically each round, read by `gpu-mon status`."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Optional

from gpu_mon.api import procfs


def write(path: str, doc: dict) -> None:
    """Replace the file atomically (temp file in the same directory, then rename); world-readable."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o755, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".state.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, separators=(",", ":"))
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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
