"""The stressor's words: a line per event on stdout (read line by line under the daemon), errors on stderr."""

from __future__ import annotations

import sys


def say(line: str) -> None:
    """One log line on stdout, flushed: under the daemon stdout is read line by line."""
    print(f"stress: {line}", flush=True)


def error(line: str) -> None:
    """One error line on stderr."""
    print(f"gpu-mon stress: error: {line}", file=sys.stderr, flush=True)


def fault(where: str, what: str) -> None:
    """The FAULT line of a --verify mismatch, naming the device."""
    print(f"gpu-mon stress: FAULT: {where}: {what}; this device may be faulty", file=sys.stderr, flush=True)


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message, with its type."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def figure(rate: float, decimals: int) -> str:
    """A rate with `decimals` places, or 3 significant digits when that would print a nonzero rate as 0.

    A small matmul on a busy CPU does real work at 0.0002 TFLOPS; "0.000" would read as no work at all.
    """
    text = f"{rate:.{decimals}f}"
    return f"{rate:.3g}" if rate > 0 and float(text) == 0 else text
