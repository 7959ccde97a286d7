"""What the engine decides: the instances it may run, actions, verdicts, the policy's memory. Plain data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

from gpu_mon.api.model import Exited


@dataclass(frozen=True)
class Instance:
    """One thing to run: a [process-*] section, or one GPU's copy of it when per_gpu = yes."""

    key: str  # "miner", or "miner@GPU-5a1c..." for per_gpu
    process: str  # section name without the "process-" prefix
    gpus: Tuple[str, ...]  # UUIDs, in config order
    # GPUs that must all be free for it to start, any busy one stopping it (default: its own `gpus`)
    group: Tuple[str, ...] = ()

    @property
    def needs(self) -> Tuple[str, ...]:
        """The GPUs whose state decides whether it may run."""
        return self.group or self.gpus

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
    """Start this instance now: its GPUs have been free for `free_seconds`."""

    instance: Instance
    free_seconds: float


@dataclass(frozen=True)
class Stop:
    """Stop this running instance now. why: gpu_busy (see `busy`), terminal, or removed (from the config)."""

    key: str
    why: str
    # gpu_busy: (uuid, first reason) of each busy GPU; the daemon looks at them again before acting
    busy: Tuple[Tuple[str, Reason], ...] = ()
    terminal: Optional[TerminalUse] = None

    @property
    def gpus(self) -> Tuple[str, ...]:
        """The GPUs whose being busy caused the stop."""
        return tuple(uuid for uuid, _ in self.busy)


@dataclass(frozen=True)
class Verdict:
    """Busy or free for one GPU in one round, with the reasons."""

    uuid: str
    busy: bool
    reasons: Tuple[Reason, ...] = ()
    free_since: Optional[float] = None
    # Busy only because processes hold its node (every reason a Busy.HOLDER): since when the one that has
    # held it longest has (monotonic). None: free, or busy for any other reason (which counts at once).
    held_since: Optional[float] = None


@dataclass(frozen=True)
class Backoff:
    """Restart backoff of one instance."""

    failures: int = 0  # consecutive quick exits
    not_before: float = 0.0  # monotonic time before which it may not start again
    restarts: int = 0
    last: Optional[Exited] = None  # how it last ended


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
    paused_by: Tuple[TerminalUse, ...] = ()
    next_wake: Optional[float] = None  # monotonic time of the next start delay or backoff expiry
    events: Tuple[Restarting, ...] = ()  # things worth saying that are not actions
    waiting: dict = field(default_factory=dict)  # instance key -> Wait


# --------------------------------------------------------------------------------------------------------
# Why: reasons and events as data. policy/words.py says them in English, at the edges (log, status).


@dataclass(frozen=True)
class Who:
    """A process named in a reason, as read from /proc (escaped only when shown)."""

    user: str
    name: str
    pid: int


class Busy:
    """The kinds of Reason: why a GPU counts as busy."""

    BACKEND = "backend_unreadable"  # detail: the backend's error (no driver, a bad sim file)
    MISSING = "gpu_missing"  # the GPU is not in this look (lost, removed)
    UNREADABLE = "gpu_unreadable"  # detail: the fields that failed
    NODE = "node_unwatchable"  # detail: why its device node cannot be used
    HIDDEN = "hidden_processes"  # who: the first process whose files we cannot read; count: how many
    HOLDER = "holds_node"  # who holds it open; path: the node as that process opened it
    CONTEXT = "nvml_context"  # who (None: not visible here), pid, context (compute/graphics), mib
    MEMORY = "memory_by_others"  # mib used by others, limit_mib = busy_memory_mib
    # its node opened by a process whose files cannot be read: who, the first that may have; count: how many
    UNSEEN = "unseen_open"
    # its node opened and closed again and again while nothing of ours ran there: who, the first opener the
    # kernel or a scan named; count: how many were named
    OPENS = "brief_opens"
    # `gpu-mon occupy`: a job of gpu-mon's queue runs on it (job; who: its user and name, pid 0), or the
    # queue's jobs cannot be known (detail: why)
    QUEUE_JOB = "queue_job"
    QUEUE_UNKNOWN = "queue_unknown"
    # [slurm]: Slurm has allocated the GPU to a job (job; who: its user, name `Slurm job N`, pid 0), or
    # Slurm's allocations have not been read yet (detail: why)
    SLURM_JOB = "slurm_job"
    SLURM_UNKNOWN = "slurm_unknown"


@dataclass(frozen=True)
class Reason:
    """One fact that makes a GPU busy."""

    kind: str
    who: Optional[Who] = None
    pid: Optional[int] = None
    path: str = ""
    detail: str = ""
    mib: Optional[int] = None
    limit_mib: Optional[int] = None
    count: int = 0
    context: str = ""
    job: Optional[int] = None  # QUEUE_JOB: the job's id


@dataclass(frozen=True)
class TerminalUse:
    """A terminal touched recently by a user who is not on the whitelist: all work pauses."""

    user: str
    device: str
    idle_seconds: float


@dataclass(frozen=True)
class Wait:
    """Why an instance is not running now. kind: paused, busy, taken, start_delay, backoff, stopping."""

    kind: str
    gpu: str = ""  # busy, taken: the GPU
    reason: Optional[Reason] = None  # busy: the GPU's first reason
    by: str = ""  # taken: the instance that has the GPU
    terminal: Optional[TerminalUse] = None  # paused
    until: Optional[float] = None  # start_delay, backoff: monotonic time it may start
    last: Optional[Exited] = None  # backoff: the exit that caused it


@dataclass(frozen=True)
class Restarting:
    """Event: an instance ended by itself and will be started again after `delay` seconds."""

    exited: Exited
    delay: float
    failures: int  # quick failures in a row

    @property
    def failing(self) -> bool:
        """Three quick failures in a row: worth a warning."""
        return self.failures >= 3


@dataclass(frozen=True)
class Preemption:
    """A workload stopped because someone else started using its GPU: when, for whom, how fast.

    Latencies count from the wake of the loop that saw the foreign use (an open event, or a poll)."""

    wall: float
    uuid: str
    workload: str
    who: str
    detected_by: str  # "open" (inotify) or "poll"
    term_ms: float  # to the stop signal
    gone_ms: Optional[float]  # to the last process of the workload gone
