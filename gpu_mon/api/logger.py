"""The library's loggers, quiet unless the application sets logging up (a NullHandler on "gpu_mon").

Here rather than in the package's __init__: the workload leader imports gpu_mon.api.procfs, and starts
without loading logging (tens of milliseconds it would add to every job's start)."""

from __future__ import annotations

import logging


def logger(name: str) -> logging.Logger:
    """The logger `name` (a module's __name__, under "gpu_mon"); a library stays quiet unless asked."""
    top = logging.getLogger("gpu_mon")
    if not any(isinstance(h, logging.NullHandler) for h in top.handlers):
        top.addHandler(logging.NullHandler())
    return logging.getLogger(name)
