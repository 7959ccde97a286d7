"""Value types: each parser takes the text after `key =` and returns the value or raises
ValueError("what is wrong"), which the section prefixes with file, line, section and key."""

from __future__ import annotations

import math
import os
import re
import signal
import socket
from dataclasses import dataclass
from typing import Callable, List, Tuple

from gpu_mon import shellwords

MAX_SECONDS = 365 * 86400.0
MAX_MIB = 1 << 30
# Minimums for intervals that drive loops: below them a typo would make the daemon spin.
MIN_INTERVAL_SECONDS = 0.1
MIN_FULL_SCAN_SECONDS = 1.0
MIN_RESTART_DELAY_SECONDS = 0.1
_UUID_RE = re.compile(r"^(GPU|MIG)-[0-9A-Za-z][0-9A-Za-z/-]*$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RESERVED_ENV = ("CUDA_VISIBLE_DEVICES",)
# Signals a workload may be asked to stop with: the ones a program can catch and that mean "please end"
# somewhere (SIGUSR1: PyTorch Lightning's and Slurm's checkpoint-and-requeue convention).
STOP_SIGNALS = (
    "SIGTERM",
    "SIGINT",
    "SIGHUP",
    "SIGQUIT",
    "SIGUSR1",
    "SIGUSR2",
    "SIGALRM",
    "SIGWINCH",
    "SIGPWR",
)


@dataclass(frozen=True)
class GpuSelection:
    """`ALL`, or an ordered list of GPU references (int index or UUID string)."""

    all: bool = False
    refs: Tuple[object, ...] = ()

    def __str__(self) -> str:
        return "ALL" if self.all else ",".join(str(r) for r in self.refs)


def seconds(value: str, minimum: float = 0.0, exclusive: bool = False) -> float:
    """A finite number of seconds from `minimum` to a year."""
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a number of seconds") from None
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not a finite number of seconds")
    if number < minimum or (exclusive and number == minimum):
        bound = "greater than" if exclusive else "at least"
        raise ValueError(f"{value!r} must be {bound} {minimum:g}")
    if number > MAX_SECONDS:
        raise ValueError(f"{value!r} is too large (at most {MAX_SECONDS:.0f} seconds, one year)")
    return number


_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(value: str) -> float:
    """A duration as `submit --time-limit` takes it (90, 90s, 30m, 2h, 1d), more than 0, at most a year: in
    seconds."""
    text = value.strip().lower()
    unit = text[-1] if text and text[-1] in "smhd" else ""
    try:
        number = float(text[: len(text) - len(unit)]) * _DURATION_UNITS[unit]
    except ValueError:
        raise ValueError(f"{value!r} is not a duration (90, 90s, 30m, 2h, 1d)") from None
    if not math.isfinite(number) or not 0 < number <= MAX_SECONDS:
        raise ValueError(f"{value!r} must be more than 0 and at most a year")
    return number


def positive_seconds(value: str) -> float:
    """Seconds, more than 0."""
    return seconds(value, 0.0, exclusive=True)


def at_least(minimum: float) -> Callable[[str], float]:
    """Seconds, at least `minimum`."""

    def parse(value: str) -> float:
        return seconds(value, minimum)

    return parse


def up_to(maximum: float) -> Callable[[str], float]:
    """Seconds, from 0 to `maximum`."""

    def parse(value: str) -> float:
        number = seconds(value)
        if number > maximum:
            raise ValueError(f"{value!r} must be at most {maximum:g}")
        return number

    return parse


def mib(value: str) -> int:
    """A whole number of MiB."""
    try:
        number = int(value)
    except ValueError:
        if value.strip().isdigit():  # more digits than int() converts
            raise ValueError(f"{value!r} is too large (at most {MAX_MIB} MiB)") from None
        raise ValueError(f"{value!r} is not a whole number of MiB") from None
    if number < 0:
        raise ValueError(f"{value!r} must be 0 or more")
    if number > MAX_MIB:
        raise ValueError(f"{value!r} is too large (at most {MAX_MIB} MiB)")
    return number


_TRUE = ("1", "yes", "true", "on")
_FALSE = ("0", "no", "false", "off")


def boolean(value: str) -> bool:
    """yes/no, true/false, on/off, 1/0."""
    low = value.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{value!r} is not a boolean (use yes/no, true/false, on/off or 1/0)")


def names(value: str) -> Tuple[str, ...]:
    """A comma-separated list (newlines also separate); empty items are errors."""
    if not value.strip():
        return ()
    items = [item.strip() for item in re.split(r",[ \t]*\n|[,\n]", value)]  # "a,\n b" is two items
    if any(not item for item in items):
        raise ValueError(f"{value!r}: empty item in the list (stray comma?)")
    return tuple(items)


_DEVICE_CLASS = re.compile(r"^(char|block)-[A-Za-z0-9_.+-]+$")
_DEVICE_PATH = re.compile(r"^/dev/[A-Za-z0-9_./:+-]+$")


def devices(value: str) -> Tuple[str, ...]:
    """Devices a job may open besides its GPUs, as systemd's DeviceAllow= takes them: a node under /dev
    (`/dev/fuse`, `/dev/char/10:229`) or a class of /proc/devices (`char-infiniband_verbs`)."""
    items = names(value)
    for item in items:
        if ".." in item.split("/") or not (_DEVICE_CLASS.match(item) or _DEVICE_PATH.match(item)):
            raise ValueError(f"{item!r} is not a device under /dev nor a class like char-NAME or block-NAME")
    return items


def parse_gpus(value: str) -> GpuSelection:
    """`ALL`, or a comma-separated list of NVML indices and UUIDs; ValueError naming what is wrong."""
    if value.strip().upper() == "ALL":
        return GpuSelection(all=True)
    if not value.strip():
        raise ValueError("is empty (use ALL or a comma-separated list of GPU indices or UUIDs)")
    refs: List[object] = []
    items = names(value)
    if any(item.upper() == "ALL" for item in items):
        raise ValueError(f"{value!r}: ALL means every GPU and cannot be listed with others")
    for item in items:
        if item.isdigit() and item.isascii():
            ref: object = int(item) if len(item) <= 6 else 1 << 30
            if ref > 4096:
                raise ValueError(f"{item!r} is not a GPU index (too large)")
        elif _UUID_RE.match(item):
            ref = item
        else:
            raise ValueError(f"{item!r} is not a GPU index or UUID")
        if ref in refs:
            raise ValueError(f"{item!r} is listed twice")
        refs.append(ref)
    return GpuSelection(refs=tuple(refs))


def parse_command(value: str) -> Tuple[str, ...]:
    """A command line split like a shell would (no shell runs it); ValueError naming what is wrong."""
    try:
        argv = shellwords.split(value)
    except ValueError as err:
        raise ValueError(f"cannot split {value!r}: {err}") from None
    if not argv:
        raise ValueError("is empty")
    if not argv[0]:
        raise ValueError(f"{value!r}: the program name is empty")
    return tuple(argv)


def environment(value: str) -> Tuple[Tuple[str, str], ...]:
    """NAME=VALUE words, split like a shell would."""
    try:
        words = shellwords.split(value)
    except ValueError as err:
        raise ValueError(f"cannot split {value!r}: {err}") from None
    pairs: List[Tuple[str, str]] = []
    for word in words:
        name, eq, val = word.partition("=")
        if not eq or not _ENV_NAME_RE.match(name):
            raise ValueError(f"{word!r} is not NAME=VALUE")
        if name in _RESERVED_ENV:
            raise ValueError(f"{name} is set by gpu-mon itself (to the UUIDs of the workload's GPUs)")
        pairs.append((name, val))
    return tuple(pairs)


def path_under(base: str) -> Callable[[str], str]:
    """A path; a relative one is relative to `base` (the config file's directory), `~` the daemon's home."""

    def parse(value: str) -> str:
        if not value:
            raise ValueError("is empty")
        if "\0" in value:
            raise ValueError("contains a NUL byte")
        return os.path.normpath(os.path.join(base, os.path.expanduser(value)))

    return parse


def optional(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An empty value means "not set" (None): conf/gpu_mon.conf lists such keys as `;key =`."""

    def parse_optional(value: str) -> object:
        return parse(value) if value else None

    return parse_optional


def choice(*options: str) -> Callable[[str], str]:
    """One of `options`, any case."""

    def parse(value: str) -> str:
        if value.lower() not in options:
            raise ValueError(f"{value!r} is not one of {', '.join(options)}")
        return value.lower()

    return parse


def globs(value: str) -> Tuple[str, ...]:
    """Blank- (or comma-) separated globs."""
    words = value.replace(",", " ").split()
    if not words:
        raise ValueError("is empty")
    return tuple(words)


def fraction(value: str) -> float:
    """A number from 0 to 1 (`0.7`)."""
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a number from 0 to 1") from None
    if not 0.0 <= number <= 1.0:
        raise ValueError(f"{value!r} is not a fraction from 0 to 1 (70% is 0.7)")
    return number


def percent(value: str) -> float:
    """A number from 0 to 100."""
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a percentage from 0 to 100") from None
    if not 0.0 <= number <= 100.0:
        raise ValueError(f"{value!r} is not a percentage from 0 to 100")
    return number


def listen_address(value: str) -> Tuple[str, int]:
    """`PORT` (127.0.0.1), `ADDRESS:PORT` or `[IPV6]:PORT` with an IP address (or localhost)."""
    text = value.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host, port_text = "127.0.0.1", text
    elif host.lower() == "localhost":
        host = "127.0.0.1"
    elif host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not _is_ip(host, socket.AF_INET6):
            raise ValueError(f"{value!r}: {host!r} is not an IPv6 address")
    elif not _is_ip(host, socket.AF_INET):
        raise ValueError(
            f"{value!r} is not PORT or ADDRESS:PORT with an IP address (IPv6 in brackets: [::1]:9842)"
        )
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{value!r}: the port must be a number from 1 to 65535")
    return host, int(port_text)


def _is_ip(text: str, family: int) -> bool:
    try:
        socket.inet_pton(family, text)
    except (OSError, ValueError):
        return False
    return True


def count(value: str) -> int:
    """A whole number, 1 or more."""
    return _at_least(value, 1, "1 or more")


def limit(value: str) -> int:
    """A whole number, 0 (no limit) or more."""
    return _at_least(value, 0, "0 (no limit) or more")


def _at_least(value: str, least: int, words: str) -> int:
    """A whole number, `least` or more (`words` says so in the error)."""
    try:
        number = int(value.strip())
    except ValueError:
        raise ValueError(f"{value!r} is not a whole number") from None
    if number < least:
        raise ValueError(f"must be {words}, not {number}")
    return number


def hours(value: str) -> float:
    """More than 0 hours, at most a year."""
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a number of hours") from None
    if not 0 < number * 3600 <= MAX_SECONDS:
        raise ValueError(f"{value!r} must be more than 0 hours and at most a year (8760)")
    return number


def program(value: str) -> str:
    """A program: a bare name (found in PATH when run) or a path."""
    if not value.strip() or "\0" in value:
        raise ValueError("is empty" if not value.strip() else "contains a NUL byte")
    return value.strip()


def stop_signal(value: str) -> int:
    """`SIGUSR1`, `USR1` or `usr1` -> its number; ValueError for one a workload cannot be stopped with."""
    name = value.strip().upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    if name not in STOP_SIGNALS or not hasattr(signal, name):
        raise ValueError(f"{value!r} is not one of {', '.join(STOP_SIGNALS)}")
    return int(getattr(signal, name))
