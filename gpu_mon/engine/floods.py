"""A GPU's node opened again and again while nothing of gpu-mon's runs on that GPU: its opens are looked at
about once a second, not one by one.

A plain user's open/close loop on an idle GPU's node held the daemon's main thread at 71-80 % of a core: a
wake, a scan and a round for every open it read, a busy and a free line in the journal and a history row
for each (issue 46). A GPU with nothing of ours on it has nothing to yield, so its opens need no look each.
The second open of such a GPU within HOLD_SECONDS of the one before starts an episode: the GPU's node is
no longer watched for HOLD_SECONDS (no wake per open, nothing queued: the kernel drops the events of a
node nobody watches), then watched again for HOLD_SECONDS. An open then is looked at as ever (a scan and
a round) and the node is let go again; none ends the episode, with one line that sums it up. While it
lasts the GPU counts as busy, opened again and again by whoever the kernel or the scans named as its
openers (policy: Busy.OPENS), so the log says busy and free once for it and the history has one interval.

Never for a GPU where something of ours runs that yields at an open (a workload, a Slurm job): every open
there is looked at at once (engine/yieldpath.py), and a GPU let go is watched again as soon as such a thing
is on it (`drop`). A queue job that waits out brief opens ([queue] brief_open_seconds: the round's
`patience`) is not such a thing: its GPU's opens again and again are let go as on an idle GPU, and count
against the job (Busy.OPENS) only once they have gone on that long (an open looked at that long after the
first: a CUDA program's or a monitor's few opens as it starts do not); a holder among the openers is looked
at again by the queue's confirm. The caller keeps the watches (engine/opens.py) in step with `held()`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Set, Tuple

from gpu_mon.api.model import Holder, OpenFlood

HOLD_SECONDS = 1.0


@dataclass
class Episode:
    """One GPU's opens again and again: since when, the last one looked at, until when its node is let go
    (then, listening: watched again until `until`), who opened it, how many of its opens were looked at."""

    since: float
    last: float
    until: float
    listening: bool = False
    by: Tuple[Holder, ...] = ()
    looks: int = 1


@dataclass(frozen=True)
class Ended:
    """An episode that is over: its GPU, how long it lasted, who, how many opens were looked at."""

    uuid: str
    seconds: float
    by: Tuple[Holder, ...]
    looks: int


class Floods:
    """The episodes under way, and when each GPU's node was last opened."""

    def __init__(self) -> None:
        self.last: Dict[str, float] = {}  # uuid -> its last open that was looked at (GPUs of nothing of ours)
        self.episodes: Dict[str, Episode] = {}

    def opened(self, uuids: Iterable[str], now: float) -> Set[str]:
        """Opens of these GPUs (nothing of ours on them) are looked at now; those in an episode from now on
        (their nodes are to be let go until HOLD_SECONDS from now)."""
        flooded = set()
        for uuid in uuids:
            e = self.episodes.get(uuid)
            if e is None and uuid in self.last and now - self.last[uuid] < HOLD_SECONDS:
                e = self.episodes[uuid] = Episode(since=self.last[uuid], last=now, until=now)
            self.last[uuid] = now
            if e is not None:
                e.last, e.until, e.listening, e.looks = now, now + HOLD_SECONDS, False, e.looks + 1
                flooded.add(uuid)
        return flooded

    def named(self, uuid: str, by: Tuple[Holder, ...]) -> None:
        """Who opened it this time (kept from an earlier look when none was seen now)."""
        e = self.episodes.get(uuid)
        if e is not None and by:
            e.by = by

    def due(self, now: float) -> Tuple[Set[str], List[Ended]]:
        """Episodes whose time is up: (GPUs whose nodes are watched again from now, episodes that ended:
        no open while watched again)."""
        listen: Set[str] = set()
        ended: List[Ended] = []
        for uuid, e in list(self.episodes.items()):
            if now < e.until:
                continue
            if e.listening:
                ended.append(Ended(uuid, e.last - e.since, e.by, e.looks))
                del self.episodes[uuid]
            else:
                e.until, e.listening = now + HOLD_SECONDS, True
                listen.add(uuid)
        return listen, ended

    def drop(self, uuids: Iterable[str]) -> Set[str]:
        """Something of ours is on these GPUs now: their episodes end at once (watched again); which did."""
        return {u for u in uuids if self.episodes.pop(u, None) is not None}

    def held(self) -> Set[str]:
        """The GPUs whose nodes are let go now."""
        return {u for u, e in self.episodes.items() if not e.listening}

    def deadline(self) -> Optional[float]:
        """When the next episode's time is up (monotonic), or None."""
        return min((e.until for e in self.episodes.values()), default=None)

    def seen(self, patience: Optional[Mapping[str, float]] = None) -> Tuple[OpenFlood, ...]:
        """The episodes under way, as the policy sees them: on a GPU with `patience` (a job's that waits out
        brief opens: how long), only once an open has been looked at that long after its first."""
        patience = patience or {}
        return tuple(
            OpenFlood(u, e.since, e.by)
            for u, e in sorted(self.episodes.items())
            if u not in patience or e.last - e.since >= patience[u]
        )


def with_gpu(h: Holder, uuid: str) -> Holder:
    """An opener as a holder of this GPU (the kernel named it; it may hold nothing now)."""
    return dataclasses.replace(h, gpus=frozenset((uuid,)))
