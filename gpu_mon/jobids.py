"""`gpu-mon _job-ids COMMAND [--config PATH] [--prefix P]`: the calling user's job ids (starting with P),
one a line, as users name them (`17`; an array `22` and its elements `22_0`, `22_1`, ...), for shell
completion of `cancel`, `hold`, `release` and `logs`.

A TAB has to be answered at once (under 50 ms with 10 000 jobs queued: bench/completion.py), and the
whole CLI takes 150-250 ms to import, so the `gpu-mon` executable (gpu_mon/entry.py) answers `_job-ids`
before importing it, with the standard library's C socket and JSON functions alone (not even typing or
json), through gpu_mon/quickclient.py. This module imports neither gpu_mon.cli nor gpu_mon.entry
(entry.py imports it: the layers in tests/test_layers.py).

The daemon knows the user from the socket's peer credentials and sends that user's jobs in the states
the command acts on only (the queue's `ids` request); the prefix is applied here, so that the shell gets
only what matches (bash's compgen takes 30 ms over 10 000 words).

Which socket: with no config named (--config on the line being completed, or GPU_MON_CONFIG), the default
one is asked first; only when nothing answers there is the config read for its [queue] socket, through
the same code as `gpu-mon jobs` (slower, but a non-default socket is rare). Any failure prints nothing
and exits 0: a completion never shows an error.
"""

from __future__ import annotations

import os

from gpu_mon.quickclient import DEFAULT_CONFIG, DEFAULT_SOCKET, Failed, NotSent, dumps, exchange, loads

TYPE_CHECKING = False  # (typing alone takes 5-10 ms to import)
if TYPE_CHECKING:
    from typing import Iterator, List, Optional, Sequence

# The states whose jobs each command can act on (logs: every job); a test checks them against the queue's.
WANTED = {
    "cancel": ("queued", "held", "running", "stopping"),
    "hold": ("queued",),
    "release": ("held",),
}
_TIMEOUT = 2.0
_MAX_ANSWER = 1 << 24


def job_ids(argv: Sequence[str]) -> List[str]:
    """The ids `COMMAND [--config PATH] [--prefix P]` completes to (empty on any failure)."""
    command = argv[0] if argv else ""
    config = _value(argv, "--config")
    prefix = _value(argv, "--prefix") or ""
    req: dict = {"op": "ids"}
    if command in WANTED:
        req["states"] = list(WANTED[command])
    for path in _sockets(config):
        ids = _ask(path, req)
        if ids is not None:
            named = (str(i) for i in ids if isinstance(i, (int, str)) and not isinstance(i, bool))
            return [i for i in named if i.startswith(prefix)]
    return []


def _value(argv: Sequence[str], option: str) -> Optional[str]:
    """The word after `option` (None when it is not there)."""
    return argv[argv.index(option) + 1] if option in argv[:-1] else None


def _sockets(config: Optional[str]) -> Iterator[str]:
    """The sockets to try, cheapest first."""
    named = config or os.environ.get("GPU_MON_CONFIG")
    if not named:
        yield DEFAULT_SOCKET
        if not os.access(DEFAULT_CONFIG, os.R_OK):
            return
    path = _configured_socket(named)
    if path and (named or path != DEFAULT_SOCKET):
        yield path


def _configured_socket(config: Optional[str]) -> Optional[str]:
    """[queue] socket as `gpu-mon jobs` finds it (None when the config is bad or has no queue)."""
    import argparse

    from gpu_mon.commands import queue

    try:
        return queue.socket_path(argparse.Namespace(config=config))
    except Exception:  # (completion: nothing to say, whatever went wrong)
        return None


def _ask(path: str, req: dict) -> Optional[list]:
    """The ids the daemon answers on this socket; None when nothing (sensible) answers."""
    try:
        answer = loads(exchange(path, dumps(req), _TIMEOUT, _MAX_ANSWER))
    except (NotSent, Failed, ValueError):
        return None
    ids = answer.get("ids") if isinstance(answer, dict) and answer.get("ok") else None
    return ids if isinstance(ids, list) else None
