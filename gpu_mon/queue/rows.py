"""A job as the queue's database keeps it: a JSON row, and an array's shared part stored once.

An array's elements are submitted alike but for their index: the `arrays` row, under the array's id,
holds every field of the array as submitted, and an element's row only `{"array_id":A,"array_index":I}`
until it changes; from then on its row holds what may change (state, times, ...), never what every
element keeps alike (SHARED: command, directory, environment, ...) unless `gpu-mon update` changed it for
that element (its name, its --after: then its row holds its own). Read back, an element's values are
its row's over its array's, and the elements share one copy of the array's in memory (jobs.array_class).
A row that holds its own copy (an older gpu-mon wrote every element whole, or its row whole but SHARED)
is read as it is.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Dict, Mapping, Sequence, Tuple, Type

from gpu_mon.queue import jobs as J
from gpu_mon.queue.jobs import Job

TUPLES = ("command", "gpus", "notify", *J.DEPENDENCIES)
# What every element of an array has alike (never changed after the submit), stored once per array
SHARED = ("command", "cwd", "env", "name", "output", "notify", *J.DEPENDENCIES)
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
    """The job's row; shared: without what its array keeps once (see the module's doc)."""
    data = _data(job)
    if shared:
        for key in SHARED:
            if not J.holds_own(job, key):  # (`gpu-mon update` changed its name or --after: kept)
                data.pop(key)
    return _dumps(data)


def array_row(base: Job, indices: Sequence[int]) -> str:
    """An array's `arrays` row: every field of its elements as submitted, but their ids and indices; and
    its indices, in the order of its elements' ids (`span`: [start, stop, step] of a range; else
    `indices`)."""
    data = _data(base)
    data.pop("array_index")
    if isinstance(indices, range):
        data["span"] = [indices.start, indices.stop, indices.step]
    else:
        data["indices"] = list(indices)
    return _dumps(data)


def element_row(array_id: int, index: int) -> str:
    """An element's row as submitted (its values are its array's: `array_row`)."""
    return f'{{"array_id":{array_id},"array_index":{index}}}'


def element_rows_bytes(array_id: int, indices: Sequence[int]) -> int:
    """The bytes of the rows of an array's elements as submitted (element_row's, added up)."""
    return len(indices) * (len(element_row(array_id, 0)) - 1) + _digits(indices)


def _digits(indices: Sequence[int]) -> int:
    """The digits of the (whole, not negative) indices, added up; of a range, counted by widths."""
    if not isinstance(indices, range) or indices.step < 1:
        return sum(len(str(i)) for i in indices)

    def before(value: int) -> int:  # how many of the indices are below value
        return min(len(indices), max(0, -(-(value - indices.start) // indices.step)))

    widest = len(str(indices[-1])) if indices else 0
    return sum(
        width * (before(10**width) - before(10 ** (width - 1) if width > 1 else 0))
        for width in range(1, widest + 1)
    )


def array_class(text: str) -> Type[Job]:
    """The class of an array's elements (jobs.array_class) from its `arrays` row: they share its values.
    A row without the array's indices (an older gpu-mon's): each element keeps its own index."""
    data = json.loads(text)
    out: Dict[str, object] = {}
    for key, value in data.items():
        if key == "env":
            out[key] = _env(value)
        elif key in TUPLES:
            out[key] = tuple(value or ())
        elif key in _KNOWN:
            out[key] = value
    span, indices = data.get("span"), data.get("indices")
    order = range(*span) if isinstance(span, list) else tuple(indices) if isinstance(indices, list) else None
    return J.array_class(out, order)


def _env(value: object) -> Tuple[Tuple[str, str], ...]:
    return tuple((str(k), str(v)) for k, v in (value or {}).items())  # type: ignore[union-attr]


def from_row(job_id: int, text: str, arrays: Mapping[int, Type[Job]]) -> Job:
    """A job from its row (an array's element: its row's values over its array's class, from `arrays`)."""
    data = json.loads(text)
    cls = arrays.get(data.get("array_id") or 0)
    for key in TUPLES:
        if key in data or cls is None:
            data[key] = tuple(data.get(key) or ())
    if "env" in data or cls is None:
        data["env"] = _env(data.get("env"))
    fields = {k: v for k, v in data.items() if k in _KNOWN}
    return (cls or Job)(id=job_id, **fields)
