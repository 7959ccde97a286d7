"""Files -> Config: read the config and its drop-ins, lex them, merge their sections, parse each section,
and report every problem at once, each with its file and line.

Drop-ins: the files `PATH.d/*.conf` (for /etc/gpu_mon.conf, /etc/gpu_mon.conf.d/*.conf) are read after PATH,
in the order of their names. A section a drop-in writes is added; a section that an earlier file already
has is overridden key by key, as systemd's drop-ins do: a key the drop-in writes replaces the earlier
value, the others stay. A drop-in cannot remove a section. Relative paths in a drop-in are relative to
PATH's directory, as in PATH. Each drop-in and the directory obey the same trust rule as PATH.
"""

from __future__ import annotations

import difflib
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

from gpu_mon import safefile
from gpu_mon.config import sections_features as features
from gpu_mon.config.lexer import RawSection, lex
from gpu_mon.config.model import Config, ConfigError, GpuSection, ProcessSection
from gpu_mon.config.sections import Section, defaults, gpu_section, process_section, tty_section

DEFAULT_PATH = "/etc/gpu_mon.conf"
DROPIN_SUFFIX = ".conf"
MAX_CONFIG_BYTES = 1 << 20
MAX_MESSAGE = 240  # longer messages (a huge value or key) are cut in the middle, after `PATH:`
_SECTION_NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]+$")
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


def _check_section_name(raw: RawSection, sec: Section) -> Optional[str]:
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


def _merge(into: Dict[str, RawSection], raw: RawSection) -> None:
    """Add a file's section; one an earlier file has is overridden key by key (a drop-in's keys win)."""
    old = into.get(raw.name)
    if old is None:
        into[raw.name] = raw
        return
    written = {item.key for item in raw.items}
    old.items = [item for item in old.items if item.key not in written] + raw.items


def _lex_all(files: Sequence[Tuple[str, str]], errors: List[str]) -> Tuple[List[RawSection], Dict[str, str]]:
    """The merged sections of every file, and the lines with control characters ("FILE:LINE" -> error)."""
    merged: Dict[str, RawSection] = {}
    bad: Dict[str, str] = {}
    for path, text in files:
        if text.startswith("\ufeff"):  # a byte-order mark some Windows editors write
            text = text[1:]
        bad_lines: Dict[int, str] = {}
        for raw in lex(text, path, errors, bad_lines):
            _merge(merged, raw)
        bad.update((f"{path}:{line}", message) for line, message in bad_lines.items())
    return list(merged.values()), bad


def parse(text: str, path: str = "<config>", dropins: Sequence[Tuple[str, str]] = ()) -> Config:
    """Parse config text (and its drop-ins' texts, as (path, text)); raise ConfigError listing every
    problem."""
    errors: List[str] = []
    warnings: List[str] = []
    files = ((path, text), *dropins)
    base = os.path.dirname(os.path.abspath(path)) if not path.startswith("<") else os.getcwd()
    found: Dict[str, object] = {}
    gpu_sections: List[GpuSection] = []
    processes: List[ProcessSection] = []
    raws, bad_lines = _lex_all(files, errors)
    for raw in raws:
        sec = Section(raw, errors, base)
        kind = _check_section_name(raw, sec)
        if kind == "gpu-":
            g = gpu_section(sec, warnings)
            if g:
                gpu_sections.append(g)
        elif kind == "process-":
            p = process_section(sec, warnings)
            if p:
                processes.append(p)
        elif kind is not None:
            found[kind] = _one_section(kind, sec, warnings)
    runs_jobs = found.get("queue") is not None or found.get("slurm") is not None
    _cross_check(gpu_sections, processes, errors, warnings, path, runs_jobs)
    if bad_lines:
        errors = [e for e in errors if _where_of(e) not in bad_lines] + list(bad_lines.values())
    names = tuple(name for name, _ in files)
    config = Config(
        path=path,
        gpu_sections=tuple(gpu_sections),
        processes=tuple(processes),
        warnings=tuple(_shorten(w, names) for w in warnings),
        files=names,
        **found,  # type: ignore[arg-type]
    )
    if errors:
        raise ConfigError([_shorten(e, names) for e in sort_by_line(errors, names)], partial=config)
    return config


def _one_section(kind: str, sec: Section, warnings: List[str]) -> object:
    """The dataclass of a section of which there is at most one."""
    if kind == "defaults":
        return defaults(sec)
    if kind == "tty":
        return tty_section(sec, warnings)
    if kind == "occupy":
        return features.occupy_section(sec, warnings)
    if kind == "queue":
        return features.queue_section(sec, warnings)
    build = {
        "sentinel": features.sentinel_section,
        "history": features.history_section,
        "metrics": features.metrics_section,
        "slurm": features.slurm_section,
    }
    return build[kind](sec)


def sort_by_line(errors: List[str], files: Sequence[str] = ()) -> List[str]:
    """Problems in the order of the lines they name (by file first, in the order of `files`)."""

    def position(message: str) -> Tuple[int, int]:
        match = re.match(r"^(.*?):(\d+): ", message)
        if not match:
            return (0, 0)
        rank = files.index(match.group(1)) if match.group(1) in files else 0
        return (rank, int(match.group(2)))

    return sorted(errors, key=position)


def _where_of(message: str) -> str:
    match = re.match(r"^(.*?:\d+): ", message)
    return match.group(1) if match else ""


def _shorten(line: str, files: Sequence[str]) -> str:
    """Cut the middle out of an overlong message (a 100 kB value), keeping `PATH:` and the explanation."""
    head = next((path for path in files if line.startswith(path)), "")
    rest = line[len(head) :]
    if len(rest) <= MAX_MESSAGE:
        return line
    half = MAX_MESSAGE // 2
    return f"{head}{rest[:half]}...{rest[-half:]}"


def _cross_check(
    gpu_sections: List[GpuSection],
    processes: List[ProcessSection],
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
        where = f"{g.path}:{g.line}"
        if g.gpus.all:
            if all_section or owner:
                errors.append(
                    f"{where}: [gpu-{g.name}] gpus: ALL overlaps another [gpu-*] section "
                    "(each GPU may be named by one section)"
                )
            all_section = g
            continue
        if all_section:
            errors.append(
                f"{where}: [gpu-{g.name}] gpus: overlaps [gpu-{all_section.name}] "
                "which names ALL (each GPU may be named by one section)"
            )
        for ref in g.gpus.refs:
            if ref in owner:
                errors.append(f"{where}: [gpu-{g.name}] gpus: {ref} is already named by [gpu-{owner[ref]}]")
            owner[ref] = g.name
    if not gpu_sections:
        warnings.append(f"{path}: no [gpu-*] section: no GPU is watched, so no workload will ever start")
    elif not processes and not runs_jobs:  # ([queue] runs users' jobs; [slurm] has Slurm requeue its own)
        warnings.append(f"{path}: no [process-*] section: gpu-mon will only watch")


def dropin_dir(path: str) -> str:
    """Where the drop-ins of the config at `path` are: `PATH.d`."""
    return path + ".d"


def dropin_paths(path: str, trusted_uid: Optional[int] = None) -> List[str]:
    """The drop-ins of `path`, in the order they are read: `PATH.d/*.conf` by name (hidden files are not
    read); none when the directory does not exist. UnsafeFile when the directory fails the trust rule."""
    directory = dropin_dir(path)
    if not os.path.lexists(directory):
        return []
    names = safefile.list_dir(directory, trusted_uid)
    wanted = sorted(n for n in names if n.endswith(DROPIN_SUFFIX) and not n.startswith("."))
    return [os.path.join(directory, name) for name in wanted]


def _read(path: str, trusted_uid: Optional[int]) -> str:
    """One file's text; ConfigError with one line when it cannot be used."""
    try:
        data = safefile.read_trusted(path, trusted_uid, MAX_CONFIG_BYTES)
    except safefile.UnsafeFile as err:
        raise ConfigError([str(err)]) from None
    nul = data.find(b"\0")
    if nul >= 0:
        raise ConfigError([f"{path}: not a text file (NUL byte at offset {nul})"])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError([f"{path}: not UTF-8 text (bad byte at offset {err.start})"]) from None


def load(path: str, trusted_uid: Optional[int] = None) -> Config:
    """Read and parse a config file and its drop-ins. With `trusted_uid` (running as root) each file, and
    the drop-ins' directory, must be root-only."""
    text = _read(path, trusted_uid)
    try:
        paths = dropin_paths(path, trusted_uid)
    except safefile.UnsafeFile as err:
        raise ConfigError([str(err)]) from None
    dropins: List[Tuple[str, str]] = []
    problems: List[str] = []
    for dropin in paths:
        try:
            dropins.append((dropin, _read(dropin, trusted_uid)))
        except ConfigError as err:
            problems.extend(err.errors)
    if problems:
        raise ConfigError(problems)
    return parse(text, path, dropins)


def trusted_uid_for_this_process() -> Optional[int]:
    """0 when running as root (the config must then be root-only), else None (no ownership check)."""
    return 0 if os.geteuid() == 0 else None
