"""Logging to stderr: syslog priority prefixes when stderr is the journal, timestamps with milliseconds
elsewhere. Every message is one line with untrusted characters escaped (api/text.py); only a traceback
spans lines.

systemd sets JOURNAL_STREAM=DEV:INODE for a service whose stderr is connected to journald; when it matches
our stderr, every line (each line of a traceback too) starts with `<N>` so journald files it at priority N.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional, TextIO

from gpu_mon.api.text import sanitize

_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}


def stderr_is_journal(stream: Optional[TextIO] = None, env: Optional[dict] = None) -> bool:
    """Whether JOURNAL_STREAM names the file our stderr is."""
    env = os.environ if env is None else env
    value = env.get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    if not dev.isdigit() or not ino.isdigit():
        return False
    try:
        st = os.fstat((stream or sys.stderr).fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return st.st_dev == int(dev) and st.st_ino == int(ino)


_MAX_MESSAGE = 8192


class OneLine(logging.Filter):
    """Turn each record's message into one safe line (names, commands and output are untrusted)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = sanitize(record.getMessage(), _MAX_MESSAGE)
        record.args = None
        return True


class JournalFormatter(logging.Formatter):
    """`<6>message`, with the prefix on every line of a multi-line record."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        prio = _PRIORITY.get(record.levelno, 6 if record.levelno < logging.WARNING else 3)
        return "\n".join(f"<{prio}>{line}" for line in text.split("\n"))


def setup(debug: bool = False, stream: Optional[TextIO] = None) -> logging.Logger:
    """Configure the `gpu_mon` logger once; return it."""
    stream = stream or sys.stderr
    logger = logging.getLogger("gpu_mon")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(stream)
    if stderr_is_journal(stream):
        handler.setFormatter(JournalFormatter("%(message)s"))
    else:
        fmt = logging.Formatter("%(asctime)s.%(msecs)03d gpu-mon[%(process)d] %(levelname)s %(message)s")
        fmt.datefmt = "%Y-%m-%d %H:%M:%S"
        handler.setFormatter(fmt)
    handler.addFilter(OneLine())
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if debug else logging.INFO)
    logger.propagate = False
    return logger
