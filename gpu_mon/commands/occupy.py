"""`gpu-mon occupy on|off|status` (seed 004): a user's own reservation of GPUs, no root, no config file.

`on` starts a background occupier (its own session, detached from the terminal) and returns once it runs.
The occupier is the daemon itself on an in-memory config (commands/occupy_spec.py) holding the lock of its own
state file, so two `on` that race cannot both run. `off` signals it only while it is the process recorded
(pid and start time) *and* holds that lock: a reused pid is never signalled.

Files in $XDG_STATE_HOME/gpu-mon/occupy/ (default ~/.local/state/gpu-mon/occupy/, 0700): state.json (and
its .lock), occupier.json (the record), phase.json, occupy.log.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import subprocess
import sys
import time
from typing import List, Optional, Tuple

from gpu_mon.api import procfs
from gpu_mon.api.text import sanitize
from gpu_mon.commands import base
from gpu_mon.commands.occupy_queue import daemon_state_file
from gpu_mon.commands.occupy_spec import OccupySpec

EXIT_NOT_RUNNING = 3
_START_TIMEOUT = 60.0


def state_dir() -> str:
    """$XDG_STATE_HOME/gpu-mon/occupy, made 0700 (CliError when it is not ours alone)."""
    root = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    path = os.path.join(root, "gpu-mon", "occupy")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError as err:
        raise base.CliError(f"occupy: {path}: {err.strerror}", base.EXIT_FAILURE) from None
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise base.CliError(f"occupy: {path} must be yours alone (chmod 700 {path})", base.EXIT_FAILURE)
    return path


def _files(directory: str) -> Tuple[str, str, str, str]:
    """(state file, record, phase file, log)."""
    return tuple(
        os.path.join(directory, n) for n in ("state.json", "occupier.json", "phase.json", "occupy.log")
    )  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------- options


def _gpu_refs(values: List[str]) -> List[object]:
    refs: List[object] = []
    for value in values:
        for item in value.replace(",", " ").split():
            if item.isdigit():
                refs.append(int(item))
            elif item.upper().startswith(("GPU-", "MIG-")):
                refs.append(item)
            else:
                raise base.CliError(f"occupy: --gpus: {item!r} is not a GPU index or UUID")
    return refs


def _memory(value: Optional[str]) -> Optional[str]:
    """The seed's `20` means 20 GiB; 20GiB, 512MiB and 80% as the stressor takes them."""
    if value is None:
        return None
    text = value.strip()
    with contextlib.suppress(ValueError):
        if float(text) > 0:
            text = f"{text}GiB"
    from gpu_mon.commands.stress import UsageError, parse_memory

    try:
        parse_memory(text)
    except UsageError as err:
        raise base.CliError(f"occupy: {err}") from None
    return text


def spec_from(args: argparse.Namespace) -> OccupySpec:
    """The validated options of `on`; CliError (exit 2) naming the bad one."""
    for name in ("mem_threshold", "wait_minutes", "compute_min", "sleep_min"):
        value = getattr(args, name)
        if not 0 <= value < float("inf"):
            raise base.CliError(f"occupy: --{name.replace('_', '-')} must be 0 or more, not {value:g}")
    if not 0 < args.refresh_minutes < float("inf"):
        raise base.CliError(f"occupy: --refresh-minutes must be greater than 0, not {args.refresh_minutes:g}")
    if not args.no_compute and args.compute_min == 0:
        raise base.CliError("occupy: --compute-min 0 computes nothing: use --no-compute for memory only")
    argv = list(args.argv[1:] if args.argv[:1] == ["--"] else args.argv)
    config = base.load_config(args, required=False) if base.config_path(args)[1] else None  # only when named
    sections = config.gpu_sections if config else ()
    return OccupySpec(
        gpus=_gpu_refs(args.gpus or []),
        memory=_memory(args.memory),
        mem_threshold_gib=args.mem_threshold,
        wait_minutes=args.wait_minutes,
        refresh_minutes=args.refresh_minutes,
        compute_min=args.compute_min,
        sleep_min=args.sleep_min,
        no_compute=args.no_compute,
        polite=args.polite,
        argv=argv,
        sim=base.sim_path(args),
        ignore_programs=sorted({p for g in sections for p in g.ignore_programs}),
        ignore_users=sorted({u for g in sections for u in g.ignore_users}),
        cwd=os.getcwd(),
        env=dict(os.environ),
        daemon_state=daemon_state_file(config),
    )


def add_arguments(p: argparse.ArgumentParser, common) -> None:
    """on / off / status (and the hidden `serve`, the background occupier itself)."""
    sub = p.add_subparsers(dest="occupy_command", metavar="on|off|status")
    sub.required = True
    on = sub.add_parser("on", help="wait until the GPUs are idle, then hold them in the background")
    common(on, top=False)
    base.seed_option(
        on, "gpus", nargs="+", metavar="GPU", help="indices or UUIDs: 0 1, or 0,1 (default: all GPUs)"
    )
    base.seed_option(
        on, "memory", metavar="AMOUNT", help="per GPU: 20 (GiB), 20GiB, 512MiB or 80%% (default 88%%)"
    )
    base.seed_option(
        on,
        "mem-threshold",
        type=float,
        default=1.0,
        metavar="GIB",
        help="a GPU is free while others use at most this much of its memory (default 1)",
    )
    base.seed_option(
        on, "wait-minutes", type=float, default=5.0, metavar="M", help="free this long first (5)"
    )
    base.seed_option(
        on, "refresh-minutes", type=float, default=0.05, metavar="M", help="look this often (0.05)"
    )
    base.seed_option(on, "compute-min", type=float, default=30.0, metavar="M", help="compute this long (30)")
    base.seed_option(on, "sleep-min", type=float, default=5.0, metavar="M", help="then sleep this long (5)")
    base.seed_option(on, "no-compute", action="store_true", help="hold memory only")
    on.add_argument(
        "--yield",
        dest="polite",
        action="store_true",
        help="give the GPUs back as soon as anyone else uses one; take them again after the wait",
    )
    on.add_argument(
        "argv", nargs=argparse.REMAINDER, metavar="-- CMD", help="run CMD instead of the stressor"
    )
    off = sub.add_parser("off", help="stop the occupier and everything it started")
    common(off, top=False, config=False, sim=False)
    off.add_argument("--timeout", type=float, default=30.0, metavar="SEC", help="then SIGKILL (30)")
    st = sub.add_parser("status", help="waiting, occupying, yielded or stopped; exit 3 when not running")
    common(st, top=False, config=False, sim=False)
    st.add_argument("--json", action="store_true", help="machine-readable")
    st.add_argument(
        "--all", action="store_true", help="every user's occupier on this host instead (exit 3 when none)"
    )
    common(sub.add_parser("serve"), top=False, config=False, sim=False)


# ----------------------------------------------------------------------------------------------- record


def read_record(path: str) -> Optional[dict]:
    """The occupier's record, or None."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("pid"), int) else None


def record_is_live(rec: dict) -> bool:
    """Whether the recorded pid is still the process that wrote the record (same start time)."""
    st = procfs.read_stat(int(rec["pid"]))
    return st is not None and st.start_ticks == rec.get("start_ticks") and st.state not in ("Z", "X")


def when(wall: Optional[float]) -> str:
    """ISO 8601 local time with its offset."""
    if wall is None:
        return ""
    return datetime.datetime.fromtimestamp(wall).astimezone().isoformat(timespec="seconds")


def tail(path: str, lines: int = 10) -> List[str]:
    """The last lines of the log, escaped."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [sanitize(line) for line in data.splitlines()[-lines:]]


def wait_until(condition, timeout: float) -> bool:
    """Poll a condition until it holds or the timeout passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def spawn_serve(spec: OccupySpec, log_path: str, debug: bool) -> subprocess.Popen:
    """The background occupier: its own session, stdin the spec then nothing, output to the log."""
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    try:
        p = subprocess.Popen(
            [sys.executable, "-m", "gpu_mon", "occupy", "serve", *(["--debug"] if debug else [])],
            stdin=subprocess.PIPE,
            stdout=log_fd,
            stderr=log_fd,
            start_new_session=True,
            close_fds=True,
            cwd="/",
        )
    finally:
        os.close(log_fd)
    assert p.stdin is not None
    p.stdin.write(json.dumps(spec.__dict__).encode("utf-8"))
    p.stdin.close()
    return p


def signal_occupier(rec: dict, sig: int) -> bool:
    """Send `sig` to the recorded occupier through a pidfd, if it is still that process."""
    from gpu_mon.engine.workloads.linux import signal_pid

    return signal_pid(int(rec["pid"]), int(rec["start_ticks"]), sig)
