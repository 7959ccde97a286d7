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
import subprocess
from typing import Optional, Sequence, Tuple

from gpu_mon.queue import checkscript
from gpu_mon.queue.fields import Bad

_TIMEOUT = checkscript.TIMEOUT


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
    argv = checkscript.argv(cwd, command, output, home_and_dir)
    kwargs: dict = {}
    if os.geteuid() == 0:
        kwargs.update(user=uid, group=gid, extra_groups=list(groups))
    try:
        done = subprocess.run(
            argv,
            env=checkscript.env(env_path),
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
