"""The text `gpu-mon help TOPIC` prints and gpu-mon(1) carries as its EXIT STATUS, SIGNALS, FILES and
ENVIRONMENT: written once, here. Plain text; `code` in backquotes becomes bold in the page."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

Entry = Tuple[str, str]  # (term, what it means)


@dataclass(frozen=True)
class Topic:
    """A help topic: a paragraph, entries, and the page to read for more."""

    name: str
    title: str  # the man page section's heading ('' for a topic that is not one)
    summary: str
    entries: Tuple[Entry, ...]
    more: str


EXIT_STATUS = Topic(
    "exit-codes",
    "EXIT STATUS",
    "Errors are one line on stderr naming what is wrong and where (a traceback only with `--debug`).",
    (
        ("0", "Success."),
        (
            "1",
            "A runtime failure: no daemon answers on the queue's socket, a request was refused (not allowed, "
            "a limit), another daemon already has the state file, `check` cannot read the GPUs, `report` "
            "finds no history yet, a sentinel's action failed.",
        ),
        (
            "2",
            "Bad usage or a bad config (every problem listed with its file and line). The shipped unit does "
            "not restart the daemon on it: fix the file (`gpu-mon check`), then restart.",
        ),
        ("3", "`occupy status`: no occupier of yours runs."),
        (
            "124",
            "`watch`: CMD was stopped because its GPUs stayed idle. `submit --wait`, `wait`: the job reached "
            "its `--time-limit`, or `--timeout` ran out first (the job goes on).",
        ),
        ("130", "Interrupted (Ctrl-C)."),
        (
            "other",
            "`watch` exits with CMD's own status, `submit --wait` and `wait` with the job's. `stress` "
            "stopped by a signal ends by that signal (143 in a shell for SIGTERM), whatever it was doing.",
        ),
    ),
    "man gpu-mon (EXIT STATUS)",
)

SIGNALS = Topic(
    "signals",
    "SIGNALS",
    "What `gpu-mon run` (the daemon) does on each signal; `systemctl reload gpu-mon` sends SIGHUP.",
    (
        (
            "SIGTERM, SIGINT, SIGQUIT",
            "Stop every workload (its `stop_signal`, SIGKILL after `stop_timeout_seconds`) and every running "
            "queued job (back in the queue), log what was stopped and exit 0. A second one kills what is "
            "left at once.",
        ),
        (
            "SIGHUP",
            "Re-read the config. A bad one is refused with an error in the log and the running config is "
            "kept; only workloads whose section changed are restarted.",
        ),
        ("SIGUSR1", "Log one status line (GPUs, holders, workloads)."),
        ("SIGUSR2", "Look through every process's open files at the next round (a full scan)."),
    ),
    "man gpu-mon (SIGNALS)",
)

FILES = Topic(
    "files",
    "FILES",
    "The places gpu-mon reads and writes by default; the config can move each of them.",
    (
        ("/etc/gpu_mon.conf", "The config (`--config`, GPU_MON_CONFIG). Its keys: gpu_mon.conf(5)."),
        ("/etc/gpu_mon.conf.d/*.conf", "Drop-ins, read after /etc/gpu_mon.conf in name order."),
        ("/run/gpu_mon/state.json", "The daemon's state, read by `gpu-mon status` ([defaults] state_file)."),
        (
            "/run/gpu_mon/queue.sock",
            "The queue's socket: users' commands reach the daemon here ([queue] socket).",
        ),
        ("/var/lib/gpu_mon/queue.sqlite", "The queue's jobs, root's alone ([queue] database)."),
        (
            "/run/gpu_mon/UNIT.env, UNIT.err",
            "Where jobs are systemd units: a run's environment for systemd (never on a command line) and "
            "what its start said; root's alone, removed when the run ends.",
        ),
        ("/var/lib/gpu_mon/history.sqlite", "The history `gpu-mon report` reads ([history] path)."),
        ("/var/log/gpu-mon/", "For workloads' `log =` files (created by the shipped unit)."),
        ("~/.local/state/gpu-mon/jobs/ID.log", "A queued job's output without `--output`."),
        ("$XDG_STATE_HOME/gpu-mon/occupy/", "`occupy`'s state and log (~/.local/state when unset)."),
        (
            "/tmp/gpu-mon-occupiers/",
            "Every user's running occupier, for `occupy status --all` and the limits.",
        ),
    ),
    "man gpu-mon (FILES)",
)

ENVIRONMENT = Topic(
    "environment",
    "ENVIRONMENT",
    "Variables gpu-mon reads, and those it gives a queued job.",
    (
        ("GPU_MON_CONFIG", "The config to read when `--config` is not given."),
        ("GPU_MON_SIM", "Simulated GPUs from this JSON file instead of NVML, as `--sim` (tests, demos)."),
        ("GPU_MON_SYSTEM_CONFIG", "root only: the config whose [occupy] limits `occupy` obeys."),
        ("GPU_MON_OCCUPIERS_DIR", "root only: where occupiers register instead of /tmp/gpu-mon-occupiers."),
        ("XDG_STATE_HOME", "Where `occupy` keeps its state (default ~/.local/state)."),
        (
            "NOTIFY_SOCKET, WATCHDOG_USEC, JOURNAL_STREAM",
            "Set by systemd: readiness and watchdog pings, and log lines with their priority.",
        ),
        (
            "CUDA_VISIBLE_DEVICES, GPU_MON_JOB_ID, GPU_MON_JOB_REF, GPU_MON_RESTART_COUNT",
            "Given to a queued job: its GPUs' UUIDs, its own number, its name as `jobs` gives it (17, an "
            "array's element 17_5) and how many times it was stopped and rerun.",
        ),
    ),
    "man gpu-mon (ENVIRONMENT)",
)

CONFIG = Topic(
    "config",
    "",
    "The daemon reads /etc/gpu_mon.conf (`--config PATH` or GPU_MON_CONFIG for another), then "
    "/etc/gpu_mon.conf.d/*.conf. Sections: [defaults], [gpu-NAME], [process-NAME], [tty], [queue], "
    "[occupy], [history], [metrics], [sentinel], [slurm]. Unknown keys are errors. `gpu-mon check` reports "
    "every problem with its file and line; `systemctl reload gpu-mon` applies a change.",
    (),
    "man gpu_mon.conf; /usr/share/doc/gpu-mon/examples/gpu_mon.conf",
)

QUEUE = Topic(
    "queue",
    "",
    "Queue your own jobs to run on GPUs nobody else uses: `gpu-mon submit -- CMD`, then `jobs`, `logs ID`, "
    "`cancel ID`, `hold ID`, `release ID`. A job yields when someone else needs its GPU: it gets its stop "
    "signal (`--stop-signal USR1` to checkpoint), SIGKILL after the grace, and goes back to the queue. "
    "The admin's `gpu-mon queue drain` stops new starts for maintenance (`gpu-mon queue --help`).",
    (),
    "man gpu-mon-queue",
)

TOPICS = (CONFIG, QUEUE, EXIT_STATUS, SIGNALS, FILES, ENVIRONMENT)
MAN_SECTIONS = (EXIT_STATUS, SIGNALS, FILES, ENVIRONMENT)


def text(topic: Topic, width: int = 100) -> str:
    """The topic as `gpu-mon help TOPIC` prints it."""
    import textwrap

    def wrap(s: str, indent: str = "") -> str:
        return textwrap.fill(
            s.replace("`", ""), width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
        )

    lines = [wrap(topic.summary), ""]
    for term, what in topic.entries:
        lines += [term, wrap(what, "    ")]
    if topic.entries:
        lines.append("")
    lines.append(f"More: {topic.more}")
    return "\n".join(lines) + "\n"
