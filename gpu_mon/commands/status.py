"""`gpu-mon status`: the running daemon's view (found through its lock), or a single look at the host when
no daemon runs; either way with every user's occupier (`gpu-mon occupy`) and only the terminals someone is
logged in on."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from typing import Dict, List, Optional

from gpu_mon.api import logins, occupiers, procfs
from gpu_mon.api.observe import Backend, look
from gpu_mon.commands import base
from gpu_mon.config import DEFAULT_PATH, Config, Defaults, TtySection
from gpu_mon.engine import lock
from gpu_mon.outputs import statefile
from gpu_mon.outputs import status as report
from gpu_mon.policy import decide as policy
from gpu_mon.policy.decisions import PolicyState


def fresh_look(config: Optional[Config], backend: Backend, source: str) -> dict:
    """The status document of one look at the host, decided with the config's rules (or none)."""
    tty = config.tty if config else TtySection()
    snap = look(backend, tty.devices)
    backend.close()
    cfg = config or Config(path="(none)")
    plan = policy.resolve(cfg, snap.reading.gpus) if not snap.reading.error else policy.Plan({}, (), {})
    decision = policy.decide(cfg, plan, snap, PolicyState())
    return report.build(config, plan, snap, decision, source=source)


def daemon_state(state_file: str) -> Optional[dict]:
    """The state a live daemon publishes: only while the lock beside it is held by that very daemon."""
    holder = lock.holder(state_file)
    if holder is None:
        return None
    doc = statefile.read_live(state_file)
    if doc is None or (holder > 0 and doc["daemon"].get("pid") != holder):
        return None
    return doc


def other_daemons(proc: str = procfs.PROC) -> List[Dict[str, object]]:
    """Running `gpu-mon ... run` processes and the config each was given (for a hint)."""
    found = []
    for pid in procfs.list_pids(proc):
        try:
            with open(f"{proc}/{pid}/cmdline", "rb") as f:
                argv = [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if "run" not in argv or not any(a.endswith(("gpu-mon", "gpu_mon")) for a in argv[:3]):
            continue
        config = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else DEFAULT_PATH
        if not os.path.isabs(config):
            with contextlib.suppress(OSError):
                config = os.path.join(os.readlink(f"{proc}/{pid}/cwd"), config)
        found.append({"pid": int(pid), "config": os.path.normpath(config)})
    return found


def cmd_status(args: argparse.Namespace) -> int:
    """`gpu-mon status`: the daemon's view, or one fresh look when no daemon runs."""
    config = base.load_config(args, required=False)
    state_file = config.defaults.state_file if config else Defaults().state_file
    doc = daemon_state(state_file)
    if doc is None:
        backend, source = base.backend(args)
        doc = report.no_countdowns(fresh_look(config, backend, source))
        doc["looked_for"] = state_file
        doc["other_daemons"] = other_daemons()
        if config is None:
            doc["config"] = f"{DEFAULT_PATH} (missing: showing the host only)"
    report.logged_in_terminals(doc, logins.logged_in_lines())
    doc["occupiers"] = occupiers.list_occupiers()
    print(
        json.dumps(report.with_idle_seconds(doc, time.time()), indent=2) if args.json else report.render(doc)
    )
    return base.EXIT_FAILURE if doc.get("error") and not doc.get("daemon") else base.EXIT_OK
