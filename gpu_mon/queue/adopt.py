"""Finding jobs again after a restart: what a gpu-mon that starts does with the jobs an earlier one left
running (the store says RUNNING or STOPPING), and what it writes into their logs.

- A transient unit (`launcher = systemd`) outlives gpu-mon: one that still runs is taken over as it is (no
  signal, the same processes, the same restart count): a client that waits for its end (unitwait.py)
  runs under a leader in place of the old `systemd-run`, so it is stopped, timed and ended like any run.
  One that ended while gpu-mon was away has its end recorded by systemd (ends.py): its own exit status, or,
  where systemd stopped it (a shutdown, the guard of unguarded.py, an admin), back in the queue.
- A direct job is the leader's child: when the daemon died, its leader stopped it with its stop signal and
  grace (and wrote nothing: that end is not the job's own). While that leader lives the job is waited for
  (never two runs at once); then its end, if it ended on its own before, else back in the queue.
- Either way, a run whose end nobody recorded goes back to the queue (it runs again), and every such event
  leaves a line in the job's own log.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import time
from typing import Callable, Dict, List, Optional, Protocol, Set, Tuple

from gpu_mon.api.procfs import read_stat
from gpu_mon.api.text import sanitize
from gpu_mon.config import QueueSection
from gpu_mon.engine.workloads import ends, transient, unguarded
from gpu_mon.engine.workloads.stopping import StopRule
from gpu_mon.engine.workloads.supervisor import StartError, Supervisor, unit_launch
from gpu_mon.engine.workloads.transient import Unit
from gpu_mon.policy import words
from gpu_mon.policy.decisions import Instance
from gpu_mon.queue import jobs as J
from gpu_mon.queue.jobs import Job
from gpu_mon.queue.notes import at
from gpu_mon.queue.store import Store

log = logging.getLogger("gpu_mon")


class Queue(Protocol):
    """What of the daemon's queue (runner.py) finding jobs again uses."""

    store: Store
    supervisor: Supervisor
    q: QueueSection
    systemd: bool
    wall: Callable[[], float]
    note: Callable[[Job, str], bool]
    force_place: bool
    dirty: bool

    def end_path(self, job: Job) -> str: ...

    def unit_said(self, job: Job) -> str: ...


class Finder:
    """The jobs an earlier daemon left: taken over, waited for, or ended as their records say."""

    def __init__(self, queue: Queue) -> None:
        self.queue = queue
        self.orphans: Dict[int, Tuple[int, int]] = {}  # job -> (pid, start ticks) of an old daemon's leader
        self.adopted: Set[int] = set()  # direct jobs found running whose old processes are stopping
        self.taken: Set[int] = set()  # units found running and taken over (their end has no client's word)
        self.old_leaders: List[Tuple[int, int]] = []  # the old daemon's, still letting go of their units
        self.disarming: Optional[subprocess.Popen] = None

    # ------------------------------------------------------------------ at the start

    def find(self) -> None:
        q = self.queue
        for job in q.store.all():
            if job.state not in J.LIVE:
                continue
            if q.systemd or _unit_of(job).populated():  # (a unit runs on when `launcher` changed)
                self._unit(job)
            else:
                self._direct(job)
        if q.systemd or self.taken:  # (a unit taken over under `launcher = direct` is guarded too)
            self.disarm()

    def _unit(self, job: Job) -> None:
        """A unit's run: taken over while it runs; else its recorded end, or back in the queue."""
        unit = _unit_of(job)
        if _alive(job.leader_pid, job.leader_ticks):
            self.old_leaders.append((job.leader_pid, job.leader_ticks))
        if unit.populated() and self._take_over(job, unit):
            return
        if not self.ended_while_away(job):
            self.lost(job, "its unit is gone and nothing recorded its end")

    def _take_over(self, job: Job, unit: Unit) -> bool:
        """Run a client that waits for the unit's end, under a leader, as the job's workload."""
        q = self.queue
        end_file = q.end_path(job)
        argv = transient.wait_command(end_file, str(unit.group))
        launch = unit_launch(argv, unit, end_file, q.q.unguarded_seconds)
        key = f"job:{job.id}"
        rule = StopRule(job.stop_signal, job.grace, job.grace, main_only=job.stop_main_only)
        try:
            w = q.supervisor.launch(
                Instance(key=key, process=key, gpus=job.gpus),
                launch,
                f"job {J.ref(job)}",
                time.monotonic(),
                rule,
            )
        except StartError as err:
            log.error(
                "queue: job %s: cannot take its unit %s over: %s; killing it", J.ref(job), unit.name, err
            )
            unit.kill()
            return False
        st = read_stat(w.pid)
        ticks = st.start_ticks if st else 0
        q.store.change(job.id, lambda j: dataclasses.replace(j, leader_pid=w.pid, leader_ticks=ticks))
        self.taken.add(job.id)
        log.info(
            "queue: job %s of %s found running in %s: taken over (restart %d)",
            J.ref(job),
            sanitize(job.user),
            unit.name,
            job.restarts,
        )
        q.note(
            job,
            f"gpu-mon: job {J.ref(job)} found running at {at(q.wall())} by a gpu-mon that started "
            "again; it runs on",
        )
        return True

    def _direct(self, job: Job) -> None:
        """A direct run: its old leader is stopping it (waited for), or gone: its end, or the queue."""
        q = self.queue
        if _alive(job.leader_pid, job.leader_ticks):
            self.orphans[job.id] = (job.leader_pid, job.leader_ticks)
            if job.state == J.RUNNING:
                self.adopted.add(job.id)
            q.store.change(job.id, lambda j: j if j.state == J.STOPPING else J.stopping(j, J.STOP_RESTART))
            log.info("queue: job %s: the processes an earlier gpu-mon started are stopping", J.ref(job))
            return
        if not self.ended_while_away(job):
            self.lost(job, "gpu-mon stopped while it ran")

    # ------------------------------------------------------------------ each round

    def look(self) -> None:
        """Old leaders that are gone: their jobs' ends; and the guard disarmed once more when the last
        of those letting go of a unit is gone (it may have armed the guard after the first disarm)."""
        if self.disarming is not None and self.disarming.poll() is not None:
            self.disarming = None
        if self.old_leaders and not any(_alive(p, t) for p, t in self.old_leaders):
            self.old_leaders = []
            self.disarm()
        if self.orphans:
            self._orphans_gone()

    def _orphans_gone(self) -> None:
        q = self.queue
        gone = [i for i, (pid, ticks) in self.orphans.items() if not _alive(pid, ticks)]
        for job_id in gone:
            del self.orphans[job_id]
            q.force_place = True
            job = q.store.get(job_id)
            was_running = job_id in self.adopted
            self.adopted.discard(job_id)
            if job is None or self.ended_while_away(job, was_running):
                continue
            self.lost(job, "gpu-mon stopped while it ran; its processes were stopped")
        if self.orphans:
            q.dirty = True  # look again next round

    def disarm(self) -> None:
        """Disarm the guard (unguarded.py), not waited for; the helper reaped by `look`."""
        if self.disarming is not None:
            return
        try:
            self.disarming = transient.client(unguarded.disarm_argv())
        except OSError as err:
            log.warning("queue: cannot disarm %s.timer: %s", unguarded.UNIT, err)
            return
        self.queue.supervisor.helpers[self.disarming.pid] = self.disarming

    # ------------------------------------------------------------------ ends

    def ended_while_away(self, job: Job, was_running: bool = False) -> bool:
        """A run whose end was recorded (ends.py) while gpu-mon was not there to see it ends with that end,
        as if seen then (or back in the queue, where systemd stopped it); True. was_running: it was running
        when found (its stop since was this daemon's, not its end's cause)."""
        q = self.queue
        where = q.end_path(job)
        end = ends.read(where)
        if end is None:
            ends.remove(where)
            return False
        if ends.stopped_by_systemd(where):
            ends.remove(where)
            self.lost(job, "systemd stopped it while gpu-mon was away", end.wall)
            return True
        said = q.unit_said(job)  # (its files removed)

        def own(j: Job) -> Optional[Job]:
            if j.state not in J.LIVE:
                return None
            j = dataclasses.replace(j, state=J.RUNNING) if was_running and j.reason == J.STOP_RESTART else j
            new = J.ended(j, end.wall, end.code, end.signal)
            return dataclasses.replace(new, reason=said) if new.state == J.FAILED and said else new

        new = q.store.change(job.id, own)
        ends.remove(where)
        if new is not None:
            how = words.exit_status(end.code, end.signal)
            log.info("queue: job %s %s while gpu-mon was not there to see it: %s", J.ref(job), how, new.state)
            q.note(
                new, f"gpu-mon: job {J.ref(job)} {how} at {at(end.wall)}, while gpu-mon was away: {new.state}"
            )
        return new is not None

    def lost(self, job: Job, why: str, wall: Optional[float] = None) -> Optional[Job]:
        """A run that ended without an end of its own (gpu-mon's stop, systemd's, nothing recorded): a stop
        under way ends as it was meant to; a running job goes back to the queue. One line in its log."""
        q = self.queue
        q.unit_said(job)  # (its files removed)
        when = q.wall() if wall is None else wall
        new = q.store.change(job.id, lambda j: J.run_lost(j, when) if j.state in J.LIVE else None)
        if new is None:
            return None
        then = f"requeued (restart {new.restarts})" if new.state == J.QUEUED else new.state
        log.info("queue: job %s: %s: %s", J.ref(job), why, then)
        q.note(new, f"gpu-mon: job {J.ref(job)} at {at(when)}: {why}; {then}")
        q.force_place = True
        return new


def _unit_of(job: Job) -> Unit:
    name = transient.unit_name(job.id, job.restarts)
    return Unit(name, transient.unit_group(name))


def _alive(pid: int, ticks: int) -> bool:
    if pid <= 0:
        return False
    st = read_stat(pid)
    return st is not None and st.start_ticks == ticks and st.state != "Z"
