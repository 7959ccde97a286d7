"""Where the daemon keeps its state file and the lock beside it: whether it can, and what to say when not."""

from __future__ import annotations

import errno
import os
import tempfile
from typing import Optional, Tuple

from gpu_mon.config import Config, line_of
from gpu_mon.engine.lock import lock_path


def where(config: Config) -> str:
    """`FILE:LINE: [defaults] state_file`, or the default's value when the key is not written."""
    line = line_of(config.defaults, "state_file")
    if line:
        return f"{config.path}:{line}: [defaults] state_file"
    return f"{config.path}: [defaults] state_file (default {config.defaults.state_file})"


def refusal(config: Config, detail: str, denied: bool) -> str:
    """One line: why the daemon cannot keep its state and lock where the config says, and what to do."""
    state = config.defaults.state_file
    if denied:
        fix = (
            f"this user may not write the daemon's state ({state}) or its lock ({lock_path(state)}) there; "
            "run gpu-mon as root, or give this daemon a state_file of its own"
        )
    else:
        fix = (
            f"the daemon keeps its state ({state}) and its lock ({lock_path(state)}) there; "
            "choose a state_file whose directory can be created"
        )
    return f"{where(config)}: {detail}: {fix}"


def problem(config: Config) -> Optional[Tuple[str, bool]]:
    """Why the daemon could not create its state file's directory or write in it: (the OS's words with
    the path, whether only permission is missing); None when it could. Creates nothing that stays: a
    missing directory is tried with an empty one made and removed at once."""
    state = config.defaults.state_file
    directory = os.path.dirname(state) or "."
    existing = directory
    while not os.path.lexists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing}: {os.strerror(errno.ENOTDIR)}", False
    if existing != directory:
        return _probe(existing, directory)
    for path, mode in ((directory, os.W_OK | os.X_OK), (lock_path(state), os.R_OK | os.W_OK)):
        if os.path.lexists(path) and not os.access(path, mode):
            return f"{path}: not writable by this user", os.geteuid() != 0
    return None


def _probe(parent: str, directory: str) -> Optional[Tuple[str, bool]]:
    """Whether a directory can be made in `parent` (some file systems, /proc for one, refuse even root)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".gpu-mon-check-", dir=parent))
    except OSError as err:
        missing = os.path.join(parent, os.path.relpath(directory, parent).split(os.sep)[0])
        return f"{missing}: {err.strerror}", err.errno in (errno.EACCES, errno.EPERM)
    return None
