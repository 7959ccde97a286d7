"""What [metrics] exposes, as plain data: Family, made by metrics.py and rendered by exposition.py (which
therefore never imports metrics.py), and MetricsError."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


class MetricsError(Exception):
    """[metrics] cannot be served (the extra is missing, the port is taken...); str() is one line."""


@dataclass(frozen=True)
class Family:
    """One metric as exposed. A histogram sample's value is (cumulative counts per bucket and +Inf, sum)."""

    name: str  # counters end in _total
    kind: str  # gauge, counter or histogram
    help: str
    labels: Tuple[str, ...]
    samples: Tuple[Tuple[Tuple[str, ...], object], ...]
    buckets: Tuple[float, ...] = ()
