"""The config's schema: every kind of section and its keys, in one table (schema_daemon.py,
schema_features.py and schema_queue.py hold the keys). The parser, `gpu-mon check`, gpu_mon.conf(5) and
the comments of conf/gpu_mon.conf all follow it; tests fail when they drift apart."""

from __future__ import annotations

from typing import Callable, Dict, Tuple

from gpu_mon.config.key import Key, SectionSpec
from gpu_mon.config.schema_daemon import DEFAULTS, GPU, PROCESS, TTY
from gpu_mon.config.schema_features import HISTORY, METRICS, OCCUPY, SENTINEL, SLURM
from gpu_mon.config.schema_queue import QUEUE

__all__ = ["SECTIONS", "Key", "SectionSpec", "parsers", "spec"]

# In the order of conf/gpu_mon.conf and the man page.
SECTIONS: Tuple[SectionSpec, ...] = (
    DEFAULTS,
    GPU,
    PROCESS,
    TTY,
    HISTORY,
    METRICS,
    SENTINEL,
    OCCUPY,
    QUEUE,
    SLURM,
)
_BY_NAME = {s.name: s for s in SECTIONS}


def spec(kind: str) -> SectionSpec:
    """The spec of `defaults`, `gpu-NAME` (or `gpu-`), ... ; KeyError for an unknown kind."""
    return _BY_NAME[kind + "NAME" if kind.endswith("-") else kind]


def parsers(kind: str, base: str) -> Dict[str, Callable[[str], object]]:
    """{key: parser of its value} of a kind of section, with relative paths under `base`."""
    return {key.name: key.parser(base) for key in spec(kind).keys}
