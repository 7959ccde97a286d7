"""The client of a job's unit that a restarted gpu-mon found still running (queue/adopt.py): in place of the
`systemd-run --wait` that started it (gone with the earlier daemon), it waits for the unit's end as systemd
records it (its ExecStopPost=, ends.py), and says it as systemd-run would (`Main processes terminated with:
code=exited/status=3` on stderr), so that the leader and the supervisor see an adopted run end exactly as
one they started. A unit that is gone without a record (its end is not known) ends this with UNKNOWN and
nothing said: the run is lost, and goes back to the queue.

Run under the leader as root: `python -I -S -c ... END_FILE UNIT_GROUP`. Standard library only.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from gpu_mon.engine.workloads import ends

UNKNOWN = 75  # the unit is gone and nothing recorded its end
POLL_SECONDS = 0.2
GONE_GRACE_SECONDS = 2.0  # a record written as the group goes (ExecStopPost= runs in it) has time to land


def said(end: ends.End) -> str:
    """systemd-run's line for that end."""
    if end.signal:
        try:
            name = signal.Signals(end.signal).name[3:]
        except ValueError:
            name = str(end.signal)
        return f"Main processes terminated with: code=killed/status={name}"
    return f"Main processes terminated with: code=exited/status={end.code}"


def wait(end_file: str, group: str) -> int:
    """Until the record is there (0, said on stderr) or the unit is gone without one (UNKNOWN)."""
    gone_at = None
    while True:
        end = ends.read(end_file)
        if end is not None:
            os.write(2, (said(end) + "\n").encode("ascii"))
            return 0
        if not os.path.isdir(group):
            gone_at = gone_at if gone_at is not None else time.monotonic()
            if time.monotonic() - gone_at > GONE_GRACE_SECONDS:
                return UNKNOWN
        time.sleep(POLL_SECONDS)


def main() -> int:
    if len(sys.argv) != 3:
        return 2
    return wait(sys.argv[1], sys.argv[2])


if __name__ == "__main__":
    sys.exit(main())
