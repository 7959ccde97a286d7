"""INI text -> frozen dataclasses. Strict: every error in a file is reported at once, with its line.

The format is the gpu_mon seed's: `[defaults]`, `[gpu-NAME]`, `[process-NAME]`, `[tty]`, ...; `key = value`
(or `key: value`); full-line comments with `;` or `#`; an indented line continues the previous value. Keys
are case-insensitive. Relative paths are relative to the directory of the config file. Drop-ins
(`PATH.d/*.conf`) are read after it and override it key by key (load.py).

The package: lexer.py (lines -> sections), values.py (the value types), schema.py with schema_daemon.py and
schema_features.py (every section's keys: type, default, doc), model.py (the dataclasses), sections.py and
sections_features.py (a section -> its dataclass), load.py (files -> Config), manpage.py (gpu_mon.conf(5)).
"""

from __future__ import annotations

import os  # noqa: F401  (tests patch config.os.getgrouplist)

from gpu_mon.config.load import (
    DEFAULT_PATH,
    MAX_CONFIG_BYTES,
    MAX_MESSAGE,
    dropin_dir,
    dropin_paths,
    load,
    parse,
    sort_by_line,
    trusted_uid_for_this_process,
)
from gpu_mon.config.model import (
    DEFAULT_TTY_DEVICES,
    KILL_ACTIONS,
    QUEUE_ORDERS,
    SLURM_ACTIONS,
    Config,
    ConfigError,
    Defaults,
    GpuSection,
    HistorySection,
    MetricsSection,
    OccupySection,
    ProcessSection,
    QueueSection,
    SentinelSection,
    SlurmSection,
    TtySection,
    line_of,
)
from gpu_mon.config.sections import MAX_VALUE_CHARS
from gpu_mon.config.values import (
    MAX_MIB,
    MAX_SECONDS,
    MIN_FULL_SCAN_SECONDS,
    MIN_INTERVAL_SECONDS,
    MIN_RESTART_DELAY_SECONDS,
    STOP_SIGNALS,
    GpuSelection,
    fraction,
    listen_address,
    parse_command,
    parse_gpus,
    stop_signal,
)

__all__ = [
    "DEFAULT_PATH",
    "DEFAULT_TTY_DEVICES",
    "KILL_ACTIONS",
    "MAX_CONFIG_BYTES",
    "MAX_MESSAGE",
    "MAX_MIB",
    "MAX_SECONDS",
    "MAX_VALUE_CHARS",
    "MIN_FULL_SCAN_SECONDS",
    "MIN_INTERVAL_SECONDS",
    "MIN_RESTART_DELAY_SECONDS",
    "QUEUE_ORDERS",
    "SLURM_ACTIONS",
    "STOP_SIGNALS",
    "Config",
    "ConfigError",
    "Defaults",
    "GpuSection",
    "GpuSelection",
    "HistorySection",
    "MetricsSection",
    "OccupySection",
    "ProcessSection",
    "QueueSection",
    "SentinelSection",
    "SlurmSection",
    "TtySection",
    "dropin_dir",
    "dropin_paths",
    "fraction",
    "line_of",
    "listen_address",
    "load",
    "parse",
    "parse_command",
    "parse_gpus",
    "sort_by_line",
    "stop_signal",
    "trusted_uid_for_this_process",
]
