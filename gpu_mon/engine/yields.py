"""What a stop for someone else's use owes after its signal: the stops a foreign open sent before the round
(logged by the round with the whole picture) and each preemption under way, recorded with its latencies
once its workload is gone (status, history, metrics)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Tuple

from gpu_mon.api.model import Snapshot
from gpu_mon.policy import gpustate, words
from gpu_mon.policy.decisions import Decision, Preemption, Stop


def urgent(stop: Stop) -> bool:
    """A foreign process opened the GPU (not: it went unreadable): it is about to allocate."""
    return bool(stop.busy) and stop.busy[0][1].kind in gpustate.FOREIGN_REASONS


class Yields:
    """The stops sent before their round, and the preemptions whose workload is not gone yet."""

    def __init__(self, clock: Callable[[], float], wall: Callable[[], float]):
        self.clock, self.wall = clock, wall
        self.first: Dict[str, Tuple[Stop, str, int]] = {}  # workload key -> (Stop, label, pid)
        self.yielding: Dict[str, dict] = {}  # workload key -> the stop for a busy GPU under way
        self.wake_at = 0.0  # when this wake of the loop began (yield latencies count from it)
        self.by_open = False  # this wake came from an open of a GPU's node

    def woke(self, now: float) -> None:
        """A wake begins (a round that raised may have left stops sent first: forgotten)."""
        self.wake_at, self.by_open = now, False
        self.first.clear()

    def sent_first(self, stop: Stop, label: str, pid: int) -> None:
        """A stop went out before the round."""
        self.started(stop, label)
        self.first[stop.key] = (stop, label, pid)

    def started(self, stop: Stop, label: str) -> None:
        """A preemption begins: its signal went out now."""
        uuid, reason = stop.busy[0]
        self.yielding[stop.key] = {
            "uuid": uuid,
            "workload": label,
            "who": words.reason(reason),
            "by": "open" if self.by_open else "poll",
            "wake": self.wake_at,
            "term_ms": (self.clock() - self.wake_at) * 1000,
            "wall": self.wall(),
        }

    def with_first(self, decision: Decision) -> Decision:
        """The stops sent before the round, among its actions (for their log line), each with its GPUs'
        first reason as the whole picture has it."""
        if not self.first:
            return decision
        sent = []
        for stop, _label, _pid in self.first.values():
            busy = []
            for uuid, reason in stop.busy:
                v = decision.verdicts.get(uuid)
                busy.append((uuid, v.reasons[0] if v is not None and v.busy and v.reasons else reason))
            sent.append(dataclasses.replace(stop, busy=tuple(busy)))
        return dataclasses.replace(decision, actions=(*sent, *decision.actions))

    def done(self, snap: Snapshot) -> Tuple[Preemption, ...]:
        """Preemptions whose workload is gone in this round."""
        found = []
        for ex in snap.exited:
            y = self.yielding.pop(ex.key, None)
            if y is not None:
                gone = (ex.ended_at - y["wake"]) * 1000
                found.append(
                    Preemption(y["wall"], y["uuid"], y["workload"], y["who"], y["by"], y["term_ms"], gone)
                )
        return tuple(found)
