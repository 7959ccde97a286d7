"""The check at submit (submitcheck.py), as a short `/bin/sh` script, and its run by the client itself:
`gpu-mon submit`'s quick path (commands/quicksubmit.py) runs it as the user it already is, with the standard
library's os alone (no subprocess, re or typing: a submit answers in milliseconds); the daemon runs it as
the user through submitcheck.check.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # (typing alone takes 5-10 ms to import)
if TYPE_CHECKING:
    from typing import List, Optional, Sequence, Tuple

# dash's and bash's own PATH when the environment has none (a job started without one gets the same)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TIMEOUT = 3.0  # seconds (a hung network or FUSE file system: refused, said so; the server waits meanwhile)
_PATTERNS = ("%%", "%A", "%a", "%j")
# $1 submit directory, $2 command, $3 --output (a pattern, perhaps) or -, $4 its directory, $5 home or -,
# $6 the default output directory. Its last line on stdout: `ok`, or what is wrong. (Not its exit status:
# the daemon is a child subreaper, and its loop may reap a child of its own that has ended.)
SCRIPT = r"""
no() { printf '%s\n' "$*"; exit 1; }
cd -- "$1" 2>/dev/null || { [ -d "$1" ] && no "cannot enter the submit directory $1: Permission denied"; \
  no "the submit directory $1 does not exist"; }
c=$2
case $c in
*/*) [ -e "$c" ] || no "$c: No such file or directory"
     [ -d "$c" ] && no "$c: is a directory, not a command"
     [ -x "$c" ] || no "$c: Permission denied (not executable)" ;;
*)   f=; rest=$PATH:
     while [ -n "$rest" ]; do
       d=${rest%%:*}; rest=${rest#*:}; p=${d:-.}/$c
       if [ -f "$p" ] && [ -x "$p" ]; then f=$p; break; fi
     done
     [ -n "$f" ] || no "$c: command not found on the job's PATH ($PATH)" ;;
esac
if [ "$3" != - ]; then
  if [ -e "$3" ]; then
    [ -d "$3" ] && no "cannot open $3: Is a directory"
    [ -w "$3" ] || no "cannot open $3: Permission denied"
  else
    [ -d "$4" ] || no "cannot open $3: No such file or directory (make $4 first)"
    [ -w "$4" ] && [ -x "$4" ] || no "cannot open $3: Permission denied"
  fi
fi
if [ "$5" != - ]; then
  [ -d "$5" ] || no "your home directory $5 does not exist: give --output FILE"
  d=$6
  while [ ! -e "$d" ] && [ "$d" != "$5" ]; do d=${d%/*}; done
  [ -d "$d" ] && [ -w "$d" ] && [ -x "$d" ] || no "cannot make $6: Permission denied: give --output FILE"
fi
echo ok
"""


def output_dir(pattern: str) -> str:
    """The directory an --output pattern's file is in, as far as it is known at submit: its directory
    part up to the first component with a pattern in it (`/a/%A/x.log` -> `/a`)."""
    parts = os.path.dirname(pattern).split("/")
    known = []
    for part in parts:
        if any(p in part for p in _PATTERNS):
            break
        known.append(part)
    return "/".join(known) or "/"


def argv(cwd: str, command: Sequence[str], output: str, home_and_dir: Optional[Tuple[str, str]]) -> List[str]:
    """The script's command line. output: the --output pattern ("" for the default); home_and_dir: the
    home and the default output's directory."""
    # (a pattern names no file that is there yet: its directory is what is checked)
    args = [output, output_dir(output)] if output else ["-", "-"]
    home, default_dir = home_and_dir if home_and_dir else ("-", "-")
    return ["/bin/sh", "-c", SCRIPT, "gpu-mon-check", cwd, command[0], *args, home, default_dir]


def env(env_path: Optional[str]) -> dict:
    """The script's environment: the job's PATH."""
    return {"PATH": DEFAULT_PATH if env_path is None else env_path, "LC_ALL": "C"}


def run(
    cwd: str, command: Sequence[str], env_path: Optional[str], output: str, home: Optional[Tuple[str, str]]
) -> bool:
    """Whether the check, run as this process's user, says `ok` within TIMEOUT (False for anything else:
    then submitcheck.check says why)."""
    import select

    read, write = os.pipe()
    try:
        null = os.open(os.devnull, os.O_RDWR)
        try:
            actions = [(os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, write, 1)]
            actions.append((os.POSIX_SPAWN_DUP2, null, 2))
            pid = os.posix_spawn(
                "/bin/sh", argv(cwd, command, output, home), env(env_path), file_actions=actions
            )
        finally:
            os.close(null)
    except OSError:
        os.close(read)
        return False
    finally:
        os.close(write)
    out = b""
    try:
        poller = select.poll()
        poller.register(read, select.POLLIN)
        while poller.poll(int(TIMEOUT * 1000)):
            chunk = os.read(read, 65536)
            if not chunk:
                break
            out += chunk
        else:
            os.kill(pid, 9)
            out = b""
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    return out.decode("utf-8", "backslashreplace").strip().splitlines() == ["ok"]
