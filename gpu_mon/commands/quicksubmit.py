"""`gpu-mon submit` as most submits are typed, answered before the whole CLI is imported (150-250 ms of
imports against Slurm's 4 ms sbatch; issue 38 item 10): the standard library's os, pwd and the C socket
and JSON functions alone (gpu_mon/quickclient.py; not json, which loads re), as `_job-ids` does.

`submit(argv)` returns None whenever it is not sure to do exactly what the full CLI does, before anything
is sent: then gpu_mon.cli parses the line again and answers it (its --help, usage errors and their "did
you mean", every check's refusal and its exit status, --wait, --debug, abbreviated options, a config it
cannot read simply). Handled here: the options of SUBMIT_OPTIONS written out in full (`--gpus 2`,
`--gpus=2`), a config named by --config or $GPU_MON_CONFIG or the default one, whose [queue] socket is read
by a plain scan of the file and its drop-ins (anything it does not recognise: the full CLI), the client's
check as the user (queue/submitcheck.py's script, run the same way), one request, and the answer printed
as `gpu-mon submit` prints it. Once the request is sent, a failure is reported here, as the CLI does.
"""

from __future__ import annotations

import os
import sys

from gpu_mon.quickclient import DEFAULT_CONFIG, DEFAULT_SOCKET, Failed, NotSent, dumps, exchange, loads

TYPE_CHECKING = False  # (typing alone takes 5-10 ms to import)
if TYPE_CHECKING:
    from typing import Dict, List, Optional, Sequence, Tuple

# option -> (its request key, how its value is read: int, float, str; None for a flag). The same table
# as `gpu-mon submit`'s parser (commands/queue.py SUBMIT; a test checks they agree).
SUBMIT_OPTIONS = {
    "--gpus": int,
    "--name": str,
    "--priority": int,
    "--after": str,
    "--array": str,
    "--notify": str,
    "--notify-each": None,
    "--stop-signal": str,
    "--stop-main-only": None,
    "--grace": float,
    "--time-limit": str,
    "--output": str,
    "--no-requeue": None,
    "--hold": None,
    "--json": None,
    "--config": str,
}
DEFAULT_OUTPUT = ".local/state/gpu-mon/jobs"  # = queue.protocol.DEFAULT_OUTPUT (a test checks)
MAX_SPEC = 64 * 1024  # = queue.arrays.MAX_SPEC (a test checks)
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_TIMEOUT = 30.0  # = queue.protocol.request's (a test checks)
_MAX_ANSWER = 1 << 28  # = queue.protocol.MAX_ANSWER (a test checks)
_MAX_REQUEST = 1 << 20  # = queue.protocol.MAX_FRAME (a test checks)


def submit(argv: Sequence[str]) -> Optional[int]:
    """`gpu-mon ARGV` when it is a common submit: its exit status; None for the full CLI. As the CLI:
    Ctrl-C exits 130, a closed stdout 0, anything else after the request was sent is one line."""
    try:
        parsed = _parse(argv)
        if parsed is None:
            return None
        opts, command = parsed
        socket_path = _socket(opts.get("--config") or os.environ.get("GPU_MON_CONFIG") or None)
        req = _request(opts, command) if socket_path else None
        if req is None or not _checked_as_me(req):
            return None
    except OSError:
        return None  # (a working directory gone, ...: nothing was sent; the CLI says what)
    except KeyboardInterrupt:
        return 130
    try:
        return _sent(socket_path, req, "--json" in opts)  # type: ignore[arg-type]
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


def _sent(socket_path: str, req: dict, as_json: bool) -> Optional[int]:
    try:
        answer = _ask(socket_path, req)
        if answer is None:
            return None  # (nothing was sent: no daemon there; the CLI says so)
        if not answer.get("ok"):
            from gpu_mon.api.text import sanitize

            raise Failed(sanitize(str(answer.get("error", "refused"))), int(answer.get("code", 1)))
        _print(answer, as_json)
    except Failed as err:
        _stderr(f"gpu-mon: {err}")
        return err.code
    except (ValueError, TypeError, OSError) as err:  # (an answer not as the daemon writes it)
        _stderr(f"gpu-mon: error: {type(err).__name__}: {err}")
        return 1
    return 0


def _stderr(line: str) -> None:
    """One line on stderr as gpu_mon/cli.py writes it (with a priority prefix for the journal)."""
    from gpu_mon.api.text import sanitize
    from gpu_mon.outputs import logs

    sys.stderr.write(f"{'<3>' if logs.stderr_is_journal() else ''}{sanitize(line, 4096)}\n")


def _parse(argv: Sequence[str]) -> Optional[Tuple[Dict[str, object], List[str]]]:
    """({option: value}, the command) for `[--config P] submit [OPTIONS] [--] COMMAND...`, or None."""
    opts: Dict[str, object] = {}
    words = list(argv)
    at = 0
    while at < len(words) and words[at] != "submit":  # (before the command: --config alone)
        if not _option(words, at, opts, top=True):
            return None
        at += 1 if "=" in words[at] else 2
    at += 1
    while at < len(words) and words[at].startswith("-") and words[at] != "--":
        if not _option(words, at, opts, top=False):
            return None
        at += 1 if "=" in words[at] or SUBMIT_OPTIONS[words[at]] is None else 2
    command = words[at + 1 :] if words[at : at + 1] == ["--"] else words[at:]
    return (opts, command) if command and at < len(words) else None


def _option(words: List[str], at: int, opts: Dict[str, object], top: bool) -> bool:
    """Read the option at `at` into opts; False when the full CLI must read the line."""
    name, eq, value = words[at].partition("=")
    if name not in SUBMIT_OPTIONS or (top and name != "--config"):
        return False
    kind = SUBMIT_OPTIONS[name]
    if kind is None:
        opts[name] = True
        return not eq
    if not eq:
        if at + 1 >= len(words):
            return False
        value = words[at + 1]
    if value.startswith("-"):
        return False
    try:
        opts[name] = kind(value)
    except ValueError:
        return False
    return True


def _request(opts: Dict[str, object], command: List[str]) -> Optional[dict]:
    """The request `gpu-mon submit` sends; None when the CLI must refuse something first."""
    array = opts.get("--array")
    if isinstance(array, str) and len(array) > MAX_SPEC:
        return None
    signal = str(opts.get("--stop-signal", "SIGTERM"))
    time_limit = None
    if "--time-limit" in opts:
        time_limit = _duration(str(opts["--time-limit"]))
        if time_limit is None:
            return None
    output = str(opts.get("--output") or "")
    req = {
        "op": "submit",
        "command": command,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "name": opts.get("--name", ""),
        "gpus": opts.get("--gpus", 1),
        "priority": opts.get("--priority", 0),
        "after": _after(str(opts.get("--after", ""))),
        "array": array,
        "notify": opts.get("--notify") or "",
        "notify_each": "--notify-each" in opts,
        "stop_signal": signal[2:] if signal.upper().startswith("B:") else signal,
        "stop_main_only": "--stop-main-only" in opts or signal.upper().startswith("B:"),
        "time_limit": time_limit,
        "output": os.path.abspath(output) if output else "",
        "requeue": "--no-requeue" not in opts,
        "hold": "--hold" in opts,
        # sent only once _checked_as_me has passed (as `gpu-mon submit` does): the daemon need not check again
        "checked_as_user": True,
    }
    if "--grace" in opts:
        req["grace"] = opts["--grace"]
    return None if req["after"] is None else req


def _after(text: str) -> Optional[List[object]]:
    """--after's dependencies as the CLI sends them (queue/afterspec.py, which both parse with); None when
    it refuses them (the CLI says why)."""
    from gpu_mon.queue import afterspec

    try:
        return afterspec.parse(text)  # type: ignore[return-value]
    except ValueError:
        return None


def _duration(text: str) -> Optional[float]:
    """`90`, `30m`, `2h`, `1d`, `1.5h` in seconds; None for anything else (the CLI says why)."""
    word = text.strip()
    unit = word[-1] if word and word[-1] in "smhd" else ""
    number = word[: len(word) - len(unit)].rstrip()
    whole, dot, part = number.partition(".")
    if not (whole.isascii() and whole.isdigit()) or (dot and not (part.isascii() and part.isdigit())):
        return None
    seconds = float(number) * _UNIT[unit]
    return seconds if float(number) > 0 else None


def _socket(config: Optional[str]) -> Optional[str]:
    """The [queue] socket as `gpu-mon submit` finds it; None when the full CLI must read the config."""
    path = config or DEFAULT_CONFIG
    if not config and (not os.access(path, os.R_OK) or not os.path.lexists(path)):
        return DEFAULT_SOCKET
    directory = path + ".d"
    files = [path]
    try:
        if os.path.lexists(directory):
            if not _trusted(directory, dir_ok=True):
                return None
            names = sorted(n for n in os.listdir(directory) if n.endswith(".conf") and not n.startswith("."))
            files += [os.path.join(directory, n) for n in names]
        found: Optional[str] = None
        queue = False
        for name in files:
            scanned = _scan(name)
            if scanned is None:
                return None
            queue = queue or scanned[0]
            found = scanned[1] or found
    except (OSError, UnicodeDecodeError):
        return None
    return (found or DEFAULT_SOCKET) if queue else None


def _trusted(path: str, dir_ok: bool = False) -> bool:
    """The config's own trust rule, as far as a plain check tells (anything else: the full CLI)."""
    st = os.lstat(path)
    kind = st.st_mode & 0o170000
    if kind != (0o040000 if dir_ok else 0o100000):
        return False
    return os.geteuid() != 0 or (st.st_uid == 0 and not st.st_mode & 0o022)


def _scan(path: str) -> Optional[Tuple[bool, Optional[str]]]:
    """(whether the file has [queue], its socket if written there); None when something is unusual."""
    parent = os.path.dirname(path) or "."
    if not _trusted(path) or (os.geteuid() == 0 and not _trusted(parent, dir_ok=True)):
        return None
    with open(path, "rb") as f:
        data = f.read(1 << 20 | 1)
    if len(data) > 1 << 20 or b"\0" in data:
        return None
    queue, found, section, last = False, None, None, None
    for raw in data.decode("utf-8").split("\n"):
        line = raw[:-1] if raw.endswith("\r") else raw
        stripped = line.strip()
        if not stripped or stripped[0] in ";#":
            continue
        if not (line.isprintable() or line.replace("\t", " ").isprintable()):
            return None
        if line[0] in " \t":
            if section == "queue":
                return None  # (a value continued, or a key the config's reader takes as one: the CLI)
            continue
        if stripped.startswith("["):
            section, last = (stripped[1:-1].strip() if stripped.endswith("]") else None), None
            if section == "queue" and queue:
                return None  # (twice in one file: the CLI's error)
            queue = queue or section == "queue"
            continue
        cut = [i for i in (stripped.find("="), stripped.find(":")) if i > 0]
        last = stripped[: min(cut)].strip().lower() if cut else None
        if section == "queue" and last == "socket":
            value = stripped[min(cut) + 1 :].strip()  # type: ignore[index]
            if not value.startswith("/") or found is not None:
                return None
            found = os.path.normpath(value)
    return queue, found


def _checked_as_me(req: dict) -> bool:
    """Whether queue/submitcheck.py's check, as this user, says the job can start (else the CLI checks
    again and says why)."""
    import pwd

    if os.geteuid() != os.getuid():
        return False
    from gpu_mon.queue import checkscript

    try:
        home = pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        return False
    default = None if req["output"] else (home, os.path.join(home, DEFAULT_OUTPUT))
    path = req["env"].get("PATH")
    return checkscript.run(req["cwd"], req["command"], path, req["output"], default)


def _ask(path: str, req: dict) -> Optional[dict]:
    """The daemon's answer; None when nothing was sent (no daemon there); Failed after that."""
    try:
        body = dumps(req)
    except ValueError:
        return None  # (a value the CLI's json writes and ours does not: the CLI sends it)
    if len(body) > _MAX_REQUEST:
        return None  # (the CLI says it is too large)
    try:
        data = exchange(path, body, _TIMEOUT, _MAX_ANSWER)
    except NotSent:
        return None
    try:
        answer = loads(data)
    except ValueError:
        raise Failed("not a JSON message", 2) from None
    if not isinstance(answer, dict):
        raise Failed("not a JSON object", 2)
    return answer


def _print(answer: dict, as_json: bool) -> None:
    """As `gpu-mon submit` prints its answer."""
    elements = answer.get("elements")
    if as_json:
        keys = ("id", "state", "ahead", "array_id", "elements")
        import json  # (only here: its import is a third of a quick submit's own time)

        line = json.dumps({k: answer[k] for k in keys if k in answer})
    elif elements is not None:
        line = f"job {answer['id']}: {elements} elements {answer['state']} ({answer['ahead']} ahead)"
    else:
        line = f"job {answer['id']} {answer['state']} ({answer['ahead']} ahead)"
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
