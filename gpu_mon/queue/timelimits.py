"""The admin's time limits ([queue] default_time_limit and max_time_limit, as Slurm's DefaultTime and
MaxTime): the limit a submit without one gets, and the refusal of one over the maximum (submit, update)."""

from __future__ import annotations

from gpu_mon.config import QueueSection
from gpu_mon.queue.fields import Bad

_UNITS = ((86400, "d"), (3600, "h"), (60, "m"))


def span(seconds: float) -> str:
    """A duration as `--time-limit` takes it: `2h`, `90m`, `1d`, `45s`, `1.5s`."""
    for size, unit in _UNITS:
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def within_max(limit: float, q: QueueSection) -> float:
    """The limit, when it is within [queue] max_time_limit; else Bad (code 1), one line."""
    top = q.max_time_limit
    if top is not None and limit > top:
        raise Bad(f"--time-limit {span(limit)} is over the queue's max_time_limit ({span(top)})", 1)
    return limit
