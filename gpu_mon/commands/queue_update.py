"""`gpu-mon update JOB...` (Slurm's `scontrol update`) and `gpu-mon share` (Slurm's `sshare`): one request
each over the queue's socket (commands/queue.py sends it, with its `ask`); the daemon decides and says why
(queue/update.py, queue/share.py)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, List

from gpu_mon.api.text import sanitize
from gpu_mon.commands import base
from gpu_mon.commands.base import CliError
from gpu_mon.queue import afterspec

Ask = Callable[[str, dict], dict]
Said = Callable[[List[dict], Callable[[dict, str], str]], int]  # queue.said: the results, a line each


def add_arguments(sub: argparse._SubParsersAction, add_common: Callable[..., None], job_id: Callable) -> None:
    """`update` and `share`; job_id: how an ID argument is read (as cancel reads it)."""
    p = sub.add_parser(
        "update",
        help="change a queued job: priority, time limit, GPUs, dependencies, name",
        description="Change your queued or held jobs (17: a job, or every waiting element of array 17; "
        "17_5: one element), as Slurm's `scontrol update`. Each change is checked as `submit` checks it. "
        "A plain user may only lower a priority (root may raise it); --time-limit stays within the "
        "queue's max_time_limit; a running job may change only its --name and --time-limit. One line per "
        "job; exit 1 when one was refused.",
    )
    add_common(p, top=False, sim=False)
    p.add_argument("--priority", type=int, metavar="P", help="the new priority (a plain user: lower only)")
    p.add_argument("--time-limit", metavar="DURATION", help="the new time limit (90, 30m, 2h, 1d)")
    p.add_argument("--gpus", type=int, metavar="N", help="the GPUs it needs")
    p.add_argument(
        "--after",
        metavar="DEPS",
        help="its new dependencies, as submit --after takes them (afterok:17, afterany:17_5, ...; '' none)",
    )
    p.add_argument("--name", help="its new name")
    p.add_argument("ids", nargs="+", type=job_id, metavar="ID")
    p = sub.add_parser(
        "share",
        help="each user's GPU use and place in the fair order",
        description="Each user's GPU-hours over the queue's fair window, their place in the order queued "
        "jobs take free GPUs (1: next), and their running, queued and held jobs, as Slurm's `sshare`. "
        "Everyone's, unless the admin set [queue] share_public = no (then your own; root sees all).",
    )
    add_common(p, top=False, sim=False)
    p.add_argument("--json", action="store_true", help="machine-readable output")


def update(args: argparse.Namespace, socket: str, ask: Ask, said: Said) -> int:
    """Send the update; a line per job named (`said`)."""
    from gpu_mon.config.values import duration

    req: dict = {"op": "update", "ids": list(args.ids)}
    if args.priority is not None:
        req["priority"] = args.priority
    if args.gpus is not None:
        req["gpus"] = args.gpus
    if args.name is not None:
        req["name"] = args.name
    try:
        if args.time_limit is not None:
            req["time_limit"] = duration(args.time_limit)
        if args.after is not None:
            req["after"] = afterspec.parse(args.after)
    except ValueError as err:
        what = str(err) if str(err).startswith("--") else f"--time-limit: {err}"
        raise CliError(what) from None
    if len(req) == 2:
        raise CliError("update: nothing to change (--priority, --time-limit, --gpus, --after or --name)")
    results = ask(socket, req)["results"]
    return said(results, lambda r, of: f"updated ({f'{of}: ' if of else ''}{r['state']})")


def share(args: argparse.Namespace, socket: str, ask: Ask) -> int:
    """The table (or --json)."""
    answer = ask(socket, {"op": "share"})
    users: List[dict] = answer["users"]
    if args.json:
        keys = ("order", "window_hours", "everyone", "users")
        print(json.dumps({k: answer.get(k) for k in keys}))
        return base.EXIT_OK
    hours = float(answer.get("window_hours") or 0)
    order = answer.get("order")
    head = f"{order} order; GPU-hours over the last {hours:g} h; place 1 gets the next free GPU"
    rows = [("PLACE", "USER", "GPU-HOURS", "RUNNING", "GPUS", "QUEUED", "HELD")]
    for u in users:
        place = u.get("place")
        rows.append(
            (
                str(place) if place is not None else "-",
                sanitize(str(u["user"]), limit=32),
                f"{float(u['gpu_hours']):.2f}",
                str(u["running"]),
                str(u["gpus_running"]),
                str(u["queued"]),
                str(u["held"]),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head, *("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)]
    if len(rows) == 1:
        lines.append("no use in the window and no jobs")
    if not answer.get("everyone"):
        lines.append("(your line only: the admin keeps the others' to root, [queue] share_public = no)")
    sys.stdout.write("\n".join(lines) + "\n")
    return base.EXIT_OK
