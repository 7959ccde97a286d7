"""What gpu-mon owes Slurm for the jobs it requeued: a release (the job is held while its excluded nodes
change) and a lift (its own excluded nodes back after avoid_node_seconds). Kept in a file beside the state
file, written before the hold, so that a gpu-mon killed in between pays it when it starts again: a job
held by gpu-mon never stays held."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass
from typing import Dict


@dataclass(frozen=True)
class Owed:
    """One job's debt: released or not yet; its own excluded nodes; when (wall clock) to give them back."""

    job: int
    own: str = ""  # the job's own ExcNodeList ("" none)
    node: str = ""  # the node it is kept off
    released: bool = False
    lift_at: float = 0.0  # wall clock: when its own excluded nodes come back (0: not yet known)


def path_for(state_file: str) -> str:
    """Where the debts of the daemon that writes `state_file` are kept."""
    return state_file + ".slurm"


def load(path: str) -> Dict[int, Owed]:
    """The debts in the file ({} when there is none, or it cannot be read: said by the caller)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        return {int(e["job"]): Owed(**e) for e in doc.get("jobs", [])}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise ValueError(f"{path}: {err}") from None


def save(path: str, owed: Dict[int, Owed]) -> None:
    """Write them (atomically; the file removed when there are none). May raise OSError."""
    if not owed:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"jobs": [asdict(o) for o in sorted(owed.values(), key=lambda o: o.job)]}, f)
    os.replace(tmp, path)
