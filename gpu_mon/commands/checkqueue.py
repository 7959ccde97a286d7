"""`gpu-mon check`'s look at [queue]: its socket (does a daemon answer there, and what its queue holds),
its database, how jobs would be started, its GPUs and its limits. For root and for a plain user alike
(each sees what they may): it only reads, asks the daemon one listing, and never starts or changes
anything."""

from __future__ import annotations

import dataclasses
import os
import pwd
import stat
from typing import List

from gpu_mon.api.text import sanitize
from gpu_mon.config import Config, QueueSection
from gpu_mon.engine.workloads import transient

ASK_SECONDS = 2.0  # how long a daemon that does not answer is waited for


def queue_lines(config: Config) -> List[str]:
    """One line for each thing found, each starting `queue: `."""
    q = config.queue
    if q is None:
        return [f"queue: off ({config.path} has no [queue] section): `gpu-mon submit` is refused"]
    return [
        f"queue: socket {q.socket}: {_socket(q.socket)}",
        f"queue: database {q.database}: {_database(q.database)}",
        f"queue: launcher {q.launcher}: {_launcher(q.launcher)}",
        f"queue: GPUs: {_gpus(q)}; order {q.order}; who may submit: {_who(q)}",
        f"queue: limits: {limits(q)}",
    ]


def limits(q: QueueSection) -> str:
    """Every limit of the section (a key named max_* or *_limit*), as `key = value`, 0 or none: none."""
    found = []
    for f in dataclasses.fields(q):
        if f.name.startswith("max_") or "limit" in f.name:
            value = getattr(q, f.name)
            shown = "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
            found.append(f"{f.name} = {shown}")
    return ", ".join(found)


def _socket(path: str) -> str:
    """Whether a daemon answers there, and what its queue holds (one read-only listing)."""
    from gpu_mon.queue.protocol import NoDaemon, ProtocolError, request

    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "not there: no daemon runs this queue now"
    except OSError as err:
        return f"cannot be looked at ({err.strerror})"
    if not stat.S_ISSOCK(st.st_mode):
        return "not a socket: the daemon cannot listen there"
    try:
        answer = request(path, {"op": "jobs", "limit": 0}, timeout=ASK_SECONDS)
    except NoDaemon:
        return "nobody answers (a daemon that stopped left it, or another program's)"
    except (OSError, ProtocolError, ValueError) as err:
        return f"no answer ({sanitize(str(err))[:200]})"
    if not answer.get("ok"):
        return f"the daemon answers, refusing: {sanitize(str(answer.get('error')))[:200]}"
    running, waiting = len(answer.get("jobs") or []), int(answer.get("more") or 0)
    drained = answer.get("drained")
    state = f"; drained by {sanitize(str(drained.get('by')))}" if isinstance(drained, dict) else ""
    return f"a daemon answers ({running} running or stopping, {waiting} queued or held{state})"


def _database(path: str) -> str:
    """There or not, whose, its size: as far as the caller may see."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        parent = os.path.dirname(path) or "/"
        there = "its directory is there" if os.path.isdir(parent) else f"{parent} is made then"
        return f"not there yet (the daemon makes it as it starts; {there})"
    except PermissionError:
        return "cannot be looked at by you (the daemon's alone: `sudo gpu-mon check` says more)"
    except OSError as err:
        return f"cannot be looked at ({err.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file: the daemon will refuse it"
    mode = stat.S_IMODE(st.st_mode)
    safe = "" if st.st_uid == 0 and not mode & 0o022 else " (others may change it: the daemon refuses it)"
    return f"{st.st_size / (1 << 20):.1f} MiB, {_owner(st.st_uid)}'s, mode {mode:04o}{safe}"


def _launcher(launcher: str) -> str:
    """How jobs would start, as the daemon decides it (transient.choose) when run as root."""
    if launcher == "direct":
        return "jobs run as the daemon's own children"
    if transient.systemd_runs():
        return "jobs run as transient systemd units of their own (systemd runs this machine)"
    if launcher == "systemd":
        return "systemd does not run this machine: the daemon will refuse to start the queue"
    return "systemd does not run this machine: jobs run as the daemon's own children"


def _gpus(q: QueueSection) -> str:
    return "all that [gpu-*] sections watch" if q.gpus.all else str(q.gpus) or "none"


def _who(q: QueueSection) -> str:
    if not q.users and not q.groups:
        return "everyone"
    return ", ".join([*q.users, *(f"group {g}" for g in q.groups)])


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"
