"""Command line: argument parsing, wiring of real adapters, exit codes."""
# Temporary stub while the core lands; `stress` is wired for real.
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from gpu_mon import __version__, stress


def build_parser() -> argparse.ArgumentParser:
    """The whole `gpu-mon` argument parser."""
    parser = argparse.ArgumentParser(prog="gpu-mon")
    parser.add_argument("--version", action="version", version=f"gpu-mon {__version__}")
    parser.add_argument("--debug", action="store_true", help="debug logging and tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    p_stress = sub.add_parser("stress", help="built-in CUDA stressor (needs the gpu-mon[stress] extra)")
    stress.add_arguments(p_stress)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `gpu-mon`; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.command == "stress":
        return stress.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
