"""SIGHUP: the config is read and checked in a worker thread, so that a huge or slow file (or a user database
behind NSS) never holds up the loop; the loop applies the result when the thread is done."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

from gpu_mon import config as config_mod
from gpu_mon.config import Config, QueueSection
from gpu_mon.engine.workloads import stopping
from gpu_mon.engine.workloads.supervisor import Supervisor

# [queue] keys a reload cannot change (the socket users reach, the database, how jobs are started): the
# old values stay until gpu-mon restarts.
QUEUE_RESTART_KEYS = ("socket", "database", "launcher")


class Reloader:
    """At most one load at a time; a SIGHUP during a load asks for another one after it."""

    def __init__(self, wake: Callable[[], None]):
        self._wake = wake
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._future: Optional[concurrent.futures.Future] = None
        self._again = False

    def start(self, path: str, trusted_uid: Optional[int]) -> bool:
        """Begin loading `path`; False if a load is under way (it is then repeated once done)."""
        if self._future is not None:
            self._again = True
            return False
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gpu-mon-reload")
        self._future = self._pool.submit(config_mod.load, path, trusted_uid)
        self._future.add_done_callback(lambda _f: self._wake())
        return True

    def result(self) -> Optional[Config]:
        """The loaded config once the load is done (ConfigError if it is bad), else None."""
        if self._future is None or not self._future.done():
            return None
        future, self._future = self._future, None
        return future.result()

    def take_again(self) -> bool:
        """Whether another SIGHUP came during the load (and forget it)."""
        again, self._again = self._again, False
        return again

    def close(self) -> None:
        """Wait for a load under way, then stop the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)


@dataclasses.dataclass(frozen=True)
class Changes:
    """What a reload changed, as section names in file order (`process-burn`, `tty`)."""

    added: Tuple[str, ...] = ()
    changed: Tuple[str, ...] = ()
    removed: Tuple[str, ...] = ()

    def __str__(self) -> str:
        """`added: [process-burn]; changed: [gpu-all]; removed: [process-old]`, or `nothing changed`."""
        parts = [
            f"{what}: {', '.join(f'[{name}]' for name in names)}"
            for what, names in (("added", self.added), ("changed", self.changed), ("removed", self.removed))
            if names
        ]
        return "; ".join(parts) or "nothing changed"


def changes(old: Config, new: Config) -> Changes:
    """The sections `new` adds, changes or removes compared with `old` (moving one in the file is none)."""
    before, after = _sections(old), _sections(new)
    return Changes(
        added=tuple(n for n in after if n not in before),
        changed=tuple(n for n in after if n in before and after[n] != before[n]),
        removed=tuple(n for n in before if n not in after),
    )


def _sections(config: Config) -> Dict[str, object]:
    """Every section the config has, by name, without the line it is written on."""
    found: Dict[str, object] = {"defaults": config.defaults, "tty": config.tty, "history": config.history}
    found.update((f"gpu-{g.name}", g) for g in config.gpu_sections)
    found.update((f"process-{p.name}", p) for p in config.processes)
    for name in ("sentinel", "metrics", "occupy", "queue"):
        if getattr(config, name) is not None:
            found[name] = getattr(config, name)
    return {name: unplaced(section) for name, section in found.items()}


def unplaced(section: object) -> object:
    """A section without the line it was written on (moving it in the file changes nothing)."""
    if dataclasses.is_dataclass(section) and hasattr(section, "line"):
        return dataclasses.replace(section, line=0)  # type: ignore[type-var]
    return section


def queue_on_reload(
    old: Optional[QueueSection], new: Optional[QueueSection]
) -> Tuple[Optional[QueueSection], List[str]]:
    """The [queue] a reload applies, and what it leaves for a restart (log lines). Its socket, database and
    launcher keep their old values; a [queue] added starts, and one removed stops, only at a restart (a
    queue that vanished on a reload would leave its running jobs without anyone to stop them)."""
    if old is None and new is not None:
        return None, ["[queue] added: the queue starts when gpu-mon restarts"]
    if old is not None and new is None:
        return old, ["[queue] removed: the queue and its jobs keep running until gpu-mon restarts"]
    if old is None or new is None:
        return None, []
    fixed = {k: getattr(old, k) for k in QUEUE_RESTART_KEYS if hasattr(old, k)}
    notes = [
        f"[queue] {key} changes take effect when gpu-mon restarts"
        for key, value in fixed.items()
        if getattr(new, key) != value
    ]
    return dataclasses.replace(new, **fixed), notes


def keep_start_only(old: Config, new: Config) -> Tuple[Config, List[str]]:
    """The config a reload applies, and what it leaves for a restart (log lines): state_file and containment
    are fixed for the daemon's life (the lock, the cgroup tree), [history] and [metrics] too (their threads),
    and [queue] as queue_on_reload says."""
    d, was = new.defaults, old.defaults
    notes = [
        f"[defaults] {key} changes take effect when gpu-mon restarts"
        for key in ("state_file", "containment")
        if getattr(d, key) != getattr(was, key)
    ]
    fixed = dataclasses.replace(d, state_file=was.state_file, containment=was.containment)
    for section in ("history", "metrics"):
        if unplaced(getattr(new, section)) != unplaced(getattr(old, section)):
            notes.append(f"[{section}] changes take effect when gpu-mon restarts")
    queue, queue_notes = queue_on_reload(old.queue, new.queue)
    kept = {"history": old.history, "metrics": old.metrics, "queue": queue}
    return dataclasses.replace(new, defaults=fixed, **kept), notes + queue_notes


@dataclasses.dataclass(frozen=True)
class Reloaded:
    """What a reload changes for the running daemon."""

    sections: Changes  # every section added, changed or removed (the log line)
    restarted: Tuple[str, ...]  # [process-*] names whose workloads restart (changed) ...
    removed: Tuple[str, ...]  # ... or stop for good (removed)
    watch_changed: bool  # [defaults] watch_opens
    sentinel_changed: bool  # the [sentinel] listener is made anew


def reloaded(old: Config, new: Config) -> Reloaded:
    """What changes from `old` to `new` (both as applied)."""
    was = {p.name: p for p in old.processes}
    now = {p.name: p for p in new.processes}
    changed = [n for n, p in was.items() if n not in now or now[n].fingerprint != p.fingerprint]
    return Reloaded(
        sections=changes(old, new),
        restarted=tuple(n for n in changed if n in now),
        removed=tuple(n for n in changed if n not in now),
        watch_changed=new.defaults.watch_opens != old.defaults.watch_opens,
        sentinel_changed=sentinel_rule(new) != sentinel_rule(old),
    )


def sentinel_rule(config: Config) -> tuple:
    """What the [sentinel] listener is made from (not where in the file it is written)."""
    return (unplaced(config.sentinel), config.defaults.interval_seconds)


def restart_changed(
    supervisor: Supervisor, config: Config, what: Reloaded, now: float, say: Callable[[str], None]
) -> None:
    """New stop rules for every workload; those whose [process-*] changed or went away stop (a changed one
    starts again on the new config)."""
    fresh = {p.name: p for p in config.processes}
    supervisor.rule = stopping.rule_for(None, config.defaults)
    for key, w in list(supervisor.workloads.items()):
        name = w.instance.process
        if name in fresh:
            supervisor.set_rule(key, stopping.rule_for(fresh[name], config.defaults))
        if name in what.restarted:
            supervisor.stop(key, "config changed", now)
            say(f"config changed for [process-{name}]; restarting {w.label}")
        elif name in what.removed:
            supervisor.stop(key, "config changed", now)
            say(f"[process-{name}] removed from the config; stopping {w.label}")
