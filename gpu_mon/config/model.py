"""The config as frozen dataclasses: one per section, and Config for a whole, valid file."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from gpu_mon.config.values import GpuSelection

# Always ignored as GPU holders: they only read state (DESIGN.md "[gpu-NAME]").
DEFAULT_TTY_DEVICES = ("/dev/pts/*", "/dev/tty[0-9]*")


class ConfigError(Exception):
    """The config cannot be used; `errors` holds one line per problem. `partial` is what did parse (the
    sections without errors), so that `check` can report the host's problems with it at the same time."""

    def __init__(self, errors: List[str], partial: Optional[Config] = None):
        super().__init__("\n".join(errors))
        self.errors = list(errors)
        self.partial = partial


@dataclass(frozen=True)
class Defaults:
    """The [defaults] section."""

    interval_seconds: float = 2.0
    start_delay_seconds: float = 60.0
    stop_timeout_seconds: float = 10.0
    urgent_stop_timeout_seconds: float = 2.0
    restart_delay_seconds: float = 10.0
    restart_delay_max_seconds: float = 600.0
    healthy_run_seconds: float = 60.0
    full_scan_seconds: float = 60.0
    watch_opens: bool = True
    state_file: str = "/run/gpu_mon/state.json"
    containment: str = "auto"  # auto (a cgroup where the daemon may create one), cgroup, subreaper
    # The line each written key is on (not compared: moving a key in the file changes nothing).
    key_lines: Tuple[Tuple[str, int], ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class GpuSection:
    """A [gpu-NAME] section: which GPUs to watch and what does not make them busy."""

    name: str
    gpus: GpuSelection
    ignore_programs: Tuple[str, ...] = ()
    ignore_users: Tuple[str, ...] = ()
    busy_memory_mib: int = 1024
    holder_grace_seconds: Optional[float] = None
    # A foreign process holding at least idle_holder_memory_mib at no more than idle_holder_utilization_pct
    # for idle_holder_seconds is reported as an idle holder (never signalled).
    idle_holder_seconds: float = 7200.0
    idle_holder_memory_mib: int = 1024
    idle_holder_utilization_pct: float = 1.0
    # Run (as the daemon's user, no shell) once when an idle-holder episode starts; None: nothing runs.
    idle_holder_command: Optional[Tuple[str, ...]] = None
    line: int = 0
    # The line each written key is on (not compared: moving a key in the file changes nothing).
    key_lines: Tuple[Tuple[str, int], ...] = field(default=(), compare=False)
    path: str = field(default="", compare=False)  # the file of its header: the config or a drop-in
    # Not in the INI file (`gpu-mon occupy` only): processes whose open files cannot be read do not make
    # the GPU busy. A plain user cannot read other users' processes; memory used and NVML's process list
    # still show what they do on the GPU.
    unreadable_is_busy: bool = True


@dataclass(frozen=True)
class ProcessSection:
    """A [process-NAME] section: a workload and where it may run."""

    name: str
    cmd: Tuple[str, ...]
    gpus: GpuSelection = GpuSelection(all=True)  # noqa: RUF009 (frozen: safe to share)
    dir: str = "/"
    log: Optional[str] = None
    user: str = "nobody"
    user_explicit: bool = False
    uid: int = 65534
    gid: int = 65534
    group: str = "nogroup"
    groups: Tuple[int, ...] = ()  # supplementary groups of `user`
    home: str = "/"
    env: Tuple[Tuple[str, str], ...] = ()
    per_gpu: bool = False
    # How it is stopped (engine/workloads/stopping.py): None means [defaults]'. Not in the fingerprint: a
    # reload applies them to running workloads without a restart.
    stop_signal: int = signal.SIGTERM
    stop_timeout_seconds: Optional[float] = None
    urgent_stop_timeout_seconds: Optional[float] = None
    line: int = 0
    # The line each written key is on (not compared: moving a key in the file changes nothing).
    key_lines: Tuple[Tuple[str, int], ...] = field(default=(), compare=False)
    fingerprint: Tuple[Tuple[str, str], ...] = ()  # the raw keys and values: a reload restarts on change
    path: str = field(default="", compare=False)  # the file of its header: the config or a drop-in
    # Not in the INI file (`gpu-mon occupy` only). together: per_gpu copies start only when all the
    # section's GPUs are free, and all stop when any is busy. hold: never stop for a busy GPU.
    together: bool = False
    hold: bool = False


@dataclass(frozen=True)
class TtySection:
    """The [tty] section: pause every workload while a terminal user is active."""

    enabled: bool = False
    whitelist: Tuple[str, ...] = ()
    idle_seconds: float = 300.0
    devices: Tuple[str, ...] = DEFAULT_TTY_DEVICES


@dataclass(frozen=True)
class HistorySection:
    """The [history] section: an embedded SQLite file of what happened (outputs/history.py)."""

    enabled: bool = True
    path: str = "/var/lib/gpu_mon/history.sqlite"
    retention_days: float = 90.0
    sample_seconds: float = 60.0


@dataclass(frozen=True)
class MetricsSection:
    """The [metrics] section (outputs/metrics.py): a textfile for node-exporter, an HTTP endpoint, or both."""

    textfile: Optional[str] = None
    listen: Optional[Tuple[str, int]] = None  # (address, port); a bare port is 127.0.0.1
    line: int = 0

    @property
    def listen_text(self) -> str:
        """`127.0.0.1:9842`, `[::1]:9842`."""
        if self.listen is None:
            return ""
        host, port = self.listen
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


KILL_ACTIONS = ("end_process", "shutdown", "reboot", "command")


@dataclass(frozen=True)
class OccupySection:
    """The [occupy] section: the admin's limits on every user's `gpu-mon occupy on` (read from the system
    config whatever config a user names). Empty `users` and `groups`: everyone may occupy."""

    users: Tuple[str, ...] = ()
    groups: Tuple[str, ...] = ()
    max_gpus_per_user: Optional[int] = None
    max_hold_hours: Optional[float] = None
    require_yield: bool = False
    line: int = 0


QUEUE_ORDERS = ("fair", "fifo")


@dataclass(frozen=True)
class QueueSection:
    """The [queue] section: users' own jobs (`gpu-mon submit`) on GPUs nobody else uses. Off unless
    written. Empty `users` and `groups`: everyone may submit. 0 means no limit."""

    socket: str = "/run/gpu_mon/queue.sock"
    gpus: GpuSelection = GpuSelection(all=True)  # noqa: RUF009 (frozen: safe to share)
    users: Tuple[str, ...] = ()
    groups: Tuple[str, ...] = ()
    max_running_per_user: int = 0
    max_gpus_per_user: int = 0
    max_queued_per_user: int = 1000
    max_array_size: int = 10000  # elements of one `submit --array`; indices below it
    max_kept_per_user: int = 5000  # jobs the database keeps per user, finished ones included (0: none)
    max_stored_mib_per_user: int = 64  # what the database keeps of one user's jobs (0: no limit)
    max_gpus_per_job: int = 0
    order: str = "fair"
    fair_window_hours: float = 24.0
    grace_seconds: float = 30.0
    max_grace_seconds: float = 600.0
    default_time_limit: Optional[float] = None  # seconds: a job submitted without --time-limit gets it
    max_time_limit: Optional[float] = None  # seconds: a longer --time-limit is refused (submit, update)
    share_public: bool = True  # `gpu-mon share`: a plain user sees every user's usage (no: only their own)
    start_delay_seconds: Optional[float] = None  # None: [defaults] start_delay_seconds
    # A holder of a running job's GPU's node stops the job only once it has held it this long (placement.py)
    brief_open_seconds: float = 0.3
    preempt_workloads: bool = True
    database: str = "/var/lib/gpu_mon/queue.sqlite"
    keep_finished_days: float = 7.0  # a finished job leaves the database after this long (0: never)
    launcher: str = "auto"  # auto (transient units where systemd runs the machine), systemd, direct
    unguarded_seconds: float = 120.0  # jobs' units outlive gpu-mon this long at most (unguarded.py)
    confine_devices: bool = True  # a job's unit may open only its own GPUs (and the driver's shared nodes)
    device_allow: Tuple[str, ...] = ()  # other devices a confined job may open (DeviceAllow=)
    line: int = 0


SLURM_ACTIONS = ("requeue", "cancel")


@dataclass(frozen=True)
class SlurmSection:
    """The [slurm] section: jobs of these partitions or QOS yield to anyone else's use of their GPUs, by
    asking Slurm (`scontrol requeue`, or `scancel`), never by a signal from gpu-mon. Off unless written."""

    preemptible_partitions: Tuple[str, ...] = ()
    preemptible_qos: Tuple[str, ...] = ()
    action: str = "requeue"
    signal: Optional[int] = None  # sent first through `scancel --signal --full`, then the action
    signal_grace_seconds: float = 30.0
    avoid_node_seconds: float = 600.0
    scontrol: str = "scontrol"
    scancel: str = "scancel"
    timeout_seconds: float = 5.0
    node_name: Optional[str] = None  # this host's Slurm NodeName (None: guessed)
    allocation_seconds: float = 5.0  # how often Slurm's allocations are read (0: never)
    line: int = 0


@dataclass(frozen=True)
class SentinelSection:
    """The [sentinel] section (seed 001 in the daemon), also what `gpu-mon sentinel`'s options make: arm
    after `arm_duration_seconds` at >= arm_threshold, act once after `kill_duration_seconds` below
    kill_threshold. Thresholds are fractions 0-1."""

    arm_duration_seconds: float = 30.0
    arm_threshold: float = 0.7
    kill_duration_seconds: float = 300.0
    kill_threshold: float = 0.1
    kill_action: str = "end_process"
    command: Tuple[str, ...] = ()
    gpus: GpuSelection = GpuSelection(all=True)  # noqa: RUF009 (frozen: safe to share)
    aggregate: str = "mean"  # or max: one busy GPU keeps the machine up
    dry_run: bool = False
    line: int = 0
    # The line each written key is on (not compared: moving a key in the file changes nothing).
    key_lines: Tuple[Tuple[str, int], ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class Config:
    """A whole, valid config."""

    path: str
    defaults: Defaults = Defaults()
    gpu_sections: Tuple[GpuSection, ...] = ()
    processes: Tuple[ProcessSection, ...] = ()
    tty: TtySection = TtySection()
    sentinel: Optional[SentinelSection] = None  # off unless the section is written
    history: HistorySection = HistorySection()
    metrics: Optional[MetricsSection] = None  # off unless the section is written
    occupy: Optional[OccupySection] = None  # no limits unless the section is written
    queue: Optional[QueueSection] = None  # off unless the section is written
    slurm: Optional[SlurmSection] = None  # off unless the section is written
    warnings: Tuple[str, ...] = ()
    # Every file read, in order: `path`, then its drop-ins (PATH.d/*.conf, by name).
    files: Tuple[str, ...] = ()


def line_of(section: object, key: str) -> int:
    """The line `key` is written on; its section's header line when it is not written (0: neither)."""
    return dict(getattr(section, "key_lines", ())).get(key, getattr(section, "line", 0))
