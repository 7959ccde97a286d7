"""Who opened a GPU's node: the kernel's open event does not say, so it is worked out from the scans.

An open is explained when a process whose files we can read (gpu-mon itself too: NVML's descriptors) holds
more descriptors of the node than at the last *quiet* scan (one after which no open event was waiting:
everything it read came before the open), a new holder included. A plain user cannot read other users'
descriptors, but sees that their processes started or changed how many files they have open (stat of
/proc/PID/fd is open to anyone). An open that no readable process explains, made while such processes had
started or changed since the quiet scan, is one of theirs: an UnseenOpen, which the policy counts as
someone else's use of the GPU at once, without waiting for NVML to show the opener. Where every process is
readable (root) there are none, and nothing is counted.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, Iterable, Optional, Set, Tuple

from gpu_mon.api import holders, procfs
from gpu_mon.api.model import Denied, UnseenOpen
from gpu_mon.api.observe import Observer

Held = Dict[str, Dict[Tuple[int, int], int]]  # uuid -> {(pid, start): its descriptors of the node}


class Openers:
    """What the scans since the last quiet one say about who may have opened a node; the unseen opens."""

    def __init__(self, observer: Observer):
        self.observer = observer
        self.baseline: Held = {}  # readable holders at the last quiet scan
        self.stirred: Set[int] = set()  # unreadable pids new or changed since the last quiet scan
        self.unseen: Dict[str, UnseenOpen] = {}  # uuid -> its latest unseen open

    def scanned(self, opens_waiting: Callable[[], bool]) -> None:
        """After every scan: a quiet one becomes the baseline; otherwise note the unreadable that stirred.
        Quiet is asked last: an open while the holders' descriptors are counted makes the scan not quiet."""
        held = self._held() if self.observer.denied_pids else {}
        if opens_waiting():
            self.stirred |= self._stirred_now()
            return
        self.baseline = held
        self.stirred = set()

    def before(self) -> Tuple[Held, Set[int]]:
        """What the next scan's findings are compared with (take it before the scan that follows an open)."""
        return self.baseline, set(self.stirred)

    def note(
        self, uuids: Iterable[Optional[str]], before: Tuple[Held, Set[int]], now: float
    ) -> Tuple[str, ...]:
        """After the scan that followed opens of these GPUs: those whose open no readable process explains
        while unreadable ones stirred; remembered as unseen opens (the latest per GPU)."""
        baseline, stirred = before
        suspects = (stirred | self._stirred_now()) & set(self.observer.denied_pids)
        if not suspects:
            return ()
        now_held = self._held()
        noted = []
        for uuid in sorted({u for u in uuids if u}):
            was = baseline.get(uuid, {})
            if not any(n > was.get(key, 0) for key, n in now_held.get(uuid, {}).items()):
                self.unseen[uuid] = UnseenOpen(uuid, now, self._newest_first(suspects))
                noted.append(uuid)
        return tuple(noted)

    def _held(self) -> Held:
        """Readable holders' descriptors of each node, gpu-mon's own too (NVML's: no scan reads them)."""
        observer = self.observer
        targets, _problems = holders.device_targets(observer.reading.gpus)
        out: Held = {}
        for uuid, n in _descriptors(observer.own_pid, targets.keys, observer.proc).items():
            out.setdefault(uuid, {})[(observer.own_pid, 0)] = n
        for h in observer.holders:
            counts = _descriptors(h.pid, targets.keys, observer.proc)
            for uuid in h.gpus:
                out.setdefault(uuid, {})[(h.pid, h.start_ticks)] = max(1, counts.get(uuid, 0))
        return out

    def _stirred_now(self) -> Set[int]:
        """Unreadable processes the last scan read: new ones, or ones whose open files changed."""
        return {p for p in self.observer.denied_pids if p in self.observer.last_rescanned}

    def _newest_first(self, pids: Iterable[int]) -> Tuple[Denied, ...]:
        """The processes that may have opened it, the latest started first (the likeliest opener)."""
        proc = self.observer.proc
        started = {p: st.start_ticks for p in pids if (st := procfs.read_stat(p, proc)) is not None}
        order = sorted(started, key=lambda p: -started[p])
        return tuple(d for p in order for d in holders.describe_denied((p,), proc))


def _descriptors(pid: int, keys: Dict[holders.DevKey, str], proc: str) -> Dict[str, int]:
    """{uuid: how many of this process's descriptors are that GPU's node} (a map alone counts as none)."""
    out: Dict[str, int] = {}
    fd_dir = f"{proc}/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return out
    for name in names:
        try:
            key = holders.device_key(os.stat(f"{fd_dir}/{name}"))
        except OSError:
            continue
        uuid = keys.get(key) if key is not None else None
        if uuid:
            out[uuid] = out.get(uuid, 0) + 1
    return out
