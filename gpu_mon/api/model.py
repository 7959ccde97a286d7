"""Plain data shared by the observers, the policy and the daemon. No I/O here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


def gpu_label(index: Optional[int], uuid: Optional[str]) -> str:
    """How every output names a GPU: `GPU 0 (GPU-5a1c...)` (the index is NVML's, the UUID is the name)."""
    return f"GPU {'?' if index is None else index} ({uuid or 'UUID unknown'})"


@dataclass(frozen=True)
class GpuProcess:
    """A process that NVML lists on a GPU (compute or graphics context)."""

    pid: int
    used_memory_mib: Optional[int]
    kind: str = "compute"  # "compute" or "graphics"
    # SM utilization over the last sampling period, as NVML's per-process samples report it; None: unknown
    # (the driver cannot sample processes). A listed process with no sample in the period is at 0.
    utilization_pct: Optional[int] = None


@dataclass(frozen=True)
class Gpu:
    """One look at one GPU. A field that could not be read is None and named in `errors`."""

    index: int
    uuid: Optional[str]
    name: Optional[str] = None
    minor: Optional[int] = None
    device: Optional[str] = None  # path of the device node (or the simulator's stand-in file)
    memory_total_mib: Optional[int] = None
    memory_used_mib: Optional[int] = None  # by processes and contexts (NVML v2: the driver's reserve apart)
    utilization_pct: Optional[int] = None
    memory_reserved_mib: Optional[int] = None  # held back by the driver (NVML memory info v2), not in use
    # NVML's total energy counter, millijoules since the driver loaded (Volta and newer data-centre GPUs),
    # and its power draw, milliwatts; None: not supported or unreadable (never a made-up 0)
    energy_mj: Optional[int] = None
    power_mw: Optional[int] = None
    # None: the process list could not be read (the GPU then counts as busy).
    processes: Optional[Tuple[GpuProcess, ...]] = ()
    errors: Tuple[str, ...] = ()  # "field: what went wrong", one per unreadable field

    @property
    def label(self) -> str:
        """Short human name: `GPU 0 (GPU-5a1c...)`."""
        return gpu_label(self.index, self.uuid)


@dataclass(frozen=True)
class GpuReading:
    """Everything one look at the GPU backend returned."""

    gpus: Tuple[Gpu, ...]
    error: Optional[str] = None  # the backend as a whole could not be read (no driver, bad sim file)


@dataclass(frozen=True)
class Holder:
    """A process that holds a GPU's device node open (or that NVML lists on a GPU)."""

    pid: int
    start_ticks: int  # /proc/PID/stat starttime: (pid, start_ticks) names a process without reuse
    name: str  # process name as `ps -o comm` shows it, extended from argv[0] when comm is cut at 15 chars
    argv0: str  # basename of argv[0]
    uid: Optional[int]
    user: str
    sid: int
    gpus: frozenset  # UUIDs
    # gpu_mon itself, or a process of a workload gpu_mon started holding only GPUs that workload was given
    ours: bool = False
    nodes: Tuple[
        str, ...
    ] = ()  # paths of the GPU nodes it opened, as it named them (its own mount namespace)
    monitor: bool = False  # a built-in monitor (nvidia-smi...) run from a root-owned executable
    # The GPUs of `gpus` it holds as ours: those its workload was given. Its use of any other GPU is
    # someone else's (a job given GPU 0 with a context on GPU 1 makes GPU 1 busy), and a process in no
    # workload (a hook's orphan, reparented to the daemon) is ours on none.
    ours_gpus: frozenset = frozenset()
    # A process of one of our workloads (or gpu_mon itself), whatever GPUs it holds: on a GPU it was not
    # given it is someone else's use all the same; this only tells `status` to say "ours elsewhere"
    in_workload: bool = False

    def ours_on(self, uuid: Optional[str]) -> bool:
        """Whether its hold on this GPU is ours (a workload's, on a GPU that workload was given)."""
        return self.ours or uuid in self.ours_gpus

    @property
    def label(self) -> str:
        """`alice python3[4242]`."""
        return f"{self.user} {self.name}[{self.pid}]"


@dataclass(frozen=True)
class Denied:
    """A process whose open files could not be read: it may hold any GPU."""

    pid: int
    user: str
    name: str

    @property
    def label(self) -> str:
        """`root process_api[1]`."""
        return f"{self.user} {self.name}[{self.pid}]"


@dataclass(frozen=True)
class UnseenOpen:
    """An open of a GPU's node that no process whose files we can read explains, while processes whose
    files we cannot read (another user's, to a plain user) had just started or changed their open files:
    one of them (`by`) opened it."""

    uuid: str
    at: float  # monotonic seconds of the open
    by: Tuple[Denied, ...]


@dataclass(frozen=True)
class OpenFlood:
    """A GPU whose node is opened again and again while nothing of gpu-mon's runs on it: its opens are
    looked at about once a second, not one by one (engine/floods.py), and it counts as busy meanwhile."""

    uuid: str
    since: float  # monotonic seconds of the first of its opens
    by: Tuple[Holder, ...]  # who the kernel or the scans named as its openers (none: nobody was seen)


@dataclass(frozen=True)
class TtyUser:
    """The owner of a terminal device and how long since it was last touched."""

    device: str
    user: str
    uid: int
    idle_seconds: float


@dataclass(frozen=True)
class Running:
    """A workload instance that the supervisor has running (or stopping)."""

    key: str
    pid: int  # the leader process: session and process group id of the workload
    started_at: float  # monotonic seconds
    stopping: bool = False


@dataclass(frozen=True)
class Exited:
    """A workload instance that ended since the last round."""

    key: str
    started_at: float
    ended_at: float
    returncode: int  # exit status, or 128 + signal number
    stopped_by_us: bool
    detail: str = ""  # e.g. "command not found: 'miner-run'"
    signal: int = 0  # the signal that ended its command (0: it exited, even with status 128 + N)


@dataclass(frozen=True)
class QueueJob:
    """A job that gpu-mon's queue runs, as the daemon's state file says (`gpu-mon occupy` reads it): the
    GPUs it runs on are taken, whether or not it uses them yet."""

    job: int
    user: str
    name: str
    gpus: Tuple[str, ...]  # UUIDs


@dataclass(frozen=True)
class SlurmJob:
    """A job that Slurm has allocated GPUs of this host to (the daemon's [slurm]): they are taken, whether
    or not its processes have opened them yet."""

    job: int
    user: str
    gpus: Tuple[str, ...]  # UUIDs


@dataclass(frozen=True)
class Snapshot:
    """One complete look at the host, as the policy sees it."""

    now: float  # monotonic seconds
    reading: GpuReading
    holders: Tuple[Holder, ...] = ()
    denied: Tuple[Denied, ...] = ()
    ttys: Tuple[TtyUser, ...] = ()
    running: Tuple[Running, ...] = ()
    exited: Tuple[Exited, ...] = ()
    # NVML processes of every GPU with their owners resolved (pid -> holder-like record), see observe.py
    nvml_procs: Tuple[Holder, ...] = ()
    node_errors: Tuple[Tuple[str, str], ...] = ()  # (uuid, why its device node cannot be watched)
    unseen_opens: Tuple[UnseenOpen, ...] = ()  # the latest one of each GPU
    open_floods: Tuple[OpenFlood, ...] = ()  # GPUs opened again and again (engine/floods.py)
    # `gpu-mon occupy` only: the running jobs of the daemon's queue, and why they cannot be known (then
    # every GPU counts as busy); the daemon itself leaves both empty (its own jobs are its own)
    queue_jobs: Tuple[QueueJob, ...] = ()
    queue_unknown: str = ""
    # [slurm]: the jobs Slurm has allocated GPUs of this host to, and why they are not known yet (then every
    # GPU counts as busy)
    slurm_jobs: Tuple[SlurmJob, ...] = ()
    slurm_unknown: str = ""

    def gpu(self, uuid: str) -> Optional[Gpu]:
        """The GPU with this UUID in this look, or None."""
        for gpu in self.reading.gpus:
            if gpu.uuid == uuid:
                return gpu
        return None
