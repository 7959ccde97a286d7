"""`gpu-mon sentinel` (seed 001): arm once the GPUs have been busy for a while, then act once when they have
been idle for a while: end (exit 0), shut down, reboot, or run a command.

Usage is the chosen GPUs' utilization (mean, or max so that one busy GPU keeps the machine up). A GPU that
cannot be read counts as active: a monitoring error never shuts a machine down.
SIGTERM, SIGINT and SIGQUIT stop it cleanly, like the daemon: one line naming the signal, exit 0.
Exit codes: 0 fired end_process or stopped by a signal; 1 the action failed; 2 bad usage.
"""

from __future__ import annotations

import argparse
import logging
import signal
import time
from typing import Optional, Tuple

from gpu_mon.api import usage as gpu_usage
from gpu_mon.api.observe import Backend
from gpu_mon.commands import base
from gpu_mon.config import KILL_ACTIONS, GpuSelection, SentinelSection, fraction, parse_command, parse_gpus
from gpu_mon.engine.idle import Watchdog, action_argv, run_action
from gpu_mon.engine.loop import Loop

log = logging.getLogger("gpu_mon")
_MIN_INTERVAL = 0.1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)  # the daemon's too


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Seed 001's options (its underscore spellings too)."""
    base.seed_option(
        p, "arm-duration", type=float, default=30.0, metavar="SEC", help="busy this long to arm (30)"
    )
    base.seed_option(
        p, "arm-threshold", type=str, default="0.7", metavar="FRAC", help="busy means >= this (0.7)"
    )
    base.seed_option(
        p, "kill-duration", type=float, default=300.0, metavar="SEC", help="idle this long to act (300)"
    )
    base.seed_option(
        p, "kill-threshold", type=str, default="0.1", metavar="FRAC", help="idle means < this (0.1)"
    )
    base.seed_option(
        p, "kill-action", choices=KILL_ACTIONS, default="end_process", help="what to do (end_process)"
    )
    base.seed_option(
        p,
        "command",
        dest="action_command",
        metavar="CMD",
        help="for --kill-action command: run CMD once (no shell)",
    )
    base.seed_option(p, "gpu-devices", metavar="0,1", help="GPUs by NVML index or UUID (default: all)")
    base.seed_option(p, "aggregate", choices=("mean", "max"), default="mean", help="how GPUs combine (mean)")
    p.add_argument("--interval", type=float, default=1.0, metavar="SEC", help="seconds per tick (1)")
    base.seed_option(p, "dry-run", action="store_true", help="log what it would do, never do it")


def settings_from(args: argparse.Namespace) -> SentinelSection:
    """The options as a SentinelSection (the daemon's [sentinel] has the same fields); CliError if bad."""
    try:
        arm, kill = fraction(args.arm_threshold), fraction(args.kill_threshold)
        gpus = parse_gpus(args.gpu_devices) if args.gpu_devices else GpuSelection(all=True)
        command = parse_command(args.action_command) if args.action_command is not None else ()
    except ValueError as err:
        raise base.CliError(f"sentinel: {err}") from None
    for name, value in (("--arm-duration", args.arm_duration), ("--kill-duration", args.kill_duration)):
        if not 0 <= value < float("inf"):
            raise base.CliError(f"sentinel: {name} must be a number of seconds >= 0, not {value:g}")
    if not _MIN_INTERVAL <= args.interval < float("inf"):
        raise base.CliError(
            f"sentinel: --interval must be at least {_MIN_INTERVAL:g} s, not {args.interval:g}"
        )
    if args.kill_action == "command" and not command:
        raise base.CliError("sentinel: --kill-action command needs --command CMD")
    if command and args.kill_action != "command":
        raise base.CliError("sentinel: --command is only used with --kill-action command")
    return SentinelSection(
        arm_duration_seconds=args.arm_duration,
        arm_threshold=arm,
        kill_duration_seconds=args.kill_duration,
        kill_threshold=kill,
        kill_action=args.kill_action,
        command=command,
        gpus=gpus,
        aggregate=args.aggregate,
        dry_run=args.dry_run,
    )


def read_usage(backend: Backend, settings: SentinelSection) -> Tuple[Optional[float], str]:
    """(usage of the chosen GPUs, or None when any cannot be read; why)."""
    sel = settings.gpus
    try:
        gpus = gpu_usage.select(backend.read(), None if sel.all else list(sel.refs))  # type: ignore[arg-type]
    except gpu_usage.GpuUsageError as err:
        return None, str(err)
    values = [gpu_usage.device_usage(g) for g in gpus]
    log.debug(
        "usage: %s", ", ".join(f"{g.label} {v if v is None else f'{v:.0%}'}" for g, v in zip(gpus, values))
    )
    bad = [g for g, v in zip(gpus, values) if v is None]
    why = f"{bad[0].label}: {'; '.join(bad[0].errors) or 'unreadable'}" if bad else "no GPU found"
    return gpu_usage.aggregate(values, settings.aggregate), why


def _act(settings: SentinelSection) -> Optional[int]:
    """Carry the action out: an exit code to end with, or None to go on watching."""
    if settings.kill_action == "end_process":
        log.info("sentinel: ending (kill_action = end_process)")
        return base.EXIT_OK
    ok, said = run_action(action_argv(settings))
    if not ok:
        log.error("sentinel: %s", said)
        return base.EXIT_FAILURE
    log.info("sentinel: %s; waiting to arm again", said)
    return None


def sleep_until(loop: Loop, deadline: float) -> str:
    """Sleep until the monotonic `deadline`, or until a stop signal comes: then return its name."""
    while True:
        got = [sig for sig in STOP_SIGNALS if loop.take(sig)]
        now = time.monotonic()
        if got or now >= deadline:
            return signal.Signals(got[0]).name if got else ""
        loop.wait((deadline,), now)


def cmd_sentinel(args: argparse.Namespace) -> int:
    """Tick every --interval seconds until the action ends it, or a stop signal does (exit 0)."""
    settings = settings_from(args)
    loop = Loop()
    loop.catch(STOP_SIGNALS)
    try:
        return _watch(args, settings, loop)
    finally:
        loop.close()


def _watch(args: argparse.Namespace, settings: SentinelSection, loop: Loop) -> int:
    backend, source = base.backend(args)
    dog = Watchdog(settings, args.interval)
    log.info("%s; GPUs: %s, from %s", dog.describe(), settings.gpus, source)
    next_tick = time.monotonic()
    try:
        while True:
            value, why = read_usage(backend, settings)
            log.debug("usage: %s", "unknown" if value is None else f"{value:.0%}")
            if dog.tick(value, why):
                code = _act(settings)
                if code is not None:
                    return code
            next_tick += args.interval
            now = time.monotonic()
            if next_tick < now:  # suspended or starved: do not make up for lost ticks in a burst
                next_tick = now
            name = sleep_until(loop, next_tick)
            if name:
                log.info("sentinel: stopping on %s", name)
                return base.EXIT_OK
    finally:
        backend.close()
