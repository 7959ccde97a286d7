"""The keys of [queue], the users' own jobs: type, default and doc of each (schema.py gathers them)."""

from __future__ import annotations

from gpu_mon.config import values as v
from gpu_mon.config.key import Key, SectionSpec, plain
from gpu_mon.config.model import QUEUE_ORDERS

_WHO = "Both empty: everyone; root always may."

QUEUE = SectionSpec(
    "queue",
    "Users' own jobs on GPUs nobody else uses: `gpu-mon submit -- CMD`, `jobs`, `cancel`, `hold`, "
    "`release`, `logs`. A job runs as the user who submitted it and yields to anyone else's use of its "
    "GPUs (its stop signal, a grace, then SIGKILL), then goes back to the queue. Off unless this section "
    "is written. Limits of 0 mean none.",
    (
        Key(
            "socket",
            "path",
            v.path_under,
            "/run/gpu_mon/queue.sock",
            "The unix socket users' commands talk to (made 0666 in a root-owned 0755 directory).",
        ),
        Key(
            "gpus",
            "ALL or GPU list",
            plain(v.parse_gpus),
            "ALL",
            "The GPUs jobs may use (only GPUs a [gpu-*] section names are ever used).",
        ),
        Key("users", "list of users", plain(v.names), "", f"Who may submit, by user name. {_WHO}"),
        Key("groups", "list of groups", plain(v.names), "", f"Who may submit, by group. {_WHO}"),
        Key("max_running_per_user", "whole number", plain(v.limit), "0", "Running jobs per user."),
        Key("max_gpus_per_user", "whole number", plain(v.limit), "0", "GPUs in use per user."),
        Key(
            "max_queued_per_user",
            "whole number, at least 1",
            plain(v.count),
            "1000",
            "A user with this many unfinished jobs is refused another.",
        ),
        Key(
            "max_array_size",
            "whole number, at least 1",
            plain(v.count),
            "10000",
            "The most elements one `submit --array` may queue; every index is below it (Slurm's "
            "MaxArraySize). Each element counts as a job against max_queued_per_user.",
        ),
        Key(
            "max_kept_per_user",
            "whole number",
            plain(v.limit),
            "5000",
            "The most jobs the database keeps for one user, finished ones included (never fewer than "
            "max_queued_per_user; an array's elements each count). A submit that would pass it removes that "
            "user's oldest finished jobs first (never another user's, never an unfinished one), and is "
            "refused when that is not enough.",
        ),
        Key(
            "max_stored_mib_per_user",
            "MiB",
            plain(v.mib),
            "64",
            "The most the database keeps of one user's jobs, in MiB: their commands, environments, "
            "directories, names, outputs and hooks (an array's once), and about 300 bytes a job. A submit "
            "that would pass it removes that user's oldest finished jobs first, and is refused when that "
            "is not enough.",
        ),
        Key("max_gpus_per_job", "whole number", plain(v.limit), "0", "GPUs one job may ask for."),
        Key(
            "order",
            " or ".join(QUEUE_ORDERS),
            plain(v.choice(*QUEUE_ORDERS)),
            "fair",
            "Which queued job goes first: fair (the user with the fewest GPU-seconds over fair_window_hours "
            "first, then priority, then submission order) or fifo (priority, then submission order).",
        ),
        Key("fair_window_hours", "hours", plain(v.hours), "24", "The window of fair order."),
        Key(
            "grace_seconds",
            "seconds",
            plain(v.seconds),
            "30",
            "The grace between a job's stop signal and SIGKILL (`submit --grace`).",
        ),
        Key("max_grace_seconds", "seconds", plain(v.seconds), "600", "The longest grace a job may ask for."),
        Key(
            "default_time_limit",
            "duration, or empty",
            plain(v.optional(v.duration)),
            "",
            "The time limit of a job submitted without --time-limit (90, 30m, 2h, 1d; Slurm's DefaultTime). "
            "Empty: none.",
            "1d",
        ),
        Key(
            "max_time_limit",
            "duration, or empty",
            plain(v.optional(v.duration)),
            "",
            "The longest --time-limit a job may have (Slurm's MaxTime): `submit` and `update` refuse a "
            "longer one, in one line. At least default_time_limit. Empty: none.",
            "7d",
        ),
        Key(
            "share_public",
            "boolean",
            plain(v.boolean),
            "yes",
            "yes: `gpu-mon share` shows every user's usage and place in the fair order to everyone (the "
            "order is public on a shared server); no: a plain user sees only their own line (root sees all).",
        ),
        Key(
            "start_delay_seconds",
            "seconds, or empty",
            plain(v.optional(v.seconds)),
            "",
            "How long a GPU must stay free before a job starts on it (empty: [defaults] "
            "start_delay_seconds).",
            "5",
        ),
        Key(
            "brief_open_seconds",
            "seconds, 0 to 2",
            plain(v.up_to(2.0)),
            "0.3",
            "Someone else's process that holds a running job's GPU's node stops the job if it still holds "
            "it this long after it was first seen (looked at again then): a brief probe does not. A context "
            "NVML shows, memory over busy_memory_mib, anything else stops the job at once. 0: at once.",
        ),
        Key(
            "preempt_workloads",
            "boolean",
            plain(v.boolean),
            "yes",
            "yes: a queued job takes a GPU from a [process-*] workload (which gets its full grace).",
        ),
        Key(
            "database",
            "path",
            v.path_under,
            "/var/lib/gpu_mon/queue.sqlite",
            "The queue's database (SQLite). Jobs are written here before `submit` answers.",
        ),
        Key(
            "launcher",
            "auto, systemd or direct",
            plain(v.choice("auto", "systemd", "direct")),
            "auto",
            "How jobs are started. auto: where systemd runs the machine (and gpu-mon runs as root), each "
            "job is a transient service unit of its own (in gpu_mon_jobs.slice); elsewhere a child of "
            "gpu-mon. systemd: always a transient unit; direct: always a child.",
        ),
        Key(
            "unguarded_seconds",
            "seconds",
            plain(v.positive_seconds),
            "120",
            "With transient units: jobs keep running through a restart, an upgrade or a crash of gpu-mon; "
            "when gpu-mon has been away this long (a stop that lasts, a failed start), systemd stops them "
            "(their stop signal and grace) and they go back to the queue.",
        ),
        Key(
            "confine_devices",
            "boolean",
            plain(v.boolean),
            "yes",
            "With transient units: a job may open only its own GPUs' device nodes, the driver's shared "
            "nodes (nvidiactl, nvidia-uvm, nvidia-modeset, nvidia-caps), the standard pseudo devices and "
            "device_allow; its open of another GPU fails (EPERM), so it disturbs no one else's job (as "
            "Slurm's ConstrainDevices). Direct jobs are not confined.",
        ),
        Key(
            "device_allow",
            "list of devices",
            plain(v.devices),
            "",
            "Other devices a confined job may open: nodes under /dev or classes of /proc/devices, as "
            "systemd's DeviceAllow= takes them.",
            "/dev/fuse, char-infiniband_verbs",
        ),
        Key(
            "keep_finished_days",
            "days",
            plain(v.seconds),
            "7",
            "Finished jobs leave the database after this many days (never sooner than fair_window_hours); "
            "checked hourly. 0: kept for ever.",
        ),
    ),
)
