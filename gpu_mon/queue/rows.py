"""A job as the queue's database keeps it: a JSON row, and an array's shared part stored once.

Every element of an array has the same command, directory, environment, name, output, hook and
dependencies: those are written once, in the `arrays` table under the array's id, and each element's row
holds only what is its own (its index, state, times, ...). Read back, the elements share one copy of each
of those values in memory too. A row that holds its own copy (an older gpu-mon wrote every element whole)
is read as it is.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Dict, Mapping, Tuple

from gpu_mon.queue.jobs import Job

TUPLES = ("command", "after", "gpus", "after_arrays", "notify")
# What every element of an array has alike (never changed after the submit), stored once per array
SHARED = ("command", "cwd", "env", "name", "output", "notify", "after", "after_arrays")
_KNOWN = frozenset(f.name for f in dataclasses.fields(Job))


def _dumps(data: dict) -> str:
    return json.dumps(data, separators=(",", ":"))


def _data(job: Job) -> dict:
    """The job as a JSON object (without its id: the row's key)."""
    data = dataclasses.asdict(job)
    data.pop("id")
    data["env"] = dict(job.env)
    return data


def to_row(job: Job, shared: bool = False) -> str:
    """The job's row; shared: without what its array keeps once (see `split`)."""
    data = _data(job)
    if shared:
        for key in SHARED:
            data.pop(key)
    return _dumps(data)


def split(base: Job) -> Tuple[str, str]:
    """An array's shared part (its `arrays` row), and the head of its elements' rows: each element's row is
    the head, its index, and `}` (the index written last, so one encoding serves every element)."""
    data = _data(base)
    shared = _dumps({key: data.pop(key) for key in SHARED})
    data.pop("array_index")
    return shared, _dumps(data)[:-1] + ',"array_index":'


def shared_part(text: str) -> Dict[str, object]:
    """An `arrays` row read back once, in the form a Job holds (its elements share these objects)."""
    data = json.loads(text)
    out: Dict[str, object] = {}
    for key, value in data.items():
        if key == "env":
            out[key] = _env(value)
        elif key in TUPLES:
            out[key] = tuple(value or ())
        elif key in _KNOWN:
            out[key] = value
    return out


def _env(value: object) -> Tuple[Tuple[str, str], ...]:
    return tuple((str(k), str(v)) for k, v in (value or {}).items())  # type: ignore[union-attr]


def from_row(job_id: int, text: str, arrays: Mapping[int, Dict[str, object]]) -> Job:
    """A job from its row (an array's element stored so: with its array's shared part, from `arrays`)."""
    data = json.loads(text)
    base = arrays.get(data.get("array_id") or 0) or {}
    for key in TUPLES:
        if key in data or key not in base:
            data[key] = tuple(data.get(key) or ())
    if "env" in data or "env" not in base:
        data["env"] = _env(data.get("env"))
    fields = {k: v for k, v in data.items() if k in _KNOWN}
    if base:
        fields = {**{k: v for k, v in base.items() if k not in fields}, **fields}
    return Job(id=job_id, **fields)
