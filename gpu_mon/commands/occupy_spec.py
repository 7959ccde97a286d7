"""`gpu-mon occupy` as a config for the one engine: a user's reservation is a daemon run with an in-memory
config, so it waits, yields, contains and restarts exactly as the daemon does. Pure: no I/O here.

- waiting: every target GPU free (no foreign holder the user can see, no foreign NVML context, memory used
  by others at most --mem-threshold) for --wait-minutes in a row: the daemon's start delay. A GPU that
  cannot be read is busy. Processes of other users, whose files a plain user cannot read, do not count by
  themselves: what they do on a GPU shows in NVML's process list and memory, and their opens of a GPU's
  node as unseen opens (engine/openers.py), which make it busy for the start delay.
- occupying: one stressor per GPU (`per_gpu`, started together), or CMD once with all the GPUs.
- a GPU that runs a job of gpu-mon's queue (anyone's) is busy: the daemon's state file lists them.
- hold (the default, as the original) never gives a GPU back; --yield stops everything as soon as anyone
  else uses one of the GPUs, waits again, and takes them back.
"""

from __future__ import annotations

import os
import pwd
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from gpu_mon.config import (
    Config,
    Defaults,
    GpuSection,
    GpuSelection,
    HistorySection,
    ProcessSection,
    TtySection,
)

NAME = "occupy"


@dataclass(frozen=True)
class OccupySpec:
    """What `occupy on` was asked for (JSON-able: the background occupier gets it as one argument)."""

    gpus: List[object] = field(default_factory=list)  # NVML indices and UUIDs; empty: every GPU
    memory: Optional[str] = None  # the stressor's --memory (88%, 20GiB); None: its default
    mem_threshold_gib: float = 1.0
    wait_minutes: float = 5.0
    refresh_minutes: float = 0.05
    compute_min: float = 30.0
    sleep_min: float = 5.0
    no_compute: bool = False
    polite: bool = False  # --yield
    argv: List[str] = field(default_factory=list)  # -- CMD; empty: the built-in stressor
    sim: Optional[str] = None
    ignore_programs: List[str] = field(default_factory=list)  # from --config's [gpu-*] sections
    ignore_users: List[str] = field(default_factory=list)
    cwd: str = "/"
    env: Dict[str, str] = field(default_factory=dict)
    # Set by `on` from the system config's [occupy] (never from the user's options): give the GPUs back
    # and exit after this long, counted from when it first occupies; where the limit was read.
    max_hold_hours: Optional[float] = None
    limits_from: str = ""
    # The state file of the daemon whose queue jobs' GPUs are not free (commands/occupy_queue.py); "": none
    daemon_state: str = ""

    @property
    def mode(self) -> str:
        """`yield` or `hold`."""
        return "yield" if self.polite else "hold"

    @property
    def what(self) -> str:
        """`stressor (compute 30 min, sleep 5 min)`, `stressor (memory only)` or `CMD`."""
        if self.argv:
            return " ".join(self.argv)
        if self.no_compute:
            return "stressor (memory only)"
        return f"stressor (compute {self.compute_min:g} min, sleep {self.sleep_min:g} min)"


def stressor_argv(spec: OccupySpec) -> Tuple[str, ...]:
    """The built-in stressor with the duty cycle (or memory only) the spec asks for."""
    argv = [sys.executable, "-m", "gpu_mon", "stress", "--report-seconds", "60"]
    if spec.memory:
        argv += ["--memory", spec.memory]
    if spec.no_compute:
        argv += ["--workload", "none"]
    else:
        argv += [
            "--compute-seconds",
            f"{spec.compute_min * 60:g}",
            "--sleep-seconds",
            f"{spec.sleep_min * 60:g}",
        ]
    return tuple(argv)


def config(spec: OccupySpec, state_dir: str) -> Config:
    """The daemon's config for this reservation (run as the current user; no [tty])."""
    selection = GpuSelection(refs=tuple(spec.gpus)) if spec.gpus else GpuSelection(all=True)
    defaults = Defaults(
        interval_seconds=max(0.1, spec.refresh_minutes * 60),
        start_delay_seconds=spec.wait_minutes * 60,
        state_file=os.path.join(state_dir, "state.json"),
    )
    rules = GpuSection(
        name=NAME,
        gpus=selection,
        busy_memory_mib=int(spec.mem_threshold_gib * 1024),
        ignore_programs=tuple(spec.ignore_programs),
        ignore_users=tuple(spec.ignore_users),
        unreadable_is_busy=False,
    )
    return Config(
        path="(gpu-mon occupy)",
        defaults=defaults,
        gpu_sections=(rules,),
        processes=(_process(spec, selection),),
        tty=TtySection(enabled=False),
        history=HistorySection(enabled=False),
    )


def _process(spec: OccupySpec, selection: GpuSelection) -> ProcessSection:
    me = pwd.getpwuid(os.getuid())
    env = tuple((k, v) for k, v in sorted(spec.env.items()) if k not in ("CUDA_VISIBLE_DEVICES",))
    return ProcessSection(
        name=NAME,
        cmd=tuple(spec.argv) or stressor_argv(spec),
        gpus=selection,
        dir=spec.cwd,
        user=me.pw_name,
        uid=me.pw_uid,
        gid=os.getgid(),
        groups=tuple(os.getgroups()),
        home=me.pw_dir,
        env=env,
        per_gpu=not spec.argv,
        together=True,
        hold=not spec.polite,
    )
