"""Opens of GPU nodes as events: inotify IN_OPEN watches on every node the observer names (each GPU's
device node, and the nodes of other mount namespaces that a scan found holding one).

inotify says that a node was opened, not by whom. As root, fanotify marks on the same nodes name the
opener's pid (fanotify.py), which the opener search reads first; openers.py tells whether what the scans
read explains an open, and keeps the opens no readable process explains (a plain user's case)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, FrozenSet, Iterable, List, Optional, Set, Tuple

from gpu_mon.api.observe import Observer
from gpu_mon.engine.fanotify import Fanotify
from gpu_mon.engine.inotify import Inotify

log = logging.getLogger("gpu_mon")

# The kernel reports an open (inotify, fanotify) before the new descriptor is in the opener's fd table
# (fsnotify_open runs in the open itself, fd_install after it returns): a scan on the event can come too
# early, most of all when the opener loses its core in between. An open no scan explained is looked at again
# after each of these delays (seconds, from the one before); it used to wait for the next poll, up to
# interval_seconds: one open in twenty was taken up a second late on a loaded machine.
RETRY_DELAYS = (0.002, 0.01, 0.03, 0.1, 0.25, 0.6)


@dataclass(frozen=True)
class OpenRetry:
    """An open no scan has explained yet: which GPUs, the openers fanotify named, and the next look."""

    at: float
    uuids: FrozenSet[Optional[str]]
    openers: Tuple[int, ...]
    step: int = 0

    def later(self, now: float) -> Optional[OpenRetry]:
        """The next look, or None when every delay has been used (polls and full scans go on as ever)."""
        step = self.step + 1
        if step >= len(RETRY_DELAYS):
            return None
        return dataclasses.replace(self, at=now + RETRY_DELAYS[step], step=step)

    def joined(self, other: Optional[OpenRetry]) -> OpenRetry:
        """This look and one still pending (None: none) as one: both opens' GPUs and openers, at the
        earlier time and step (an open is never dropped for a later one)."""
        if other is None:
            return self
        openers = tuple(dict.fromkeys((*self.openers, *other.openers)))
        return OpenRetry(
            min(self.at, other.at), self.uuids | other.uuids, openers, min(self.step, other.step)
        )


def retry_for(uuids: Set[Optional[str]], openers: Tuple[int, ...], now: float) -> OpenRetry:
    """The first look again at an open no scan explained."""
    return OpenRetry(now + RETRY_DELAYS[0], frozenset(uuids), openers)


class OpenWatch:
    """The inotify fd and its watches, kept in step with the observer's nodes."""

    def __init__(self, observer: Observer):
        self.observer = observer
        self.inotify: Optional[Inotify] = None
        self.fanotify: Optional[Fanotify] = None  # who opened: pids to read first (hints; root only)
        self.watched: Tuple[str, ...] = ()
        self.held: FrozenSet[str] = frozenset()  # of those, the nodes let go for now (engine/floods.py)
        self.announced: Set[str] = set()
        self.opened: Set[str] = set()
        self.unwatched: Set[str] = set()  # GPUs' own nodes that cannot be watched

    def start(self, add_reader: Callable[[int, str], None], interval: float) -> None:
        """Open the inotify fd (polling alone when that fails)."""
        try:
            self.inotify = Inotify()
        except OSError as err:
            log.warning("inotify unavailable (%s): relying on polling every %g s", err, interval)
            return
        add_reader(self.inotify.fd, "inotify")
        try:
            self.fanotify = Fanotify()
        except OSError as err:  # (not root, or an old kernel: the opener is searched for without its pid)
            log.debug("no opener pids from fanotify (%s)", err.strerror)

    def stop(self, remove_reader: Callable[[int], None]) -> None:
        """Close the inotify fd and the fanotify group (and forget pending opens)."""
        if self.inotify is not None:
            remove_reader(self.inotify.fd)
            self.inotify.close()
            self.inotify = None
        if self.fanotify is not None:
            self.fanotify.close()
            self.fanotify = None
        self.opened.clear()
        self.watched, self.held = (), frozenset()

    def read(self) -> None:
        """Collect the opens the kernel reported; renew the watches if it asked."""
        if self.inotify is None:
            return
        opened, renew = self.inotify.read()
        self.opened.update(opened)
        if self.fanotify is not None:  # (queued by the same open, before the inotify event woke us)
            self.fanotify.read()
        if renew:
            self.rewatch()

    def pending(self) -> bool:
        """Whether events wait to be read (an open happened since the last read)."""
        return self.inotify is not None and self.inotify.pending()

    def wait(self, seconds: float) -> None:
        """Sleep up to `seconds`, or until an open is reported."""
        if self.inotify is not None:
            self.inotify.pending(seconds)

    def covers(self) -> bool:
        """Whether an open of every GPU's own node wakes us (inotify works and watches each of them)."""
        return self.inotify is not None and not self.unwatched

    def take(self) -> Set[str]:
        """The paths opened since the last take."""
        opened, self.opened = self.opened, set()
        return opened

    def _mark_openers(self, paths: List[str]) -> None:
        """fanotify marks on these nodes (what cannot be marked is searched for without its opener's pid)."""
        if self.fanotify is None:
            return
        try:
            errors = self.fanotify.watch(paths)
        except OSError as err:
            log.debug("no opener pids from fanotify (%s)", err.strerror)
            self.fanotify.close()
            self.fanotify = None
            return
        for path, why in errors.items():
            log.debug("no opener pids for opens of %s (%s)", path, why)

    def openers(self) -> Tuple[int, ...]:
        """The pids that fanotify says opened a watched node since the last call, the latest first."""
        return self.fanotify.take() if self.fanotify is not None else ()

    def watching(self) -> Tuple[str, ...]:
        """The nodes an open of which wakes us now: those watched less those let go."""
        return tuple(p for p in self.watched if p not in self.held)

    def hold(self, paths: Iterable[str]) -> None:
        """Let go of exactly these nodes for now (their opens wake nobody); watch the others again."""
        held = frozenset(paths)
        if held != self.held:
            self.held = held
            if self.inotify is not None:  # (a node that cannot be watched again: rewatch says so)
                self.inotify.watch(self.watching())

    def refresh(self) -> None:
        """Watch exactly the observer's nodes, if they changed."""
        if self.observer.device_paths() != self.watched:
            self.rewatch()

    def rewatch(self) -> None:
        """Watch the observer's nodes now; a container's node that went away is forgotten."""
        self.watched = self.observer.device_paths()
        if self.inotify is None:
            return
        devices = {g.device for g in self.observer.reading.gpus}
        errors = self.inotify.watch(self.watching())
        self.unwatched = {p for p in errors if p in devices}
        self._mark_openers([p for p in self.watched if p not in errors])
        for path, why in errors.items():
            if path in devices:
                log.warning("cannot watch %s for opens (%s): relying on polling", path, why)
            else:
                log.debug("no longer watching %s (%s)", path, why)
                self.observer.forget_node(path)
        new = [p for p in self.watched if p not in devices and p not in self.announced]
        for path in new:
            log.info("watching %s for opens too (a GPU node of another mount namespace)", path)
        self.announced.update(new)
