"""`gpu-mon submit`, `jobs`, `cancel`, `hold`, `release`, `logs`, `wait`: the queue's front door, run by the
user; and the admin's `gpu-mon queue drain|resume`.

Each command is one request over the daemon's socket ([queue] socket); the daemon knows the user from the
kernel, never from what we send. The job's output file, and its default directory, are made by the job's
own wrapper as the user (queue/runner.py), never here: the daemon knows the user's home, we only $HOME.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple, Union

from gpu_mon.api.text import sanitize
from gpu_mon.commands import base, queue_show, queue_update
from gpu_mon.commands.base import CliError
from gpu_mon.config import DEFAULT_PATH, QueueSection
from gpu_mon.queue import arrays
from gpu_mon.queue import jobs as J
from gpu_mon.queue.protocol import DEFAULT_OUTPUT, NoDaemon, ProtocolError, request

EXIT_TIMEOUT = 124
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_POLL_SECONDS = 0.5
TABLE_WAITING = 100  # queued or held jobs the table lists without --all (--json lists every one)


def add_arguments(sub: argparse._SubParsersAction, add_common: Callable[..., None]) -> None:
    """The queue's commands."""
    p = sub.add_parser(
        "submit",
        help="queue a command to run as you on free GPUs, yielding to anyone else's use",
        description="Queue COMMAND to run as you, in this directory, with this environment, on GPUs nobody "
        "else uses ([queue] in the daemon's config). It gets CUDA_VISIBLE_DEVICES (GPU UUIDs), "
        "GPU_MON_JOB_ID, GPU_MON_JOB_REF (its name: 17, an element 17_5) and GPU_MON_RESTART_COUNT. When "
        "someone else uses one of its GPUs it gets its stop signal, SIGKILL after the grace, and goes back "
        "to the queue. Prints `job ID queued (N ahead)`; "
        "exit 1 when refused, 2 on bad usage; with --wait the job's own exit status (124: time limit).",
    )
    add_common(p, top=False, sim=False)
    _add(p, _SUBMIT_OPTIONS)
    _add_timeout(p, "with --wait: ")
    _add(p, _SUBMIT_LAST)
    p = sub.add_parser("jobs", help="the queue's jobs and why each waits", description="List the queue.")
    add_common(p, top=False, sim=False)
    _add(p, _JOBS_OPTIONS)
    for name, what in (("cancel", "cancel your"), ("hold", "hold your"), ("release", "release your held")):
        p = sub.add_parser(
            name,
            help=f"{what} jobs",
            description=f"{what.capitalize()} jobs: those named (17: a job or a whole array; 17_5: one "
            "element; '17_[0-3,8]': those elements), or every one of yours that --name, --state or --all "
            "selects (the daemon picks them, in one go, and says how many). Root selects only its own jobs "
            "unless --user names another user ('*': every user). Exit 1 when nothing matched.",
        )
        add_common(p, top=False, sim=False)
        p.add_argument("--name", help="your jobs with this name (every element of a named array)")
        p.add_argument("--state", choices=J.STATES, help="your jobs in this state")
        p.add_argument("--all", action="store_true", help="all your jobs (that it applies to)")
        p.add_argument("--user", help="root: select this user's jobs instead ('*': every user's)")
        p.add_argument("ids", nargs="*", type=_job_id, metavar="ID")
    p = sub.add_parser("logs", help="a job's output", description="Print a job's output file.")
    add_common(p, top=False, sim=False)
    p.add_argument("id", type=_job_id, metavar="ID")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    _add_wait(sub, add_common)
    p = sub.add_parser(
        "queue",
        help="the admin's: drain the queue (no job starts) or resume it",
        description="drain: no queued job starts (running jobs go on), for maintenance; resume: jobs start "
        "again. Root only (or the daemon's own user); a drain lasts across a restart of the daemon. "
        "`jobs` and `status` say who drained it, and when.",
    )
    add_common(p, top=False, sim=False)
    p.add_argument("action", choices=("drain", "resume"))
    queue_show.add_arguments(sub, add_common, _job_id)
    queue_update.add_arguments(sub, add_common, _job_id)


def _add_wait(sub: argparse._SubParsersAction, add_common: Callable[..., None]) -> None:
    """`wait`."""
    p = sub.add_parser(
        "wait",
        help="wait until jobs end",
        description="Wait until every job named (17: a job or a whole array; 17_5: one element; "
        "'17_[0-3,8]': those elements) has ended. "
        "Exit 0 when all are done, else the first failure's status as `submit --wait` gives it "
        "(124: time limit; 1: cancelled or preempted; an array with an element cancelled is not done: "
        "exit 1); with --any-end, 0 once all have ended, whatever the end. Waiting outlives a restart of "
        "the daemon: one line on stderr says so and it waits on (for ever, without --timeout, if no daemon "
        "comes back).",
    )
    add_common(p, top=False, sim=False)
    _add_timeout(p, "")
    p.add_argument(
        "--any-end",
        action="store_true",
        help="exit 0 once every job has ended, done or not (`wait --any-end 17 && python3 collect.py`)",
    )
    p.add_argument("ids", nargs="+", type=_job_id, metavar="ID")


def _add_timeout(p: argparse.ArgumentParser, prefix: str) -> None:
    p.add_argument(
        "--timeout",
        metavar="DURATION",
        help=f"{prefix}stop waiting after this long (90, 30m, 2h): exit 124, the jobs go on",
    )


COMMANDS = ("submit", "jobs", "cancel", "hold", "release", "logs", "wait", "queue", "show", "update", "share")


def cmd_queue(args: argparse.Namespace) -> int:
    """Run one of the queue commands."""
    named = getattr(args, "id", None)
    _ranges_checked([*(getattr(args, "ids", None) or []), *([named] if named is not None else [])])
    socket = socket_path(args)
    handler = {
        "submit": _submit,
        "jobs": _jobs,
        "cancel": _change,
        "hold": _change,
        "release": _change,
        "logs": _logs,
        "wait": lambda a, s: _wait(_Waiting(a, s), list(a.ids), a.any_end),
        "queue": _drain,
        "show": lambda a, s: queue_show.run(a, s, _ask),
        "update": lambda a, s: queue_update.update(a, s, _ask, said),
        "share": lambda a, s: queue_update.share(a, s, _ask),
    }[args.command]
    try:
        return handler(args, socket)
    except NoDaemon as err:
        raise CliError(str(err), base.EXIT_FAILURE) from None
    except ProtocolError as err:
        raise CliError(str(err), base.EXIT_USAGE) from None


def socket_path(args: argparse.Namespace) -> str:
    """The socket the config names; the default one when the config cannot be read (a user may not be
    able to read /etc/gpu_mon.conf); an error when the config has no [queue]."""
    path, explicit = base.config_path(args)
    if not explicit and not os.access(path, os.R_OK):
        return QueueSection().socket
    config = base.load_config(args, required=explicit)
    if config is None:
        return QueueSection().socket
    if config.queue is None:
        raise CliError(f"the queue is off: {path or DEFAULT_PATH} has no [queue] section", base.EXIT_FAILURE)
    return config.queue.socket


def _ask(socket: str, req: dict) -> dict:
    """The daemon's answer (`_answer`); why it came late, one line on stderr (the daemon slowed this
    user's requests: `wait`, asking again and again, does not say it)."""
    answer = _answer(request(socket, req))
    if answer.get("slowed"):
        print(f"gpu-mon: {sanitize(str(answer['slowed']))}", file=sys.stderr)
    return answer


def _answer(answer: dict) -> dict:
    """The daemon's answer; its refusal as one line, with its exit status."""
    if not answer.get("ok"):
        raise CliError(sanitize(str(answer.get("error", "refused"))), int(answer.get("code", 1)))
    return answer


# ------------------------------------------------------------------ submit


def _submit(args: argparse.Namespace, socket: str) -> int:
    command = list(args.argv)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise CliError("submit: no command given (gpu-mon submit [OPTIONS] -- COMMAND [ARGS...])")
    if args.timeout is not None and not args.wait:
        raise CliError("submit: --timeout is how long --wait waits: give --wait too")
    waiting = _Waiting(args, socket)  # (a bad --timeout is refused before the job is queued)
    req = {
        "op": "submit",
        "command": command,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "name": args.name,
        "gpus": args.gpus,
        "priority": args.priority,
        "after": _after(args.after),
        "array": args.array,
        "notify": args.notify or "",
        "notify_each": args.notify_each,
        "stop_signal": _stop_signal(args.stop_signal),
        "stop_main_only": args.stop_main_only or args.stop_signal.upper().startswith("B:"),
        "time_limit": _duration(args.time_limit, "--time-limit") if args.time_limit else None,
        "output": os.path.abspath(args.output) if args.output else "",
        "requeue": not args.no_requeue,
        "hold": args.hold,
    }
    if args.grace is not None:
        req["grace"] = args.grace
    if args.array is not None and len(args.array) > arrays.MAX_SPEC:
        size = len(args.array)
        raise CliError(f"--array: the spec is too long ({size} characters; at most {arrays.MAX_SPEC})")
    _check_as_me(req)
    # (the daemon need not check it again: a client that says so falsely only makes its own job fail later,
    # with the true cause; a request without it is checked by the daemon as its user)
    req["checked_as_user"] = True
    answer = _ask(socket, req)
    elements = answer.get("elements")
    if args.json:
        keys = ("id", "state", "ahead", "array_id", "elements")
        print(json.dumps({k: answer[k] for k in keys if k in answer}))
    elif elements is not None:
        print(f"job {answer['id']}: {elements} elements {answer['state']} ({answer['ahead']} ahead)")
    else:
        print(f"job {answer['id']} {answer['state']} ({answer['ahead']} ahead)")
    sys.stdout.flush()
    waiting.answered = True
    return _wait(waiting, [int(answer["id"])]) if args.wait else base.EXIT_OK


def _check_as_me(req: dict) -> None:
    """What can be known now, checked as the user who submits, where the job will see the files (a job in
    a unit of its own sees the user's, not the daemon's sandbox): one line and nothing queued."""
    import pwd

    from gpu_mon.queue import submitcheck
    from gpu_mon.queue.fields import Bad

    try:
        home = pwd.getpwuid(os.getuid()).pw_dir  # (the job's output goes under its passwd home, not $HOME)
    except KeyError:
        raise CliError(f"uid {os.getuid()} has no passwd entry: a job cannot be run as it") from None
    default = None if req["output"] else (home, os.path.join(home, DEFAULT_OUTPUT))
    path = req["env"].get("PATH")
    try:
        submitcheck.check(
            os.getuid(), os.getgid(), os.getgroups(), req["cwd"], req["command"], path, req["output"], default
        )
    except Bad as err:
        raise CliError(str(err), err.code) from None


def _stop_signal(text: str) -> str:
    """`B:USR1` (Slurm's --signal: to the main process only) is USR1 with --stop-main-only."""
    return text[2:] if text.upper().startswith("B:") else text


class _Waiting:
    """How `wait` (and `submit --wait`) asks the daemon: until a deadline (--timeout), and on through a
    restart of the daemon (its socket gone, refusing, or closed without an answer) once it has answered
    (no daemon at the start is one line, as for `jobs`): one line on stderr, then asked again every 0.5-2
    s. The config is read again each time (a restart may turn the queue off: one line, as `jobs` says)."""

    def __init__(self, args: argparse.Namespace, socket: str) -> None:
        self.args, self.socket = args, socket
        timeout = getattr(args, "timeout", None)
        seconds = _duration(timeout, "--timeout") if timeout is not None else None
        self.deadline = None if seconds is None else time.monotonic() + seconds
        self.told = False
        self.answered = False  # (the daemon has answered once: `submit` did, or the first listing)

    def left(self) -> Optional[float]:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def jobs(self, refs: List[Union[int, str]]) -> Optional[List[dict]]:
        """The jobs' states as the daemon has them; None when it does not answer before the deadline."""
        pause = _POLL_SECONDS
        while True:
            left = self.left()
            if left is not None and left <= 0:
                return None
            try:
                timeout = 30.0 if left is None else max(0.1, min(30.0, left))
                answer = request(self.socket, _listing(refs), timeout=timeout)
                self.answered = True
                return _answer(answer)["jobs"]
            except (NoDaemon, ConnectionError):  # (reset or broken pipe: it stopped while answering)
                if not self.answered:
                    raise
                self._tell(refs)
            left = self.left()
            time.sleep(pause if left is None else max(0.0, min(pause, left)))
            pause = min(2.0, pause * 2)
            self.socket = socket_path(self.args)

    def _tell(self, refs: List[Union[int, str]]) -> None:
        """One line, the first time the daemon does not answer."""
        if not self.told:
            print(f"gpu-mon: the daemon is restarting; still waiting for {_named(refs)}", file=sys.stderr)
            sys.stderr.flush()
            self.told = True


def _listing(refs: List[Union[int, str]]) -> dict:
    return {"op": "jobs", "ids": refs, "collapse": True}


def _named(refs: List[Union[int, str]]) -> str:
    return ("job " if len(refs) == 1 else "jobs ") + ", ".join(map(str, refs))


def _wait(waiting: _Waiting, refs: List[Union[int, str]], any_end: bool = False) -> int:
    """Until every job named has ended (an array: each element, listed by state); then 0 when all are
    done (any_end: whatever their end), else the first failure's status; 124 when --timeout ran out
    first."""
    jobs = waiting.jobs(refs)
    while jobs is not None:
        if not jobs:
            raise CliError(f"no such job: {', '.join(map(str, refs))}", base.EXIT_FAILURE)
        if all(j["state"] in J.ENDED for j in jobs):
            break
        left = waiting.left()
        time.sleep(_POLL_SECONDS if left is None else max(0.0, min(_POLL_SECONDS, left)))
        jobs = waiting.jobs(refs)
    if jobs is None:
        print(f"gpu-mon: --timeout: {_named(refs)} not ended yet (it goes on)", file=sys.stderr)
        return EXIT_TIMEOUT
    for j in jobs:
        print(f"job {_shown_id(j)} {j['state']}", file=sys.stderr)
    failed = [j for j in jobs if j["state"] != J.DONE]
    if not failed or any_end:
        return base.EXIT_OK
    job = failed[0]
    if job["state"] == J.TIMEOUT:
        return EXIT_TIMEOUT
    status = job.get("first_exit_status", job["exit_status"])  # (an array's elements: the first's)
    if job["state"] == J.FAILED and status is not None:
        return min(255, max(1, int(status)))
    return base.EXIT_FAILURE


def _after(text: str) -> List[Union[int, str]]:
    """--after's dependencies as the request sends them (queue/afterspec.py)."""
    from gpu_mon.queue import afterspec

    try:
        return afterspec.parse(text)
    except ValueError as err:
        raise CliError(str(err)) from None


def _job_id(text: str) -> Union[int, str]:
    """`17` (a job, or a whole array) as a number, `17_5` (an array's element) and `17_[0-3,8]` (those
    elements: the daemon, which knows [queue] max_array_size, bounds it) as text."""
    if arrays.is_range(text):
        return text.strip()  # (checked by _ranges_checked: one line, not the usage)
    try:
        job_id, index = arrays.parse_ref(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return job_id if index is None else f"{job_id}_{index}"


_ANY_SIZE = 10**9  # (the client checks a range's shape; the daemon its size)


def _ranges_checked(refs: List[Union[int, str]], what: str = "") -> List[Union[int, str]]:
    """The refs; CliError (one line, exit 2) for a range that is malformed (nothing is built per index)."""
    for ref in refs:
        if arrays.is_range(ref):
            try:
                arrays.parse_range(str(ref), _ANY_SIZE, build=False)
            except arrays.SpecError as err:
                raise CliError(f"{what}{err}") from None
    return refs


def _shown_id(j: dict) -> str:
    """`17`, `17_5`, or `17_[8-199]` for an array's elements in one state."""
    if j.get("elements") is not None:
        return f"{j['array_id']}_[{j['elements']}]"
    if j.get("array_id"):
        return f"{j['array_id']}_{j['array_index']}"
    return str(j["id"])


def _duration(text: str, option: str) -> float:
    m = _DURATION.match(text)
    if not m or float(m.group(1)) <= 0:
        raise CliError(f"{option}: {text!r} is not a duration (90, 90s, 30m, 2h, 1d)")
    return float(m.group(1)) * _UNIT[m.group(2)]


# ------------------------------------------------------------------ jobs, cancel, hold, release


def _jobs(args: argparse.Namespace, socket: str) -> int:
    user = args.user
    if args.me:
        user = _me()
    req = {"op": "jobs", "all": args.all, "user": user, "state": args.state}
    if args.name is not None:
        req["name"] = args.name
    if args.ids:
        req["ids"] = list(args.ids)
    if not args.json and not args.expand:
        req["collapse"] = True
    if not args.json and not args.all:
        req["limit"] = TABLE_WAITING
    answer = _ask(socket, req)
    jobs, drained, arrays = answer["jobs"], answer.get("drained"), answer.get("arrays") or {}
    if args.json:
        _print_json(jobs, arrays, drained)
        return base.EXIT_OK
    head = []
    if drained:
        from gpu_mon.queue import words

        head.append(words.drained(str(drained.get("by")), float(drained.get("at_wall") or 0)))
    if not jobs:
        sys.stdout.write("\n".join([*head, "no jobs"]) + "\n")
        return base.EXIT_OK
    ended = any(j["state"] in J.ENDED for j in jobs)  # (then each line says when it ended)
    end = ("END",) if ended else ()
    rows = [("ID", "USER", "STATE", "GPUS", "TIME", *end, "RESTARTS", "NAME / COMMAND", "WHY")]
    today = time.strftime("%Y-%m-%d")
    rows += [_row(j, today if ended else None, arrays) for j in jobs]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = head + ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    more = int(answer.get("more") or 0)
    if more:
        lines.append(f"... and {more} more queued or held (gpu-mon jobs --all or --json lists every one)")
    sys.stdout.write("\n".join(lines) + "\n")
    return base.EXIT_OK


def _print_json(jobs: List[dict], arrays: Dict[str, dict], drained: Optional[dict]) -> None:
    """`{"jobs": [...], "arrays": {...}, "drained": null}`, a job a line, then an array a line. One
    encoding of the whole list (json's own indenting is slow for a long queue), then a new line before
    each job: `}, {"id": ` with bare quotes is only ever found between two jobs (inside a string every
    quote is escaped, and a job holds no other object)."""
    for j in jobs:
        j.pop("gpu_indices", None)
    body = json.dumps(jobs)[1:-1].replace('}, {"id": ', '},\n  {"id": ')
    shared = ",\n  ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in arrays.items())
    tail = ', "arrays": {' + ("\n  " + shared + "\n" if shared else "") + "}"
    tail += ', "drained": ' + json.dumps(drained) + "}\n"
    sys.stdout.write('{"jobs": [\n  ' + body + "\n]" + tail if jobs else '{"jobs": []' + tail)


def _command(j: dict, arrays: Dict[str, dict]) -> List[str]:
    """The job's command: its own, or (an array's element) its array's."""
    if "command" in j:
        return j["command"]
    return arrays.get(str(j.get("array_id")), {}).get("command") or []


def _row(j: dict, today: Optional[str] = None, arrays: Optional[Dict[str, dict]] = None) -> tuple:
    """A line of the table; with `today` (some job listed has ended), the END column too; `arrays`: the
    listing's arrays (their commands)."""
    from gpu_mon.policy import words  # (only for the table: `--json` and the other commands do without)

    gpus = ",".join(str(i) if i is not None else "?" for i in j.get("gpu_indices") or []) or "-"
    ran = _ran(j)
    what = j["name"] or " ".join(_command(j, arrays or {}))
    why = j["reason"] or ""
    if j["state"] in (J.DONE, J.FAILED) and j.get("exit_status") is not None and not why:
        why = words.exit_status(int(j["exit_status"]), j.get("signal") or 0)
    if j["state"] in (J.DONE, J.FAILED) and j.get("exit_status") is None and j.get("count") and not why:
        why = "their exit statuses differ (jobs --expand)"
    if j["state"] == J.QUEUED and j.get("estimated_start") and "starting in" not in why:
        why = f"{why} (estimated start {_end(j['estimated_start'], time.strftime('%Y-%m-%d'))})"
    if j.get("preempted") and j["state"] in (J.QUEUED, J.HELD, J.PREEMPTED, *J.LIVE):
        last = f"last preempted at {j['preempted'][11:19]}: {j.get('preempted_reason') or '?'}"
        why = f"{why} ({last})" if why else last
    count = f" ({j['count']})" if j.get("count") else ""
    return (
        _shown_id(j) + count,
        sanitize(j["user"]),
        j["state"],
        gpus,
        ran,
        *((_end(j.get("ended"), today),) if today is not None else ()),
        str(j["restarts"]),
        sanitize(what, limit=40),
        sanitize(why, limit=400),  # (a wait's reason and the last preemption's, each naming who: whole)
    )


def _ran(j: dict) -> str:
    """TIME: how long it has run over all its runs (a running one: so far); for an array's elements whose
    times differ, `5 min-2 h`."""
    from gpu_mon.policy import words
    from gpu_mon.queue.listing import elapsed

    now = time.time()
    if j.get("started_range") and j["state"] in J.LIVE:
        longest, shortest = (elapsed({**j, "started": s}, now) for s in j["started_range"])
        return _span(words.duration(shortest or 0.0), words.duration(longest or 0.0))
    ranged = j.get("ran_seconds_range") if "ran_seconds" in j else j.get("run_seconds_range")
    if ranged and j["state"] in J.ENDED:
        shortest, longest = ranged
        return _span(words.duration(shortest), words.duration(longest))
    seconds = elapsed(j, now)
    return words.duration(seconds) if seconds is not None else "-"


def _span(shortest: str, longest: str) -> str:
    return shortest if shortest == longest else f"{shortest}-{longest}"


def _end(ended: Optional[str], today: str) -> str:
    """When a job ended, from its ISO time: `14:02:11` today, `11-24 14:02` another day; `-` not ended."""
    if not ended:
        return "-"
    return ended[11:19] if ended[:10] == today else f"{ended[5:10]} {ended[11:16]}"


_DONE = {"cancel": "cancelled", "hold": "held", "release": "released"}


def _change(args: argparse.Namespace, socket: str) -> int:
    select = {
        k: v for k, v in (("name", args.name), ("state", args.state), ("user", args.user)) if v is not None
    }
    if args.all:
        select["all"] = True
    if args.ids and select:
        raise CliError(f"{args.command}: give job IDs or a selection (--name, --state, --all), not both")
    if not args.ids and not (set(select) - {"user"}):
        what = "--name, --state or --all" + (" (--user only narrows them)" if args.user else "")
        raise CliError(f"{args.command}: name the jobs: IDs, or {what}")
    if select:
        return _change_selected(args.command, socket, select)
    answer = _ask(socket, {"op": args.command, "ids": args.ids})
    return said(answer["results"], lambda r, of: f"{r['state']}{f' ({of})' if of else ''}")


def said(results: List[dict], done: Callable[[dict, str], str]) -> int:
    """Each job's result of a change, a line each (`job 17: WHAT`, `done(result, "3 of 5 elements")`;
    a refusal on stderr); exit 1 when any was refused."""
    code = base.EXIT_OK
    for r in results:
        if r["ok"]:
            of = f"{r['count']} of {r['of']} elements" if r.get("count") is not None else ""
            print(f"job {r['id']}: {done(r, of)}")
        else:
            print(f"gpu-mon: {sanitize(r['error'])}", file=sys.stderr)
            code = max(code, int(r.get("code") or base.EXIT_FAILURE))  # (2: a range refused)
    return code


def _change_selected(command: str, socket: str, select: dict) -> int:
    """`cancelled 12 jobs (3 running: stopping)`: the daemon picks the jobs and says how many."""
    answer = _ask(socket, {"op": command, "select": select})
    count, stopping = int(answer["count"]), int(answer.get("stopping") or 0)
    more = f" ({stopping} running: stopping)" if stopping else ""
    print(f"{_DONE[command]} {count} job{'s' if count != 1 else ''}{more}")
    return base.EXIT_OK


def _drain(args: argparse.Namespace, socket: str) -> int:
    """`gpu-mon queue drain` / `resume`: one line saying what the queue is now."""
    from gpu_mon.queue import words

    answer = _ask(socket, {"op": "queue", "action": args.action})
    drained = answer.get("drained")
    if drained:
        line = words.drained(str(drained.get("by")), float(drained.get("at_wall") or 0))
        print(line if answer.get("changed") else f"already {line.removeprefix('queue ')}")
    else:
        print("queue resumed: jobs start again" if answer.get("changed") else "queue is not drained")
    return base.EXIT_OK


def _me() -> str:
    """The name of the user running this command."""
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        raise CliError(f"uid {os.getuid()} has no user name", base.EXIT_FAILURE) from None


# ------------------------------------------------------------------ logs


def _logs(args: argparse.Namespace, socket: str) -> int:
    answer = _ask(socket, {"op": "logs-path", "id": args.id})
    path, state = answer["path"], answer["state"]
    output = _Output(path, answer.get("uid"), answer.get("gid"))
    offset = output.print_from(0, quiet=args.follow or state in (J.QUEUED, J.HELD))
    if args.follow:
        offset = _follow(output, offset, state, args.id, socket)
        if offset is None:  # (how it ended: cancelled before it ran, say)
            answer = _ask(socket, {"op": "logs-path", "id": args.id})
            state = answer["state"]
    if offset is None and state in J.ENDED and answer.get("ran") is False:
        why = sanitize(str(answer.get("reason") or state))
        raise CliError(f"job {args.id} never ran ({why}): it has no output", base.EXIT_FAILURE)
    if offset is None:
        why = answer.get("reason") if state == J.FAILED else ""  # (its output could not be opened: why)
        said = f": {why}" if why else f" yet ({path})"
        raise CliError(f"job {args.id} has no output{said}", base.EXIT_FAILURE)
    return base.EXIT_OK


def _follow(
    output: _Output, offset: Optional[int], state: str, job_id: Union[int, str], socket: str
) -> Optional[int]:
    """`logs --follow`: print what comes until the job ends, then the rest; the last offset (None: there
    was never an output). What cannot be read then (a link to a file the user may not read) is a
    CliError, as without --follow: quiet only while the job may still make its output."""
    while state not in J.ENDED:
        time.sleep(_POLL_SECONDS)
        (job,) = _ask(socket, {"op": "jobs", "ids": [job_id]})["jobs"]
        state = job["state"]
        offset = output.print_from(offset or 0, quiet=True)
    return output.print_from(offset or 0, quiet=False)


class _Output:
    """A job's output file, opened once it is there: root opens another user's as that user (a link the
    user made there reaches only what the user may read), never through a link when it cannot tell whose
    the job is; anyone else, with their own rights."""

    def __init__(self, path: str, uid: Optional[int], gid: Optional[int]) -> None:
        self.path, self.uid, self.gid = path, uid, gid
        self.fd: Optional[int] = None

    def _open(self) -> int:
        from gpu_mon import safefile

        try:
            if os.geteuid() != 0 or self.uid == 0:
                return os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
            if self.uid is None or self.gid is None:  # (a daemon that does not say whose the job is)
                return safefile.open_no_links(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
            import pwd

            name = pwd.getpwuid(self.uid).pw_name
            groups = os.getgrouplist(name, self.gid)
            return safefile.open_as_user(self.path, self.uid, self.gid, groups)
        except (safefile.UnsafeFile, KeyError) as err:
            raise CliError(f"{sanitize(str(err))}: refused", base.EXIT_FAILURE) from None

    def print_from(self, offset: int, quiet: bool) -> Optional[int]:
        """Print what the file has past `offset`; the new offset, or None when it cannot be read."""
        try:
            if self.fd is None:
                self.fd = self._open()
            chunks, at = [], offset
            while True:
                chunk = os.pread(self.fd, 1 << 16, at)
                if not chunk:
                    break
                chunks.append(chunk)
                at += len(chunk)
        except FileNotFoundError:
            return None
        except OSError as err:
            if quiet:
                return None
            raise CliError(f"{sanitize(self.path)}: {err.strerror}", base.EXIT_FAILURE) from None
        data = b"".join(chunks)
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return offset + len(data)


def _opt(*flags: str, **options: object) -> Tuple[Tuple[str, ...], Dict[str, object]]:
    return flags, options


def _add(p: argparse.ArgumentParser, options: tuple) -> None:
    for flags, kw in options:
        p.add_argument(*flags, **kw)


# The options of `submit` and `jobs` in --help's order, (flags, argparse keywords); below the functions
# they name (_job_id)
_SUBMIT_OPTIONS = (
    _opt("--gpus", type=int, default=1, metavar="N", help="GPUs the job needs (default 1)"),
    _opt("--name", default="", help="a name for `jobs` (at most 64 characters)"),
    _opt(
        "--priority",
        type=int,
        default=0,
        metavar="P",
        help="higher goes first (default 0; -1000000 to 1000000)",
    ),
    _opt(
        "--after",
        default="",
        metavar="DEPS",
        help="start only after these jobs, as Slurm's --dependency: afterok:ID[:ID...] (done; a plain ID "
        "too), afterany:ID (ended, whatever the end), afternotok:ID (ended without success), combined "
        "with commas (17: every element of array 17; 17_5: one element)",
    ),
    _opt(
        "--array",
        metavar="SPEC",
        help="queue an array: one job per index (0-199, 1,3,5-9, 0-99:5; %%N: at most N running at once), "
        "each with GPU_MON_ARRAY_ID and GPU_MON_ARRAY_INDEX",
    ),
    _opt(
        "--notify",
        metavar="CMD",
        help="run CMD (sh -c, as you, in the job's directory) when the job ends or is preempted "
        "(default: ~/.config/gpu-mon/notify when executable); an array: when its last element ends",
    ),
    _opt("--notify-each", action="store_true", help="an array: notify for each element"),
    _opt(
        "--stop-signal",
        default="SIGTERM",
        metavar="SIG",
        help="signal to stop it, sent to all its processes: TERM (default), INT, HUP, QUIT, USR1, USR2, "
        "ALRM, WINCH or PWR (B:USR1 as --stop-main-only)",
    ),
    _opt(
        "--stop-main-only",
        action="store_true",
        help="send the stop signal to its main process only (its SIGTERM and SIGKILL still reach all)",
    ),
    _opt("--grace", type=float, metavar="SECONDS", help="stop signal to SIGKILL (default [queue])"),
    _opt("--time-limit", metavar="DURATION", help="stop it after this long (90, 30m, 2h, 1d)"),
    _opt(
        "--output",
        metavar="FILE",
        help=f"stdout and stderr (default ~/{DEFAULT_OUTPUT}/ID.log); %%A array id, %%a index, %%j job id",
    ),
    _opt("--no-requeue", action="store_true", help="when preempted, end as `preempted`"),
    _opt("--hold", action="store_true", help="queue it held: it waits for `gpu-mon release`"),
    _opt("--wait", action="store_true", help="wait for the end; exit with the job's status"),
)
_SUBMIT_LAST = (
    _opt("--json", action="store_true", help="machine-readable output"),
    _opt("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS...]", help="what to run"),
)
_JOBS_OPTIONS = (
    _opt(
        "--all",
        action="store_true",
        help=f"finished jobs too, and every waiting one (the table lists the first {TABLE_WAITING})",
    ),
    _opt("--user", help="only this user's jobs"),
    _opt("--me", action="store_true", help="only your own jobs"),
    _opt("--state", choices=J.STATES, help="only jobs in this state"),
    _opt("--name", help="only jobs with this name (every element of a named array)"),
    _opt("--expand", action="store_true", help="an array's elements one a line (default: by state)"),
    _opt(
        "--json", action="store_true", help="machine-readable output (every element; an array's command once)"
    ),
    _opt("ids", nargs="*", type=_job_id, metavar="ID", help="only these jobs (17, 17_5, '17_[0-3,8]')"),
)
