"""The four verbs of `gpu-mon occupy` (options and files in occupy.py)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
from typing import List, Optional

from gpu_mon.api import usage
from gpu_mon.commands import base, occupy_limits
from gpu_mon.commands import occupy as oc
from gpu_mon.commands.occupy_spec import OccupySpec
from gpu_mon.engine import lock

log = logging.getLogger("gpu_mon")


def on(args: argparse.Namespace) -> int:
    """Start the background occupier; exit 1 (with its state) when one already runs."""
    spec = oc.spec_from(args)
    directory = oc.state_dir()
    state, record, _phase, log_path = oc._files(directory)
    if lock.holder(state) is not None:
        _already_running(args)
        return base.EXIT_FAILURE
    spec = occupy_limits.apply(spec, _check_gpus(args, spec))
    child = oc.spawn_serve(spec, log_path, bool(args.debug))
    started = oc.wait_until(
        lambda: child.poll() is not None or _is_up(state, record, child.pid), oc._START_TIMEOUT
    )
    if started and child.poll() is None:
        many = len(spec.gpus) > 1
        named = f"GPU{'s' if many else ''} {', '.join(str(g) for g in spec.gpus)}"
        gpus = named if spec.gpus else "every GPU"
        print(
            f"gpu-mon occupy: started (pid {child.pid}, {spec.mode} mode): waits until {gpus} "
            f"{'have' if many else 'has'} been free "
            f"for {spec.wait_minutes:g} min, then runs {spec.what}{_hold_limit(spec)}\nlog: {log_path}"
        )
        return base.EXIT_OK
    if child.poll() is None:  # not up in time: take it down again rather than leave it half-started
        child.kill()
        child.wait()
    if lock.holder(state) not in (None, child.pid):  # lost a race with another `on`
        _already_running(args)
        return base.EXIT_FAILURE
    last = oc.tail(log_path, 1)
    raise base.CliError(f"occupy: the occupier did not start: {last[0] if last else 'no output'}", 1)


def _is_up(state: str, record: str, pid: int) -> bool:
    rec = oc.read_record(record)
    return lock.holder(state) == pid and rec is not None and rec["pid"] == pid


def _already_running(args: argparse.Namespace) -> None:
    print("gpu-mon occupy: already running; `gpu-mon occupy off` stops it", file=sys.stderr)
    _print_status(args, stream=sys.stderr)


def _hold_limit(spec: OccupySpec) -> str:
    if not spec.max_hold_hours:
        return ""
    hours = f"{spec.max_hold_hours:g} h"
    return f"; gives them back after {hours} ([occupy] max_hold_hours in {spec.limits_from})"


def _check_gpus(args: argparse.Namespace, spec: OccupySpec) -> Optional[int]:
    """The GPUs named must exist now (exit 2); GPUs that cannot be read are the occupier's to wait on.
    Returns how many GPUs it would take (None: none could be read)."""
    backend, _source = base.backend(args)
    try:
        reading = backend.read()
        if reading.error:
            return len({str(g).lower() for g in spec.gpus}) or None
        return len({g.uuid or g.index for g in usage.select(reading, spec.gpus or None)})
    except usage.GpuUsageError as err:
        raise base.CliError(f"occupy: --gpus: {err}") from None
    finally:
        backend.close()


# ------------------------------------------------------------------------------------------------ serve


def serve(args: argparse.Namespace) -> int:
    """The occupier: the daemon on the reservation's config, holding the lock of its state file."""
    from gpu_mon.commands import occupy_spec as engine_occupy
    from gpu_mon.commands.occupy_queue import QueueJobs
    from gpu_mon.engine.daemon import Daemon
    from gpu_mon.outputs.phase import PhaseFile
    from gpu_mon.outputs.statefile import StateFile

    spec = OccupySpec(**json.loads(sys.stdin.read()))
    _stdin_to_devnull()
    directory = oc.state_dir()
    state, record, phase, _log = oc._files(directory)
    config = engine_occupy.config(spec, directory)
    args.sim = spec.sim
    backend, source = base.backend(args, writes=False)
    listeners = [StateFile(state), PhaseFile(phase, spec.polite)]
    tiers = [lambda _wiring: QueueJobs(spec.daemon_state)] if spec.daemon_state else []
    daemon = Daemon(
        config, backend, source="" if source == "NVML" else source, listeners=listeners, tiers=tiers
    )
    daemon.loop.listeners.extend(occupy_limits.serve_listeners(spec, daemon.end, time.time()))
    daemon.catch_signals()
    held = lock.DaemonLock(state)
    try:
        held.acquire()
    except lock.LockError as err:
        raise base.CliError(str(err), base.EXIT_FAILURE) from None
    try:
        _write_record(record, spec)
        log.info(
            "occupy: %s mode, %s; waits for %g min of free GPUs", spec.mode, spec.what, spec.wait_minutes
        )
        if spec.daemon_state:
            log.info("occupy: a GPU that runs a job of gpu-mon's queue is busy (%s)", spec.daemon_state)
        if os.geteuid() != 0:
            daemon.observer.warn_denied = False  # said once here, not for every process
            log.warning("occupy: %s", plain_user_sight(spec))
        return daemon.run()
    finally:
        with_removed(record)
        held.release()


def plain_user_sight(spec: OccupySpec) -> str:
    """What an occupier that is not root sees of other users, and what that means for its mode."""
    sees = (
        "not root: other users' processes are seen only through NVML (their contexts and memory) and by "
        "their opens of the GPUs' device nodes, never by the descriptors they hold"
    )
    if not spec.polite:
        return f"{sees}; hold mode keeps the GPUs whatever they do"
    return (
        f"{sees}; an open that none of your processes explains counts as theirs: the GPUs are given back "
        f"at once and count as busy for --wait-minutes after it (a process that holds a node without a "
        f"context is not seen after its open)"
    )


def _stdin_to_devnull() -> None:
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)


def _write_record(path: str, spec: OccupySpec) -> None:
    from gpu_mon.api.procfs import read_stat
    from gpu_mon.outputs import statefile

    st = read_stat(os.getpid())
    options = {k: v for k, v in spec.__dict__.items() if k not in ("env", "cwd")}
    doc = {
        "pid": os.getpid(),
        "start_ticks": st.start_ticks if st else 0,
        "started_wall": time.time(),
        **options,
    }
    statefile.write(path, doc)
    os.chmod(path, 0o600)


def with_removed(path: str) -> None:
    """Remove a file, whether or not it is there."""
    with contextlib.suppress(OSError):
        os.unlink(path)


# -------------------------------------------------------------------------------------------------- off


def off(args: argparse.Namespace) -> int:
    """Stop the occupier (SIGTERM, SIGKILL after --timeout); a stale record is removed, never signalled."""
    if not args.timeout > 0:
        raise base.CliError(f"occupy: --timeout must be greater than 0, not {args.timeout:g}")
    state, record, _phase, _log = oc._files(oc.state_dir())
    rec = oc.read_record(record)
    holder = lock.holder(state)
    if rec is None or not oc.record_is_live(rec) or holder != rec["pid"]:
        return _nothing_to_stop(rec, record, holder)
    oc.signal_occupier(rec, signal.SIGTERM)
    if not oc.wait_until(lambda: not oc.record_is_live(rec), args.timeout):
        oc.signal_occupier(rec, signal.SIGKILL)
        print(f"gpu-mon occupy: still running {args.timeout:g} s after SIGTERM; killed", file=sys.stderr)
        oc.wait_until(lambda: not oc.record_is_live(rec), 10)
        with_removed(record)
    print(f"gpu-mon occupy: stopped (pid {rec['pid']})")
    return base.EXIT_OK


def _nothing_to_stop(rec: Optional[dict], record: str, holder: Optional[int]) -> int:
    if rec is not None:
        why = "is gone" if holder is None else "is not the occupier any more"
        print(f"gpu-mon occupy: stale record (pid {rec['pid']} {why}): removed, nothing signalled")
        with_removed(record)
    else:
        print("gpu-mon occupy: not running")
    return base.EXIT_OK


# ----------------------------------------------------------------------------------------------- status


def status(args: argparse.Namespace) -> int:
    """waiting / occupying / yielded: exit 0; stopped: exit 3."""
    return _print_status(args, sys.stdout)


def _print_status(args: argparse.Namespace, stream) -> int:
    from gpu_mon.commands.status import daemon_state

    state, record, phase_path, log_path = oc._files(oc.state_dir())
    rec = oc.read_record(record)
    doc = daemon_state(state)
    if doc is None or rec is None or rec["pid"] != doc["daemon"].get("pid"):
        found = {"state": "stopped", "pid": None, "gpus": [], "mode": None, "since": None}
    else:
        found = _running_status(rec, doc, phase_path)
    if getattr(args, "json", False):
        print(
            json.dumps({**found, "log": log_path, "last_log_lines": oc.tail(log_path)}, indent=2), file=stream
        )
    else:
        print("\n".join([*_status_lines(found, log_path), "", *oc.tail(log_path)]), file=stream)
    return base.EXIT_OK if found["state"] != "stopped" else oc.EXIT_NOT_RUNNING


def _running_status(rec: dict, doc: dict, phase_path: str) -> dict:
    try:
        with open(phase_path, encoding="utf-8") as f:
            phase = json.load(f)
    except (OSError, ValueError):
        phase = {"phase": "waiting", "since_wall": rec.get("started_wall")}
    workloads = doc.get("workloads") or []
    gpus = sorted({u for w in workloads for u in w.get("gpus", [])})
    held = {
        g["uuid"]: sum(p.get("used_memory_mib") or 0 for p in g.get("nvml_processes", []) if p.get("ours"))
        for g in doc.get("gpus", [])
        if g.get("uuid") in gpus
    }
    blockers = sorted({w.get("why", "") for w in workloads if w.get("state") not in ("running", "stopping")})
    return {
        "state": phase.get("phase", "waiting"),
        "pid": rec["pid"],
        "gpus": gpus,
        "mode": "yield" if rec.get("polite") else "hold",
        "since": oc.when(phase.get("since_wall")),
        "running": spec_what(rec),
        "duty": _duty(rec, phase),
        "memory_held_mib": held,
        "blocked_by": [b for b in blockers if b],
    }


def spec_what(rec: dict) -> str:
    """What the record says it runs."""
    fields = {k: rec[k] for k in OccupySpec.__dataclass_fields__ if k in rec}
    return OccupySpec(**fields).what


def _duty(rec: dict, phase: dict) -> Optional[str]:
    """compute or sleep, worked out from when occupying began and the duty cycle (stressor only)."""
    if phase.get("phase") != "occupying" or rec.get("argv") or rec.get("no_compute"):
        return None
    cycle = (rec["compute_min"] + rec["sleep_min"]) * 60
    into = (time.time() - float(phase.get("since_wall") or time.time())) % cycle if cycle else 0
    return "compute" if into < rec["compute_min"] * 60 else "sleep"


def _status_lines(found: dict, log_path: str) -> List[str]:
    if found["state"] == "stopped":
        return ["gpu-mon occupy: stopped", f"log: {log_path}"]
    lines = [
        f"gpu-mon occupy: {found['state']} since {found['since']} (pid {found['pid']}, {found['mode']} mode)",
        f"  runs: {found['running']}" + (f", now in its {found['duty']} phase" if found["duty"] else ""),
        f"  GPUs: {', '.join(found['gpus']) or 'none found yet'}",
    ]
    held = {u: m for u, m in found["memory_held_mib"].items() if m}
    if found["state"] == "occupying" and held:
        lines.append("  holding (NVML): " + ", ".join(f"{u} {m} MiB" for u, m in held.items()))
    lines += [f"  {b}" for b in found["blocked_by"]]
    lines.append(f"log: {log_path}")
    return lines


def cmd_occupy(args: argparse.Namespace) -> int:
    """Dispatch on / off / status / serve."""
    if args.occupy_command == "status" and args.all:
        return status_all(args)
    return {
        "on": on,
        "off": off,
        "status": status,
        "serve": serve,
    }[args.occupy_command](args)


def status_all(args: argparse.Namespace) -> int:
    """Every user's live occupier (api/occupiers.py): exit 0, or 3 when there is none."""
    from gpu_mon.api.occupiers import list_occupiers, registry_dir, registry_problem
    from gpu_mon.outputs.status import occupier_lines

    problem = registry_problem(registry_dir())
    if problem:
        print(f"gpu-mon occupy: warning: no record believed: {problem}", file=sys.stderr)
    found = list_occupiers()
    if args.json:
        print(json.dumps({"occupiers": found, "registry": registry_dir()}, indent=2))
    elif found:
        lines = occupier_lines(found, [], time.time())
        print("\n".join(["gpu-mon occupy: every user's occupier on this host:", *lines]))
    else:
        print("gpu-mon occupy: no occupier runs on this host")
    return base.EXIT_OK if found else oc.EXIT_NOT_RUNNING
