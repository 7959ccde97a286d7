"""Sections -> dataclasses: the shared machinery (Section), and the sections of watching and workloads:
[defaults], [gpu-NAME], [process-NAME], [tty]. The keys and their parsers are in the schema."""

from __future__ import annotations

import difflib
import grp
import os
import pwd
from typing import Callable, Dict, List, Optional, Tuple

from gpu_mon.config import schema
from gpu_mon.config.lexer import Item, RawSection
from gpu_mon.config.model import Defaults, GpuSection, ProcessSection, TtySection

MAX_VALUE_CHARS = 65536  # a longer value is an error (a cmd longer than this is a mistake, not a command)


def key_lines(values: Dict[str, Tuple[object, int]]) -> Tuple[Tuple[str, int], ...]:
    """(key, line) of each key written."""
    return tuple((key, line) for key, (_, line) in values.items())


class Section:
    """Parses one raw section against its schema, collecting errors with file:line and key."""

    def __init__(self, raw: RawSection, errors: List[str], base: str):
        self.raw, self.errors, self.base = raw, errors, base
        self._by_line: Optional[Dict[int, List[Item]]] = None

    def where(self, line: int, key: Optional[str] = None) -> str:
        """`FILE:LINE` of a line of this section: its header's file, or the file `key` is written in at
        that line (a drop-in's key in a section of the main file)."""
        if self._by_line is None:  # built once: a section of 20 000 bad keys must not be quadratic
            self._by_line = {}
            for item in self.raw.items:
                self._by_line.setdefault(item.line, []).append(item)
        at_line = self._by_line.get(line, [])
        exact = [item.path for item in at_line if item.key == key]
        if exact:
            return f"{exact[-1]}:{line}"
        if line == self.raw.line or not at_line:
            return f"{self.raw.path}:{line}"
        return f"{at_line[-1].path}:{line}"

    def error(self, line: int, key: Optional[str], message: str) -> None:
        """Record one problem in this section."""
        key_part = f" {key}" if key else ""
        self.errors.append(f"{self.where(line, key)}: [{self.raw.name}]{key_part}: {message}")

    def has(self, key: str) -> bool:
        """Whether the key is written in the section at all (even with a bad value)."""
        return any(item.key == key for item in self.raw.items)

    def values(self, kind: str) -> Dict[str, Tuple[object, int]]:
        """The values of this kind of section's keys (schema.py), as parse() returns them."""
        return self.parse(schema.parsers(kind, self.base))

    def parse(self, known: Dict[str, Callable[[str], object]]) -> Dict[str, Tuple[object, int]]:
        """Values of the known keys as {key: (value, line)}; unknown keys and bad values are errors."""
        out: Dict[str, Tuple[object, int]] = {}
        for key, value, line, _path in self.raw.items:
            if key not in known:
                near = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
                hint = f" (did you mean '{near[0]}'?)" if near else f" (known keys: {', '.join(known)})"
                self.error(line, key, f"unknown key{hint}")
                continue
            if len(value) > MAX_VALUE_CHARS:
                self.error(line, key, f"value too long ({len(value)} characters; at most {MAX_VALUE_CHARS})")
                continue
            try:
                out[key] = (known[key](value), line)
            except ValueError as err:
                self.error(line, key, str(err))
        return out


def user_names_warning(names: Tuple[str, ...], what: str, sec: Section, line: int, warn: List[str]) -> None:
    """A warning for each user in `names` unknown on this host."""
    for name in names:
        try:
            pwd.getpwnam(name)
        except KeyError:
            warn.append(f"{sec.where(line, what)}: [{sec.raw.name}] {what}: no user {name!r} on this host")


def defaults(sec: Section) -> Defaults:
    """The [defaults] section."""
    values = sec.values("defaults")
    d = Defaults(key_lines=key_lines(values), **{k: v for k, (v, _) in values.items()})
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


def gpu_section(sec: Section, warn: List[str]) -> Optional[GpuSection]:
    """A [gpu-NAME] section (None when it cannot be used)."""
    values = sec.values("gpu-")
    if not sec.has("gpus"):
        sec.error(sec.raw.line, "gpus", "missing (use ALL or a comma-separated list of GPU indices or UUIDs)")
    if "gpus" not in values:
        return None
    if "ignore_users" in values:
        user_names_warning(values["ignore_users"][0], "ignore_users", sec, values["ignore_users"][1], warn)
    return GpuSection(
        name=sec.raw.name[len("gpu-") :],
        line=sec.raw.line,
        key_lines=key_lines(values),
        path=sec.raw.path,
        **{k: v for k, (v, _) in values.items()},
    )


def _resolve_user(sec: Section, values: Dict[str, Tuple[object, int]], warn: List[str]) -> Dict[str, object]:
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
            f"{sec.where(line, 'user')}: [{sec.raw.name}] user: runs as root (written explicitly); "
            "a workload as root can do anything on this machine"
        )
    return out


_STOP_KEYS = ("stop_signal", "stop_timeout_seconds", "urgent_stop_timeout_seconds")


def process_section(sec: Section, warn: List[str]) -> Optional[ProcessSection]:
    """A [process-NAME] section (None when it cannot be used)."""
    values = sec.values("process-")
    if not sec.has("cmd"):
        sec.error(sec.raw.line, "cmd", "missing (the command to run)")
    who = _resolve_user(sec, values, warn)
    if "cmd" not in values or not who:
        return None
    fields = {k: v for k, (v, _) in values.items() if k not in ("user", "group")}
    fields.update(who)
    fingerprint = tuple(sorted((it.key, it.value) for it in sec.raw.items if it.key not in _STOP_KEYS))
    return ProcessSection(
        name=sec.raw.name[len("process-") :],
        line=sec.raw.line,
        key_lines=key_lines(values),
        path=sec.raw.path,
        fingerprint=fingerprint,
        **fields,
    )


def tty_section(sec: Section, warn: List[str]) -> TtySection:
    """The [tty] section."""
    values = sec.values("tty")
    if "whitelist" in values:
        user_names_warning(values["whitelist"][0], "whitelist", sec, values["whitelist"][1], warn)
    return TtySection(**{k: v for k, (v, _) in values.items()})
