"""Seed 001 at work: the pure Sentinel (api/sentinel.py) ticked at an interval, its state changes logged in
one line each, and its action carried out once. Shared by `gpu-mon sentinel` and the daemon's [sentinel].

Usage that cannot be read is None: it counts as activity (a monitoring error never powers a machine off),
and the log says so once per episode.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
import threading
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

from gpu_mon.api import usage as gpu_usage
from gpu_mon.api.sentinel import ARMED, FIRED, Sentinel
from gpu_mon.api.text import sanitize
from gpu_mon.config import SentinelSection
from gpu_mon.policy.report import RoundReport

log = logging.getLogger("gpu_mon")
ACTION_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def ticks(seconds: float, interval: float) -> int:
    """How many ticks of `interval` seconds make `seconds` (rounded up)."""
    return math.ceil(seconds / interval - 1e-9) if seconds > 0 else 0


def action_argv(settings: SentinelSection) -> List[str]:
    """The command an action runs (none for end_process)."""
    return {
        "shutdown": ["systemctl", "poweroff"],
        "reboot": ["systemctl", "reboot"],
        "command": list(settings.command),
    }.get(settings.kill_action, [])


def action_words(settings: SentinelSection) -> str:
    """`shutting down`, `rebooting`, `ending` or `running: CMD` (for the log)."""
    if settings.kill_action == "command":
        return f"running: {' '.join(settings.command)}"
    return {"shutdown": "shutting down", "reboot": "rebooting"}.get(settings.kill_action, "ending")


def resolve(argv: List[str], env: Optional[dict] = None) -> Optional[List[str]]:
    """argv with its program found on PATH (None when it is not there)."""
    program = argv[0] if "/" in argv[0] else shutil.which(argv[0], path=(env or os.environ).get("PATH"))
    return None if program is None else [program, *argv[1:]]


def outcome(argv: List[str], returncode: int, stderr: bytes) -> Tuple[bool, str]:
    """(succeeded, one line saying how an action's command went)."""
    said = stderr.decode("utf-8", "replace").strip().splitlines()
    if returncode != 0:
        detail = f": {sanitize(said[-1])}" if said else ""
        return False, f"{' '.join(argv)} failed (exit {returncode}){detail}"
    return True, f"{' '.join(argv)} done"


def run_action(argv: List[str]) -> Tuple[bool, str]:
    """Run an action's command to its end, no shell, with our stdout; (succeeded, one line)."""
    found = resolve(argv)
    if found is None:
        return False, f"{argv[0]}: command not found"
    try:
        done = subprocess.run(found, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
    except OSError as err:
        return False, f"{argv[0]}: {err.strerror or err}"
    return outcome(argv, done.returncode, done.stderr or b"")


class Watchdog:
    """A Sentinel with durations in seconds at a fixed tick interval, logging what it does."""

    def __init__(self, settings: SentinelSection, interval: float, name: str = "sentinel"):
        self.settings, self.interval, self.name = settings, interval, name
        self.due = False
        self.sentinel = Sentinel(
            ticks(settings.arm_duration_seconds, interval),
            settings.arm_threshold,
            max(1, ticks(settings.kill_duration_seconds, interval)),
            settings.kill_threshold,
            kill_fn=self._fire,
        )
        self.unsure = False

    def _fire(self) -> None:
        self.due = True

    def describe(self) -> str:
        """The rule in one line (for the start-up log)."""
        s = self.settings
        return (
            f"{self.name}: arms after {s.arm_duration_seconds:g} s at >= {s.arm_threshold:.0%} GPU use "
            f"({s.aggregate}), then acts after {s.kill_duration_seconds:g} s below {s.kill_threshold:.0%}: "
            f"{s.kill_action}{' (dry run)' if s.dry_run else ''}; a tick every {self.interval:g} s"
        )

    def tick(self, value: Optional[float], why_unsure: str = "") -> bool:
        """One tick with this usage; True when the action is due now (once per idle episode)."""
        self._note_unsure(value, why_unsure)
        before = self.sentinel.state
        self.due = False
        after = self.sentinel.tick(value)
        s = self.settings
        if after == ARMED and before != ARMED:
            log.info(
                "%s: armed after %g s at >= %.0f%%", self.name, s.arm_duration_seconds, s.arm_threshold * 100
            )
        if after == FIRED and self.due:
            what = action_words(s) + (" (dry run: not done)" if s.dry_run else "")
            log.warning(
                "%s: idle %g s below %.0f%%: %s",
                self.name,
                s.kill_duration_seconds,
                s.kill_threshold * 100,
                what,
            )
        return self.due and not s.dry_run

    def _note_unsure(self, value: Optional[float], why: str) -> None:
        if value is None and not self.unsure:
            log.warning("%s: cannot read GPU use (%s): counting as active", self.name, why or "unknown")
        elif value is not None and self.unsure:
            log.info("%s: GPU use readable again", self.name)
        self.unsure = value is None

    @property
    def state(self) -> str:
        """waiting, armed or fired."""
        return self.sentinel.state


class DaemonSentinel:
    """The daemon's [sentinel]: a round listener that ticks every `interval` seconds on the latest round.

    Usage is that of processes that are not ours (api/usage.foreign_usage), so the daemon's own workloads
    never keep the machine up. shutdown, reboot and command are spawned by the supervisor as helpers (never
    reaped or swept as a workload's orphans) and waited for in a thread: the loop never waits on them.
    """

    def __init__(
        self,
        settings: SentinelSection,
        interval: float,
        end_daemon: Callable[[], None],
        spawn: Callable[[List[str], dict], subprocess.Popen],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.watchdog = Watchdog(settings, interval)
        self.settings, self.interval, self.clock = settings, interval, clock
        self.end_daemon, self.spawn = end_daemon, spawn
        self.report: Optional[RoundReport] = None
        self.next_tick = clock() + interval
        self.worker: Optional[threading.Thread] = None
        log.info("%s", self.watchdog.describe())

    def on_round(self, report: RoundReport) -> None:
        """Keep the latest round; the tick happens on its own schedule."""
        self.report = report

    def on_event(self, event: str) -> None:
        """On each wake of the loop: tick if one is due."""
        now = self.clock()
        if event != "alive" or now < self.next_tick or self.report is None:
            return
        self.next_tick = (
            self.next_tick + self.interval if now - self.next_tick < self.interval else now + self.interval
        )
        value, why = self.usage(self.report)
        log.debug("sentinel: usage by others %s", "unknown" if value is None else f"{value:.0%}")
        if self.watchdog.tick(value, why):
            self._act()

    def deadline(self) -> Optional[float]:
        """When the next tick is due."""
        return self.next_tick

    def usage(self, report: RoundReport) -> Tuple[Optional[float], str]:
        """(usage of the chosen GPUs by everyone but us, or None; why None)."""
        snap = report.snapshot
        sel = self.settings.gpus
        try:
            gpus = gpu_usage.select(snap.reading, None if sel.all else list(sel.refs))  # type: ignore[arg-type]
        except gpu_usage.GpuUsageError as err:
            return None, str(err)
        ours: Dict[Optional[str], Set[int]] = {}
        for h in snap.nvml_procs:
            for uuid in h.gpus:
                if h.ours_on(uuid):
                    ours.setdefault(uuid, set()).add(h.pid)
        occupied = {u for w in report.workloads for u in w.get("gpus", ())}
        values = [gpu_usage.foreign_usage(g, ours.get(g.uuid, ()), g.uuid in occupied) for g in gpus]
        value = gpu_usage.aggregate(values, self.settings.aggregate)
        bad = [g.label for g, v in zip(gpus, values) if v is None]
        return value, (f"{bad[0]} unreadable" if bad else "no GPU")

    def _act(self) -> None:
        if self.settings.kill_action == "end_process":
            log.info("sentinel: stopping gpu-mon (kill_action = end_process)")
            self.end_daemon()
            return
        if self.worker is not None and self.worker.is_alive():
            log.warning("sentinel: the last action is still running; not starting another")
            return
        argv = action_argv(self.settings)
        env = {"PATH": ACTION_PATH, "LANG": "C.UTF-8"}
        found = resolve(argv, env)
        if found is None:
            log.error("sentinel: %s: command not found", argv[0])
            return
        try:
            popen = self.spawn(found, env)
        except OSError as err:
            log.error("sentinel: %s: %s", argv[0], err.strerror or err)
            return
        self.worker = threading.Thread(target=self._wait, args=(argv, popen), name="sentinel", daemon=True)
        self.worker.start()

    def _wait(self, argv: List[str], popen: subprocess.Popen) -> None:
        """In a thread: wait for the action's command, then say how it went."""
        _out, err = popen.communicate()
        ok, said = outcome(argv, popen.returncode, err or b"")
        log.log(logging.INFO if ok else logging.ERROR, "sentinel: %s", said)
