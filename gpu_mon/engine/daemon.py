"""The daemon: one thread, one `selectors` loop over inotify, the signal wakeup fd, workload pidfds and pipes,
and a timer. Each wake: observe -> decide -> look again before stopping -> act -> state file and notify.

Fast path: an open of a GPU node (inotify IN_OPEN) triggers an incremental holder scan (new processes and
processes whose fd count changed) with the last GPU reading, so the opener is usually found in a few ms at
1000 processes. An open that the incremental scan cannot explain triggers a full scan. The polling timer
(interval_seconds) reads NVML and scans incrementally; a full scan runs every full_scan_seconds.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import logging
import os
import selectors
import signal
import time
from typing import Callable, Deque, Dict, List, Optional, Set, Tuple

from gpu_mon import config as config_mod
from gpu_mon.api.model import Exited, Snapshot
from gpu_mon.api.observe import Backend, Observer
from gpu_mon.api.procfs import read_stat
from gpu_mon.config import Config, ConfigError
from gpu_mon.engine import policy
from gpu_mon.engine.decisions import Decision, PolicyState, Start, Stop
from gpu_mon.engine.inotify import Inotify
from gpu_mon.engine.workloads import cgroups, linux
from gpu_mon.engine.workloads.supervisor import StartError, Supervisor
from gpu_mon.outputs import statefile
from gpu_mon.outputs import status as report
from gpu_mon.outputs.notify import Notifier, watchdog_interval

log = logging.getLogger("gpu_mon")

_EVENT_FULL_SCAN_GAP = 0.5  # at most two unexplained-open full scans a second
_EMPTY_PLAN = policy.Plan(rules={}, instances=(), index_of={})


def _set_subreaper() -> None:
    try:
        linux.prctl(linux.PR_SET_CHILD_SUBREAPER, 1)
    except OSError as err:
        log.warning("cannot become a child subreaper: %s", err.strerror)


class ContainmentError(Exception):
    """`containment = cgroup` was asked for and cannot be had; str() is one line."""


def containment_tree(mode: str) -> Tuple[Optional[cgroups.CgroupTree], str]:
    """The cgroup tree to contain workloads in (None: the subreaper), and how to say which one it is."""
    if mode == "subreaper":
        return None, "subreaper (containment = subreaper)"
    tree, why = cgroups.CgroupTree.probe(os.getpid())
    if tree is None and mode == "cgroup":
        raise ContainmentError(f"containment = cgroup, but {why}")
    if tree is None:
        return None, f"subreaper ({why})"
    return tree, f"cgroup (a group per workload under {tree.parent})"


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
        notifier: Optional[Notifier] = None,
        source: str = "",
    ):
        self.config = config
        self.trusted_uid = trusted_uid
        self.clock, self.wall = clock, wall
        self.notifier = notifier or Notifier()
        self.source = source
        self.selector = selectors.DefaultSelector()
        self.observer = Observer(backend, wall=wall)
        self.supervisor = Supervisor(self.selector, config.defaults.stop_timeout_seconds)
        self.containment = ""
        self.status_line = ""
        self.state = PolicyState()
        self.plan: Optional[policy.Plan] = None
        self.reported_problems: Set[str] = set()
        self.decisions: Deque[dict] = collections.deque(maxlen=30)
        self.last_busy: Dict[str, bool] = {}
        self.decision: Optional[Decision] = None
        self.snapshot: Optional[Snapshot] = None
        self.inotify: Optional[Inotify] = None
        self.stop_requested = 0
        self.reload_requested = False
        self.status_requested = False
        self.full_scan_requested = False
        self.reload_future: Optional[concurrent.futures.Future] = None
        self.reload_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.reload_again = False
        self.child_exited = False
        self.opened: Set[str] = set()
        self.watched: Tuple[str, ...] = ()
        self.announced: Set[str] = set()
        self.started_wall = wall()
        self.next_poll = 0.0
        self.next_full = 0.0
        self.last_event_full = -1e9
        self.deferred_full: Optional[float] = None
        self.watchdog_every = watchdog_interval()
        self.next_watchdog = 0.0
        self.state_error_logged = False
        self.published: Optional[dict] = None
        stat = read_stat(os.getpid())
        self.start_ticks = stat.start_ticks if stat else 0
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    # ------------------------------------------------------------------ setup

    def _install_signals(self) -> None:
        def handler(signum: int, _frame: object) -> None:
            if signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
                self.stop_requested += 1
            elif signum == signal.SIGHUP:
                self.reload_requested = True
            elif signum == signal.SIGCHLD:
                self.child_exited = True
            elif signum == signal.SIGUSR1:
                self.status_requested = True
            elif signum == signal.SIGUSR2:
                self.full_scan_requested = True

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, handler)
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, handler)
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        self.selector.register(self._wake_r, selectors.EVENT_READ, ("signal", ""))

    def _setup_inotify(self) -> None:
        if not self.config.defaults.watch_opens:
            log.info(
                "watch_opens = no: noticing GPU use only by polling every %g s",
                self.config.defaults.interval_seconds,
            )
            return
        try:
            self.inotify = Inotify()
        except OSError as err:
            log.warning(
                "inotify unavailable (%s): relying on polling every %g s",
                err,
                self.config.defaults.interval_seconds,
            )
            return
        self.selector.register(self.inotify.fd, selectors.EVENT_READ, ("inotify", ""))

    def _teardown_inotify(self) -> None:
        if self.inotify is not None:
            self.selector.unregister(self.inotify.fd)
            self.inotify.close()
            self.inotify = None
            self.opened.clear()

    def _rewatch(self) -> None:
        self.watched = self.observer.device_paths()
        if self.inotify is None:
            return
        devices = {g.device for g in self.observer.reading.gpus}
        for path, why in self.inotify.watch(self.watched).items():
            if path in devices:
                log.warning("cannot watch %s for opens (%s): relying on polling", path, why)
            else:  # a container's node that went away with its container
                log.debug("no longer watching %s (%s)", path, why)
                self.observer.forget_node(path)
        new = [p for p in self.watched if p not in devices and p not in self.announced]
        for path in new:
            log.info("watching %s for opens too (a GPU node of another mount namespace)", path)
        self.announced.update(new)

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        """Run until SIGTERM/SIGINT/SIGQUIT and every workload is gone; return the exit code."""
        _set_subreaper()
        tree, self.containment = containment_tree(self.config.defaults.containment)
        self.supervisor.cgroup_tree = tree
        self._install_signals()
        self._setup_inotify()
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
        now = self.clock()
        self._poll(now, full=True)
        self._rewatch()
        self.notifier.ready()
        stopping_logged = False
        while True:
            if self.stop_requested and not stopping_logged:
                stopping_logged = True
                self._shutdown()
            if self.stop_requested and not self.supervisor.busy():
                break
            timeout = self._timeout()
            events = self.selector.select(timeout)
            now = self.clock()
            try:
                self._handle(events, now)
            except Exception:  # a bug must not take the workloads' supervisor down with it
                self._internal_error(now)
        self._finish()
        return 0

    def _internal_error(self, now: float) -> None:
        """Fail closed after an unexpected error: stop every workload, keep running, try again next round."""
        log.exception("internal error (please report it); stopping every workload to be safe")
        self.decisions.append({"wall": self.wall(), "text": "internal error: stopping every workload"})
        self.supervisor.stop_all("internal error in gpu-mon", now)
        self.next_poll = now + self.config.defaults.interval_seconds

    def _timeout(self) -> float:
        now = self.clock()
        deadlines = [self.next_poll]
        if self.decision and self.decision.next_wake is not None:
            deadlines.append(self.decision.next_wake)
        kill = self.supervisor.next_deadline(now)
        if kill is not None:
            deadlines.append(kill)
        if self.watchdog_every:
            deadlines.append(self.next_watchdog)
        if self.deferred_full is not None:
            deadlines.append(self.deferred_full)
        return max(0.0, min(deadlines) - now)

    def _handle(self, events: list, now: float) -> None:
        exits = False
        for key, _mask in events:
            kind, name = key.data
            if kind == "signal":
                _drain(self._wake_r)
            elif kind == "inotify" and self.inotify is not None:
                opened, renew = self.inotify.read()
                self.opened.update(opened)
                if renew:
                    self._rewatch()
            else:
                if self.supervisor.dispatch(kind, name, now) is not None:
                    exits = True
        if self.child_exited:
            self.child_exited = False
            self.supervisor.reap_orphans()
        if self.stop_requested > 1:
            for w in self.supervisor.workloads.values():
                w.kill_at = now  # a second SIGTERM: no more waiting
        self.supervisor.tick(now)
        self._rounds(now, exits)
        # Slower work comes after the yield path, so that it never delays a stop.
        if self.reload_requested:
            self.reload_requested = False
            self._start_reload()
        if self.reload_future is not None and self.reload_future.done():
            self._finish_reload(now)
            if self.reload_again:
                self.reload_again = False
                self._start_reload()
        if self.status_requested:
            self.status_requested = False
            log.info("status: %s", self.status_line or "no round yet")
        if self.watchdog_every and now >= self.next_watchdog:
            self.notifier.watchdog()
            self.next_watchdog = now + self.watchdog_every

    def _rounds(self, now: float, exits: bool) -> None:
        """The rounds this wake calls for: opens first, then a poll, a deferred full scan or a re-decide."""
        ran = False
        if self.opened:
            self._on_open(now)
            ran = True
        if now >= self.next_poll or self.full_scan_requested:
            full = now >= self.next_full or self.full_scan_requested
            self.full_scan_requested = False
            self._poll(now, full=full)
        elif self.deferred_full is not None and now >= self.deferred_full:
            self.deferred_full = None
            self.last_event_full = now
            self._round(now, scan="full")
        if self.observer.device_paths() != self.watched:
            self._rewatch()
        elif not ran and (
            exits
            or (self.decision and self.decision.next_wake is not None and now >= self.decision.next_wake)
        ):
            self._round(now, scan=None)
        if self.observer.rescan_wanted and self.deferred_full is None:
            # A holder let go of a GPU: its descriptor may have been handed to another process.
            self.observer.rescan_wanted = False
            self.deferred_full = max(now, self.last_event_full + _EVENT_FULL_SCAN_GAP)

    def _poll(self, now: float, full: bool) -> None:
        d = self.config.defaults
        self.observer.read_gpus()
        self.next_poll = now + d.interval_seconds
        if full or not self.observer.scanner.incremental:
            self.next_full = now + d.full_scan_seconds
        self._round(now, scan="full" if full else "changed")

    def _on_open(self, now: float) -> None:
        """A GPU node was opened: find the opener with an incremental scan, else a (rate-limited) full one.

        The open is never dropped: when the full scan has to wait for its rate limit it is deferred, and a
        poll that comes in the same wake does not replace it (a poll's incremental scan misses a process
        that swapped a descriptor in place, as a CUDA program's imports can: this was a CI flake).
        """
        opened = set(self.opened)
        self.opened.clear()
        self.observer.scan("changed", self.supervisor.sessions())
        uuids = {self.observer.watch_targets().get(path) for path in opened}
        rescanned = self.observer.last_rescanned
        explained = any(h.pid in rescanned and h.gpus & uuids for h in self.observer.holders)
        if explained:
            self._round(now, scan=None)
        elif now - self.last_event_full >= _EVENT_FULL_SCAN_GAP:
            self.last_event_full = now
            self._round(now, scan="full")
        else:
            self._round(now, scan=None)
            if self.deferred_full is None:
                self.deferred_full = self.last_event_full + _EVENT_FULL_SCAN_GAP

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

    def _snapshot(self, now: float) -> Snapshot:
        tty = self.config.tty
        snap = self.observer.snapshot(now, self.supervisor.sessions(), tty.devices if tty.enabled else None)
        return dataclasses.replace(
            snap, running=self.supervisor.running(), exited=self.supervisor.take_exits()
        )

    def _round(self, now: float, scan: Optional[str]) -> None:
        if scan is not None:
            self.observer.scan(scan, self.supervisor.sessions())
        plan = self._ensure_plan()
        snap = self._snapshot(now)
        decision = policy.decide(self.config, plan, snap, self.state)
        stops = [a for a in decision.actions if isinstance(a, Stop)]
        if any(s.gpus for s in stops):
            # Look again before doing something destructive: re-read the holders of those GPUs.
            busy = {u for s in stops for u in s.gpus}
            pids = [h.pid for h in self.observer.holders if h.gpus & busy]
            if pids:
                self.observer.scan("pids", self.supervisor.sessions(), pids)
            again = dataclasses.replace(self._snapshot(now), exited=snap.exited)
            second = policy.decide(self.config, plan, again, self.state)
            confirmed = {s.key for s in policy.stops_confirmed(decision.actions, second.actions)}
            dropped = [s for s in stops if s.key not in confirmed]
            for s in dropped:
                log.info("not stopping %s: a second look no longer finds the GPU busy (%s)", s.key, s.reason)
            decision = dataclasses.replace(
                second,
                actions=tuple(a for a in second.actions if not isinstance(a, Stop) or a.key in confirmed),
            )
            snap = again
        self.state = decision.state
        self._log_transitions(plan, decision)
        for note in decision.notes:
            self._say(note, logging.WARNING if "quick failures" in note else logging.INFO)
        self._act(decision, plan, now)
        self.decision, self.snapshot = decision, snap
        self._publish(plan, snap, decision)

    def _act(self, decision: Decision, plan: policy.Plan, now: float) -> None:
        sections = policy.processes_by_name(self.config)
        for action in decision.actions:
            if isinstance(action, Stop):
                w = self.supervisor.workloads.get(action.key)
                if w is None:
                    continue
                self.supervisor.stop(action.key, action.reason, now)
                self._say(f"{action.reason}; stopping {w.label}[{w.pid}]")
            elif isinstance(action, Start) and not self.stop_requested:
                inst = action.instance
                section = sections[inst.process]
                label = inst.label(plan.index_of)
                try:
                    w = self.supervisor.start(inst, section, label, now)
                except StartError as err:
                    self._say(f"cannot start {label}: {err}", logging.ERROR)
                    self.supervisor.exits.append(
                        Exited(
                            key=inst.key,
                            started_at=now,
                            ended_at=now,
                            returncode=126,
                            stopped_by_us=False,
                            detail=str(err),
                        )
                    )
                    continue
                gpus = ", ".join(f"GPU {plan.index_of.get(u, '?')}" for u in inst.gpus)
                self._say(
                    f"{action.reason}; starting {label}[{w.pid}] on {gpus} as {section.user}: "
                    f"{' '.join(section.cmd)}"
                )

    def _log_transitions(self, plan: policy.Plan, decision: Decision) -> None:
        stopping_for = {u for a in decision.actions if isinstance(a, Stop) for u in a.gpus}
        for uuid in plan.rules:
            v = decision.verdicts.get(uuid)
            if v is None:
                continue
            if self.last_busy.get(uuid) != v.busy:
                index = plan.index_of.get(uuid, "?")
                if v.busy and uuid in stopping_for:
                    pass  # the stop line says it, with what is being stopped
                elif v.busy:
                    self._say(f"GPU {index} ({uuid}) busy: {'; '.join(v.reasons)}")
                elif uuid in self.last_busy:
                    self._say(f"GPU {index} ({uuid}) free")
                self.last_busy[uuid] = v.busy
        was = bool(self.decision and self.decision.paused_by)  # the previous round's decision
        if decision.paused_by and not was:
            self._say(f"pausing all work: terminal user {decision.paused_by[0]}")
        elif was and not decision.paused_by:
            self._say("terminal users idle again: work may resume")

    def _say(self, text: str, level: int = logging.INFO) -> None:
        log.log(level, "%s", text)
        self.decisions.append({"wall": self.wall(), "text": text})

    # ------------------------------------------------------------------ outputs

    def _workload_views(self) -> List[dict]:
        return [
            {
                "key": k,
                "label": w.label,
                "gpus": list(w.instance.gpus),
                "pid": w.pid,
                "command_pid": w.command_pid,
                "started_at": w.started_at,
                "stopping": w.stopping,
                "stop_reason": w.stop_reason,
            }
            for k, w in self.supervisor.workloads.items()
        ]

    def _publish(self, plan: policy.Plan, snap: Snapshot, decision: Decision) -> None:
        doc = report.build(
            self.config,
            plan,
            snap,
            decision,
            workloads=self._workload_views(),
            decisions=self.decisions,
            source=self.source,
            daemon={
                "pid": os.getpid(),
                "start_ticks": self.start_ticks,
                "started_wall": self.started_wall,
                "containment": self.containment,
            },
            wall=self.wall(),
        )
        self.status_line = self._status_line(plan, doc)
        self.notifier.status(self.status_line)
        # Rewrite the state file only when what it shows changed (its times are absolute): serializing and
        # renaming it every round was a third of an idle poll's cost at 1000 processes.
        content = {k: v for k, v in doc.items() if k != "updated_wall"}
        if content == self.published:
            return
        self.published = content
        path = self.config.defaults.state_file
        try:
            statefile.write(path, doc)
            self.state_error_logged = False
        except OSError as err:
            self.published = None
            if not self.state_error_logged:
                log.warning(
                    "cannot write the state file %s: %s (gpu-mon status will not see the daemon)",
                    path,
                    err.strerror or err,
                )
                self.state_error_logged = True

    def _status_line(self, plan: policy.Plan, doc: dict) -> str:
        watched = [g for g in doc["gpus"] if g["watched"]]
        working = [g for g in watched if g["state"].startswith("running")]
        parts = [f"{len(working)}/{len(watched)} GPUs running work"]
        for g in watched:
            if g["busy"]:
                holders = [
                    h for h in g["holders"] + g["nvml_processes"] if not h["ours"] and not h["ignored"]
                ]
                who = holders[0]["user"] if holders else (g["reasons"][0] if g["reasons"] else "?")
                parts.append(f"GPU {g['index']} busy ({who})")
        if doc["paused_by"]:
            parts.append(f"paused: {doc['paused_by'][0]}")
        if doc["error"]:
            parts.append(f"GPUs unreadable: {doc['error']}")
        return "; ".join(parts)

    # ------------------------------------------------------------------ reload and shutdown

    def _start_reload(self) -> None:
        """SIGHUP: read and check the config in a worker thread, so that a huge or slow file (a user
        database behind NSS, too) never holds up the loop; the result is applied by `_finish_reload`."""
        if self.reload_future is not None:
            self.reload_again = True
            return
        self.notifier.reloading()
        self.reload_future = self._reloader().submit(config_mod.load, self.config.path, self.trusted_uid)
        self.reload_future.add_done_callback(lambda _f: _poke(self._wake_w))

    def _reloader(self) -> concurrent.futures.ThreadPoolExecutor:
        if self.reload_pool is None:
            self.reload_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gpu-mon-reload")
        return self.reload_pool

    def _finish_reload(self, now: float) -> None:
        future, self.reload_future = self.reload_future, None
        assert future is not None
        try:
            new = future.result()
        except ConfigError as err:
            for line in err.errors:
                log.error("reload: %s", line)
            self._say(
                f"reload failed ({len(err.errors)} problem(s)); still running on the old config",
                logging.ERROR,
            )
            self.notifier.ready()
            return
        except Exception:  # an unexpected error reading the file: keep running on what we have
            log.exception("reload failed; still running on the old config")
            self.notifier.ready()
            return
        self._apply(self._keep_start_only(new), now)

    def _keep_start_only(self, new: Config) -> Config:
        """state_file and containment are fixed for the daemon's life (the lock, the cgroup tree)."""
        d, old = new.defaults, self.config.defaults
        for key in ("state_file", "containment"):
            if getattr(d, key) != getattr(old, key):
                log.warning("reload: [defaults] %s changes take effect when gpu-mon restarts", key)
        fixed = dataclasses.replace(d, state_file=old.state_file, containment=old.containment)
        return dataclasses.replace(new, defaults=fixed)

    def _apply(self, new: Config, now: float) -> None:
        path = new.path
        old = policy.processes_by_name(self.config)
        fresh = policy.processes_by_name(new)
        changed = [n for n, p in old.items() if n not in fresh or fresh[n].fingerprint != p.fingerprint]
        for warning in new.warnings:
            log.warning("%s", warning)
        watch_changed = new.defaults.watch_opens != self.config.defaults.watch_opens
        self.config = new
        if watch_changed:
            self._teardown_inotify()
            self._setup_inotify()
            self._rewatch()
        self.plan = None
        self.reported_problems.clear()
        self.supervisor.stop_timeout = new.defaults.stop_timeout_seconds
        for key, w in list(self.supervisor.workloads.items()):
            if w.instance.process in changed:
                self.supervisor.stop(key, "config changed", now)
                self._say(f"config changed for [process-{w.instance.process}]; restarting {w.label}")
        self._say(
            f"reloaded {path}" + (f"; changed: {', '.join(changed)}" if changed else "; no workload changed")
        )
        self.next_poll = now  # look again with the new rules at once (next wake, with a fresh NVML read)
        self._round(now, scan=None)  # and publish what the reload stopped
        self.notifier.ready()

    def _shutdown(self) -> None:
        self.notifier.stopping()
        now = self.clock()
        if self.supervisor.workloads:
            self._say(f"stopping: {len(self.supervisor.workloads)} workload(s) to stop")
        self.supervisor.stop_all("gpu-mon is stopping", now)

    def _finish(self) -> None:
        if self.reload_pool is not None:
            self.reload_pool.shutdown(wait=True)
        log.info("gpu-mon stopped")
        statefile.remove(self.config.defaults.state_file)
        self._teardown_inotify()
        self.observer.backend.close()


def _poke(fd: int) -> None:
    """Wake the loop (from another thread)."""
    with contextlib.suppress(OSError):
        os.write(fd, b"\0")


def _drain(fd: int) -> None:
    while True:
        try:
            if not os.read(fd, 4096):
                return
        except OSError as err:
            if err.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return
            raise
