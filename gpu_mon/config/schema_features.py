"""The keys of the sections that turn on a feature: [history], [metrics], [sentinel], [occupy], [slurm]
([queue]'s are in schema_queue.py). Each key's parser, default and doc are here and only here."""

from __future__ import annotations

import re

from gpu_mon.config import values as v
from gpu_mon.config.key import Key, SectionSpec, plain
from gpu_mon.config.model import KILL_ACTIONS, SLURM_ACTIONS

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
