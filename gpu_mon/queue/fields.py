"""The door: each field of a request that a user controls, checked as it arrives, so that nothing a user
sends reaches the daemon's round in a shape that could fail there (for everyone). A field that is refused
is one line (`Bad`, code 2; a size over its limit, code 1), and nothing is queued.

Text that becomes bytes (a command's arguments, the environment, the submit directory, --output, the
--notify command) may hold what Linux allows there and nothing else: no NUL byte, and no lone surrogate
but U+DC80..U+DCFF, which is how Python (os.fsdecode, the client's sys.argv and os.environ) spells a byte
that is not UTF-8: those are carried byte for byte (os.fsencode: 'surrogateescape') to the job and its
hook. The client sends JSON with `\\uXXXX` escapes (json.dumps' ensure_ascii), so they arrive as such.
A job's name is a label, shown everywhere: UTF-8 text, no NUL.
"""

from __future__ import annotations

import signal
from typing import Optional, Tuple

from gpu_mon.api.text import sanitize
from gpu_mon.config import STOP_SIGNALS

MAX_COMMAND = 64 * 1024  # bytes of a command's arguments (each with its NUL)
MAX_ENV = 256 * 1024  # bytes of an environment (each NAME=VALUE with its NUL)
MAX_NAME = 64  # characters of a job's name
MAX_PATH = 4096  # bytes of a path (the submit directory, --output): Linux's PATH_MAX
MAX_NOTIFY = 4096  # characters of a --notify command
MAX_GPUS = 4096  # --gpus (a job that could never start is refused later, by the queue's GPUs)
MAX_PRIORITY = 1_000_000  # --priority, either way: higher goes first


class Bad(Exception):
    """A refusal: str() is the line, `code` 1 (not allowed, a limit) or 2 (bad usage)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def _shown(value: str, limit: int = 40) -> str:
    return repr(sanitize(value, limit))


def as_bytes(value: str, what: str) -> bytes:
    """The bytes a text of a request stands for; Bad for a NUL or a lone surrogate that is no byte."""
    if "\0" in value:
        raise Bad(f"{what} contains a NUL byte")
    try:
        return value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as err:
        bad = value[err.start]
        raise Bad(
            f"{what} holds U+{ord(bad):04X}, a lone surrogate that is neither a character nor a byte "
            "(bytes that are not UTF-8 come as U+DC80..U+DCFF)"
        ) from None


def text(req: dict, key: str, what: str, limit: int, default: str = "") -> str:
    """A text that becomes bytes (a path, a command line): at most `limit` bytes."""
    value = req.get(key, default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise Bad(f"{what} must be text")
    size = len(as_bytes(value, what))
    if size > limit:
        raise Bad(f"{what} is too long ({size} bytes; at most {limit})", 1)
    return value


def label(req: dict, key: str, what: str, limit: int) -> str:
    """A name shown in listings and logs: UTF-8 text without NUL, at most `limit` characters."""
    value = req.get(key, "")
    if value is None:
        return ""
    if not isinstance(value, str) or "\0" in value:
        raise Bad(f"{what} must be text without NUL bytes")
    if len(value) > limit:
        raise Bad(f"{what} too long ({len(value)} characters; at most {limit})", 1)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise Bad(f"{what} must be UTF-8 text (it holds a lone surrogate)") from None
    return value


def command(value: object) -> Tuple[str, ...]:
    """The command's arguments: a non-empty list of texts, MAX_COMMAND bytes in all."""
    if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
        raise Bad("no command given (gpu-mon submit [OPTIONS] -- COMMAND [ARGS...])")
    size = sum(len(as_bytes(a, f"the command's argument {i}")) + 1 for i, a in enumerate(value))
    if size > MAX_COMMAND:
        raise Bad(f"command too long ({size} bytes; at most {MAX_COMMAND})", 1)
    return tuple(value)


def environment(value: object) -> Tuple[Tuple[str, str], ...]:
    """The environment: an object of texts, each name non-empty and without `=`; MAX_ENV bytes in all."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise Bad("env must be an object of strings")
    size = 0
    for name, v in value.items():
        if not isinstance(v, str):
            raise Bad(f"env {_shown(name)}: the value must be text")
        if not name or "=" in name:
            raise Bad(f"env {_shown(name)}: a name must be non-empty, without '='")
        size += len(as_bytes(name, f"env name {_shown(name)}")) + 1
        size += len(as_bytes(v, f"env {_shown(name)}")) + 1
    if size > MAX_ENV:
        raise Bad(f"environment too large ({size} bytes; at most {MAX_ENV})", 1)
    return tuple(value.items())


def whole(req: dict, key: str, what: str, default: int, low: int, high: int) -> int:
    """A whole number from low to high."""
    value = req.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise Bad(f"{what} must be a whole number from {low} to {high}")
    return value


def flag(req: dict, key: str, default: bool) -> bool:
    """true or false (absent or null: the default)."""
    value = req.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise Bad(f"{key} must be true or false")
    return value


def stop_signal(value: object) -> int:
    """--stop-signal: one a program catches to end cleanly (config's STOP_SIGNALS, by name or number).
    Any other would reach the job's leader too (it is in the job's process group): one whose default
    action kills (SIGSEGV, SIGRTMIN+2, ...) took it down, and the job lost its grace."""
    allowed = {int(getattr(signal, name)): name for name in STOP_SIGNALS if hasattr(signal, name)}
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit() and len(value) < 20:
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value in allowed:
        return value
    if isinstance(value, str) and len(value) < 20:
        name = value.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        found = [n for n, s in allowed.items() if s == name]
        if found:
            return found[0]
    shown = _shown(str(value), 20)
    if not isinstance(value, (int, str)) or isinstance(value, bool) or not _is_signal(value):
        raise Bad(f"--stop-signal {shown} is not a signal name")
    names = ", ".join(s[3:] for s in allowed.values())
    raise Bad(f"--stop-signal {shown} is not one a job may be stopped with: one of {names}")


def _is_signal(value: object) -> bool:
    if isinstance(value, int):
        return 1 <= value < signal.NSIG
    name = str(value).strip().upper()
    return (name if name.startswith("SIG") else "SIG" + name) in signal.Signals.__members__


def optional_text(value: object, what: str, limit: int) -> Optional[str]:
    """A selection's text (cancel --name, jobs --user): None, or text without NUL of at most limit."""
    if value is None:
        return None
    if not isinstance(value, str) or "\0" in value or len(value) > limit:
        raise Bad(f"{what} must be text (at most {limit} characters, no NUL)")
    return value
