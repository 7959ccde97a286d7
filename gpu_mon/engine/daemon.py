"""The daemon: wiring of one round, again and again. Each wake: observe -> decide -> look again before
stopping -> act -> tell the listeners (state file, notify, ...), which never steer it.

Fast path: an open of a GPU node (inotify IN_OPEN) triggers an incremental holder scan with the last GPU
reading that reads the likeliest openers first (the latest that changed or appeared, then new processes,
then the newest) and stops at the first foreign holder of that GPU: the stops it calls for go out at once
(after the look again); the daemon then leaves the CPU for up to _STEP_ASIDE_SECONDS, so that the
signalled workload runs, and the rest of the scan follows before the round logs and publishes the whole
picture. An open that the incremental scan cannot explain triggers a full scan (at most two a second; a
later one is deferred, never dropped). The polling timer (interval_seconds) reads NVML and looks at new
processes, holders and young ones; every process's fd signature is compared every _SIGNATURE_SECONDS, at
every poll where opens cannot all be watched, and at once when NVML shows use the holders found do not
explain. A full scan, memory maps included, runs every full_scan_seconds, and soon after a holder lets go
of a GPU (its descriptor may have been handed on: that one reads every process, the others only those that
ran since they were read). The scans of polls and of deferred full scans give way to an open: they pause
when one waits, the open is served, and they go on (`owed`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import signal
import sys
import time
from typing import Callable, Deque, Dict, Iterable, List, Optional, Set, Tuple

from gpu_mon.api.model import GpuReading, Holder, QueueJob, Snapshot
from gpu_mon.api.observe import Backend, Observer, unexplained
from gpu_mon.api.procfs import read_stat
from gpu_mon.config import Config, ConfigError
from gpu_mon.engine import reload
from gpu_mon.engine.idle import DaemonSentinel
from gpu_mon.engine.idlecommand import IdleCommands
from gpu_mon.engine.loop import Listener, Loop, RoundReport
from gpu_mon.engine.openers import Openers
from gpu_mon.engine.opens import OpenRetry, OpenWatch, retry_for
from gpu_mon.engine.reload import Reloader
from gpu_mon.engine.workloads import cgroups, linux, stopping
from gpu_mon.engine.workloads.supervisor import StartError, Supervisor
from gpu_mon.policy import decide as policy
from gpu_mon.policy import gpustate, idleholders, words
from gpu_mon.policy.decisions import Decision, PolicyState, Preemption, Start, Stop
from gpu_mon.queue.retry import QueueRetry, next_try
from gpu_mon.queue.runner import PREFIX as JOB_PREFIX
from gpu_mon.queue.runner import Queue, queue_gpus
from gpu_mon.slurm.owed import path_for as owed_path
from gpu_mon.slurm.preempt import Slurm

log = logging.getLogger("gpu_mon")

_EVENT_FULL_SCAN_GAP = 0.5  # at most two unexplained-open full scans a second
# After a foreign open's stop signal goes out, the daemon leaves the CPU this long (or until another open)
# before it reads the rest of /proc: on a 2-core machine the signalled workload otherwise waited up to ~9 ms
# for a core behind that read (p99 of the signal to its handler 5.4 ms; 3.5 ms with the pause).
_STEP_ASIDE_SECONDS = 0.005
# How long another of our threads (the history writer, the metrics server, a reload) may keep the
# interpreter's lock once the loop wants it back (Python's default is 5 ms: a woken loop waited for it).
_SWITCH_SECONDS = 0.0005
_SIGNATURE_SECONDS = 10.0  # every process's fd signature compared at least this often (a poll's own cost)
# Per-process utilization (status, idle holders, [sentinel]) is read every 5th poll, at least every 10 s,
# and carried between: NVML's call costs 1.4 ms a GPU on an H200 (driver 580), 90% of a whole look.
_UTILIZATION_SECONDS, _UTILIZATION_POLLS = 10.0, 5
_EMPTY_PLAN = policy.Plan(rules={}, instances=(), index_of={})
_STOP = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
# SIGHUP reloads, SIGUSR1 logs a status line, SIGUSR2 asks for a full scan; SIGALRM is ignored.
_CAUGHT = (*_STOP, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2)


class Daemon:
    """`gpu-mon run`."""

    def __init__(
        self,
        config: Config,
        backend: Backend,
        *,
        trusted_uid: Optional[int] = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        listeners: Iterable[Listener] = (),
        source: str = "",
    ):
        self.config = config
        self.trusted_uid = trusted_uid
        self.clock, self.wall = clock, wall
        self.source = source
        self.loop = Loop()
        self.loop.listeners.extend(listeners)
        self.observer = Observer(backend, wall=wall)
        self.opens = OpenWatch(self.observer)
        self.openers = Openers(self.observer)
        self.observer.after_scan = lambda: self.openers.scanned(self.opens.pending)
        self.supervisor = Supervisor(self.loop.selector, stopping.rule_for(None, config.defaults))
        self.reloader = Reloader(self.loop.poke)
        self.idle: Optional[DaemonSentinel] = None
        self.idle_track = idleholders.IdleTrack({}, {})
        self.idle_commands = IdleCommands(self.supervisor.spawn_helper)
        self.wake_at = 0.0  # when this wake of the loop began (yield latencies count from it)
        self.wake_by_open = False
        self.yielding: Dict[str, dict] = {}  # workload key -> the stop for a busy GPU under way
        self.signals_caught = False
        self.containment = ""
        self.state = PolicyState()
        self.plan: Optional[policy.Plan] = None
        self.reported_problems: Set[str] = set()
        self.said: Deque[dict] = collections.deque(maxlen=30)
        self.last_busy: Dict[str, bool] = {}
        self.decision: Optional[Decision] = None
        self.report: Optional[RoundReport] = None
        self.stopping = 0
        self.next_poll = 0.0
        self.next_utilization = 0.0  # when a poll next asks NVML for per-process utilization
        self.next_full = 0.0
        self.next_signatures = 0.0
        self.sent_first: Dict[str, tuple] = {}  # workload key -> (Stop, label, pid): sent before the round
        self.full_scan_requested = False
        self.last_event_full = -1e9
        # `gpu-mon occupy`: the running jobs of the daemon's queue and why they cannot be known (the GPUs of
        # those jobs, or every GPU, are busy: commands/occupy_queue.py)
        self.queue_jobs: Optional[Callable[[], Tuple[Tuple[QueueJob, ...], str]]] = None
        self.deferred_full: Optional[float] = None
        self.open_retry: Optional[OpenRetry] = None  # an open no scan explained yet: looked at again soon
        self.owed: Optional[str] = None  # a scan that paused for an open: it goes on once that is handled
        self.every_next = False  # the next full scan reads every process (see Observer.scan)
        self.queue: Optional[Queue] = None  # [queue]: users' jobs (queue/runner.py)
        self.queue_retry: Optional[QueueRetry] = None  # a queue that could not start: tried again
        self.slurm: Optional[Slurm] = None  # [slurm]: preemptible Slurm jobs (slurm/preempt.py)
        self.started_wall = wall()
        stat = read_stat(os.getpid())
        self.start_ticks = stat.start_ticks if stat else 0

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        """Run until SIGTERM/SIGINT/SIGQUIT and every workload is gone; return the exit code."""
        sys.setswitchinterval(_SWITCH_SECONDS)
        try:
            linux.prctl(linux.PR_SET_CHILD_SUBREAPER, 1)
        except OSError as err:
            log.warning("cannot become a child subreaper: %s", err.strerror)
        self.catch_signals()
        tree, self.containment = cgroups.choose(self.config.defaults.containment, os.getpid())
        self.supervisor.contain_in(tree)
        self._start_queue()
        self._set_slurm()
        self._start_watching()
        self._say_hello()
        self._set_sentinel()
        self._poll(self.clock(), full=True)
        self.opens.rewatch()
        self.loop.announce("ready")
        while True:
            if self.stopping and not self.supervisor.busy():
                break
            owed = 0.0 if self.owed is not None else None  # (a scan that paused goes on at once)
            deadlines = (
                self.next_poll,
                self.deferred_full,
                self.open_retry.at if self.open_retry else None,
                owed,
                self.supervisor.next_deadline(self.clock()),
            )
            if self.queue is not None:
                deadlines += (self.queue.next_wake,)
            deadlines += (next_try(self.queue_retry),)
            if self.slurm is not None:
                deadlines += (self.slurm.next_wake(),)
            wake = self.decision.next_wake if self.decision else None
            ready = self.loop.wait((*deadlines, wake), self.clock())
            now = self.clock()
            try:
                self._handle(ready, now)
            except Exception:  # a bug must not take the workloads' supervisor down with it
                self._internal_error(now)
        self._finish()
        return 0

    def catch_signals(self) -> None:
        """From now on SIGTERM and friends are counted and handled by the loop (a stop before `run` is kept
        for it). Call before taking the state file's lock: a daemon that holds it stops cleanly."""
        if not self.signals_caught:
            self.loop.catch(_CAUGHT, ignore=(signal.SIGALRM,))
            self.signals_caught = True

    def _say_hello(self) -> None:
        d = self.config.defaults
        log.info(
            "gpu-mon starting: config %s, %s, polling every %g s, start delay %g s%s",
            self.config.path,
            self.source or "NVML",
            d.interval_seconds,
            d.start_delay_seconds,
            "" if self.observer.scanner.incremental else " (kernel < 6.2: every poll is a full /proc scan)",
        )
        log.info("containment: %s", self.containment)
        for warning in self.config.warnings:
            log.warning("%s", warning)

    def _set_sentinel(self) -> None:
        """The [sentinel] listener for the current config (anew: a changed section starts over)."""
        if self.idle is not None:
            self.loop.listeners.remove(self.idle)
            self.idle = None
        s = self.config.sentinel
        if s is not None:
            self.idle = DaemonSentinel(
                s, self.config.defaults.interval_seconds, self.end, self.supervisor.spawn_helper, self.clock
            )
            self.loop.listeners.append(self.idle)

    def end(self) -> None:
        """Stop every workload and exit 0, as SIGTERM does (the sentinel's end_process)."""
        self.stopping += 1
        if self.stopping == 1:
            self._shutdown(self.clock())

    def _start_queue(self) -> None:
        """[queue]: open its database and socket; without them gpu-mon runs on, without the queue, and
        tries again later (queue/retry.py)."""
        if self.config.queue is None:
            return
        try:
            self.queue = Queue(self.config, self.supervisor, self.loop.poke, self.wall, self._say)
            self.queue.start()
        except Exception as err:  # a database, socket or lock we cannot have: one line, and no queue yet
            self.queue = None
            self.queue_retry = self.queue_retry or QueueRetry()
            delay = self.queue_retry.failed(str(err), self.clock(), self.wall())
            log.error("queue: cannot start the queue: %s; trying again in %.0f s", err, delay)
            return
        if self.queue_retry is not None:
            log.info("queue: started (after %d failed tries)", self.queue_retry.tries)
            self.queue_retry = None
            self.next_poll = self.clock()  # its round at once

    def _retry_queue(self, now: float) -> None:
        """The queue that could not start, when its next try is due (never while stopping)."""
        if self.queue_retry is not None and self.queue_retry.due(now) and not self.stopping:
            self._start_queue()

    def _set_slurm(self) -> None:
        """[slurm] as the config has it now: the hook made, changed or closed."""
        rule = self.config.slurm
        if rule is None and self.slurm is not None:
            self.slurm.close()
            self.slurm = None
        elif rule is not None and self.slurm is None:
            record = owed_path(self.config.defaults.state_file)
            self.slurm = Slurm(
                rule, self.loop.poke, self.clock, self.wall, self.supervisor.spawn_helper, record
            )
            log.info("slurm: jobs of %s yield to anyone else's use of their GPUs", self.slurm.whose())
        elif rule is not None and self.slurm is not None:
            self.slurm.set_rule(rule)

    def _start_watching(self) -> None:
        d = self.config.defaults
        if d.watch_opens:
            self.opens.start(self.loop.add_reader, d.interval_seconds)
        else:
            log.info("watch_opens = no: noticing GPU use only by polling every %g s", d.interval_seconds)

    def _internal_error(self, now: float) -> None:
        """Fail closed after an unexpected error: stop every workload, keep running, try again next round."""
        log.exception("internal error (please report it); stopping every workload to be safe")
        self.said.append({"wall": self.wall(), "text": "internal error: stopping every workload"})
        if self.queue is not None:
            try:
                self.queue.requeue_running()
            except Exception:  # (the error may be the queue's own: the jobs are stopped all the same)
                log.exception("queue: cannot mark the running jobs to be requeued")
        self.supervisor.stop_all("internal error in gpu-mon", now)
        self.next_poll = now + self.config.defaults.interval_seconds

    def _handle(self, ready: List[tuple], now: float) -> None:
        self.wake_at, self.wake_by_open = now, False
        self.sent_first.clear()  # (a round that raised may have left some)
        exits = False
        for kind, name in ready:
            if kind == "inotify":
                self.opens.read()
            elif self.supervisor.dispatch(kind, name, now) is not None:
                exits = True
        self._take_signals(now)
        self.supervisor.tick(now)
        self._rounds(now, exits)
        # Slower work comes after the yield path, so that it never delays a stop.
        self._reload_if_asked(now)
        self._retry_queue(now)
        self.loop.announce("alive")

    def _take_signals(self, now: float) -> None:
        if self.loop.take(signal.SIGCHLD):
            self.supervisor.reap_orphans()
        taken = [(s, self.loop.take(s)) for s in _STOP]
        stops = sum(n for _s, n in taken)
        if stops:
            self.stopping += stops
            if self.stopping == stops:
                self._shutdown(now, "on " + next(signal.Signals(s).name for s, n in taken if n))
            if self.stopping > 1:
                self.supervisor.kill_all_now(now)  # a second SIGTERM: no more waiting
        if self.loop.take(signal.SIGUSR2):
            self.full_scan_requested = self.every_next = True
        if self.loop.take(signal.SIGUSR1):
            log.info("status: %s", words.status_line(self.report) if self.report else "no round yet")

    def _rounds(self, now: float, exits: bool) -> None:
        """The rounds this wake calls for: opens first, then a poll, a deferred full scan or a re-decide."""
        ran = False
        opened = self.opens.take()
        if opened:
            self.wake_by_open = True
            self._on_open(opened, now)
            ran = True
        elif self.open_retry is not None and now >= self.open_retry.at:
            self._retry_open(now)
            ran = True
        if self.owed is not None:
            self._go_on(now)
        elif now >= self.next_poll or self.full_scan_requested:
            full = now >= self.next_full or self.full_scan_requested
            self.full_scan_requested = False
            self._poll(now, full=full)
        elif self.deferred_full is not None and now >= self.deferred_full:
            self.deferred_full = None
            self.last_event_full = now
            self._round(now, scan="fds", pause=True)
        elif not ran and (exits or self._wake_due(now)):
            self._round(now, scan=None)
        self.opens.refresh()
        if self.observer.rescan_wanted and self.deferred_full is None:
            # A holder let go of a GPU: its descriptor may have been handed to another process (or to one
            # that shares its fd table without being a thread of it: every process is read).
            self.observer.rescan_wanted = False
            self.every_next = True
            self.deferred_full = max(now, self.last_event_full + _EVENT_FULL_SCAN_GAP)

    def _go_on(self, now: float) -> None:
        """The scan that paused for an open, once that open has been handled (a full scan goes on where it
        stopped; one that a full scan of the open's has made moot is dropped)."""
        mode, self.owed = self.owed, None
        if mode in ("full", "fds") and not self.observer.full_paused() and not self.every_next:
            return
        self._round(now, scan=mode, pause=True)

    def _wake_due(self, now: float) -> bool:
        """A start delay or a restart backoff the last decision waits for has run out."""
        wake = self.decision.next_wake if self.decision else None
        return (
            (wake is not None and now >= wake)
            or (self.queue is not None and self.queue.wanted(now))
            or (self.slurm is not None and self.slurm.wanted(now))
        )

    def _poll(self, now: float, full: bool) -> None:
        d = self.config.defaults
        was = self.observer.reading
        sample = now >= self.next_utilization
        self.observer.read_gpus(process_utilization=sample)
        if sample:
            self.next_utilization = now + min(_UTILIZATION_SECONDS, _UTILIZATION_POLLS * d.interval_seconds)
        self.next_poll = now + d.interval_seconds
        if full or not self.observer.scanner.incremental:
            self.next_full = now + d.full_scan_seconds
        scan = "full" if full else "changed" if self._signatures_due(now, was) else "new"
        if scan != "new":
            self.next_signatures = now + max(d.interval_seconds, _SIGNATURE_SECONDS)
        self._round(now, scan=scan, pause=True)

    def _signatures_due(self, now: float, was: GpuReading) -> bool:
        """Whether this poll compares every process's fd signature: every _SIGNATURE_SECONDS; at every poll
        where an open of some GPU's node would not wake us; at once when NVML shows a process that is not a
        known holder of that GPU or memory used changed. (New processes, holders and young ones are looked
        at in every poll.)"""
        if now >= self.next_signatures or not self.opens.covers():
            return True
        return unexplained(was, self.observer.reading, self.observer.holders)

    def _on_open(self, opened: Set[str], now: float) -> None:
        """A GPU node was opened: find the opener with an incremental scan, else a (rate-limited) full one.

        The open is never dropped: when the full scan has to wait for its rate limit it is deferred, and a
        poll that comes in the same wake does not replace it (a poll's incremental scan misses a process
        that swapped a descriptor in place, as a CUDA program's imports can: this was a CI flake). An open
        the incremental scan does explain is confirmed by a full scan within 0.5 s all the same: the
        process that explained it may be a child that inherited the descriptor from the real opener.
        """
        uuids = {self.observer.watch_targets().get(path) for path in opened}
        before = self.openers.before()
        named = self.opens.openers()
        explained = self._explained("first", uuids, named)
        if not self.observer.scan_complete:  # a foreign holder of an opened GPU: it is yielded to first
            self._yield_first(now)
            if self.sent_first:  # (its handler runs now, even where other processes hold every core)
                self.opens.wait(_STEP_ASIDE_SECONDS)
            explained = self._explained("changed", uuids, polite=bool(self.sent_first)) | explained
        for uuid in self.openers.note(uuids, before, now):  # a process we cannot read opened it: at once
            log.debug("open of %s by a process whose files cannot be read", uuid)
        self.open_retry = None if explained else retry_for(uuids, named, now)
        if explained:
            self._round(now, scan=None)
            if not self._still_held(explained, uuids):
                self.open_retry = retry_for(uuids, named, now)
            # Explained by *a* new holder, which may only have inherited the descriptor (a fork) while the
            # opener swapped one in place and went unseen: confirm with a full scan soon.
            if self.deferred_full is None:
                self.deferred_full = max(now, self.last_event_full + _EVENT_FULL_SCAN_GAP)
        elif now - self.last_event_full >= _EVENT_FULL_SCAN_GAP:
            # Every process's every fd table; if even that does not explain it, memory maps too (a process
            # that opened, mapped and closed the node between two looks).
            self.last_event_full = now
            found = self._explained("fds", uuids)
            if found:
                self.open_retry = None
            self._round(now, scan=None if found else "full")
        else:
            self._round(now, scan=None)
            if self.deferred_full is None:
                self.deferred_full = self.last_event_full + _EVENT_FULL_SCAN_GAP

    def _retry_open(self, now: float) -> None:
        """An open no scan explained, looked at again: its openers and the processes that changed."""
        retry, self.open_retry = self.open_retry, None
        assert retry is not None
        explained = self._explained("first", set(retry.uuids), retry.openers)
        if explained:
            log.debug("an open of %d GPU(s) explained on look %d", len(retry.uuids), retry.step + 2)
            self._round(now, scan=None)
        if not explained or not self._still_held(explained, set(retry.uuids)):
            self.open_retry = retry.later(now)

    def _still_held(self, explainers: Set[int], uuids: Set[Optional[str]]) -> bool:
        """Whether a process that explained an open still holds that GPU after the round. One that let go by
        the round's look again (it opened and closed the node) leaves the open looked at again, as one no
        scan explained: a descriptor it is handed later (SCM_RIGHTS, pidfd_getfd) makes no event of its
        own, and was found only by the next poll (a CI flake, polls 30 s apart)."""
        return any(h.pid in explainers and h.gpus & uuids for h in self.observer.holders)

    def _explained(
        self, scan: str, uuids: Set[Optional[str]], openers: Iterable[int] = (), polite: bool = False
    ) -> Set[int]:
        """Scan; the processes that scan read that now hold one of these GPUs (none: not explained). A
        'first' scan reads the `openers` the kernel named first and stops at the first holder of one of them
        that is not ours and that its [gpu-*] section does not ignore."""
        enough = self._foreign_holder(uuids) if scan == "first" else None
        mode = scan if enough else "changed"
        pause = _let_others_run if polite else None  # (a workload just signalled may be waiting for a core)
        self.observer.scan(mode, self.supervisor.sessions(), enough=enough, first=openers, pause=pause)
        rescanned = self.observer.last_rescanned
        return {h.pid for h in self.observer.holders if h.pid in rescanned and h.gpus & uuids}

    def _foreign_holder(self, uuids: Set[Optional[str]]) -> Optional[Callable[[Holder], bool]]:
        """Whether a holder makes one of these GPUs busy by the policy's rule for holders (one more holder
        changes the log line, not the decision); None while the plan has problems."""
        plan = self.plan
        if plan is None or plan.problems:
            return None
        rules = {u: plan.rules[u] for u in uuids if u in plan.rules}
        # (our workload's process on a GPU it was not given is someone else's use of that GPU)
        return lambda h: any(
            u in rules and not h.ours_on(u) and not policy.ignored(h, rules[u]) for u in h.gpus
        )

    def _yield_first(self, now: float) -> None:
        """The urgent stops a foreign open calls for, sent on what the search has read (confirmed by the look
        again, as in every round); the round after the rest of the scan logs them with the whole picture."""
        plan = self._ensure_plan()
        snap = self._snapshot(now, quick=True)
        if self.slurm is not None:  # a preemptible Slurm job on that GPU: Slurm is asked first, too
            self.slurm.round(snap, plan.rules, plan.index_of, self.wake_at, True)
        decision = policy.decide(self.config, plan, snap, self.state)
        stops = tuple(a for a in decision.actions if isinstance(a, Stop) and _urgent(a))
        queue_gpus_ = queue_gpus(self.queue.q, plan.rules, plan.index_of) if self.queue is not None else []
        jobs_hit = self.queue.hit(decision, queue_gpus_) if self.queue is not None else set()
        if not stops and not jobs_hit:
            return
        decision = dataclasses.replace(decision, actions=stops)
        decision, _snap = self._look_again(plan, snap, decision, now, quick=True, also=jobs_hit)
        if jobs_hit and self.queue is not None:  # queued jobs yield exactly as workloads do
            self.queue.yield_first(decision, plan.index_of, queue_gpus_, now)
        for stop in decision.actions:
            w = self.supervisor.workloads.get(stop.key) if isinstance(stop, Stop) and _urgent(stop) else None
            if w is not None and not w.stopping:
                why = words.stop(stop, plan.index_of)
                self.supervisor.stop(stop.key, why, now, urgent=True)
                self._yield_started(stop, w.label)
                self.sent_first[stop.key] = (stop, w.label, w.pid)
                log.debug("stopping %s before reading the rest of /proc: %s", w.label, why)

    def _with_first(self, decision: Decision) -> Decision:
        """The stops sent before the round, among its actions (for their log line), each with its GPUs'
        first reason as the whole picture has it."""
        if not self.sent_first:
            return decision
        sent = []
        for stop, _label, _pid in self.sent_first.values():
            busy = []
            for uuid, reason in stop.busy:
                v = decision.verdicts.get(uuid)
                busy.append((uuid, v.reasons[0] if v is not None and v.busy and v.reasons else reason))
            sent.append(dataclasses.replace(stop, busy=tuple(busy)))
        return dataclasses.replace(decision, actions=(*sent, *decision.actions))

    # ------------------------------------------------------------------ one round

    def _ensure_plan(self) -> policy.Plan:
        reading = self.observer.reading
        if self.plan is not None and not self.plan.problems:
            return self.plan
        if reading.error:
            return self.plan or _EMPTY_PLAN
        plan = policy.resolve(self.config, reading.gpus)
        for problem in plan.problems:
            if problem not in self.reported_problems:
                self.reported_problems.add(problem)
                log.error("%s:%s", self.config.path, problem)
        self.plan = plan
        return plan

    def _snapshot(self, now: float, quick: bool = False) -> Snapshot:
        """What the policy sees now. `quick` (a stop sent before the round): the last round's terminals,
        no exits or jobs taken (the round that follows takes them)."""
        tty = self.config.tty
        patterns = tty.devices if tty.enabled and not quick else None
        snap = self.observer.snapshot(now, self.supervisor.sessions(), patterns)
        snap = dataclasses.replace(
            snap,
            running=self.supervisor.running(),
            exited=() if quick else self.supervisor.take_exits(),
            unseen_opens=tuple(self.openers.unseen.values()),
        )
        if self.queue_jobs is not None:
            jobs, unknown = self.queue_jobs()
            snap = dataclasses.replace(snap, queue_jobs=jobs, queue_unknown=unknown)
        if self.slurm is not None:  # GPUs Slurm has allocated: its jobs', opened or not
            jobs_, unknown = self.slurm.allocations()
            snap = dataclasses.replace(snap, slurm_jobs=jobs_, slurm_unknown=unknown)
        if quick:
            return dataclasses.replace(snap, ttys=self.report.snapshot.ttys if self.report else ())
        return self.queue.take_jobs(snap) if self.queue is not None else snap

    def _round(self, now: float, scan: Optional[str], pause: bool = False) -> None:
        """Scan (`pause`: a scan of /proc that gives way to an open, and goes on after it), decide, act,
        publish."""
        if scan is not None and not self._scan(scan, pause):
            return
        plan = self._ensure_plan()
        snap = self._snapshot(now)
        decision = policy.decide(self.config, plan, snap, self.state)
        if any(isinstance(a, Stop) and a.gpus for a in decision.actions):
            decision, snap = self._look_again(plan, snap, decision, now)
        decision = self._with_first(decision)
        if self.slurm is not None:  # (before our own stops: asking Slurm only hands a call to a thread)
            self.slurm.round(snap, plan.rules, plan.index_of, self.wake_at, self.wake_by_open)
        self.state = decision.state
        self._log_transitions(plan, decision)
        for event in decision.events:
            self._say(words.restarting(event), logging.WARNING if event.failing else logging.INFO)
        if self.queue is not None:
            decision = self._queue_round(decision, plan, now)
        self._act(decision, plan, now)
        self.sent_first.clear()
        self.decision = decision
        self._publish(plan, snap, decision, self._yields_done(snap), self._idle_holders(plan, snap))

    def _scan(self, mode: str, pause: bool) -> bool:
        """Scan; False when the scan paused for an open (it is owed: the loop goes on with it after)."""
        full = mode in ("full", "fds")
        every = full and self.every_next
        self.observer.scan(
            mode, self.supervisor.sessions(), pause=self.opens.pending if pause else None, every=every
        )
        if self.observer.scan_paused:
            log.debug("the %s scan gives way to an open, and goes on after it", mode)
            self.owed = mode
            return False
        if every:
            self.every_next = False
        return True

    def _look_again(
        self,
        plan: policy.Plan,
        snap: Snapshot,
        decision: Decision,
        now: float,
        quick: bool = False,
        also: Set[str] = frozenset(),
    ) -> tuple[Decision, Snapshot]:
        """Look again before doing something destructive: re-read the holders of the busy GPUs (those of the
        stops, and `also`: running jobs' GPUs)."""
        stops = [a for a in decision.actions if isinstance(a, Stop)]
        busy = {u for s in stops for u in s.gpus} | set(also)
        pids = [h.pid for h in self.observer.holders if h.gpus & busy]
        if pids:
            self.observer.scan("pids", self.supervisor.sessions(), pids)
        again = dataclasses.replace(self._snapshot(now, quick), exited=snap.exited)
        second = policy.decide(self.config, plan, again, self.state)
        confirmed = {s.key for s in policy.stops_confirmed(decision.actions, second.actions)}
        for s in stops:
            if s.key not in confirmed:
                why = words.stop(s, plan.index_of)
                log.info("not stopping %s: a second look no longer finds the GPU busy (%s)", s.key, why)
        actions = tuple(a for a in second.actions if not isinstance(a, Stop) or a.key in confirmed)
        return dataclasses.replace(second, actions=actions), again

    def _queue_round(self, decision: Decision, plan: policy.Plan, now: float) -> Decision:
        """Workloads yield first; then the queue yields and places its jobs (queue/runner.py). Returns the
        decision's other actions, less the starts on GPUs that jobs hold or are about to take."""
        stops = tuple(a for a in decision.actions if isinstance(a, Stop))
        self._act(dataclasses.replace(decision, actions=stops), plan, now)
        rest = dataclasses.replace(decision, actions=tuple(a for a in decision.actions if a not in stops))
        uuids = queue_gpus(self.queue.q, plan.rules, plan.index_of)
        return self.queue.round(rest, plan.index_of, uuids, now, stopping=bool(self.stopping))

    def _act(self, decision: Decision, plan: policy.Plan, now: float) -> None:
        for action in decision.actions:
            if isinstance(action, Stop):
                w = self.supervisor.workloads.get(action.key)
                first = self.sent_first.pop(action.key, None)
                if first is not None:  # (its signal went out before the round)
                    self._say(f"{words.stop(action, plan.index_of)}; stopping {first[1]}[{first[2]}]")
                elif w is not None:
                    why = words.stop(action, plan.index_of)
                    urgent = _urgent(action)
                    self.supervisor.stop(action.key, why, now, urgent=urgent)
                    if urgent:
                        self._yield_started(action, w.label)  # a preemption
                    self._say(f"{why}; stopping {w.label}[{w.pid}]")
            elif isinstance(action, Start) and not self.stopping:
                self._start(action, plan, now)
        self._hurry(decision, now)

    def _hurry(self, decision: Decision, now: float) -> None:
        """A workload stopping with the full grace (a terminal user, a reload) whose GPU a foreign process
        has now opened: the rest of its stop gets the urgent grace."""
        for w in self.supervisor.workloads.values():
            if not w.stopping or w.urgent:
                continue
            for uuid in w.instance.gpus:
                v = decision.verdicts.get(uuid)
                if v is not None and v.busy and v.reasons and v.reasons[0].kind in gpustate.FOREIGN_REASONS:
                    self.supervisor.hurry(w)
                    break

    def _yield_started(self, stop: Stop, label: str) -> None:
        uuid, reason = stop.busy[0]
        self.yielding[stop.key] = {
            "uuid": uuid,
            "workload": label,
            "who": words.reason(reason),
            "by": "open" if self.wake_by_open else "poll",
            "wake": self.wake_at,
            "term_ms": (self.clock() - self.wake_at) * 1000,
            "wall": self.wall(),
        }

    def _yields_done(self, snap: Snapshot) -> tuple:
        """Preemptions whose workload is gone in this round."""
        done = []
        for ex in snap.exited:
            y = self.yielding.pop(ex.key, None)
            if y is not None:
                gone = (ex.ended_at - y["wake"]) * 1000
                done.append(
                    Preemption(y["wall"], y["uuid"], y["workload"], y["who"], y["by"], y["term_ms"], gone)
                )
        return tuple(done)

    def _idle_holders(self, plan: policy.Plan, snap: Snapshot) -> tuple:
        """The idle-holder episodes after this round (and a log line for each that began or ended)."""
        self.idle_track, started, ended = idleholders.track(plan.rules, snap, self.idle_track)
        for h in started:
            log.info(
                "idle holder on %s: %s %s[%d] holds %d MiB at <= %g%% for %s",
                words.gpu(h.uuid, plan.index_of),
                h.user,
                h.program,
                h.pid,
                h.memory_mib,
                plan.rules[h.uuid].idle_holder_utilization_pct if h.uuid in plan.rules else 1.0,
                words.duration(h.idle_seconds(snap.now)),
            )
            rules = plan.rules.get(h.uuid)
            if rules is not None and rules.idle_holder_command:
                label = f"{h.user} {h.program}[{h.pid}] on {words.gpu(h.uuid, plan.index_of)}"
                self.idle_commands.start(rules.idle_holder_command, h, snap.now, label)
        for h in ended:
            log.info(
                "idle holder on %s no more: %s %s[%d] (idle for %s)",
                words.gpu(h.uuid, plan.index_of),
                h.user,
                h.program,
                h.pid,
                words.duration(h.idle_seconds(snap.now)),
            )
        return tuple(self.idle_track.current.values()), started, ended

    def _start(self, action: Start, plan: policy.Plan, now: float) -> None:
        inst = action.instance
        section = policy.processes_by_name(self.config)[inst.process]
        label = inst.label(plan.index_of)
        try:
            rule = stopping.rule_for(section, self.config.defaults)
            w = self.supervisor.start(inst, section, label, now, rule)
        except StartError as err:
            self._say(f"cannot start {label}: {err}", logging.ERROR)
            self.supervisor.failed_to_start(inst.key, now, str(err))
            return
        gpus = ", ".join(f"GPU {plan.index_of.get(u, '?')}" for u in inst.gpus)
        self._say(
            f"{words.start(action, plan.index_of)}; starting {label}[{w.pid}] on {gpus} as {section.user}: "
            f"{' '.join(section.cmd)}"
        )

    def _log_transitions(self, plan: policy.Plan, decision: Decision) -> None:
        stopping_for = {u for a in decision.actions if isinstance(a, Stop) for u in a.gpus}
        for uuid in plan.rules:
            v = decision.verdicts.get(uuid)
            if v is None or self.last_busy.get(uuid) == v.busy:
                continue
            label = words.gpu(uuid, plan.index_of)
            if v.busy and uuid not in stopping_for:  # (else the stop line says it, with what it stops)
                self._say(f"{label} busy: {'; '.join(words.reason(r) for r in v.reasons)}")
            elif not v.busy and uuid in self.last_busy:
                self._say(f"{label} free")
            self.last_busy[uuid] = v.busy
        was = bool(self.decision and self.decision.paused_by)  # the previous round's decision
        if decision.paused_by and not was:
            self._say(f"pausing all work: terminal user {words.terminal(decision.paused_by[0])}")
        elif was and not decision.paused_by:
            self._say("terminal users idle again: work may resume")

    def _say(self, text: str, level: int = logging.INFO) -> None:
        log.log(level, "%s", text)
        self.said.append({"wall": self.wall(), "text": text})

    def _publish(
        self,
        plan: policy.Plan,
        snap: Snapshot,
        decision: Decision,
        yields: tuple = (),
        idle: tuple = ((), (), ()),
    ) -> None:
        self.report = RoundReport(
            config=self.config,
            plan=plan,
            snapshot=snap,
            decision=decision,
            workloads=tuple(self.supervisor.views()),
            said=tuple(self.said),
            daemon={
                "pid": os.getpid(),
                "start_ticks": self.start_ticks,
                "started_wall": self.started_wall,
                "containment": self.containment,
            },
            source=self.source,
            wall=self.wall(),
            preemptions=yields,
            idle_holders=idle[0],
            idle_started=idle[1],
            idle_ended=idle[2],
            scans=self.observer.take_scan_times(),
            queue=self.queue.report() if self.queue is not None else None,
            queue_down=self.queue_retry.report() if self.queue_retry is not None else None,
            slurm=self.slurm.report() if self.slurm is not None else None,
        )
        self.loop.publish(self.report)

    # ------------------------------------------------------------------ reload and shutdown

    def _reload_if_asked(self, now: float) -> None:
        if self.loop.take(signal.SIGHUP) and self.reloader.start(self.config.path, self.trusted_uid):
            self.loop.announce("reloading")
        if self._finish_reload(now) and self.reloader.take_again():
            self.reloader.start(self.config.path, self.trusted_uid)
            self.loop.announce("reloading")

    def _finish_reload(self, now: float) -> bool:
        """Apply a load the worker has finished; False while none has."""
        try:
            new = self.reloader.result()
        except ConfigError as err:
            for line in err.errors:
                log.error("reload: %s", line)
            self._say(
                f"reload failed ({len(err.errors)} problem(s)); still running on the old config",
                logging.ERROR,
            )
        except Exception:  # an unexpected error reading the file: keep running on what we have
            log.exception("reload failed; still running on the old config")
        else:
            if new is None:
                return False
            self._apply(self._keep_start_only(new), now)
            return True
        self.loop.announce("ready")
        return True

    def _keep_start_only(self, new: Config) -> Config:
        """state_file and containment are fixed for the daemon's life (the lock, the cgroup tree)."""
        d, old = new.defaults, self.config.defaults
        for key in ("state_file", "containment"):
            if getattr(d, key) != getattr(old, key):
                log.warning("reload: [defaults] %s changes take effect when gpu-mon restarts", key)
        fixed = dataclasses.replace(d, state_file=old.state_file, containment=old.containment)
        for section in ("history", "metrics"):
            if reload.unplaced(getattr(new, section)) != reload.unplaced(getattr(self.config, section)):
                log.warning("reload: [%s] changes take effect when gpu-mon restarts", section)
        queue, notes = reload.queue_on_reload(self.config.queue, new.queue)
        for note in notes:
            log.warning("reload: %s", note)
        kept = {"history": self.config.history, "metrics": self.config.metrics, "queue": queue}
        return dataclasses.replace(new, defaults=fixed, **kept)

    def _apply(self, new: Config, now: float) -> None:
        sections = reload.changes(self.config, new)
        old = policy.processes_by_name(self.config)
        fresh = policy.processes_by_name(new)
        changed = [n for n, p in old.items() if n not in fresh or fresh[n].fingerprint != p.fingerprint]
        for warning in new.warnings:
            log.warning("%s", warning)
        watch_changed = new.defaults.watch_opens != self.config.defaults.watch_opens
        sentinel_changed = _sentinel_rule(new) != _sentinel_rule(self.config)
        self.config = new
        if self.queue is not None and new.queue is not None:
            self.queue.reconfigure(new)  # (its socket and database stay until a restart)
        if sentinel_changed:
            self._set_sentinel()
        if watch_changed:
            self.opens.stop(self.loop.remove_reader)
            self._start_watching()
            self.opens.rewatch()
        self.plan = None
        self.reported_problems.clear()
        self.supervisor.rule = stopping.rule_for(None, new.defaults)
        for key, w in list(self.supervisor.workloads.items()):
            if w.instance.process in fresh:
                self.supervisor.set_rule(key, stopping.rule_for(fresh[w.instance.process], new.defaults))
            if w.instance.process in changed:
                self.supervisor.stop(key, "config changed", now)
                if w.instance.process in fresh:
                    self._say(f"config changed for [process-{w.instance.process}]; restarting {w.label}")
                else:
                    self._say(f"[process-{w.instance.process}] removed from the config; stopping {w.label}")
        self._set_slurm()
        dropins = f" and {', '.join(new.files[1:])}" if new.files[1:] else ""
        self._say(f"reloaded {new.path}{dropins}; {sections}")
        self.next_poll = now  # look again with the new rules at once (next wake, with a fresh NVML read)
        self._round(now, scan=None)  # and publish what the reload stopped
        self.loop.announce("ready")

    def _shutdown(self, now: float, why: str = "") -> None:
        """Stop every workload; one line says why (`stopping on SIGTERM: 2 workload(s) to stop`, and the
        queue's jobs apart: `1 queue job(s) to stop, back to the queue`)."""
        self.loop.announce("stopping")
        jobs = sum(1 for key in self.supervisor.workloads if key.startswith(JOB_PREFIX))
        count = len(self.supervisor.workloads) - jobs
        parts = [f"{count} workload(s) to stop"] if count else []
        parts += [f"{jobs} queue job(s) to stop, back to the queue"] if jobs else []
        self._say(f"stopping{' ' + why if why else ''}{': ' + ', '.join(parts) if parts else ''}")
        if self.queue is not None:
            self.queue.requeue_running()  # its running jobs go back to the queue
        self.supervisor.stop_all("gpu-mon is stopping", now)

    def _finish(self) -> None:
        self.reloader.close()
        if self.queue is not None:
            self.queue.close()
        if self.slurm is not None:
            self.slurm.close()
        log.info("gpu-mon stopped")
        self.loop.announce("stopped")
        self.opens.stop(self.loop.remove_reader)
        self.observer.backend.close()
        self.loop.close()


def _let_others_run() -> bool:
    """A scan's `pause` that never pauses, but lets the processes waiting for this core run first."""
    os.sched_yield()
    return False


def _urgent(stop: Stop) -> bool:
    """A foreign process opened the GPU (not: it went unreadable): it is about to allocate."""
    return bool(stop.busy) and stop.busy[0][1].kind in gpustate.FOREIGN_REASONS


def _sentinel_rule(config: Config) -> tuple:
    """What the [sentinel] listener is made from (not where in the file it is written)."""
    return (reload.unplaced(config.sentinel), config.defaults.interval_seconds)
