"""What can be known at submit is checked there, as the user: the submit directory can be entered, the
command is found and executable on the job's own PATH (a relative one from the submit directory), the
output's directory is there and writable (the directory part of a `%A/%a/%j` pattern up to its first
pattern), and without --output the user's home is there and its default output directory can be made.

As the user, never as root: a short `/bin/sh` run with the user's uid, gid and groups (the daemon is root;
a check made with root's rights would pass for /root/out.log, and its answer would tell a user what exists
where the user may not look). It sees only what the user may see, and says nothing the user could not learn
by trying. A job can still fail later (a directory removed in between): it then says so itself.
"""

from __future__ import annotations

import os
import re
import subprocess
from typing import Optional, Sequence, Tuple

from gpu_mon.queue.fields import Bad

# dash's and bash's own PATH when the environment has none (a job started without one gets the same)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_PATTERN = re.compile(r"%[%Aaj]")
_TIMEOUT = 3.0  # seconds (a hung network or FUSE file system: refused, said so; the server waits meanwhile)
# $1 submit directory, $2 command, $3 --output (a pattern, perhaps) or -, $4 its directory, $5 home or -,
# $6 the default output directory. Its last line on stdout: `ok`, or what is wrong. (Not its exit status:
# the daemon is a child subreaper, and its loop may reap a child of its own that has ended.)
_SCRIPT = r"""
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
        if _PATTERN.search(part):
            break
        known.append(part)
    return "/".join(known) or "/"


def check(
    uid: int,
    gid: int,
    groups: Sequence[int],
    cwd: str,
    command: Sequence[str],
    env_path: Optional[str],
    output: str,
    home_and_dir: Optional[Tuple[str, str]],
) -> None:
    """Bad (one line, code 2) when the job as submitted cannot start; nothing when it can. output: the
    --output pattern ("" for the default); home_and_dir: the home and the default output's directory."""
    # (a pattern names no file that is there yet: its directory is what is checked)
    args = [output, output_dir(output)] if output else ["-", "-"]
    home, default_dir = home_and_dir if home_and_dir else ("-", "-")
    argv = ["/bin/sh", "-c", _SCRIPT, "gpu-mon-check", cwd, command[0], *args, home, default_dir]
    kwargs: dict = {}
    if os.geteuid() == 0:
        kwargs.update(user=uid, group=gid, extra_groups=list(groups))
    try:
        done = subprocess.run(
            argv,
            env={"PATH": DEFAULT_PATH if env_path is None else env_path, "LC_ALL": "C"},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            cwd="/",
            timeout=_TIMEOUT,
            **kwargs,
        )
    except subprocess.TimeoutExpired:
        raise Bad(f"checking the job took over {_TIMEOUT:g} s (a file system that hangs?)", 1) from None
    except (OSError, ValueError, subprocess.SubprocessError) as err:
        raise Bad(f"cannot check the job as its user: {err}", 1) from None
    lines = done.stdout.decode("utf-8", "backslashreplace").strip().splitlines()
    if not lines:
        raise Bad("cannot check the job as its user (the check said nothing)", 1)
    if lines != ["ok"]:
        raise Bad(lines[-1])
