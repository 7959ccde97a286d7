"""INI text -> frozen dataclasses. Strict: every error in a file is reported at once, with its line.

The format is the gpu_mon seed's: `[defaults]`, `[gpu-NAME]`, `[process-NAME]`, `[tty]`; `key = value` (or
`key: value`); full-line comments with `;` or `#`; an indented line continues the previous value. Keys are
case-insensitive. Relative paths are relative to the directory of the config file.
"""

from __future__ import annotations

import difflib
import grp
import math
import os
import pwd
import re
import signal
import socket
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from gpu_mon import safefile, shellwords

DEFAULT_PATH = "/etc/gpu_mon.conf"
MAX_CONFIG_BYTES = 1 << 20
MAX_SECONDS = 365 * 86400.0
MAX_MIB = 1 << 30
MAX_VALUE_CHARS = 65536  # a longer value is an error (a cmd longer than this is a mistake, not a command)
# Minimums for intervals that drive loops: below them a typo would make the daemon spin.
MIN_INTERVAL_SECONDS = 0.1
MIN_FULL_SCAN_SECONDS = 1.0
MIN_RESTART_DELAY_SECONDS = 0.1
# Always ignored as GPU holders: they only read state (DESIGN.md "[gpu-NAME]").
DEFAULT_TTY_DEVICES = ("/dev/pts/*", "/dev/tty[0-9]*")
_UUID_RE = re.compile(r"^(GPU|MIG)-[0-9A-Za-z][0-9A-Za-z/-]*$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SECTION_NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]+$")
_RESERVED_ENV = ("CUDA_VISIBLE_DEVICES",)
# C0/C1 controls (tab allowed), DEL and the Unicode line/paragraph separators: never meaningful in a config
# line, and echoed raw they would garble the one-line error messages.
_CONTROL_RE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
MAX_MESSAGE = 240  # longer messages (a huge value or key) are cut in the middle, after `PATH:`


class ConfigError(Exception):
    """The config cannot be used; `errors` holds one line per problem. `partial` is what did parse (the
    sections without errors), so that `check` can report the host's problems with it at the same time."""

    def __init__(self, errors: List[str], partial: Optional[Config] = None):
        super().__init__("\n".join(errors))
        self.errors = list(errors)
        self.partial = partial


@dataclass(frozen=True)
class GpuSelection:
    """`ALL`, or an ordered list of GPU references (int index or UUID string)."""

    all: bool = False
    refs: Tuple[object, ...] = ()

    def __str__(self) -> str:
        return "ALL" if self.all else ",".join(str(r) for r in self.refs)


@dataclass(frozen=True)
class Defaults:
    """The [defaults] section."""

    interval_seconds: float = 2.0
    start_delay_seconds: float = 60.0
    stop_timeout_seconds: float = 10.0
    urgent_stop_timeout_seconds: float = 2.0
    restart_delay_seconds: float = 10.0
    restart_delay_max_seconds: float = 600.0
    healthy_run_seconds: float = 60.0
    full_scan_seconds: float = 60.0
    watch_opens: bool = True
    state_file: str = "/run/gpu_mon/state.json"
    containment: str = "auto"  # auto (a cgroup where the daemon may create one), cgroup, subreaper
    # The line each written key is on (not compared: moving a key in the file changes nothing).
    key_lines: Tuple[Tuple[str, int], ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class GpuSection:
    """A [gpu-NAME] section: which GPUs to watch and what does not make them busy."""

    name: str
    gpus: GpuSelection
    ignore_programs: Tuple[str, ...] = ()
    ignore_users: Tuple[str, ...] = ()
    busy_memory_mib: int = 1024
    holder_grace_seconds: Optional[float] = None
    # A foreign process holding at least idle_holder_memory_mib at no more than idle_holder_utilization_pct
    # for idle_holder_seconds is reported as an idle holder (never signalled).
    idle_holder_seconds: float = 7200.0
    idle_holder_memory_mib: int = 1024
    idle_holder_utilization_pct: float = 1.0
    # Run (as the daemon's user, no shell) once when an idle-holder episode starts; None: nothing runs.
    idle_holder_command: Optional[Tuple[str, ...]] = None
    line: int = 0
    # The line each written key is on (not compared: moving a key in the file changes nothing).
    key_lines: Tuple[Tuple[str, int], ...] = field(default=(), compare=False)
    # Not in the INI file (`gpu-mon occupy` only): processes whose open files cannot be read do not make
    # the GPU busy. A plain user cannot read other users' processes; memory used and NVML's process list
    # still show what they do on the GPU.
    unreadable_is_busy: bool = True


@dataclass(frozen=True)
class ProcessSection:
    """A [process-NAME] section: a workload and where it may run."""

    name: str
    cmd: Tuple[str, ...]
    gpus: GpuSelection = GpuSelection(all=True)
    dir: str = "/"
    log: Optional[str] = None
    user: str = "nobody"
    user_explicit: bool = False
    uid: int = 65534
    gid: int = 65534
    group: str = "nogroup"
    groups: Tuple[int, ...] = ()  # supplementary groups of `user`
    home: str = "/"
    env: Tuple[Tuple[str, str], ...] = ()
    per_gpu: bool = False
    # How it is stopped (engine/workloads/stopping.py): None means [defaults]'. Not in the fingerprint: a
    # reload applies them to running workloads without a restart.
    stop_signal: int = signal.SIGTERM
    stop_timeout_seconds: Optional[float] = None
    urgent_stop_timeout_seconds: Optional[float] = None
    line: int = 0
    # The line each written key is on (not compared: moving a key in the file changes nothing).
    key_lines: Tuple[Tuple[str, int], ...] = field(default=(), compare=False)
    fingerprint: Tuple[Tuple[str, str], ...] = ()  # the raw keys and values: a reload restarts on change
    # Not in the INI file (`gpu-mon occupy` only). together: per_gpu copies start only when all the
    # section's GPUs are free, and all stop when any is busy. hold: never stop for a busy GPU.
    together: bool = False
    hold: bool = False


@dataclass(frozen=True)
class TtySection:
    """The [tty] section: pause every workload while a terminal user is active."""

    enabled: bool = False
    whitelist: Tuple[str, ...] = ()
    idle_seconds: float = 300.0
    devices: Tuple[str, ...] = DEFAULT_TTY_DEVICES


@dataclass(frozen=True)
class HistorySection:
    """The [history] section: an embedded SQLite file of what happened (outputs/history.py)."""

    enabled: bool = True
    path: str = "/var/lib/gpu_mon/history.sqlite"
    retention_days: float = 90.0
    sample_seconds: float = 60.0


@dataclass(frozen=True)
class MetricsSection:
    """The [metrics] section (outputs/metrics.py): a textfile for node-exporter, an HTTP endpoint, or both."""

    textfile: Optional[str] = None
    listen: Optional[Tuple[str, int]] = None  # (address, port); a bare port is 127.0.0.1
    line: int = 0

    @property
    def listen_text(self) -> str:
        """`127.0.0.1:9842`, `[::1]:9842`."""
        if self.listen is None:
            return ""
        host, port = self.listen
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


KILL_ACTIONS = ("end_process", "shutdown", "reboot", "command")


@dataclass(frozen=True)
class OccupySection:
    """The [occupy] section: the admin's limits on every user's `gpu-mon occupy on` (read from the system
    config whatever config a user names). Empty `users` and `groups`: everyone may occupy."""

    users: Tuple[str, ...] = ()
    groups: Tuple[str, ...] = ()
    max_gpus_per_user: Optional[int] = None
    max_hold_hours: Optional[float] = None
    require_yield: bool = False
    line: int = 0


QUEUE_ORDERS = ("fair", "fifo")


@dataclass(frozen=True)
class QueueSection:
    """The [queue] section: users' own jobs (`gpu-mon submit`) on GPUs nobody else uses. Off unless
    written. Empty `users` and `groups`: everyone may submit. 0 means no limit."""

    socket: str = "/run/gpu_mon/queue.sock"
    gpus: GpuSelection = GpuSelection(all=True)
    users: Tuple[str, ...] = ()
    groups: Tuple[str, ...] = ()
    max_running_per_user: int = 0
    max_gpus_per_user: int = 0
    max_queued_per_user: int = 1000
    max_gpus_per_job: int = 0
    order: str = "fair"
    fair_window_hours: float = 24.0
    grace_seconds: float = 30.0
    max_grace_seconds: float = 600.0
    start_delay_seconds: Optional[float] = None  # None: [defaults] start_delay_seconds
    preempt_workloads: bool = True
    database: str = "/var/lib/gpu_mon/queue.sqlite"
    keep_finished_days: float = 7.0  # a finished job leaves the database after this long (0: never)
    launcher: str = "auto"  # auto (transient units where systemd runs the machine), systemd, direct
    line: int = 0


SLURM_ACTIONS = ("requeue", "cancel")


@dataclass(frozen=True)
class SlurmSection:
    """The [slurm] section: jobs of these partitions or QOS yield to anyone else's use of their GPUs, by
    asking Slurm (`scontrol requeue`, or `scancel`), never by a signal from gpu-mon. Off unless written."""

    preemptible_partitions: Tuple[str, ...] = ()
    preemptible_qos: Tuple[str, ...] = ()
    action: str = "requeue"
    signal: Optional[int] = None  # sent first through `scancel --signal --full`, then the action
    signal_grace_seconds: float = 30.0
    avoid_node_seconds: float = 600.0
    scontrol: str = "scontrol"
    scancel: str = "scancel"
    timeout_seconds: float = 5.0
    line: int = 0


@dataclass(frozen=True)
class SentinelSection:
    """The [sentinel] section (seed 001 in the daemon), also what `gpu-mon sentinel`'s options make: arm
    after `arm_duration_seconds` at >= arm_threshold, act once after `kill_duration_seconds` below
    kill_threshold. Thresholds are fractions 0-1."""

    arm_duration_seconds: float = 30.0
    arm_threshold: float = 0.7
    kill_duration_seconds: float = 300.0
    kill_threshold: float = 0.1
    kill_action: str = "end_process"
    command: Tuple[str, ...] = ()
    gpus: GpuSelection = GpuSelection(all=True)
    aggregate: str = "mean"  # or max: one busy GPU keeps the machine up
    dry_run: bool = False
    line: int = 0
    # The line each written key is on (not compared: moving a key in the file changes nothing).
    key_lines: Tuple[Tuple[str, int], ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class Config:
    """A whole, valid config."""

    path: str
    defaults: Defaults = Defaults()
    gpu_sections: Tuple[GpuSection, ...] = ()
    processes: Tuple[ProcessSection, ...] = ()
    tty: TtySection = TtySection()
    sentinel: Optional[SentinelSection] = None  # off unless the section is written
    history: HistorySection = HistorySection()
    metrics: Optional[MetricsSection] = None  # off unless the section is written
    occupy: Optional[OccupySection] = None  # no limits unless the section is written
    queue: Optional[QueueSection] = None  # off unless the section is written
    slurm: Optional[SlurmSection] = None  # off unless the section is written
    warnings: Tuple[str, ...] = ()


def line_of(section: object, key: str) -> int:
    """The line `key` is written on; its section's header line when it is not written (0: neither)."""
    return dict(getattr(section, "key_lines", ())).get(key, getattr(section, "line", 0))


def _key_lines(values: Dict[str, Tuple[object, int]]) -> Tuple[Tuple[str, int], ...]:
    return tuple((key, line) for key, (_, line) in values.items())


# ---------------------------------------------------------------------------------------------------------
# Lexing: lines -> sections of (key, value, line)


@dataclass
class _RawSection:
    name: str
    line: int
    items: List[Tuple[str, str, int]] = field(default_factory=list)
    more: Dict[int, List[str]] = field(default_factory=dict)  # item index -> its continuation lines

    def join(self) -> None:
        """Put continuation lines into their values (once, at the end: joining per line is quadratic)."""
        for index, lines in self.more.items():
            key, value, at = self.items[index]
            self.items[index] = (key, "\n".join([value, *lines]).strip(), at)
        self.more = {}


def _lex(
    text: str, where: Callable[[int], str], errors: List[str], bad_lines: Dict[int, str]
) -> List[_RawSection]:
    """Split into sections; lines with control characters go to `bad_lines` (line -> error)."""
    lexer = _Lexer(where, errors, bad_lines)
    # Only "\n" ends a line (CRLF tolerated): str.splitlines() would also split on form feeds, U+2028 and
    # others, and every line number after one would be wrong.
    for lineno, raw in enumerate(text.split("\n"), start=1):
        lexer.line(lineno, raw[:-1] if raw.endswith("\r") else raw)
    for section in lexer.sections:
        section.join()
    return lexer.sections


class _Lexer:
    """Line by line: headers, `key = value` items, continuation lines."""

    def __init__(self, where: Callable[[int], str], errors: List[str], bad_lines: Dict[int, str]):
        self.where, self.errors, self.bad_lines = where, errors, bad_lines
        self.sections: List[_RawSection] = []
        self.seen: Dict[str, int] = {}  # section name -> line
        self.keys_seen: Dict[str, int] = {}  # key -> line, in the current section
        self.current: Optional[_RawSection] = None
        self.header_seen = False  # a '[...' line was met, even a broken one
        self.last_item: Optional[int] = None  # index into current.items that an indented line continues

    def line(self, lineno: int, raw: str) -> None:
        """One line (without its newline)."""
        stripped = raw.strip()
        if not stripped or stripped[0] in ";#":
            return
        bad = _CONTROL_RE.search(raw)
        if bad:  # reported alone: the errors that its mangled text causes are dropped in parse()
            self.bad_lines[lineno] = (
                f"{self.where(lineno)}: control character U+{ord(bad.group()):04X} in the line (not allowed)"
            )
            raw = _CONTROL_RE.sub("\ufffd", raw)
            stripped = raw.strip()
        if raw[0] in " \t" and self.current is not None and self.last_item is not None:
            self.current.more.setdefault(self.last_item, []).append(stripped)
            return
        self.last_item = None
        if stripped.startswith("["):
            self.header(lineno, stripped)
        else:
            self.item(lineno, stripped)

    def header(self, lineno: int, stripped: str) -> None:
        """A `[section]` line."""
        self.header_seen = True
        self.current = None
        if not stripped.endswith("]"):
            what = (
                "text after the section header's ']' (comments go on their own line)"
                if "]" in stripped
                else "section header is missing its closing ']'"
            )
            self.errors.append(f"{self.where(lineno)}: {what}")
            return
        name = stripped[1:-1].strip()
        if name in self.seen:
            self.errors.append(
                f"{self.where(lineno)}: [{name}] appears twice (first at line {self.seen[name]})"
            )
            return
        self.seen[name] = lineno
        self.keys_seen = {}
        self.current = _RawSection(name, lineno)
        self.sections.append(self.current)

    def item(self, lineno: int, stripped: str) -> None:
        """A `key = value` (or `key: value`) line."""
        cut = [i for i in (stripped.find("="), stripped.find(":")) if i > 0]
        if not cut:
            self.errors.append(
                f"{self.where(lineno)}: expected 'key = value' or '[section]', found {stripped[:60]!r}"
            )
            return
        if self.current is None:
            if not self.header_seen:
                self.errors.append(f"{self.where(lineno)}: 'key = value' before any [section]")
            return  # inside a broken or duplicate section: already reported
        i = min(cut)
        key = stripped[:i].strip().lower()
        if key in self.keys_seen:
            first = self.keys_seen[key]
            self.errors.append(
                f"{self.where(lineno)}: [{self.current.name}] {key}: set twice (first at line {first})"
            )
            return
        self.keys_seen[key] = lineno
        self.current.items.append((key, stripped[i + 1 :].strip(), lineno))
        self.last_item = len(self.current.items) - 1


# ---------------------------------------------------------------------------------------------------------
# Value parsers: each returns the value or raises ValueError("what is wrong").


def _seconds(value: str, minimum: float = 0.0, exclusive: bool = False) -> float:
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


def _positive_seconds(value: str) -> float:
    return _seconds(value, 0.0, exclusive=True)


def _at_least(minimum: float) -> Callable[[str], float]:
    def parse(value: str) -> float:
        return _seconds(value, minimum)

    return parse


def _mib(value: str) -> int:
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


def _bool(value: str) -> bool:
    low = value.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{value!r} is not a boolean (use yes/no, true/false, on/off or 1/0)")


def _names(value: str) -> Tuple[str, ...]:
    """A comma-separated list (newlines also separate); empty items are errors."""
    if not value.strip():
        return ()
    items = [item.strip() for item in re.split(r",[ \t]*\n|[,\n]", value)]  # "a,\n b" is two items
    if any(not item for item in items):
        raise ValueError(f"{value!r}: empty item in the list (stray comma?)")
    return tuple(items)


def _gpus(value: str) -> GpuSelection:
    if value.strip().upper() == "ALL":
        return GpuSelection(all=True)
    if not value.strip():
        raise ValueError("is empty (use ALL or a comma-separated list of GPU indices or UUIDs)")
    refs: List[object] = []
    items = _names(value)
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


def parse_gpus(value: str) -> GpuSelection:
    """`ALL`, or a comma-separated list of NVML indices and UUIDs; ValueError naming what is wrong."""
    return _gpus(value)


def parse_command(value: str) -> Tuple[str, ...]:
    """A command line split like a shell would (no shell runs it); ValueError naming what is wrong."""
    return _command(value)


def _command(value: str) -> Tuple[str, ...]:
    try:
        argv = shellwords.split(value)
    except ValueError as err:
        raise ValueError(f"cannot split {value!r}: {err}") from None
    if not argv:
        raise ValueError("is empty")
    if not argv[0]:
        raise ValueError(f"{value!r}: the program name is empty")
    return tuple(argv)


def _env(value: str) -> Tuple[Tuple[str, str], ...]:
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


def _path(base: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if not value:
            raise ValueError("is empty")
        if "\0" in value:
            raise ValueError("contains a NUL byte")
        return os.path.normpath(os.path.join(base, os.path.expanduser(value)))

    return parse


def _optional(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An empty value means "not set" (None): conf/gpu_mon.conf lists such keys as `;key =`."""

    def parse_optional(value: str) -> object:
        return parse(value) if value else None

    return parse_optional


def _choice(*options: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value.lower() not in options:
            raise ValueError(f"{value!r} is not one of {', '.join(options)}")
        return value.lower()

    return parse


def _globs(value: str) -> Tuple[str, ...]:
    words = value.replace(",", " ").split()
    if not words:
        raise ValueError("is empty")
    return tuple(words)


# ---------------------------------------------------------------------------------------------------------
# Sections


class _Section:
    """Parses one raw section against a schema, collecting errors with file:line and key."""

    def __init__(self, raw: _RawSection, where: Callable[[int], str], errors: List[str]):
        self.raw, self.where, self.errors = raw, where, errors

    def error(self, line: int, key: Optional[str], message: str) -> None:
        """Record one problem in this section."""
        key_part = f" {key}" if key else ""
        self.errors.append(f"{self.where(line)}: [{self.raw.name}]{key_part}: {message}")

    def has(self, key: str) -> bool:
        """Whether the key is written in the section at all (even with a bad value)."""
        return any(k == key for k, _, _ in self.raw.items)

    def parse(self, schema: Dict[str, Callable[[str], object]]) -> Dict[str, Tuple[object, int]]:
        """Values of the known keys as {key: (value, line)}; unknown keys and bad values are errors."""
        out: Dict[str, Tuple[object, int]] = {}
        for key, value, line in self.raw.items:
            if key not in schema:
                near = difflib.get_close_matches(key, list(schema), n=1, cutoff=0.6)
                hint = f" (did you mean '{near[0]}'?)" if near else f" (known keys: {', '.join(schema)})"
                self.error(line, key, f"unknown key{hint}")
                continue
            if len(value) > MAX_VALUE_CHARS:
                self.error(line, key, f"value too long ({len(value)} characters; at most {MAX_VALUE_CHARS})")
                continue
            try:
                out[key] = (schema[key](value), line)
            except ValueError as err:
                self.error(line, key, str(err))
        return out


def _user_names_warning(names: Tuple[str, ...], what: str, sec: _Section, line: int, warn: List[str]) -> None:
    for name in names:
        try:
            pwd.getpwnam(name)
        except KeyError:
            warn.append(f"{sec.where(line)}: [{sec.raw.name}] {what}: no user {name!r} on this host")


def _defaults(sec: _Section, base: str) -> Defaults:
    schema: Dict[str, Callable[[str], object]] = {
        "interval_seconds": _at_least(MIN_INTERVAL_SECONDS),
        "start_delay_seconds": _seconds,
        "stop_timeout_seconds": _positive_seconds,
        "urgent_stop_timeout_seconds": _positive_seconds,
        "restart_delay_seconds": _at_least(MIN_RESTART_DELAY_SECONDS),
        "restart_delay_max_seconds": _seconds,
        "healthy_run_seconds": _seconds,
        "full_scan_seconds": _at_least(MIN_FULL_SCAN_SECONDS),
        "watch_opens": _bool,
        "state_file": _path(base),
        "containment": _choice("auto", "cgroup", "subreaper"),
    }
    values = sec.parse(schema)
    d = Defaults(key_lines=_key_lines(values), **{k: v for k, (v, _) in values.items()})
    pair = ("restart_delay_seconds", "restart_delay_max_seconds")
    unparsed = any(sec.has(k) and k not in values for k in pair)  # already reported
    if d.restart_delay_max_seconds < d.restart_delay_seconds and not unparsed:
        if "restart_delay_max_seconds" in values:
            sec.error(
                values["restart_delay_max_seconds"][1],
                "restart_delay_max_seconds",
                f"must be at least restart_delay_seconds ({d.restart_delay_seconds:g})",
            )
        else:  # only the delay is written: point at it, not at a key the admin never wrote
            sec.error(
                values["restart_delay_seconds"][1],
                "restart_delay_seconds",
                f"must be at most restart_delay_max_seconds ({d.restart_delay_max_seconds:g}, the default)",
            )
    return d


def _gpu_section(sec: _Section, warn: List[str]) -> Optional[GpuSection]:
    schema: Dict[str, Callable[[str], object]] = {
        "gpus": _gpus,
        "ignore_programs": _names,
        "ignore_users": _names,
        "busy_memory_mib": _mib,
        "holder_grace_seconds": _optional(_seconds),
        "idle_holder_seconds": _seconds,
        "idle_holder_memory_mib": _mib,
        "idle_holder_utilization_pct": _percent,
        "idle_holder_command": _optional(_command),
    }
    values = sec.parse(schema)
    if not sec.has("gpus"):
        sec.error(sec.raw.line, "gpus", "missing (use ALL or a comma-separated list of GPU indices or UUIDs)")
    if "gpus" not in values:
        return None
    if "ignore_users" in values:
        _user_names_warning(values["ignore_users"][0], "ignore_users", sec, values["ignore_users"][1], warn)
    return GpuSection(
        name=sec.raw.name[len("gpu-") :],
        line=sec.raw.line,
        key_lines=_key_lines(values),
        **{k: v for k, (v, _) in values.items()},
    )


def _resolve_user(sec: _Section, values: Dict[str, Tuple[object, int]], warn: List[str]) -> Dict[str, object]:
    user_value = values.get("user")
    user = str(user_value[0]) if user_value else "nobody"
    line = user_value[1] if user_value else sec.raw.line
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        what = "no such user" if user_value else "the default user does not exist here; set user ="
        sec.error(line, "user", f"{what} {user!r}")
        pw = None
    gid = pw.pw_gid if pw else -1
    group_value = values.get("group")
    # `group =` (empty): the user's primary group. Checked even for an unknown user (all errors at once).
    if group_value and group_value[0]:
        try:
            gid = grp.getgrnam(str(group_value[0])).gr_gid
        except KeyError:
            sec.error(group_value[1], "group", f"no such group {group_value[0]!r}")
            return {}
    if pw is None:
        return {}
    out: Dict[str, object] = {
        "user": user,
        "user_explicit": bool(user_value),
        "uid": pw.pw_uid,
        "home": pw.pw_dir or "/",
    }
    try:
        out["group"] = grp.getgrgid(gid).gr_name
    except KeyError:
        out["group"] = str(gid)
    out["gid"] = gid
    try:
        out["groups"] = tuple(sorted(set(os.getgrouplist(user, gid))))
    except OSError:
        out["groups"] = (gid,)
    if pw.pw_uid == 0:
        warn.append(
            f"{sec.where(line)}: [{sec.raw.name}] user: runs as root (written explicitly); "
            "a workload as root can do anything on this machine"
        )
    return out


_STOP_KEYS = ("stop_signal", "stop_timeout_seconds", "urgent_stop_timeout_seconds")
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


def stop_signal(value: str) -> int:
    """`SIGUSR1`, `USR1` or `usr1` -> its number; ValueError for one a workload cannot be stopped with."""
    name = value.strip().upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    if name not in STOP_SIGNALS or not hasattr(signal, name):
        raise ValueError(f"{value!r} is not one of {', '.join(STOP_SIGNALS)}")
    return int(getattr(signal, name))


def _process_section(sec: _Section, base: str, warn: List[str]) -> Optional[ProcessSection]:
    schema: Dict[str, Callable[[str], object]] = {
        "cmd": _command,
        "dir": _path(base),
        "gpus": _gpus,
        "log": _optional(_path(base)),
        "user": str,
        "group": str,
        "env": _env,
        "per_gpu": _bool,
        "stop_signal": stop_signal,
        "stop_timeout_seconds": _optional(_positive_seconds),  # empty: [defaults]'
        "urgent_stop_timeout_seconds": _optional(_positive_seconds),
        # Seed compatibility: nothing else; unknown keys are errors.
    }
    values = sec.parse(schema)
    if not sec.has("cmd"):
        sec.error(sec.raw.line, "cmd", "missing (the command to run)")
    who = _resolve_user(sec, values, warn)
    if "cmd" not in values or not who:
        return None
    fields = {k: v for k, (v, _) in values.items() if k not in ("user", "group")}
    fields.update(who)
    fingerprint = tuple(sorted((k, v) for k, v, _ in sec.raw.items if k not in _STOP_KEYS))
    return ProcessSection(
        name=sec.raw.name[len("process-") :],
        line=sec.raw.line,
        key_lines=_key_lines(values),
        fingerprint=fingerprint,
        **fields,
    )


def _tty_section(sec: _Section, warn: List[str]) -> TtySection:
    schema: Dict[str, Callable[[str], object]] = {
        "enabled": _bool,
        "whitelist": _names,
        "idle_seconds": _seconds,
        "devices": _globs,
    }
    values = sec.parse(schema)
    if "whitelist" in values:
        _user_names_warning(values["whitelist"][0], "whitelist", sec, values["whitelist"][1], warn)
    return TtySection(**{k: v for k, (v, _) in values.items()})


def fraction(value: str) -> float:
    """A number from 0 to 1 (`0.7`)."""
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a number from 0 to 1") from None
    if not 0.0 <= number <= 1.0:
        raise ValueError(f"{value!r} is not a fraction from 0 to 1 (70% is 0.7)")
    return number


def _percent(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a percentage from 0 to 100") from None
    if not 0.0 <= number <= 100.0:
        raise ValueError(f"{value!r} is not a percentage from 0 to 100")
    return number


def _history_section(sec: _Section, base: str) -> HistorySection:
    schema: Dict[str, Callable[[str], object]] = {
        "enabled": _bool,
        "path": _path(base),
        "retention_days": _at_least(1.0 / 24),
        "sample_seconds": _at_least(1.0),
    }
    values = sec.parse(schema)
    return HistorySection(**{k: v for k, (v, _) in values.items()})


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


def _metrics_section(sec: _Section, base: str) -> MetricsSection:
    schema: Dict[str, Callable[[str], object]] = {"textfile": _path(base), "listen": listen_address}
    values = sec.parse(schema)
    if not values and not sec.raw.items:
        sec.error(sec.raw.line, None, "empty: set textfile = PATH, listen = [ADDRESS:]PORT, or both")
    textfile = values.get("textfile", (None, 0))[0]
    if isinstance(textfile, str) and not textfile.endswith(".prom"):
        sec.error(values["textfile"][1], "textfile", f"{textfile!r}: node-exporter reads only *.prom files")
    return MetricsSection(line=sec.raw.line, **{k: v for k, (v, _) in values.items()})


def _sentinel_section(sec: _Section) -> SentinelSection:
    schema: Dict[str, Callable[[str], object]] = {
        "arm_duration_seconds": _seconds,
        "arm_threshold": fraction,
        "kill_duration_seconds": _seconds,
        "kill_threshold": fraction,
        "kill_action": _choice(*KILL_ACTIONS),
        "command": _optional(_command),
        "gpus": _gpus,
        "aggregate": _choice("mean", "max"),
        "dry_run": _bool,
    }
    values = sec.parse(schema)
    fields = {k: v for k, (v, _) in values.items() if v is not None}
    found = SentinelSection(line=sec.raw.line, key_lines=_key_lines(values), **fields)
    if found.kill_action == "command" and not found.command:
        sec.error(values["kill_action"][1], "command", "missing: kill_action = command needs command = CMD")
    elif found.command and found.kill_action != "command":
        sec.error(
            values["command"][1],
            "command",
            f"is only used with kill_action = command, not {found.kill_action}",
        )
    return found


def _count(value: str) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        raise ValueError(f"{value!r} is not a whole number") from None
    if number < 1:
        raise ValueError(f"must be 1 or more, not {number}")
    return number


def _hours(value: str) -> float:
    try:
        hours = float(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a number of hours") from None
    if not 0 < hours * 3600 <= MAX_SECONDS:
        raise ValueError(f"{value!r} must be more than 0 hours and at most a year (8760)")
    return hours


def _occupy_section(sec: _Section, warn: List[str]) -> OccupySection:
    schema: Dict[str, Callable[[str], object]] = {
        "users": _names,
        "groups": _names,
        "max_gpus_per_user": _optional(_count),
        "max_hold_hours": _optional(_hours),
        "require_yield": _bool,
    }
    values = sec.parse(schema)
    _who_warnings(sec, values, "occupy", warn)
    return OccupySection(line=sec.raw.line, **{k: v for k, (v, _) in values.items()})


def _who_warnings(sec: _Section, values: Dict[str, tuple], section: str, warn: List[str]) -> None:
    """`users` and `groups` of a section that limits who may use it: names unknown on this host."""
    if "users" in values:
        _user_names_warning(values["users"][0], "users", sec, values["users"][1], warn)
    for name in values.get("groups", ((), 0))[0]:
        try:
            grp.getgrnam(name)
        except KeyError:
            where = sec.where(values["groups"][1])
            warn.append(f"{where}: [{section}] groups: no group {name!r} on this host")


def _limit(value: str) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        raise ValueError(f"{value!r} is not a whole number") from None
    if number < 0:
        raise ValueError(f"must be 0 (no limit) or more, not {number}")
    return number


def _queue_section(sec: _Section, base: str, warn: List[str]) -> QueueSection:
    schema: Dict[str, Callable[[str], object]] = {
        "socket": _path(base),
        "gpus": _gpus,
        "users": _names,
        "groups": _names,
        "max_running_per_user": _limit,
        "max_gpus_per_user": _limit,
        "max_queued_per_user": _count,
        "max_gpus_per_job": _limit,
        "order": _choice(*QUEUE_ORDERS),
        "fair_window_hours": _hours,
        "grace_seconds": _seconds,
        "max_grace_seconds": _seconds,
        "start_delay_seconds": _optional(_seconds),
        "preempt_workloads": _bool,
        "database": _path(base),
        "launcher": _choice("auto", "systemd", "direct"),
        "keep_finished_days": _seconds,
    }
    values = sec.parse(schema)
    _who_warnings(sec, values, "queue", warn)
    queue = QueueSection(line=sec.raw.line, **{k: v for k, (v, _) in values.items()})
    if queue.grace_seconds > queue.max_grace_seconds:
        line = values.get("grace_seconds", values.get("max_grace_seconds", (0, sec.raw.line)))[1]
        sec.error(
            line,
            "grace_seconds",
            f"{queue.grace_seconds:g} is over max_grace_seconds ({queue.max_grace_seconds:g})",
        )
    return queue


def _program(value: str) -> str:
    """A program: a bare name (found in PATH when run) or a path."""
    if not value.strip() or "\0" in value:
        raise ValueError("is empty" if not value.strip() else "contains a NUL byte")
    return value.strip()


def _slurm_section(sec: _Section) -> SlurmSection:
    schema: Dict[str, Callable[[str], object]] = {
        "preemptible_partitions": _names,
        "preemptible_qos": _names,
        "action": _choice(*SLURM_ACTIONS),
        "signal": _optional(stop_signal),
        "signal_grace_seconds": _seconds,
        "avoid_node_seconds": _seconds,
        "scontrol": _program,
        "scancel": _program,
        "timeout_seconds": _positive_seconds,
    }
    values = sec.parse(schema)
    slurm = SlurmSection(line=sec.raw.line, **{k: v for k, (v, _) in values.items()})
    if not slurm.preemptible_partitions and not slurm.preemptible_qos:
        sec.error(
            sec.raw.line, None, "name preemptible_partitions or preemptible_qos (whose jobs yield to others)"
        )
    return slurm


_KINDS = (
    "defaults",
    "tty",
    "sentinel",
    "history",
    "metrics",
    "occupy",
    "queue",
    "slurm",
    "gpu-NAME",
    "process-NAME",
)


def _check_section_name(raw: _RawSection, sec: _Section) -> Optional[str]:
    name = raw.name
    if name in ("defaults", "tty", "sentinel", "history", "metrics", "occupy", "queue", "slurm"):
        return name
    for prefix in ("gpu-", "process-"):
        if name.startswith(prefix):
            suffix = name[len(prefix) :]
            if not suffix or not _SECTION_NAME_RE.match(suffix):
                sec.error(
                    raw.line,
                    None,
                    f"bad section name: use [{prefix}NAME] with NAME made of letters, "
                    "digits, '-', '_', '.' or ':'",
                )
                return None
            return prefix
    known = [*(k for k in _KINDS if not k.endswith("-NAME")), "gpu-", "process-"]
    near = difflib.get_close_matches(name.lower(), known, n=1, cutoff=0.5)
    hint = f" (did you mean [{near[0]}{'NAME' if near[0].endswith('-') else ''}]?)" if near else ""
    sec.error(raw.line, None, f"unknown section{hint}; known: {', '.join('[' + k + ']' for k in _KINDS)}")
    return None


def parse(text: str, path: str = "<config>") -> Config:
    """Parse config text; raise ConfigError listing every problem."""
    errors: List[str] = []
    warnings: List[str] = []

    def where(line: int) -> str:
        return f"{path}:{line}"

    if text.startswith("\ufeff"):  # a byte-order mark some Windows editors write
        text = text[1:]

    base = os.path.dirname(os.path.abspath(path)) if not path.startswith("<") else os.getcwd()
    defaults, tty = Defaults(), TtySection()
    sentinel: Optional[SentinelSection] = None
    history = HistorySection()
    metrics: Optional[MetricsSection] = None
    occupy: Optional[OccupySection] = None
    queue: Optional[QueueSection] = None
    slurm: Optional[SlurmSection] = None
    gpu_sections: List[GpuSection] = []
    processes: List[ProcessSection] = []
    bad_lines: Dict[int, str] = {}
    for raw in _lex(text, where, errors, bad_lines):
        sec = _Section(raw, where, errors)
        kind = _check_section_name(raw, sec)
        if kind == "defaults":
            defaults = _defaults(sec, base)
        elif kind == "tty":
            tty = _tty_section(sec, warnings)
        elif kind == "sentinel":
            sentinel = _sentinel_section(sec)
        elif kind == "history":
            history = _history_section(sec, base)
        elif kind == "metrics":
            metrics = _metrics_section(sec, base)
        elif kind == "occupy":
            occupy = _occupy_section(sec, warnings)
        elif kind == "queue":
            queue = _queue_section(sec, base, warnings)
        elif kind == "slurm":
            slurm = _slurm_section(sec)
        elif kind == "gpu-":
            g = _gpu_section(sec, warnings)
            if g:
                gpu_sections.append(g)
        elif kind == "process-":
            p = _process_section(sec, base, warnings)
            if p:
                processes.append(p)
    runs_jobs = queue is not None or slurm is not None
    _cross_check(gpu_sections, processes, where, errors, warnings, path, runs_jobs)
    if bad_lines:
        errors = [e for e in errors if _line_of(e) not in bad_lines] + list(bad_lines.values())
    config = Config(
        path=path,
        defaults=defaults,
        gpu_sections=tuple(gpu_sections),
        processes=tuple(processes),
        tty=tty,
        sentinel=sentinel,
        history=history,
        metrics=metrics,
        occupy=occupy,
        queue=queue,
        slurm=slurm,
        warnings=tuple(_shorten(w, path) for w in warnings),
    )
    if errors:
        raise ConfigError([_shorten(e, path) for e in sorted(errors, key=_line_of)], partial=config)
    return config


def sort_by_line(errors: List[str]) -> List[str]:
    """Problems in the order of the lines they name."""
    return sorted(errors, key=_line_of)


def _shorten(line: str, path: str) -> str:
    """Cut the middle out of an overlong message (a 100 kB value), keeping `PATH:` and the explanation."""
    head = path if line.startswith(path) else ""
    rest = line[len(head) :]
    if len(rest) <= MAX_MESSAGE:
        return line
    half = MAX_MESSAGE // 2
    return f"{head}{rest[:half]}...{rest[-half:]}"


def _cross_check(
    gpu_sections: List[GpuSection],
    processes: List[ProcessSection],
    where: Callable[[int], str],
    errors: List[str],
    warnings: List[str],
    path: str,
    runs_jobs: bool = False,
) -> None:
    """Checks that need several sections: overlapping [gpu-*] sections, empty configs (runs_jobs: a
    [queue] or [slurm] acts on jobs, so no [process-*] does not mean watching only)."""
    owner: Dict[object, str] = {}
    all_section: Optional[GpuSection] = None
    for g in gpu_sections:
        if g.gpus.all:
            if all_section or owner:
                errors.append(
                    f"{where(g.line)}: [gpu-{g.name}] gpus: ALL overlaps another [gpu-*] section "
                    "(each GPU may be named by one section)"
                )
            all_section = g
            continue
        if all_section:
            errors.append(
                f"{where(g.line)}: [gpu-{g.name}] gpus: overlaps [gpu-{all_section.name}] "
                "which names ALL (each GPU may be named by one section)"
            )
        for ref in g.gpus.refs:
            if ref in owner:
                errors.append(
                    f"{where(g.line)}: [gpu-{g.name}] gpus: {ref} is already named by [gpu-{owner[ref]}]"
                )
            owner[ref] = g.name
    if not gpu_sections:
        warnings.append(f"{path}: no [gpu-*] section: no GPU is watched, so no workload will ever start")
    elif not processes and not runs_jobs:  # ([queue] runs users' jobs; [slurm] has Slurm requeue its own)
        warnings.append(f"{path}: no [process-*] section: gpu-mon will only watch")


def _line_of(message: str) -> int:
    match = re.match(r"^.*?:(\d+): ", message)
    return int(match.group(1)) if match else 0


def load(path: str, trusted_uid: Optional[int] = None) -> Config:
    """Read and parse a config file. With `trusted_uid` (running as root) the file must be root-only."""
    try:
        data = safefile.read_trusted(path, trusted_uid, MAX_CONFIG_BYTES)
    except safefile.UnsafeFile as err:
        raise ConfigError([str(err)]) from None
    nul = data.find(b"\0")
    if nul >= 0:
        raise ConfigError([f"{path}: not a text file (NUL byte at offset {nul})"])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError([f"{path}: not UTF-8 text (bad byte at offset {err.start})"]) from None
    return parse(text, path)


def trusted_uid_for_this_process() -> Optional[int]:
    """0 when running as root (the config must then be root-only), else None (no ownership check)."""
    return 0 if os.geteuid() == 0 else None
