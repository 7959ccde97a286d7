"""The tiers beside the configured workloads: the users' queue (queue/tier.py), Slurm's preemptible jobs
(slurm/tier.py) and, for `occupy`, the jobs of a daemon's queue (commands/occupy_queue.py).

The loop calls every tier at the same points of a wake and of a round, in the order they were given, and
never asks which tier it is: a tier keeps the default (nothing) for a point it has no use for. The points,
in the order of a round:

  recheck  -> after the round's scan: the GPUs whose holders are read again before it decides (a holder
              of a job's GPU that must still hold it a while after its open: [queue] brief_open_seconds)
  see      -> the snapshot as the policy must see it (the tier's jobs, or the GPUs they hold)
  ask      -> after the look again, before our own stops (Slurm is asked to requeue its jobs)
  place    -> after the workloads' stops: the tier yields and starts its own jobs; returns the decision's
              other actions, less the starts on GPUs it holds or is about to take
  report   -> its part of the round's report (RoundReport's fields)

and of a foreign open, before the rest of /proc is read (engine/yieldpath.py):

  ask      -> as in a round (`by_open`)
  hit      -> the GPUs of its jobs the open hits (looked at again with the stops)
  yield_first -> its jobs on those GPUs stop, exactly as workloads do
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Optional, Set, Tuple

from gpu_mon.api.model import Snapshot
from gpu_mon.config import Config
from gpu_mon.engine.workloads.supervisor import Supervisor
from gpu_mon.policy.decide import Plan
from gpu_mon.policy.decisions import Decision


@dataclass(frozen=True)
class Wiring:
    """What a tier may use of the daemon, given once when the daemon is made."""

    config: Config  # as the daemon starts (reconfigure() brings a reload's)
    supervisor: Supervisor  # starts, stops and reaps every process gpu-mon runs
    poke: Callable[[], None]  # wakes the loop (from another thread)
    clock: Callable[[], float]
    wall: Callable[[], float]
    say: Callable[..., None]  # a decision's line: logged and among status's recent ones (text, level)


@dataclass(frozen=True)
class Moment:
    """The wake a round or a first yield belongs to."""

    plan: Plan
    now: float
    wake_at: float  # when this wake began (yield latencies count from it)
    by_open: bool  # woken by an open of a GPU's node
    stopping: bool = False  # gpu-mon is stopping: nothing starts


class Tier:
    """One tier: every method does nothing until a subclass says otherwise."""

    def start(self, now: float) -> None:
        """At the daemon's start, once signals are caught and the workloads' tree is set."""

    def later(self, now: float) -> bool:
        """Slower work after the wake's rounds (never before a stop). True: poll at once."""
        return False

    def deadline(self) -> Optional[float]:
        """When it next wants the loop awake (monotonic), or None."""
        return None

    def wanted(self, now: float) -> bool:
        """Whether this wake needs a round for it (a request came, a delay ran out)."""
        return False

    def patience(self, key: str) -> float:
        """How long opens of the GPUs of this workload key may go on before they count (this tier's job
        that waits out brief opens); 0: each open is looked at at once (not its job, or it does not wait)."""
        return 0.0

    def recheck(self, now: float) -> Set[str]:
        """The GPUs whose holders this round must read again before it decides (a confirm is due)."""
        return set()

    def see(self, snap: Snapshot, quick: bool) -> Snapshot:
        """The snapshot with what this tier knows (`quick`: for a first yield, nothing taken)."""
        return snap

    def ask(self, snap: Snapshot, moment: Moment) -> None:
        """Before our own stops: whatever this tier asks of others on what the round saw."""

    def hit(self, decision: Decision, moment: Moment) -> Set[str]:
        """A foreign open's first decision: the GPUs of this tier's jobs it makes busy."""
        return set()

    def yield_first(self, decision: Decision, moment: Moment) -> None:
        """Stop this tier's jobs that the (looked again) first decision hits."""

    def place(self, decision: Decision, moment: Moment) -> Decision:
        """Yield and start this tier's jobs; return the decision less what they take."""
        return decision

    def report(self) -> Dict[str, object]:
        """This tier's fields of the round's report."""
        return {}

    def reconfigure(self, config: Config) -> None:
        """A reload's config."""

    def leave_running(self) -> int:
        """gpu-mon stops: let go of what outlives it (never on an internal error); how many were left."""
        return 0

    def stop_all(self) -> None:
        """Every process gpu-mon runs is about to be stopped (a stop, an internal error)."""

    def owned(self, keys: Iterable[str]) -> Tuple[int, str]:
        """How many of these workload keys are this tier's jobs, and what stopping them means."""
        return 0, ""

    def close(self) -> None:
        """At the daemon's end, after every process is gone."""


TierMaker = Callable[[Wiring], Tier]
