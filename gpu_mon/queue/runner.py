"""The queue in the daemon: each round, after the policy has judged every GPU, place the queue's jobs
(queue/placement.py, pure) and act: start jobs as workloads with an owner (the supervisor, its leader and
containment), stop a job whose GPU someone else now uses (its stop signal, its grace, then SIGKILL: an
urgent stop), take a GPU from a [process-*] workload, and keep [process-*] workloads off the GPUs jobs hold.

The store is the truth: a cancel or time limit marks the job `stopping` and the round stops it; an exit
ends it as done, failed, timeout, cancelled, preempted or back in the queue. A daemon that starts finds
the jobs an earlier one was running (adopt.py).

Where systemd runs the machine (`[queue] launcher`, workloads/transient.py), a job is a transient service
unit of its own, started through `systemd-run` under the leader: outside gpu-mon's sandbox, stopped through
its unit's cgroup, and bound to nothing: it outlives a restart, an upgrade or a crash of gpu-mon, which lets
go of it when it stops (the guard of unguarded.py bounds how long it runs unguarded). Elsewhere it is the
leader's child, as a workload is, and a stop of gpu-mon stops it (back to the queue).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

from gpu_mon.api.model import Exited, Snapshot
from gpu_mon.api.procfs import read_stat
from gpu_mon.api.text import sanitize
from gpu_mon.config import Config, QueueSection
from gpu_mon.engine.lock import DaemonLock
from gpu_mon.engine.workloads import ends, transient
from gpu_mon.engine.workloads.stopping import StopRule
from gpu_mon.engine.workloads.supervisor import Launch, StartError, Supervisor
from gpu_mon.policy import words
from gpu_mon.policy.decisions import Decision, Instance, Start, Wait
from gpu_mon.queue import jobs as J
from gpu_mon.queue import launching, notes, placement
from gpu_mon.queue.adopt import Finder
from gpu_mon.queue.described import View
from gpu_mon.queue.hookleader import LeaderHooks
from gpu_mon.queue.hooks import Hooks, Notices
from gpu_mon.queue.jobs import Job
from gpu_mon.queue.outside import UserUnits
from gpu_mon.queue.prune import Pruner
from gpu_mon.queue.requests import Requests, groups_of, output_of
from gpu_mon.queue.runrecords import RunRecords
from gpu_mon.queue.runs import JobRun, QueueReport, Runs
from gpu_mon.queue.server import Server
from gpu_mon.queue.show import Live
from gpu_mon.queue.store import Store
from gpu_mon.queue.words import never_met as _never_met_words

log = logging.getLogger("gpu_mon")

PREFIX = "job:"
PLACE_GAP = 0.2  # seconds between two placements that only requests (submit, cancel, ...) asked for


def job_key(job_id: int) -> str:
    """The supervisor's key of a job's workload."""
    return f"{PREFIX}{job_id}"


def _job_id(key: str) -> Optional[int]:
    return int(key[len(PREFIX) :]) if key.startswith(PREFIX) else None


class Queue:
    """The daemon's queue: the store, the socket, and each round's placement."""

    def __init__(self, config: Config, supervisor: Supervisor, poke, wall, say=None) -> None:
        assert config.queue is not None
        self.say = say  # the daemon's: logged, and among status's recent decisions (None: logged only)
        self.q: QueueSection = config.queue
        self.delay = (
            self.q.start_delay_seconds
            if self.q.start_delay_seconds is not None
            else config.defaults.start_delay_seconds
        )
        self.supervisor, self.poke, self.wall = supervisor, poke, wall
        # Transient units where systemd runs the machine (LauncherError where `systemd` cannot be had)
        self.systemd = transient.choose(self.q.launcher, os.geteuid() == 0)
        # The files of a job's unit: its environment, what it says before its output is open
        self.run_dir = os.path.dirname(config.defaults.state_file)
        # Its end's record (ends.py): beside the database, never where systemd deletes it
        self.ends_dir = os.path.dirname(os.path.abspath(self.q.database))
        # One daemon per queue: two that shared a database would run its jobs twice.
        self.lock = DaemonLock(self.q.database)
        self.lock.acquire()
        try:
            self.store = Store.open(self.q.database, wall())
        except BaseException:
            self.lock.release()
            raise
        self.view = View()
        self.requests = Requests(
            self.store, self.q, lambda: self.view, self._changed, not self.systemd, self._submitted
        )
        self.server = Server(self.q.socket, self.requests)
        self.pruner = Pruner(self.store, lambda: self.q, wall)  # finished jobs, after keep_finished_days
        self.exits: List[Exited] = []
        self.finder = Finder(self)  # the jobs an earlier daemon left
        self.let_go: Set[int] = set()  # units left running as gpu-mon stops (they outlive it)
        self.nodes: Dict[str, str] = {}  # GPU -> its device node, as the last look saw it
        self.next_wake: Optional[float] = None
        self.dirty = True
        self.plan: Optional[placement.Placement] = None  # the last placement, and what it was made from
        self.placed_on: tuple = ()
        self.placed_at = -1e9
        self.placed_up_to = 0  # the newest job the placement has seen (View: newer ones are "not placed yet")
        # Submits the placement has not read yet (set from the server's thread); while place_pending, the
        # loop knows (a placement is due: at once, or at placed_at + PLACE_GAP) and needs no wake.
        self.unplaced = False
        self.place_pending = False
        self.closing = False  # gpu-mon stops: nothing is placed any more (submits want no round)
        self._live_jobs: List[Job] = []  # (_live: the running and stopping jobs at _live_version)
        self._live_version = -1
        self.force_place = False  # a job ended (its GPUs may take the next one at once)
        # Running jobs' GPUs that someone else opened and holds, by GPU: the job stops if they still do at
        # the confirm's time ([queue] brief_open_seconds; the round then reads their holders again)
        self.confirms: Dict[str, placement.ConfirmJob] = {}
        self.runs = Runs()  # what status, history and metrics hear of (report())
        self.records = RunRecords(self.store)  # each run's record, written as it starts and ends
        self.look: Optional[Snapshot] = None  # the round's look (its GPUs' energy; `show`'s processes)
        self.notices = Notices()  # jobs' ends for their hooks (--notify), run beside the loop
        # (outside gpu-mon's sandbox as the job's user where jobs are units: the service cannot write homes)
        self.outside = UserUnits(supervisor.helpers, self.run_dir) if self.systemd else None
        self.note = self.outside.note if self.outside is not None else notes.note
        launch = self.outside.hook if self.outside is not None else LeaderHooks(groups_of).hook
        self.hooks = Hooks(output_of, groups_of, self.note, supervisor.helpers, launch)

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Take over the jobs an earlier daemon left running, then listen (ServerError if impossible)."""
        self.requests.live = Live(lambda: self.look, self.records.of_job)  # (what `show` reads of the loop)
        self.notices.changes(self.store.all(), self.store.version)  # (what was before is not news)
        self._runs_seen()  # (the runs an earlier daemon left, before they are taken over)
        self.finder.find()
        self._runs_seen()
        try:
            self.server.start()
        except BaseException:
            self.close()
            raise
        self.pruner.start()
        queued = sum(1 for j in self.store.all() if j.state == J.QUEUED)
        log.info("queue: listening on %s; %d job(s) queued (%s)", self.q.socket, queued, self.q.database)
        drained = self.store.drained
        if drained is not None:  # (`gpu-mon queue drain` lasts across restarts)
            at = time.strftime("%Y-%m-%d %H:%M", time.localtime(drained.at))
            log.info("queue: drained by %s at %s: no job starts until `gpu-mon queue resume`", drained.by, at)
        if self.systemd:
            log.info(
                "queue: jobs run as transient units in %s; they outlive gpu-mon (stopped by systemd after "
                "%g s without it)",
                transient.SLICE,
                self.q.unguarded_seconds,
            )

    def end_path(self, job: Job) -> str:
        return ends.path(self.ends_dir, job.id, job.restarts)

    def requeue_running(self) -> None:
        """Every workload is being stopped (gpu-mon stops, or an internal error): the running jobs go
        back to the queue when their processes are gone."""

        def restart(j: Job) -> Optional[Job]:  # (a stop under way keeps its meaning: cancel, time limit)
            return J.stopping(j, J.STOP_RESTART) if j.state == J.RUNNING else None

        running = [j for j in self.store.all() if j.state == J.RUNNING and j.id not in self.let_go]
        changed = self.store.change_many([(j.id, restart) for j in running])
        for job in changed:
            if job is not None:
                at = notes.at(self.wall())
                self.note(job, f"gpu-mon: job {J.ref(job)} stopped at {at}: gpu-mon is stopping; requeued")

    def leave_running(self) -> int:
        """gpu-mon stops: the running jobs' units outlive it (their leaders arm the guard as it exits);
        how many were left. A direct job, or one whose stop is under way, is not left."""
        if not self.systemd:
            return 0
        for job in self.store.all():
            if job.state == J.RUNNING and self.supervisor.let_go(job_key(job.id)):
                self.let_go.add(job.id)
        if self.let_go:
            log.info(
                "queue: %d job(s) left running in their units: %s",
                len(self.let_go),
                ", ".join(self._ref(i) for i in sorted(self.let_go)),
            )
        return len(self.let_go)

    def close(self) -> None:
        """Stop listening; end the running hooks (a few seconds at most); close the database; let the next
        daemon have the queue."""
        self.server.stop()
        self.pruner.stop()
        try:  # (what the running runs sampled so far: the next daemon goes on from it)
            self._runs_seen()
            self.records.write(everything_live=True)
        except Exception:
            log.exception("queue: cannot record the runs going on (please report it)")
        self.hooks.close()
        if self.outside is not None:
            self.outside.close()
        self.store.close()
        self.lock.release()

    def reconfigure(self, config: Config) -> None:
        """A reload's [queue] (its socket and database kept: they change at a restart): limits, order,
        who may submit, grace, GPUs, start delay, preempt_workloads and keep_finished_days apply now."""
        assert config.queue is not None
        before = self.q
        self.q = self.requests.queue = config.queue
        self.delay = (
            self.q.start_delay_seconds
            if self.q.start_delay_seconds is not None
            else config.defaults.start_delay_seconds
        )
        self.force_place = self.dirty = True  # placed again at once, by the new rules
        if before.keep_finished_days != self.q.keep_finished_days:
            self.pruner.poke()

    def _ref(self, job_id: int) -> str:
        """The job as users name it (17, 17_5), from its number."""
        job = self.store.get(job_id)
        return J.ref(job) if job is not None else str(job_id)

    def _say(self, fmt: str, *args: object) -> None:
        text = fmt % args if args else fmt
        if self.say is not None:
            self.say(text)
        else:
            log.info("%s", text)

    def _changed(self) -> None:
        """A request changed the queue (called from the server's thread): a round soon."""
        self.dirty = True
        self.poke()

    def _submitted(self) -> None:
        """A submit (from the server's thread) only adds a job to place: a round places it at once, or
        PLACE_GAP after the last placement (a burst of submits: one round for many, not one each). The
        loop is woken once for them (to know the deadline); place_pending is read after the store took
        the job, and a placement clears it before it reads the store: either way the job is placed."""
        self.unplaced = True
        if not self.place_pending:
            self.place_pending = True
            self.poke()

    def _submits_due(self) -> Optional[float]:
        """When the submits not placed yet are (None: there are none)."""
        return self.placed_at + PLACE_GAP if self.unplaced and not self.closing else None

    def wake_at(self) -> Optional[float]:
        """When the queue wants its next round (a start delay, a time limit, a hook, submits to place)."""
        due = [t for t in (self.next_wake, self._submits_due()) if t is not None]
        return min(due) if due else None

    def wanted(self, now: float) -> bool:
        """Whether the queue wants a round now (a request came, a start delay or time limit is over,
        submits are to be placed)."""
        wake = self.wake_at()
        return self.dirty or (wake is not None and now >= wake)

    # ------------------------------------------------------------------ each round

    def take_jobs(self, snap: Snapshot) -> Snapshot:
        """The snapshot as the policy must see it: jobs' workloads and exits are the queue's."""
        self.exits.extend(e for e in snap.exited if e.key.startswith(PREFIX))
        self.nodes = {g.uuid: g.device for g in snap.reading.gpus if g.uuid and g.device}
        return dataclasses.replace(
            snap,
            running=tuple(r for r in snap.running if not r.key.startswith(PREFIX)),
            exited=tuple(e for e in snap.exited if not e.key.startswith(PREFIX)),
        )

    def round(
        self,
        decision: Decision,
        index_of: Dict[str, int],
        uuids: List[str],
        now: float,
        stopping: bool = False,
    ) -> Decision:
        """Place and act; return the policy's decision without starts on GPUs that jobs hold or claim.
        While gpu-mon stops, only the jobs' ends are recorded (and the running hooks' time is cut short:
        close() ends them). Then the hooks of the jobs that ended."""
        out = self._round(decision, index_of, uuids, now, stopping)
        if stopping:
            self.hooks.stopping(now)
        else:
            self._notify(now)
        return out

    def _notify(self, now: float) -> None:
        """Start the hooks of the jobs that ended (or were preempted) since the last round; look at those
        running (a round again soon while any runs)."""
        if self.store.version != self.notices.version:
            for n in self.notices.changes(self.store.all(), self.store.version):
                try:
                    self.hooks.add(n, now)
                except Exception:  # (one job's hook: not run; the others, and every job, go on)
                    log.exception(
                        "queue: job %s: its hook is not run: internal error (please report it)", J.ref(n.job)
                    )
        try:
            self.hooks.poll(now)
        except Exception:  # (hooks hold no GPU: nothing to stop for them)
            log.exception("queue: internal error running the jobs' hooks (please report it); they go on")
        if self.outside is not None:
            self.outside.poll()
        again = self.hooks.next_poll(now)
        if again is not None:
            self.next_wake = again if self.next_wake is None else min(again, self.next_wake)

    def _round(
        self, decision: Decision, index_of: Dict[str, int], uuids: List[str], now: float, stopping: bool
    ) -> Decision:
        self.dirty = False
        wall = self.wall()
        self.store.flush(now)  # (what a full disk kept from the database: it never stops the loop)
        self._ended(wall)
        if stopping:
            self.closing = True
            return decision
        self.finder.look()
        views = self._views(decision, uuids)
        urgent = placement.stops(self._live(), views, now, wall, self.q.brief_open_seconds)  # stops first
        self._preempt(urgent, index_of, now)
        self._spared(urgent, index_of)
        self._time_up(urgent)
        self._reconcile(now)
        self._runs_seen()  # every end of this round is seen before a job starts again
        wake = self.wake_at()
        due = wake is not None and now >= wake
        inputs = (self.store.version, tuple(views))
        gpus_changed = not self.placed_on or inputs[1] != self.placed_on[1]
        carry = not (self.force_place or self.unplaced) and self.plan is not None and inputs == self.placed_on
        if due and carry:
            # Only time passed since the placement (a start delay is over, a hook to look at): carry it on.
            self.plan = placement.later(self.plan, now)
            if self.plan.starts:
                self._place_done(self.plan, index_of, uuids, now, wall)
            return self._after_place(urgent, now, decision)
        force = self.force_place or due or self.plan is None or gpus_changed
        if not force and inputs != self.placed_on and now < self.placed_at + PLACE_GAP:
            # Only requests changed the queue (a burst of submits): place again at most every PLACE_GAP.
            soon = self.placed_at + PLACE_GAP
            wakes = [w for w in (soon, self.next_wake, urgent.next_wake) if w is not None and w > now]
            self.next_wake = min(wakes)
            self.place_pending = True
            return _without_claimed(decision, self._kept(), self._ref) if self.plan else decision
        if force or inputs != self.placed_on:
            self.force_place = self.place_pending = self.unplaced = False
            known = self.store.all()
            drained = self.store.drained is not None
            self.plan = placement.place(known, views, self.q, self.delay, now, wall, drained)
            self.placed_on = inputs
            self.placed_at = now
            self.placed_up_to = known[-1].id if known else 0
            self._place_done(self.plan, index_of, uuids, now, wall)
        return self._after_place(urgent, now, decision)

    def _place_done(
        self, plan: placement.Placement, index_of: Dict[str, int], uuids: List[str], now: float, wall: float
    ) -> None:
        """Act on a placement: cancels for failed dependencies, workloads to stop, jobs to start."""
        self._dependencies(plan, wall)
        self._take_from_workloads(plan, index_of, now)
        for s in plan.starts:
            self._start(s, index_of, now, wall)
        self.view = View(
            plan.waiting, dict(index_of), self.placed_up_to, len(uuids), estimates=plan.estimates
        )

    def _after_place(self, urgent: placement.Placement, now: float, decision: Decision) -> Decision:
        assert self.plan is not None
        wakes = [w for w in (urgent.next_wake, self.plan.next_wake) if w is not None and w > now]
        self.next_wake = min(wakes) if wakes else None
        return _without_claimed(decision, self._kept(), self._ref)

    def _kept(self) -> Dict[str, int]:
        """The GPUs no [process-*] workload may start on: those jobs hold or claim, and those kept for the
        head's reservation unless a job may take a GPU from a workload (then one harvests it meanwhile)."""
        assert self.plan is not None
        if self.q.preempt_workloads or not self.plan.kept:
            return self.plan.claimed
        return {**self.plan.kept, **self.plan.claimed}

    def report(self) -> QueueReport:
        """For the outputs: the jobs in each state, the runs going on, and those that began or ended
        since the last report."""
        self._runs_seen()
        drained = self.store.drained
        report = self.runs.take()
        return report if drained is None else dataclasses.replace(report, drained=(drained.by, drained.at))

    def _runs_seen(self) -> None:
        version = self.store.version
        if version != self.runs.version:
            self.runs.seen(self.store.all(), version, self.wall(), self._run_seen)
            self.records.write()

    def _run_seen(self, run: JobRun) -> JobRun:
        """A run started or ended: its record (with its GPUs' energy counters as the round's look saw
        them)."""
        return self.records.seen(run, self.look.reading.gpus if self.look is not None else None)

    def seen_look(self, snap: Snapshot) -> None:
        """The round's look (after the look again): kept for the runs' energy and `show`."""
        self.look = snap
        self.records.sample(snap.reading.gpus, snap.now)

    def hit(self, decision: Decision, uuids: List[str], now: float) -> Set[str]:
        """The GPUs of running jobs that this decision finds busy (someone else uses them), less those
        only held for less than brief_open_seconds (the round after confirms them later)."""
        running = {
            u
            for w in self.supervisor.workloads.values()
            if w.instance.key.startswith(PREFIX) and not w.stopping
            for u in w.instance.gpus
        }
        busy = set()
        for u in running & set(uuids):
            v = decision.verdicts.get(u)
            if v is not None and not v.busy:
                continue
            held = v.held_since if v is not None else None
            at = placement.confirm_at(placement.GpuView(u, True, held_since=held), self.q.brief_open_seconds)
            if at is None or at <= now:
                busy.add(u)
        return busy

    def yield_first(self, decision: Decision, index_of: Dict[str, int], uuids: List[str], now: float) -> None:
        """A foreign open's first look found a running job's GPU busy (confirmed by the look again): the job
        is stopped at once, before the rest of /proc is read, as a workload is."""
        views = self._views(decision, uuids)
        urgent = placement.stops(self._running(), views, now, self.wall(), self.q.brief_open_seconds)
        for p in urgent.preempt_jobs:
            log.debug("stopping job %s before reading the rest of /proc", self._ref(p.job))
        self._preempt(urgent, index_of, now)

    def _live(self) -> List[Job]:
        """The running and stopping jobs, found again only when the store has changed (a long queue that
        waits costs a round nothing)."""
        version = self.store.version  # (read first: a change meanwhile makes the next call look again)
        if version != self._live_version:
            self._live_jobs = [j for j in self.store.all() if j.state in J.LIVE]
            self._live_version = version
        return self._live_jobs

    def _running(self) -> List[Job]:
        return [j for j in (self.store.get(i) for i in self._running_ids()) if j is not None]

    def _running_ids(self) -> List[int]:
        ids = (_job_id(k) for k in self.supervisor.workloads)
        return [i for i in ids if i is not None]

    def _views(self, decision: Decision, uuids: List[str]) -> List[placement.GpuView]:
        on: Dict[str, Tuple[str, bool]] = {}
        for key, w in self.supervisor.workloads.items():
            if not key.startswith(PREFIX):
                for u in w.instance.gpus:
                    on[u] = (key, w.stopping)
        views = []
        for u in uuids:
            v = decision.verdicts.get(u)
            busy = v is None or v.busy
            reason = v.reasons[0] if v is not None and v.reasons else None
            key, stopping = on.get(u, ("", False))
            free = v.free_since if v is not None else None
            held = v.held_since if v is not None else None
            views.append(placement.GpuView(u, busy, reason, free, key, stopping, held))
        return views

    def _preempt(self, plan: placement.Placement, index_of: Dict[str, int], now: float) -> None:
        """Someone else uses a job's GPU: the stop goes out first, the database after."""
        whys = []
        for p in plan.preempt_jobs:
            why = f"{words.gpu(p.gpu, index_of)} busy: {words.reason(p.reason) if p.reason else 'unsure'}"
            self.supervisor.stop(job_key(p.job), why, now, urgent=True)
            whys.append(why)
            self._say("queue: %s; stopping job %s", why, self._ref(p.job))
        if not whys:
            return
        wall = self.wall()
        changed = self.store.change_many(
            (p.job, lambda j, w=why: J.preempted(j, wall, w) if j.state == J.RUNNING else None)
            for p, why in zip(plan.preempt_jobs, whys)
        )
        for job in changed:
            if job is not None:
                again = f"requeued (restart {job.restarts + 1})" if job.requeue else "not requeued"
                at = notes.at(wall)
                why = job.preempted_reason
                self.note(job, f"gpu-mon: job {J.ref(job)} preempted at {at}: {why}; {again}")

    def _spared(self, urgent: placement.Placement, index_of: Dict[str, int]) -> None:
        """Keep this round's confirms; a job whose GPU's holder let go before its confirm runs on (said
        once, naming who)."""
        pending = {c.gpu: c for c in urgent.confirms}
        stopped = {p.gpu for p in urgent.preempt_jobs}
        for gpu, c in self.confirms.items():
            w = self.supervisor.workloads.get(job_key(c.job))
            if gpu in pending or gpu in stopped or w is None or w.stopping:
                continue
            by = c.reason.who if c.reason is not None else None
            who = words.who(by) if by is not None else "its opener"
            log.info(
                "queue: job %s runs on: %s let go of %s within %g s",
                self._ref(c.job),
                who,
                words.gpu(gpu, index_of),
                self.q.brief_open_seconds,
            )
        self.confirms = pending

    def confirms_due(self, now: float) -> Set[str]:
        """The running jobs' GPUs whose holders must be read again now: does their opener still hold it?"""
        return {gpu for gpu, c in self.confirms.items() if now >= c.at}

    def _reconcile(self, now: float) -> None:
        """Jobs marked stopping (cancel, time limit, shutdown) whose workload has not been told yet."""
        gone = []
        for job in self._live():
            if job.state != J.STOPPING:
                continue
            w = self.supervisor.workloads.get(job_key(job.id))
            if w is not None and not w.stopping:
                why = {J.STOP_CANCEL: "cancelled", J.STOP_TIMEOUT: "time limit"}.get(job.reason, job.reason)
                self.supervisor.stop(job_key(job.id), why, now)
                self._say("queue: job %s (%s): %s; stopping it", J.ref(job), sanitize(job.user), why)
                self.note(job, notes.stop_line(job, self.wall()))
            elif w is None and job.id not in self.finder.orphans:
                gone.append(job.id)  # (its workload is gone, and its exit was taken: not expected)
        wall = self.wall()
        self.store.change_many(
            (i, lambda j: J.run_lost(j, wall) if j.state == J.STOPPING else None) for i in gone
        )

    def _dependencies(self, plan: placement.Placement, wall: float) -> None:
        for c in plan.cancels:
            reason = f"dependency never met: {_never_met_words(c, self._ref)}"
            if self.store.change(c.job, lambda j, r=reason: _cancel_queued(j, wall, r)) is not None:
                log.info("queue: job %s cancelled: %s", self._ref(c.job), reason)

        if plan.time_up:
            self.dirty = True  # stop them in the next round (it comes at once)

    def _time_up(self, urgent: placement.Placement) -> None:
        """Jobs past their --time-limit: marked stopping, then stopped (with their full grace)."""
        self.store.change_many(
            (t.job, lambda j: J.stopping(j, J.STOP_TIMEOUT) if j.state == J.RUNNING else None)
            for t in urgent.time_up
        )

    def _take_from_workloads(self, plan: placement.Placement, index_of: Dict[str, int], now: float) -> None:
        for p in plan.preempt_workloads:
            w = self.supervisor.workloads.get(p.workload)
            if w is None or w.stopping:
                continue
            why = f"job {self._ref(p.job)} takes {words.gpu(p.gpu, index_of)}"
            self.supervisor.stop(p.workload, why, now)
            log.info("queue: %s; stopping %s[%d]", why, w.label, w.pid)

    def _start(self, s: placement.StartJob, index_of: Dict[str, int], now: float, wall: float) -> None:
        job = self.store.change(  # (not waiting for the disk: store.py says why that is safe)
            s.job, lambda j: J.started(j, s.gpus, wall, 0, 0) if j.state == J.QUEUED else None, durable=False
        )
        if job is None:
            return  # held or cancelled since it was placed
        gpus = ", ".join(words.gpu(u, index_of) for u in s.gpus)
        try:
            w = self.supervisor.launch(
                Instance(key=job_key(job.id), process=job_key(job.id), gpus=s.gpus),
                self._launch(job, s.gpus),
                f"job {J.ref(job)}",
                now,
                StopRule(job.stop_signal, job.grace, job.grace, main_only=job.stop_main_only),
            )
        except StartError as err:
            self._not_started(job, str(err), wall)
            return
        except Exception as err:  # (what one job holds: that job fails, and every other goes on)
            if job_key(job.id) in self.supervisor.workloads:
                raise  # (it runs: what failed is not known, and gpu-mon stops every workload)
            log.exception("queue: job %s: internal error starting it (please report it)", J.ref(job))
            self._not_started(job, f"cannot start: {type(err).__name__}: {sanitize(str(err))}", wall)
            return
        stat = read_stat(w.pid)
        ticks = stat.start_ticks if stat else 0
        self.store.change(
            job.id, lambda j: dataclasses.replace(j, leader_pid=w.pid, leader_ticks=ticks), durable=False
        )
        self._say(
            "queue: starting job %s[%d] of %s on %s (restart %d): %s",
            J.ref(job),
            w.pid,
            sanitize(job.user),
            gpus,
            job.restarts,
            sanitize(" ".join(job.command), limit=200),
        )

    def _not_started(self, job: Job, detail: str, wall: float) -> None:
        log.error("queue: cannot start job %s: %s", J.ref(job), detail)
        self.store.change(job.id, lambda j: dataclasses.replace(j, state=J.FAILED, ended=wall, reason=detail))

    def _ended(self, wall: float) -> None:
        exits, self.exits = self.exits, []
        for ex in exits:
            try:
                self._exited(ex, wall)
            except Exception as err:  # (what one job holds: that job fails, and every other goes on)
                log.exception("queue: job %s: internal error ending it (please report it)", ex.key)
                why = f"its end could not be recorded: {type(err).__name__}: {sanitize(str(err))}"
                self.store.change(
                    _job_id(ex.key) or 0,
                    lambda j, rc=ex.returncode, sig=ex.signal, w=why: (
                        _reason(J.ended(j, wall, rc, sig), w) if j.state in J.LIVE else None
                    ),
                )

    def _exited(self, ex: Exited, wall: float) -> None:
        """One job's run ended: the store, its unit's files, and one line."""
        job = self.store.get(_job_id(ex.key) or 0)
        unit = job is not None and (self.systemd or job.id in self.finder.taken)
        if job is not None and unit and self._not_its_own(job, ex):
            return
        new = self.store.change(
            _job_id(ex.key) or 0,
            lambda j, rc=ex.returncode, sig=ex.signal: (
                J.ended(j, wall, rc, sig) if j.state in J.LIVE else None
            ),
        )
        if job is not None:
            ends.remove(self.end_path(job))  # (seen: the record is no longer needed)
        if job is None or new is None:
            return
        said = self.unit_said(job)  # (the file goes, whatever ended the run)
        detail = ex.detail or said  # the leader's, or the unit's: its output could not be opened, ...
        if new.state == J.FAILED and detail:
            new = self.store.change(new.id, lambda j, d=detail: _reason(j, d)) or new
        self.force_place = True
        after = f" (restart {new.restarts} next)" if new.state == J.QUEUED else ""
        self._say(
            "queue: job %s of %s %s: %s%s",
            J.ref(job),
            sanitize(job.user),
            words.exit_status(ex.returncode, ex.signal),
            new.state if new.state != J.QUEUED else "back in the queue",
            after,
        )

    def _not_its_own(self, job: Job, ex: Exited) -> bool:
        """A unit's end that is not its command's own: systemd stopped it (a shutdown, the guard, an admin's
        `systemctl stop`), or a unit taken over after a restart ended with nothing recorded. Such a run is
        lost (back in the queue, or a stop under way ends as meant); True then."""
        where = self.end_path(job)
        taken = job.id in self.finder.taken
        self.finder.taken.discard(job.id)
        if ends.stopped_by_systemd(where):
            why = "systemd stopped it"
        elif taken and ends.read(where) is None:
            why = "its unit ended and nothing recorded how"
        else:
            return False
        ends.remove(where)
        self.finder.lost(job, why)
        return True

    def _devices(self, gpus: Tuple[str, ...]) -> Optional[List[str]]:
        """What a job's unit may open (`confine_devices`): its GPUs' nodes, none of the others'."""
        if not self.q.confine_devices:
            return None
        return transient.device_allow([self.nodes.get(u, "") for u in gpus], self.q.device_allow)

    def unit_said(self, job: Job) -> str:
        """What the unit of the job's run wrote before its output was open (systemd; "" when nothing);
        its files removed."""
        if not self.systemd:
            return ""
        return sanitize(
            transient.unit_ended(self.run_dir, transient.unit_name(job.id, job.restarts)), limit=300
        )

    def _launch(self, job: Job, gpus: Tuple[str, ...]) -> Launch:
        """The job run directly, or (systemd) `systemd-run` starting it as a unit of its own."""
        end_file = self.end_path(job)
        ends.remove(end_file)  # (one left by an earlier run of this number: never taken for this one's)
        direct = dataclasses.replace(launching.direct(job, gpus), end_file=end_file)
        if not self.systemd:
            return direct
        devices = self._devices(gpus)
        return launching.as_unit(job, direct, self.run_dir, devices, self.q.unguarded_seconds)


def _cancel_queued(job: Job, wall: float, reason: str) -> Optional[Job]:
    return J.cancelled(job, wall, reason) if job.state in (J.QUEUED, J.HELD) else None


def _alive(pid: int, ticks: int) -> bool:
    if pid <= 0:
        return False
    st = read_stat(pid)
    return st is not None and st.start_ticks == ticks and st.state != "Z"


def _reason(job: Job, reason: str) -> Job:
    return dataclasses.replace(job, reason=reason)


def _without_claimed(decision: Decision, claimed: Dict[str, int], ref: Callable[[int], str]) -> Decision:
    """The policy's starts, less those on GPUs that jobs hold or are about to take."""
    if not claimed:
        return decision
    actions, waiting = [], dict(decision.waiting)
    for a in decision.actions:
        if isinstance(a, Start):
            taken = [u for u in a.instance.gpus if u in claimed]
            if taken:
                waiting[a.instance.key] = Wait("taken", gpu=taken[0], by=f"job {ref(claimed[taken[0]])}")
                continue
        actions.append(a)
    return dataclasses.replace(decision, actions=tuple(actions), waiting=waiting)


def queue_gpus(queue: QueueSection, watched: Dict[str, object], index_of: Dict[str, int]) -> List[str]:
    """The UUIDs of the GPUs jobs may use: `[queue] gpus` among those a [gpu-*] section names, by index."""
    by_index = {i: u for u, i in index_of.items()}
    if queue.gpus.all:
        chosen = list(watched)
    else:
        lower = {u.lower(): u for u in watched}
        chosen = [
            by_index.get(r, "") if isinstance(r, int) else lower.get(str(r).lower(), "")
            for r in queue.gpus.refs
        ]
    out = [u for u in dict.fromkeys(chosen) if u in watched]
    return sorted(out, key=lambda u: index_of.get(u, len(index_of)))
