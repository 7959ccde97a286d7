"""The keys of the sections that turn on a feature: [history], [metrics], [sentinel], [occupy], [queue],
[slurm]. Each key's parser, default and doc are here and only here."""

from __future__ import annotations

import re

from gpu_mon.config import values as v
from gpu_mon.config.key import Key, SectionSpec, plain
from gpu_mon.config.model import KILL_ACTIONS, QUEUE_ORDERS, SLURM_ACTIONS

_WHO = "Both empty: everyone; root always may."


HISTORY = SectionSpec(
    "history",
    "What the daemon saw, in an embedded SQLite file that `gpu-mon report` reads: each GPU's states and who "
    "caused them, each workload run, each preemption with its latency, idle-holder episodes, and a sample "
    "of memory and utilization per GPU. Written in batches every 5 s beside the event loop. On unless "
    "turned off.",
    (
        Key("enabled", "boolean", plain(v.boolean), "yes", "Keep the history file."),
        Key(
            "path",
            "path",
            v.path_under,
            "/var/lib/gpu_mon/history.sqlite",
            "The SQLite file. One that is damaged or not gpu-mon's is moved aside (PATH.bad-DATE) and a new "
            "one started.",
        ),
        Key(
            "retention_days",
            "days, at least 1/24",
            plain(v.at_least(1.0 / 24)),
            "90",
            "Rows older than this are deleted once a day.",
        ),
        Key(
            "sample_seconds",
            "seconds, at least 1",
            plain(v.at_least(1.0)),
            "60",
            "How often memory and utilization of each GPU are sampled.",
        ),
    ),
)

METRICS = SectionSpec(
    "metrics",
    "Prometheus metrics (needs prometheus_client: pip install 'gpu-mon[metrics]', or Debian's "
    "python3-prometheus-client). Off unless this section is written; set one or both keys.",
    (
        Key(
            "textfile",
            "path ending in .prom",
            v.path_under,
            "",
            "A file for node-exporter's textfile collector, rewritten atomically when it changes (at most "
            "once a second) and removed when gpu-mon stops.",
            "/var/lib/prometheus/node-exporter/gpu_mon.prom",
        ),
        Key(
            "listen",
            "[ADDRESS:]PORT",
            plain(v.listen_address),
            "",
            "An HTTP endpoint, /metrics: PORT alone listens on 127.0.0.1 only; write an address to listen "
            "elsewhere (0.0.0.0:9842, [::]:9842). A port in use is an error at start.",
            "9842",
        ),
    ),
)

SENTINEL = SectionSpec(
    "sentinel",
    "The idle watchdog of `gpu-mon sentinel`, in the daemon: act once when nobody has used the GPUs for a "
    "while (e.g. power a cloud machine off). gpu-mon's own workloads are not activity; a GPU that cannot "
    "be read is. It arms once usage has been >= arm_threshold for arm_duration_seconds, then acts once "
    "when it has been < kill_threshold for kill_duration_seconds. Off unless this section is written.",
    (
        Key("arm_duration_seconds", "seconds", plain(v.seconds), "30", "How long usage must be high to arm."),
        Key("arm_threshold", "fraction, 0 to 1", plain(v.fraction), "0.7", "High usage (70% is 0.7)."),
        Key(
            "kill_duration_seconds",
            "seconds",
            plain(v.seconds),
            "300",
            "How long usage must be low, once armed, to act.",
            "3600",
        ),
        Key("kill_threshold", "fraction, 0 to 1", plain(v.fraction), "0.1", "Low usage."),
        Key(
            "kill_action",
            ", ".join(KILL_ACTIONS),
            plain(v.choice(*KILL_ACTIONS)),
            "end_process",
            "end_process (stop the daemon and its workloads, exit 0), shutdown (systemctl poweroff), reboot "
            "(systemctl reboot) or command (run `command` once, as root, no shell; its failure is logged).",
            "shutdown",
        ),
        Key(
            "command",
            "command, or empty",
            plain(v.optional(v.parse_command)),
            "",
            "What kill_action = command runs.",
            "/usr/local/sbin/on-idle",
        ),
        Key("gpus", "ALL or GPU list", plain(v.parse_gpus), "ALL", "The GPUs to watch."),
        Key(
            "aggregate",
            "mean or max",
            plain(v.choice("mean", "max")),
            "mean",
            "How GPUs combine: mean, or max (one busy GPU keeps the machine up).",
        ),
        Key("dry_run", "boolean", plain(v.boolean), "no", "Log what it would do, never do it."),
    ),
)

OCCUPY = SectionSpec(
    "occupy",
    "The admin's limits on `gpu-mon occupy on`, which any user may run without root; read from "
    "/etc/gpu_mon.conf whatever --config says (the daemon ignores them). Without this section there are no "
    "limits. If the file cannot be read, is not root's alone, or has any error, `occupy on` is refused.",
    (
        Key("users", "list of users", plain(v.names), "", f"Who may occupy, by user name. {_WHO}"),
        Key("groups", "list of groups", plain(v.names), "", f"Who may occupy, by group. {_WHO}"),
        Key(
            "max_gpus_per_user",
            "whole number, or empty",
            plain(v.optional(v.count)),
            "",
            "The most GPUs one user's occupiers may take together (an occupier of every GPU counts them "
            "all). Empty: no limit.",
            "2",
        ),
        Key(
            "max_hold_hours",
            "hours, or empty",
            plain(v.optional(v.hours)),
            "",
            "Give the GPUs back and exit after this many hours (fractions allowed), counted from when the "
            "occupier first holds them. Empty: no limit.",
            "8",
        ),
        Key(
            "require_yield",
            "boolean",
            plain(v.boolean),
            "no",
            "yes: every occupier is polite, as with --yield.",
        ),
    ),
)

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
            "keep_finished_days",
            "days",
            plain(v.seconds),
            "7",
            "Finished jobs leave the database after this many days (never sooner than fair_window_hours); "
            "checked hourly. 0: kept for ever.",
        ),
    ),
)


def _node_name(value: str) -> str:
    """One Slurm node name (letters, digits, `-`, `_`, `.`; not a list or a range)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", value):
        raise ValueError(f"{value!r} is not one Slurm node name (letters, digits, '-', '_', '.')")
    return value


def _allocation_seconds(value: str) -> float:
    """Seconds: 0 (off), or at least 1 (each read asks slurmctld about every job)."""
    number = v.seconds(value)
    if 0 < number < 1:
        raise ValueError(f"{value!r} must be 0 (not read) or at least 1")
    return number


SLURM = SectionSpec(
    "slurm",
    "Where the GPUs belong to a Slurm cluster: jobs of preemptible partitions (or QOS) yield to anyone "
    "else's use of their GPUs. gpu-mon asks Slurm to stop the job, once per job (it never signals a job's "
    "processes itself). Off unless this section is written; name at least one partition or QOS.",
    (
        Key(
            "preemptible_partitions",
            "list of partitions",
            plain(v.names),
            "",
            "Partitions whose jobs yield.",
            "scavenger",
        ),
        Key("preemptible_qos", "list of QOS", plain(v.names), "", "QOS whose jobs yield."),
        Key(
            "action",
            " or ".join(SLURM_ACTIONS),
            plain(v.choice(*SLURM_ACTIONS)),
            "requeue",
            "requeue (scontrol requeue: Slurm signals the job with its own grace and puts it back in its "
            "queue) or cancel (scancel).",
        ),
        Key(
            "signal",
            "signal name, or empty",
            plain(v.optional(v.stop_signal)),
            "",
            "A signal sent first to every process of the job through `scancel --signal=SIG --full`, e.g. "
            "USR1 so that it saves a checkpoint; the action follows signal_grace_seconds later. Empty: none.",
            "USR1",
        ),
        Key("signal_grace_seconds", "seconds", plain(v.seconds), "30", "Between the signal and the action."),
        Key(
            "avoid_node_seconds",
            "seconds",
            plain(v.seconds),
            "600",
            "A requeued job has this node added to its excluded nodes for this long, so that Slurm does not "
            "start it again on the GPU someone is using. 0: not excluded.",
        ),
        Key(
            "scontrol",
            "program",
            plain(v.program),
            "scontrol",
            "Slurm's scontrol (a name is looked up in PATH).",
        ),
        Key(
            "scancel",
            "program",
            plain(v.program),
            "scancel",
            "Slurm's scancel (a name is looked up in PATH).",
        ),
        Key(
            "timeout_seconds",
            "seconds, more than 0",
            plain(v.positive_seconds),
            "5",
            "How long a Slurm command may take before it counts as failed (one log line, tried again each "
            "round).",
        ),
        Key(
            "node_name",
            "Slurm node name, or empty",
            plain(v.optional(_node_name)),
            "",
            "This host's NodeName in Slurm, where it is not the short host name. Set: Slurm's allocations "
            "and excluded nodes name this node only. Empty: guessed (the short host name, SLURMD_NODENAME "
            "of a job's process here, or a node whose gres.conf device nodes no other node names).",
            "gpu03",
        ),
        Key(
            "allocation_seconds",
            "seconds: 0, or at least 1",
            plain(_allocation_seconds),
            "5",
            "How often Slurm's allocations are read (`scontrol show job -d -o`: every job of the cluster), "
            "so that a GPU allocated to a job counts as taken before its processes open it. 0: not read; "
            "a GPU is the job's only once its processes use it.",
        ),
    ),
)
