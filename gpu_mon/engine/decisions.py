"""What the engine decides: the instances it may run, actions, verdicts, the policy's memory. Plain data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple


@dataclass(frozen=True)
class Instance:
    """One thing to run: a [process-*] section, or one GPU's copy of it when per_gpu = yes."""

    key: str  # "miner", or "miner@GPU-5a1c..." for per_gpu
    process: str  # section name without the "process-" prefix
    gpus: Tuple[str, ...]  # UUIDs, in config order

    def label(self, index_of: Optional[dict] = None) -> str:
        """`miner` or `miner@0` (GPU index when known)."""
        if "@" not in self.key:
            return self.key
        uuid = self.key.split("@", 1)[1]
        if index_of and uuid in index_of:
            return f"{self.process}@{index_of[uuid]}"
        return self.key


@dataclass(frozen=True)
class Start:
    """Start this instance now."""

    instance: Instance
    reason: str


@dataclass(frozen=True)
class Stop:
    """Stop this running instance now."""

    key: str
    reason: str
    # GPUs whose busy state caused the stop: the daemon looks at them again before acting
    gpus: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Verdict:
    """Busy or free for one GPU in one round, with the reasons."""

    uuid: str
    busy: bool
    reasons: Tuple[str, ...] = ()
    free_since: Optional[float] = None


@dataclass(frozen=True)
class Backoff:
    """Restart backoff of one instance."""

    failures: int = 0  # consecutive quick exits
    not_before: float = 0.0  # monotonic time before which it may not start again
    restarts: int = 0
    last_exit: str = ""


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between rounds."""

    free_since: dict = field(default_factory=dict)  # uuid -> monotonic time it became free
    first_seen: dict = field(default_factory=dict)  # (pid, start_ticks, uuid) -> monotonic time
    backoff: dict = field(default_factory=dict)  # instance key -> Backoff


@dataclass(frozen=True)
class Decision:
    """What `policy.decide` returns."""

    actions: Tuple[object, ...]
    state: PolicyState
    verdicts: dict  # uuid -> Verdict
    paused_by: Tuple[str, ...] = ()
    next_wake: Optional[float] = None  # monotonic time of the next start delay or backoff expiry
    notes: Tuple[str, ...] = ()  # log lines for things worth saying that are not actions
    waiting: dict = field(default_factory=dict)  # instance key -> why it is not running now
