"""The keys of the sections the daemon's watching and workloads read: [defaults], [gpu-NAME],
[process-NAME], [tty]. Each key's parser, default and doc are here and only here."""

from __future__ import annotations

from gpu_mon.config import values as v
from gpu_mon.config.key import Key, SectionSpec, plain

DEFAULTS = SectionSpec(
    "defaults",
    "Timings and files of the daemon itself; every key may be left out.",
    (
        Key(
            "interval_seconds",
            f"seconds, at least {v.MIN_INTERVAL_SECONDS:g}",
            plain(v.at_least(v.MIN_INTERVAL_SECONDS)),
            "2",
            "Polling fallback: read NVML (processes, memory) and look for new GPU holders this often. "
            "Opening a GPU's device node is seen at once (inotify); polling catches what inotify cannot "
            "(the first open of a container's own /dev node, NVML-only use, memory used by processes in "
            "other PID namespaces).",
            "0.5",
        ),
        Key(
            "start_delay_seconds",
            "seconds",
            plain(v.seconds),
            "60",
            "A GPU must stay free this long before a workload starts on it (also bridges a user's gap "
            "between jobs).",
        ),
        Key(
            "stop_timeout_seconds",
            "seconds, more than 0",
            plain(v.positive_seconds),
            "10",
            "A stop sends the workload's stop_signal (and SIGCONT), then SIGKILL to every process it started "
            "after this long. This full grace is for a terminal user, a reload and a shutdown of gpu-mon. "
            "Under systemd the unit allows 30 s for the whole stop (TimeoutStopSec=): above about 25 s "
            "here, raise TimeoutStopSec too.",
        ),
        Key(
            "urgent_stop_timeout_seconds",
            "seconds, more than 0",
            plain(v.positive_seconds),
            "2",
            "The grace when a foreign process opens the GPU (it is about to allocate memory); never longer "
            "than stop_timeout_seconds.",
        ),
        Key(
            "restart_delay_seconds",
            f"seconds, at least {v.MIN_RESTART_DELAY_SECONDS:g}",
            plain(v.at_least(v.MIN_RESTART_DELAY_SECONDS)),
            "10",
            "A workload that exits by itself is started again after this long. Each further exit within "
            "healthy_run_seconds of its start doubles the delay, up to restart_delay_max_seconds.",
        ),
        Key(
            "restart_delay_max_seconds",
            "seconds, at least restart_delay_seconds",
            plain(v.seconds),
            "600",
            "The longest delay before a workload that keeps exiting is started again.",
        ),
        Key(
            "healthy_run_seconds",
            "seconds",
            plain(v.seconds),
            "60",
            "A run that lasts this long resets the restart delay to restart_delay_seconds.",
        ),
        Key(
            "full_scan_seconds",
            f"seconds, at least {v.MIN_FULL_SCAN_SECONDS:g}",
            plain(v.at_least(v.MIN_FULL_SCAN_SECONDS)),
            "60",
            "Between polls only processes whose open-file count or thread count changed are re-read (Linux "
            ">= 6.2); a full scan of the open files and memory maps of every process that ran since it was "
            "last read runs this often as well.",
        ),
        Key(
            "watch_opens",
            "boolean",
            plain(v.boolean),
            "yes",
            "React at once when a GPU's device node is opened (inotify). `no` leaves only polling every "
            "interval_seconds, which is how the older tools worked: a new job may then allocate before "
            "gpu-mon yields.",
        ),
        Key(
            "state_file",
            "path",
            v.path_under,
            "/run/gpu_mon/state.json",
            "Where the daemon writes what `gpu-mon status` shows. It also holds STATE_FILE.lock for its "
            "whole life: a second daemon with the same state_file exits at once. Its directory must not be "
            "writable by other users (unless sticky). A reload does not change it.",
        ),
        Key(
            "containment",
            "auto, cgroup or subreaper",
            plain(v.choice("auto", "cgroup", "subreaper")),
            "auto",
            "How a stop reaches every process a workload started: `cgroup` puts each workload in a cgroup v2 "
            "group of its own and ends it with cgroup.kill (needs a writable cgroup2 mount); `subreaper` "
            "kills every descendant again and again until none is left; `auto` uses cgroup where the daemon "
            "may create groups, else subreaper. Fixed at start.",
            "subreaper",
        ),
    ),
)

GPU = SectionSpec(
    "gpu-NAME",
    "Which GPUs to watch and what does not make them busy (any number of sections; each GPU in at most "
    "one). GPUs named by no [gpu-*] section are never used.",
    (
        Key(
            "gpus",
            "ALL or GPU list",
            plain(v.parse_gpus),
            "",
            "ALL, or a comma-separated list of NVML indices (as `nvidia-smi` shows them) and/or UUIDs "
            "(GPU-...).",
            "ALL",
            required=True,
        ),
        Key(
            "ignore_programs",
            "list of names",
            plain(v.names),
            "",
            "Programs that do not make a GPU busy by holding it (comma-separated process names, as `ps -o "
            "comm` shows them). Any user can give a process any name, so list only names you trust. "
            "nvidia-smi, nvidia-persistenced, nv-hostengine and dcgm-exporter are always ignored when they "
            "run a root-owned executable of that name.",
            "nvitop,gpustat",
        ),
        Key(
            "ignore_users",
            "list of users",
            plain(v.names),
            "",
            "Users whose processes do not make a GPU busy.",
        ),
        Key(
            "busy_memory_mib",
            "MiB",
            plain(v.mib),
            "1024",
            "A GPU is also busy when memory used by processes that are not gpu-mon's exceeds this. This "
            "catches use that gpu-mon cannot see as a process (containers with their own PID namespace).",
        ),
        Key(
            "holder_grace_seconds",
            "seconds, or empty",
            plain(v.optional(v.seconds)),
            "",
            "Off by default (every holder counts). With N seconds: a process that holds the device node but "
            "that NVML has not shown on the GPU within N seconds of being first seen stops counting "
            "(monitors such as nvitop). It counts again as soon as NVML shows it.",
            "45",
        ),
        Key(
            "idle_holder_seconds",
            "seconds",
            plain(v.seconds),
            "7200",
            "A process that is not gpu-mon's holding at least idle_holder_memory_mib of a GPU at no more "
            "than idle_holder_utilization_pct for this long is reported as an idle holder (log, `gpu-mon "
            "status`, history, `gpu-mon report --by user`). It is never signalled.",
        ),
        Key(
            "idle_holder_memory_mib",
            "MiB",
            plain(v.mib),
            "1024",
            "The least memory an idle holder holds.",
        ),
        Key(
            "idle_holder_utilization_pct",
            "percent, 0 to 100",
            plain(v.percent),
            "1",
            "The most utilization an idle holder shows (its own per-process utilization; the GPU's when the "
            "driver cannot sample processes and it is the GPU's only process).",
        ),
        Key(
            "idle_holder_command",
            "command, or empty",
            plain(v.optional(v.parse_command)),
            "",
            "A command run once when an idle-holder episode starts on one of these GPUs, e.g. to mail the "
            "user: split like cmd, run without a shell as the daemon's user, with GPU_MON_IDLE_USER, "
            "GPU_MON_IDLE_PID, GPU_MON_IDLE_GPU, GPU_MON_IDLE_MEMORY_MIB and GPU_MON_IDLE_SECONDS set; "
            "killed after 60 s. Empty: nothing runs.",
            "/usr/local/sbin/mail-idle-holder",
        ),
    ),
)

PROCESS = SectionSpec(
    "process-NAME",
    "A workload to run while its GPUs are free (any number of sections).",
    (
        Key(
            "cmd",
            "command",
            plain(v.parse_command),
            "",
            "The command, split like a shell would (quotes work) but run without a shell (at most 64 KiB). "
            "Use a full path: the workload's PATH is the plain /usr/local/bin:/usr/bin:/bin.",
            "/usr/bin/gpu-mon stress --memory 88%",
            required=True,
        ),
        Key("dir", "path", v.path_under, "/", "Working directory.", "/srv/miner"),
        Key(
            "gpus",
            "ALL or GPU list",
            plain(v.parse_gpus),
            "ALL",
            "The GPUs it needs (ALL = every watched GPU). All of them must be free for it to start; any of "
            "them turning busy stops it. It sees exactly these GPUs: CUDA_VISIBLE_DEVICES=<their UUIDs>.",
            "0,1",
        ),
        Key(
            "log",
            "path, or empty",
            lambda base: v.optional(v.path_under(base)),
            "",
            "Append stdout and stderr to this file (created 0640, never through a symlink). Default: the "
            "daemon's log, one line per output line, tagged with the workload's name.",
            "/var/log/gpu-mon/miner.log",
        ),
        Key(
            "user",
            "user name",
            plain(str),
            "nobody",
            "Whom it runs as; root only when written explicitly (with a warning). Supplementary groups are "
            "the user's own; the daemon's are dropped.",
        ),
        Key("group", "group name, or empty", plain(str), "", "Its group. Empty: the user's primary group."),
        Key(
            "env",
            "NAME=VALUE words",
            plain(v.environment),
            "",
            "Extra environment variables, NAME=VALUE separated by blanks (quote values with blanks). The "
            "workload otherwise gets a clean environment: PATH, HOME, USER, LOGNAME, SHELL, LANG, "
            "GPU_MON_PROCESS, CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER=PCI_BUS_ID.",
            'POOL="a b" THREADS=4',
        ),
        Key(
            "per_gpu",
            "boolean",
            plain(v.boolean),
            "no",
            "yes: one copy per GPU in `gpus`, each with its own single GPU, started and stopped "
            "independently.",
        ),
        Key(
            "stop_signal",
            "signal name",
            plain(v.stop_signal),
            "SIGTERM",
            "How it is asked to stop: this signal to its main process group, then (if it is not SIGTERM) "
            "SIGTERM once the grace is over, SIGKILL 1 s later. SIGUSR1 suits a workload that checkpoints "
            f"and exits on it. One of {', '.join(v.STOP_SIGNALS)}. A reload applies it to running "
            "workloads.",
            "SIGUSR1",
        ),
        Key(
            "stop_timeout_seconds",
            "seconds, or empty",
            plain(v.optional(v.positive_seconds)),
            "",
            "Its full grace; empty: [defaults] stop_timeout_seconds. A reload applies it to running "
            "workloads.",
            "60",
        ),
        Key(
            "urgent_stop_timeout_seconds",
            "seconds, or empty",
            plain(v.optional(v.positive_seconds)),
            "",
            "Its grace when a foreign process opens its GPU; empty: [defaults] urgent_stop_timeout_seconds. "
            "A reload applies it to running workloads.",
            "5",
        ),
    ),
)

TTY = SectionSpec(
    "tty",
    "Pause every workload while a terminal user is active.",
    (
        Key(
            "enabled",
            "boolean",
            plain(v.boolean),
            "no",
            "Stop every workload while a user who is not on the whitelist is active at a terminal.",
        ),
        Key(
            "whitelist",
            "list of users",
            plain(v.names),
            "",
            "Users who never pause work (comma-separated), e.g. the admins.",
            "root,alice",
        ),
        Key(
            "idle_seconds",
            "seconds",
            plain(v.seconds),
            "300",
            "A user who typed at a terminal within this many seconds is active (input only: a program's "
            "output to the terminal does not count).",
        ),
        Key(
            "devices",
            "globs",
            plain(v.globs),
            "/dev/pts/* /dev/tty[0-9]*",
            "Terminal devices to look at (globs, blank-separated).",
            "/dev/pts/* /dev/ttyS*",
        ),
    ),
)
