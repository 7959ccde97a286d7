"""The lines gpu-mon writes into a job's own log, as Slurm writes into a job's: a stop, a preemption, a
requeue, a takeover after a restart, an end seen while gpu-mon was away. Here, where jobs are gpu-mon's
children, root writes them itself (`note`); where jobs are units of their own, a short unit of the job's
user does (outside.py), since the service's sandbox cannot reach users' homes."""

from __future__ import annotations

import logging
import os
import stat
import time

from gpu_mon import safefile
from gpu_mon.api.text import sanitize
from gpu_mon.policy import words
from gpu_mon.queue import jobs as J
from gpu_mon.queue.jobs import Job
from gpu_mon.queue.requests import output_of

log = logging.getLogger("gpu_mon")

CLOCK = "%H:%M:%S"  # the time in the lines written into a job's output


def at(wall: float) -> str:
    """A wall time as the lines say it."""
    return time.strftime(CLOCK, time.localtime(wall))


def stop_line(job: Job, wall: float) -> str:
    """The line a cancel or time limit writes into the job's output."""
    when = at(wall)
    if job.reason == J.STOP_CANCEL:
        by = f" by {job.stopped_by}" if job.stopped_by else ""
        return f"gpu-mon: job {J.ref(job)} cancelled at {when}{by}"
    if job.reason == J.STOP_TIMEOUT:
        limit = f" ({words.duration(job.time_limit)})" if job.time_limit else ""
        return f"gpu-mon: job {J.ref(job)} reached its time limit{limit} at {when}; stopping it"
    return f"gpu-mon: job {J.ref(job)} stopped at {when}: {job.reason}"


def note(job: Job, text: str) -> bool:
    """One line into the job's output, as Slurm writes into a job's: root writes it, so only into a regular
    file that the job's user owns and may write, never through a symbolic link at its end, and never by
    opening anything else (O_PATH first: a device or FIFO put there is not opened), nor through a link in
    any component (a directory swapped for one after the start). Whether it was written."""
    path = output_of(job)
    try:
        where = safefile.open_no_links(path, os.O_PATH)
    except ValueError as err:  # (a NUL or a lone surrogate in its --output: an older gpu-mon let it in)
        log.info("queue: job %s: no line written into %s: %s", J.ref(job), sanitize(path), err)
        return False
    except safefile.UnsafeFile as err:
        log.debug("queue: job %s: no line written: %s", J.ref(job), sanitize(str(err)))
        return False
    try:
        st = os.fstat(where)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != job.uid or not st.st_mode & stat.S_IWUSR:
            named = sanitize(path)
            log.info("queue: job %s: %s is not a file of its user: no line written", J.ref(job), named)
            return False
        # The inode just checked, opened again (not the path: it may have changed since)
        fd = os.open(f"/proc/self/fd/{where}", os.O_RDWR | os.O_APPEND | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as err:
        log.debug("queue: job %s: no line written into %s: %s", J.ref(job), sanitize(path), err.strerror)
        return False
    finally:
        os.close(where)
    try:
        size = os.fstat(fd).st_size
        apart = b"\n" if size and os.pread(fd, 1, size - 1) != b"\n" else b""  # (after a partial line)
        os.write(fd, apart + (sanitize(text, limit=1000) + "\n").encode("utf-8", "backslashreplace"))
        return True
    except OSError as err:
        log.debug("queue: job %s: no line written into %s: %s", J.ref(job), sanitize(path), err.strerror)
        return False
    finally:
        os.close(fd)
