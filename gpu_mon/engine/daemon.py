"""The daemon: a loop over parts that each own one thing.

    wake (loop.py: signals, the inotify fd, workloads' pipes, deadlines)
      -> the yield path (yieldpath.py): opens of GPU nodes, from the event to the stop
      -> the scan that is due (scanclock.py: poll, deferred full scan, a paused scan owed)
      -> a round (round.py: scan, plan, snapshot, decide, look again, act, publish), each tier
         (tiers.py: the users' queue, Slurm's preemptible jobs) at its points
      -> slower work: a reload (reload.py), the tiers' own (a queue that could not start)

A holder's close of a GPU's node (closes.py) brings the next poll forward, so that a GPU let go is seen
free at once, not at the next poll."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Callable, Iterable, List, Optional, Sequence

from gpu_mon.api.observe import Backend, Observer, unexplained
from gpu_mon.api.procfs import read_stat
from gpu_mon.config import Config, ConfigError
from gpu_mon.engine import reload, scanclock
from gpu_mon.engine.closes import CLOSE_AGAIN, CLOSE_POLL_GAP, CloseWatch
from gpu_mon.engine.idle import DaemonSentinel
from gpu_mon.engine.idlecommand import IdleCommands
from gpu_mon.engine.idleround import IdleRound
from gpu_mon.engine.loop import Listener, Loop
from gpu_mon.engine.openers import Openers
from gpu_mon.engine.opens import OpenWatch
from gpu_mon.engine.reload import Reloader
from gpu_mon.engine.round import Parts, Round
from gpu_mon.engine.tiers import TierMaker, Wiring
from gpu_mon.engine.workloads import cgroups, linux, stopping
from gpu_mon.engine.workloads.supervisor import Supervisor
from gpu_mon.engine.yieldpath import YieldPath
from gpu_mon.engine.yields import Yields
from gpu_mon.policy import words

log = logging.getLogger("gpu_mon")

# How long another of our threads (the history writer, the metrics server, a reload) may keep the
# interpreter's lock once the loop wants it back (Python's default is 5 ms: a woken loop waited for it).
_SWITCH_SECONDS = 0.0005
_STOP = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
# SIGHUP reloads, SIGUSR1 logs a status line, SIGUSR2 asks for a full scan; SIGALRM is ignored.
_CAUGHT = (*_STOP, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2)


class Daemon:
    """`gpu-mon run` (and `gpu-mon occupy`'s occupier, on its own config)."""

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
        tiers: Sequence[TierMaker] = (),
    ):
        self.config = config
        self.trusted_uid = trusted_uid
        self.clock, self.wall = clock, wall
        self.source = source
        self.loop = Loop()
        self.loop.listeners.extend(listeners)
        self.observer = Observer(backend, wall=wall)
        self.opens = OpenWatch(self.observer)
        self.closes = CloseWatch(self.observer)
        openers = Openers(self.observer)
        self.observer.after_scan = lambda: openers.scanned(self.opens.pending)
        self.supervisor = Supervisor(self.loop.selector, stopping.rule_for(None, config.defaults))
        self.reloader = Reloader(self.loop.poke)
        self.idle: Optional[DaemonSentinel] = None
        self.scans = scanclock.ScanClock(config.defaults)
        idle = IdleRound(IdleCommands(self.supervisor.spawn_helper))
        parts = Parts(
            self.observer,
            self.supervisor,
            self.opens,
            openers,
            self.scans,
            Yields(clock, wall),
            idle,
            self.loop,
        )
        self.round = Round(config, parts, wall, source)
        wiring = Wiring(config, self.supervisor, self.loop.poke, clock, wall, self.round.say)
        self.tiers = parts.tiers = tuple(make(wiring) for make in tiers)
        self.yields = YieldPath(self.round)
        self.signals_caught = False
        self.stopping = 0
        stat = read_stat(os.getpid())
        self.round.daemon = {"pid": os.getpid(), "start_ticks": stat.start_ticks if stat else 0}
        self.round.daemon["started_wall"] = wall()

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        """Run until SIGTERM/SIGINT/SIGQUIT and every workload is gone; return the exit code."""
        self._set_up()
        while not (self.stopping and not self.supervisor.busy()):
            deadlines = (
                *self.scans.deadlines(),
                self.yields.deadline(),
                self.supervisor.next_deadline(self.clock()),
                *(t.deadline() for t in self.tiers),
                self.round.decision.next_wake if self.round.decision else None,
            )
            ready = self.loop.wait(deadlines, self.clock())
            now = self.clock()
            try:
                self._handle(ready, now)
            except Exception:  # a bug must not take the workloads' supervisor down with it
                self._internal_error(now)
        self._finish()
        return 0

    def _set_up(self) -> None:
        sys.setswitchinterval(_SWITCH_SECONDS)
        try:
            linux.prctl(linux.PR_SET_CHILD_SUBREAPER, 1)
        except OSError as err:
            log.warning("cannot become a child subreaper: %s", err.strerror)
        self.catch_signals()
        tree, self.round.daemon["containment"] = cgroups.choose(self.config.defaults.containment, os.getpid())
        self.supervisor.contain_in(tree)
        for tier in self.tiers:
            tier.start(self.clock())
        self._start_watching()
        _say_hello(self.config, self.source, self.observer.scanner.incremental, self.round.daemon)
        self._set_sentinel()
        # The nodes are watched before the first scan: an open during that scan is an event, not a poll later.
        self.observer.read_gpus(process_utilization=False)
        self.opens.rewatch()
        self.closes.follow(self.opens.watching())
        self._poll(self.clock(), full=True)
        self.opens.refresh()  # (and the nodes of other mount namespaces the scan found)
        self.closes.follow(self.opens.watching())
        self.loop.announce("ready")

    def catch_signals(self) -> None:
        """From now on SIGTERM and friends are counted and handled by the loop (a stop before `run` is kept
        for it). Call before taking the state file's lock: a daemon that holds it stops cleanly."""
        if not self.signals_caught:
            self.loop.catch(_CAUGHT, ignore=(signal.SIGALRM,))
            self.signals_caught = True

    def _set_sentinel(self) -> None:
        """The [sentinel] listener for the current config (anew: a changed section starts over)."""
        if self.idle is not None:
            self.loop.listeners.remove(self.idle)
            self.idle = None
        s = self.config.sentinel
        if s is not None:
            interval = self.config.defaults.interval_seconds
            self.idle = DaemonSentinel(s, interval, self.end, self.supervisor.spawn_helper, self.clock)
            self.loop.listeners.append(self.idle)

    def end(self) -> None:
        """Stop every workload and exit 0, as SIGTERM does (the sentinel's end_process)."""
        self.stopping += 1
        if self.stopping == 1:
            self._shutdown(self.clock())

    def _start_watching(self) -> None:
        d = self.config.defaults
        if d.watch_opens:
            self.opens.start(self.loop.add_reader, d.interval_seconds)
            self.closes.start(self.loop.add_reader)
        else:
            log.info("watch_opens = no: noticing GPU use only by polling every %g s", d.interval_seconds)

    def _internal_error(self, now: float) -> None:
        """Fail closed after an unexpected error: stop every workload, keep running, try again next round."""
        log.exception("internal error (please report it); stopping every workload to be safe")
        self.round.said.append({"wall": self.wall(), "text": "internal error: stopping every workload"})
        for tier in self.tiers:
            tier.stop_all()
        self.supervisor.stop_all("internal error in gpu-mon", now)
        self.scans.next_poll = now + self.config.defaults.interval_seconds

    def _handle(self, ready: List[tuple], now: float) -> None:
        self.round.p.yields.woke(now)
        exits = False
        for kind, name in ready:
            if kind == "inotify":
                self.opens.read()
            elif kind == "closes":
                if self.closes.read():  # a holder let go: is its GPU free now?
                    self.scans.poll_soon(now, CLOSE_POLL_GAP, CLOSE_AGAIN)
            elif self.supervisor.dispatch(kind, name, now) is not None:
                exits = True
        self._take_signals(now)
        self.supervisor.tick(now)
        self._rounds(now, exits)
        # Slower work comes after the yield path, so that it never delays a stop.
        self._reload_if_asked(now)
        if not self.stopping and any([t.later(now) for t in self.tiers]):
            self.scans.poll_now(now)
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
            self.scans.full_requested = self.scans.every_next = True
        if self.loop.take(signal.SIGUSR1):
            report = self.round.report
            log.info("status: %s", words.status_line(report) if report else "no round yet")

    def _rounds(self, now: float, exits: bool) -> None:
        """The rounds this wake calls for: opens first, then the scan that is due, or a re-decide."""
        ran = self.yields.on_wake(now)
        due = self.scans.due(now)
        if due == scanclock.OWED:
            mode = self.scans.take_owed()
            # (a full scan goes on where it stopped; one that a full scan of the open's made moot is dropped)
            if mode not in ("full", "fds") or self.observer.full_paused() or self.scans.every_next:
                self.round.run(now, scan=mode, pause=True)
        elif due in (scanclock.POLL, scanclock.FULL_POLL):
            self._poll(now, full=due == scanclock.FULL_POLL)
        elif due == scanclock.DEFERRED:
            self.scans.take_deferred(now)
            self.round.run(now, scan="fds", pause=True)
        elif not ran and (exits or self._wake_due(now)):
            self.round.run(now, scan=None)
        self.yields.guard()
        self.opens.refresh()
        self.closes.follow(self.opens.watching())
        if self.observer.rescan_wanted and self.scans.deferred_full is None:
            # A holder let go of a GPU: its descriptor may have been handed to another process (or to one
            # that shares its fd table without being a thread of it: every process is read).
            self.observer.rescan_wanted = False
            self.scans.defer_full(now, every=True)

    def _wake_due(self, now: float) -> bool:
        """A start delay or a restart backoff the last decision waits for has run out, or a tier wants one."""
        wake = self.round.decision.next_wake if self.round.decision else None
        return (wake is not None and now >= wake) or any([t.wanted(now) for t in self.tiers])

    def _poll(self, now: float, full: bool) -> None:
        was = self.observer.reading
        sample = self.scans.polling(now, full, self.observer.scanner.incremental)
        self.observer.read_gpus(process_utilization=sample)
        covered = self.opens.covers()
        scan = self.scans.poll_scan(
            now, full, covered, lambda: unexplained(was, self.observer.reading, self.observer.holders)
        )
        self.round.run(now, scan=scan, pause=True)

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
            self.round.say(
                f"reload failed ({len(err.errors)} problem(s)); still running on the old config",
                logging.ERROR,
            )
        except Exception:  # an unexpected error reading the file: keep running on what we have
            log.exception("reload failed; still running on the old config")
        else:
            if new is None:
                return False
            new, notes = reload.keep_start_only(self.config, new)
            for note in notes:
                log.warning("reload: %s", note)
            self._apply(new, now)
            return True
        self.loop.announce("ready")
        return True

    def _apply(self, new: Config, now: float) -> None:
        what = reload.reloaded(self.config, new)
        for warning in new.warnings:
            log.warning("%s", warning)
        self.config = self.round.config = new
        self.scans.defaults = new.defaults
        for tier in self.tiers:
            tier.reconfigure(new)
        if what.sentinel_changed:
            self._set_sentinel()
        if what.watch_changed:
            self.opens.stop(self.loop.remove_reader)
            self.closes.stop(self.loop.remove_reader)
            self._start_watching()
            self.opens.rewatch()
            self.closes.follow(self.opens.watching())
        self.round.plan = None
        self.round.reported_problems.clear()
        reload.restart_changed(self.supervisor, new, what, now, self.round.say)
        dropins = f" and {', '.join(new.files[1:])}" if new.files[1:] else ""
        self.round.say(f"reloaded {new.path}{dropins}; {what.sections}")
        self.scans.poll_now(now)  # look again with the new rules at once (next wake, with a fresh NVML read)
        self.round.run(now, scan=None)  # and publish what the reload stopped
        self.loop.announce("ready")

    def _shutdown(self, now: float, why: str = "") -> None:
        """Stop every workload; one line says why (`stopping on SIGTERM: 2 workload(s) to stop`, and each
        tier's jobs apart: `1 queue job(s) to stop, back to the queue`)."""
        self.loop.announce("stopping")
        self.round.stopping = True
        left = sum(t.leave_running() for t in self.tiers)  # (units that outlive gpu-mon: not stopped)
        keys = list(self.supervisor.workloads)
        owned = [t.owned(keys) for t in self.tiers]
        count = len(keys) - sum(n for n, _text in owned)
        parts = [f"{count} workload(s) to stop"] if count else []
        parts += [f"{n} {text}" for n, text in owned if n]
        parts += [f"{left} queue job(s) left running"] if left else []
        self.round.say(f"stopping{' ' + why if why else ''}{': ' + ', '.join(parts) if parts else ''}")
        for tier in self.tiers:
            tier.stop_all()
        self.supervisor.stop_all("gpu-mon is stopping", now)

    def _finish(self) -> None:
        self.reloader.close()
        for tier in self.tiers:
            tier.close()
        log.info("gpu-mon stopped")
        self.loop.announce("stopped")
        self.opens.stop(self.loop.remove_reader)
        self.closes.stop(self.loop.remove_reader)
        self.observer.backend.close()
        self.loop.close()


def _say_hello(config: Config, source: str, incremental: bool, daemon: dict) -> None:
    d = config.defaults
    log.info(
        "gpu-mon starting: config %s, %s, polling every %g s, start delay %g s%s",
        config.path,
        source or "NVML",
        d.interval_seconds,
        d.start_delay_seconds,
        "" if incremental else " (kernel < 6.2: every poll is a full /proc scan)",
    )
    log.info("containment: %s", daemon["containment"])
    for warning in config.warnings:
        log.warning("%s", warning)
