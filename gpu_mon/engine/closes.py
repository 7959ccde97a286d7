"""Closes of GPU nodes: a holder letting go of a GPU is seen at once, not at the next poll.

An inotify fd of its own (IN_CLOSE on the nodes the open watch watches), so that a close never makes an open
look pending (scans pause for opens, not closes). A close matters only when someone other than gpu-mon holds
that GPU: then the next poll (NVML read, holders looked at again) is brought forward, at most one every
CLOSE_POLL_GAP seconds, and one more follows CLOSE_AGAIN seconds later (a driver may list the holder's
context a while after its close); the GPU found free starts its start delay from there. Closes by our
own workloads and of GPUs nobody else holds cost one read of the fd and nothing else."""

from __future__ import annotations

import logging
from typing import Callable, Optional, Tuple

from gpu_mon.api.observe import Observer
from gpu_mon.engine.inotify import IN_CLOSE, Inotify

log = logging.getLogger("gpu_mon")

CLOSE_POLL_GAP = 0.1  # (a CUDA program opens and closes the nodes dozens of times as it starts)
CLOSE_AGAIN = 0.3


class CloseWatch:
    """The close watches, kept in step with the observer's nodes."""

    def __init__(self, observer: Observer):
        self.observer = observer
        self.inotify: Optional[Inotify] = None
        self.watched: Tuple[str, ...] = ()

    def start(self, add_reader: Callable[[int, str], None]) -> None:
        """Open the fd (without it, a GPU let go is seen at the next poll, as before)."""
        try:
            self.inotify = Inotify(IN_CLOSE)
        except OSError as err:
            log.debug("no close events (%s): a GPU let go is seen at the next poll", err)
            return
        add_reader(self.inotify.fd, "closes")

    def stop(self, remove_reader: Callable[[int], None]) -> None:
        if self.inotify is not None:
            remove_reader(self.inotify.fd)
            self.inotify.close()
            self.inotify = None
        self.watched = ()

    def follow(self, paths: Tuple[str, ...]) -> None:
        """Watch the nodes the open watch watches (engine/opens.py keeps them in step with the observer)."""
        if paths != self.watched:
            self.watched = paths
            if self.inotify is not None:
                self.inotify.watch(paths)  # (what cannot be watched is the open watch's to say)

    def read(self) -> bool:
        """Drain the closes; True when one was of a GPU that someone other than gpu-mon holds."""
        if self.inotify is None:
            return False
        closed, renew = self.inotify.read()
        if renew:
            self.watched = ()  # (a node went away: watched afresh at the next follow)
        targets = self.observer.watch_targets()
        uuids = {targets.get(path) for path in closed} - {None}
        return any(not h.ours_on(u) for h in self.observer.holders for u in h.gpus & uuids)
