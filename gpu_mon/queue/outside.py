"""What gpu-mon runs as a job's user outside its own sandbox, where jobs are transient units (transient.py):
a job's hook (`--notify`) and the lines gpu-mon writes into a job's log (preempted, cancelled, stopping).

Under the shipped gpu-mon.service the daemon cannot do either itself: its home directories are read-only
(ProtectHome=read-only), its /tmp is its own (PrivateTmp=yes), and its root has no CAP_DAC_OVERRIDE, so it
may not open a user's 0600 log at all. The job ran outside the sandbox, as its user; so do these, each as a
short transient unit of that user in gpu_mon_jobs.slice (`gpu-mon-hook-17-…`, `gpu-mon-note-17-…`), ended by
systemd after RuntimeMaxSec= if nobody else ends it. Neither is waited for: the loop never blocks on
systemd (the `systemd-run` client is a child that the loop polls).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import subprocess
import time
from typing import Dict, List, Tuple

from gpu_mon.api.text import sanitize
from gpu_mon.engine.workloads import transient
from gpu_mon.engine.workloads.transient import Unit
from gpu_mon.queue import jobs as J
from gpu_mon.queue.jobs import Job
from gpu_mon.queue.requests import output_of

log = logging.getLogger("gpu_mon")

NOTE_SECONDS = 10  # a line into a log (a hung NFS home: systemd ends the writer)
FILE_SECONDS = 120.0  # a hook's environment file is removed this long after (its unit is long gone)
# As the user: append $2 (one line) to $1, only a regular file (never a FIFO or device, nor through a link
# in any component of its path: each is looked at in turn), after a newline when the file ends in a partial
# line. (As the user, a link swapped in after the look reaches only what the user may write.)
NOTE_SCRIPT = (
    "case $1 in /*) ;; *) exit 0;; esac; d=; IFS=/; set -f; "
    'for c in $1; do [ -n "$c" ] || continue; d=$d/$c; [ -L "$d" ] && exit 0; done; unset IFS; set +f; '
    '[ -f "$1" ] || exit 0; '
    '{ [ -n "$(tail -c 1 -- "$1")" ] && echo; printf "%s\\n" "$2"; } >>"$1"'
)


class UserUnits:
    """Hooks and log lines as transient units of the job's user; `keep`: the supervisor's helpers (its
    children that it must neither reap nor sweep)."""

    def __init__(self, keep: Dict[int, subprocess.Popen], directory: str) -> None:
        self.keep = keep
        self.directory = directory  # root's: the hooks' environment files (never on a command line)
        self.files: Dict[str, float] = {}  # environment file -> when it was written (monotonic)
        self.seq = itertools.count()
        self.clients: List[subprocess.Popen] = []  # the notes' clients, reaped by poll()

    def _argv(
        self, kind: str, job: Job, argv: List[str], env: Dict[str, str], seconds: float
    ) -> Tuple[List[str], Unit]:
        """The client's command line, and the unit it starts (its name unique to this daemon). OSError
        when its environment cannot be written."""
        name = f"gpu-mon-{kind}-{job.id}-{os.getpid()}-{next(self.seq)}.service"
        kept, dropped = transient.environment(env)
        if dropped:
            log.debug(
                "queue: job %s: not passed to its %s (systemd refuses them): %s", J.ref(job), kind, dropped
            )
        env_path = transient.env_file(self.directory, name, kept) if kept else None
        if env_path:
            self.files[env_path] = time.monotonic()
        what = f"gpu-mon: job {J.ref(job)}'s {kind}"  # (SIGTERM, 2 s, SIGKILL when systemd ends it)
        out = transient.command(
            *(name, what, tuple(argv), env_path, job.uid, job.gid, signal.SIGTERM, 1.0, None),
            runtime_max=seconds,
        )
        return out, Unit(name, transient.unit_group(name))

    def hook(
        self, job: Job, argv: List[str], env: Dict[str, str], seconds: float
    ) -> Tuple[subprocess.Popen, Unit]:
        """Start a hook (hooks.py's `launch`): its client, and its unit (what ends every process of the
        hook: `signal`, `kill`). systemd ends the unit when the hook's main process exits (KillMode=
        control-group: SIGTERM to what is left in it, SIGKILL 2 s later), and after `seconds` in any case.
        OSError when it cannot be started."""
        out, unit = self._argv("hook", job, argv, env, seconds)
        return self._client(out), unit

    @staticmethod
    def _client(argv: List[str]) -> subprocess.Popen:
        """The `systemd-run --wait` client, in a group of its own, as root."""
        return transient.client(argv)

    def note(self, job: Job, text: str) -> bool:
        """Append `text` to the job's log as its user (started, not waited for: whether it could be)."""
        self.poll()
        path = output_of(job)
        writer = ["/bin/sh", "-c", NOTE_SCRIPT, "gpu-mon-note", path, sanitize(text, limit=1000)]
        try:
            argv, _unit = self._argv("note", job, writer, {}, NOTE_SECONDS)
            client = self._client(argv)
        except OSError as err:
            log.debug("queue: job %s: no line written into %s: %s", J.ref(job), sanitize(path), err)
            return False
        self.keep[client.pid] = client
        self.clients.append(client)
        return True

    def poll(self) -> None:
        """Reap the notes' clients that ended; remove the hooks' old environment files."""
        now = time.monotonic()
        for path in [p for p, at in self.files.items() if now - at > FILE_SECONDS]:
            self._remove(path)
        still = []
        for c in self.clients:
            if c.poll() is None:
                still.append(c)
            else:
                self.keep.pop(c.pid, None)
        self.clients = still

    def close(self, wait: float = 2.0) -> None:
        """gpu-mon stops: give the notes' clients `wait` seconds in all (a stop's lines), then end those
        left (their units end by themselves); every one reaped."""
        deadline = time.monotonic() + wait
        for c in self.clients:
            try:
                c.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(c.pid, signal.SIGKILL)
                c.wait()
        self.poll()
        for path in list(self.files):
            self._remove(path)

    def _remove(self, path: str) -> None:
        del self.files[path]
        with contextlib.suppress(OSError):
            os.unlink(path)
