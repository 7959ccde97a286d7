"""`gpu-mon watch -- CMD...` (seed 003): run CMD; when the GPUs its process tree uses stay idle over a window
of samples, stop the whole tree and exit 124, like `timeout`. Otherwise exit with CMD's own status.

CMD runs under the engine's workload leader (its own session, contained by a cgroup or the subreaper, so
grandchildren that left its session are stopped too) with this terminal's stdin, stdout and stderr and our
environment. SIGINT, SIGTERM, SIGQUIT and SIGHUP are forwarded to every process of the tree (one log line
names the signal), and `watch` exits with CMD's status. A sample that cannot be read (NVML failure,
unreadable /proc) counts as busy: a monitoring error never kills a command.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import signal
import time
from typing import Deque, List, Optional

from gpu_mon.api.observe import Backend
from gpu_mon.api.tree import TreeObserver, TreeSample
from gpu_mon.commands import base

log = logging.getLogger("gpu_mon")
EXIT_IDLE = 124
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Seed 003's options (its `--threshhold-percentage` spelling too)."""
    p.add_argument(
        "-t",
        "--threshold-percentage",
        "--threshhold-percentage",
        dest="threshold",
        type=float,
        default=1.0,
        metavar="PCT",
        help="a sample below this GPU utilization (%%) is idle (default 1)",
    )
    p.add_argument(
        "-s",
        "--sample-freq",
        dest="sample_seconds",
        type=float,
        default=5.0,
        metavar="SEC",
        help="seconds between samples (default 5)",
    )
    p.add_argument(
        "-n",
        "--num-samples",
        dest="samples",
        type=int,
        default=60,
        metavar="N",
        help="stop CMD when the last N samples are all idle (default 60)",
    )
    p.add_argument(
        "-d",
        "--delay-samples",
        dest="delay",
        type=int,
        default=12,
        metavar="N",
        help="samples to let pass before judging, while CMD starts up (default 12)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=10.0,
        metavar="SEC",
        help="SIGTERM to SIGKILL when stopping the tree (default 10)",
    )
    p.add_argument("--dry-run", action="store_true", help="say when CMD would be stopped, never stop it")
    p.add_argument("-x", dest="debug", action="store_true", help="one log line per sample (same as --debug)")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]", help="the command to run")


def _validate(args: argparse.Namespace) -> List[str]:
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise base.CliError("watch: no command given (gpu-mon watch [options] -- CMD [ARGS...])")
    for name, value, minimum in (
        ("-t/--threshold-percentage", args.threshold, 0.0),
        ("-s/--sample-freq", args.sample_seconds, 0.0),
        ("-n/--num-samples", args.samples, 0),
        ("--grace", args.grace, 0.0),
    ):
        if not value > minimum or value != value or value == float("inf"):
            raise base.CliError(f"watch: {name} must be greater than 0, not {value:g}")
    if args.delay < 0:
        raise base.CliError(f"watch: -d/--delay-samples must be 0 or more, not {args.delay}")
    if args.sample_seconds < 0.1:
        raise base.CliError(f"watch: -s/--sample-freq must be at least 0.1, not {args.sample_seconds:g}")
    return argv


class IdleWindow:
    """The last N samples' verdicts: idle when all N are below the threshold (None counts as busy)."""

    def __init__(self, threshold_pct: float, size: int, delay: int):
        self.threshold, self.delay = threshold_pct, delay
        self.window: Deque[bool] = collections.deque(maxlen=size)
        self.seen = 0

    def add(self, usage: Optional[float]) -> bool:
        """Record one sample; True when the window is full and every sample in it was idle."""
        self.seen += 1
        if self.seen <= self.delay:
            return False
        self.window.append(usage is not None and usage * 100 < self.threshold)
        return len(self.window) == self.window.maxlen and all(self.window)

    def clear(self) -> None:
        """Start a new window (after a dry-run verdict)."""
        self.window.clear()


class Watcher:
    """Runs one command under a leader and samples its tree until it ends."""

    def __init__(self, args: argparse.Namespace, argv: List[str], backend: Backend):
        from gpu_mon.engine.loop import Loop
        from gpu_mon.engine.workloads import cgroups, linux
        from gpu_mon.engine.workloads.stopping import StopRule
        from gpu_mon.engine.workloads.supervisor import Supervisor

        self.args, self.argv, self.backend = args, argv, backend
        self.loop = Loop()
        with_cgroup, self.containment = cgroups.choose("auto", os.getpid())
        self.supervisor = Supervisor(self.loop.selector, StopRule(grace=args.grace), with_cgroup)
        self.window = IdleWindow(args.threshold, args.samples, args.delay)
        self.linux = linux
        self.idle_stopped = False
        self.unsure_logged = False
        self.observer: Optional[TreeObserver] = None

    def start(self) -> None:
        """Spawn CMD (with our stdio and environment) under a leader."""
        from gpu_mon.engine.workloads.supervisor import Launch
        from gpu_mon.policy.decisions import Instance

        self.linux.prctl(self.linux.PR_SET_CHILD_SUBREAPER, 1)
        self.loop.catch((*_FORWARDED, signal.SIGCHLD))
        stdin = _dup_stdin()
        launch = Launch(
            argv=tuple(self.argv),
            dir=os.getcwd(),
            env=dict(os.environ),
            uid=os.getuid(),
            gid=os.getgid(),
            groups=tuple(os.getgroups()),
            stdio=(stdin, 1, 2),
        )
        instance = Instance(key="cmd", process="watch", gpus=())
        w = self.supervisor.launch(instance, launch, "watch", time.monotonic())
        os.close(stdin)
        self.observer = TreeObserver(self.backend, w.pid)
        a = self.args
        log.info(
            "watching %s[%d]: stop it when its GPUs stay below %g%% for %d samples %g s apart (after %d "
            "delay samples, %g s in all at the earliest; %s)%s",
            self.argv[0],
            w.pid,
            a.threshold,
            a.samples,
            a.sample_seconds,
            a.delay,
            (a.samples + a.delay) * a.sample_seconds,
            self.containment,
            "; dry run" if a.dry_run else "",
        )

    def run(self) -> int:
        """Until CMD's tree is gone; return the exit code."""
        self.start()
        next_sample = time.monotonic() + self.args.sample_seconds
        while True:
            now = time.monotonic()
            ready = self.loop.wait((next_sample, self.supervisor.next_deadline(now)), now)
            now = time.monotonic()
            for kind, key in ready:
                ended = self.supervisor.dispatch(kind, key, now)
                if ended is not None:
                    return self._finish(ended.returncode)
            self._forward_signals()
            self.supervisor.tick(now)
            if now >= next_sample:
                next_sample = max(next_sample + self.args.sample_seconds, now)
                self._sample(now)

    def _forward_signals(self) -> None:
        self.loop.take(signal.SIGCHLD)
        self.supervisor.reap_orphans()
        w = self.supervisor.workloads.get("cmd")
        for sig in _FORWARDED:
            if self.loop.take(sig) and w is not None:
                count = self.linux.kill_tree(w.pid, sig)
                log.info("forwarded %s to %d process(es)", signal.Signals(sig).name, count)

    def _sample(self, now: float) -> None:
        w = self.supervisor.workloads.get("cmd")
        if w is None or w.stopping or self.observer is None:
            return
        sample = self.observer.sample()
        idle = self.window.add(sample.usage)
        self._log_sample(sample)
        if idle:
            self._idle(sample, now)

    def _log_sample(self, sample: TreeSample) -> None:
        if sample.usage is None and not self.unsure_logged:
            log.warning("cannot tell whether the command uses its GPUs (%s): counting as busy", sample.error)
        self.unsure_logged = sample.usage is None
        if log.isEnabledFor(logging.DEBUG):
            gpus = "; ".join(f"{k} {_pct(v)}" for k, v in sample.gpus.items()) or "no GPU held"
            log.debug(
                "sample %d: %s: %s (%d processes)",
                self.window.seen,
                _pct(sample.usage),
                gpus,
                len(sample.pids),
            )

    def _idle(self, sample: TreeSample, now: float) -> None:
        a = self.args
        gpus = ", ".join(sample.gpus) or "no GPU held"
        window = f"{a.samples} samples ({a.samples * a.sample_seconds:g} s)"
        why = f"{gpus}: below {a.threshold:g}% for the last {window}"
        if a.dry_run:
            log.warning("idle (%s): would stop the command's %d process(es) (dry run)", why, len(sample.pids))
            self.window.clear()
            return
        log.warning("idle (%s): stopping the command's %d process(es)", why, len(sample.pids))
        self.idle_stopped = True
        self.supervisor.stop("cmd", f"idle: {why}", now)

    def _finish(self, returncode: int) -> int:
        self.loop.close()
        self.backend.close()
        if self.idle_stopped:
            log.info("stopped for idleness: exit %d", EXIT_IDLE)
            return EXIT_IDLE
        return returncode


def _pct(value: Optional[float]) -> str:
    return "unknown" if value is None else f"{value * 100:.0f}%"


def _dup_stdin() -> int:
    """A copy of our stdin for CMD (fd 0 itself is the leader's spec pipe); /dev/null when we have none."""
    try:
        return os.dup(0)
    except OSError:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)


def cmd_watch(args: argparse.Namespace) -> int:
    """`gpu-mon watch`: see the module's docstring."""
    argv = _validate(args)
    backend, _source = base.backend(args)
    return Watcher(args, argv, backend).run()
