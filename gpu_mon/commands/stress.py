"""`gpu-mon stress`: its options and the call into the stressor (gpu_mon/stress/, where torch is imported)."""

from __future__ import annotations

import argparse
from typing import Dict, Tuple

from gpu_mon.stress.plan import HOLD_BLOCKS, UsageError, parse_config, parse_memory
from gpu_mon.stress.report import error

__all__ = ["UsageError", "add_arguments", "parse_memory", "run"]  # occupy checks --memory with parse_memory


DESCRIPTION = (
    "Hold a GPU's memory and keep its SMs busy until stopped (SIGTERM/SIGINT: it releases and ends by "
    "that signal within a fraction of a second, in every phase, start-up included). Exit codes: 0 "
    "--duration reached; 1 runtime failure or a --verify mismatch; 2 bad options, no torch, or no such "
    "device; killed by the stop signal (143, 130) when stopped."
)


def _opt(*flags: str, **options: object) -> Tuple[Tuple[str, ...], Dict[str, object]]:
    return flags, options


# Every option, in --help's order: (flags, argparse keywords)
_OPTIONS = (
    _opt(
        "--memory",
        default="88%",
        metavar="AMOUNT",
        help="memory to hold, buffers included: a percent of the device's free memory at start, or a size "
        "such as 20GiB or 512MiB (default: 88%%)",
    ),
    _opt(
        "--chunk-mib",
        default="512",
        metavar="MIB",
        help="with --hold chunks, allocate memory in chunks of this size; with blocks, no block smaller "
        "(default: 512; at least 10 on CUDA)",
    ),
    _opt(
        "--hold",
        default="one",
        metavar="{chunks,blocks,one}",
        help=f"how memory is held: one block, {HOLD_BLOCKS} equal blocks, or chunks of --chunk-mib; fewer "
        "allocations are fewer frees on a stop (default: one)",
    ),
    _opt(
        "--release",
        default="free-then-exit",
        metavar="{free-then-exit,exit}",
        help="on a stop: free every buffer, then exit; or exit at once and leave the freeing to the driver "
        "(default: free-then-exit)",
    ),
    _opt(
        "--workload",
        default="matmul",
        metavar="{matmul,elementwise,none}",
        help="matmul: dense N*N matrix products; elementwise: a*b+a over N*N buffers (memory bandwidth); "
        "none: hold memory only (default: matmul)",
    ),
    _opt(
        "--dtype",
        default=None,
        metavar="{bf16,fp16,tf32,fp32}",
        help="data type (default: bf16 on compute capability >= 8.0, else fp16; fp32 on cpu)",
    ),
    _opt(
        "--matmul-size",
        "--size",
        dest="matmul_size",
        default=None,
        metavar="N",
        help="side of the N*N work matrices (default: 8192 on CUDA, 1024 on cpu, halved while the buffers "
        "take over half of the memory target or one product takes over 50 ms)",
    ),
    _opt(
        "--compute-seconds",
        default="60",
        metavar="SECONDS",
        help="length of each compute phase of the duty cycle (default: 60)",
    ),
    _opt(
        "--sleep-seconds",
        default="0",
        metavar="SECONDS",
        help="idle pause after each compute phase, memory still held (default: 0, compute continuously)",
    ),
    _opt(
        "--duration",
        default=None,
        metavar="SECONDS",
        help="stop this long after the start line (default: run until signalled)",
    ),
    _opt(
        "--device",
        default="cuda",
        metavar="DEVICE",
        help="cuda (the first visible), cuda:N or N (within CUDA_VISIBLE_DEVICES), or cpu (default: cuda)",
    ),
    _opt(
        "--report-seconds",
        default="10",
        metavar="SECONDS",
        help="print throughput and memory held this often (default: 10)",
    ),
    _opt(
        "--verify",
        action="store_true",
        help="compare every result with a reference computed once; a mismatch exits 1 (faulty GPU)",
    ),
    _opt(
        "--inject-fault-at", default=None, help=argparse.SUPPRESS
    ),  # tests: corrupt the result of iteration N
    _opt("--assume-free-mib", default=None, help=argparse.SUPPRESS),  # tests: free memory for percent targets
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `stress` options to its subparser (values are checked by `parse_config`, one line each)."""
    parser.description = DESCRIPTION
    for flags, options in _OPTIONS:
        parser.add_argument(*flags, **options)  # type: ignore[arg-type]


def run(args: argparse.Namespace) -> int:
    """Run `gpu-mon stress` with parsed arguments: the exit code (0, 1 or 2), or it ends by a stop signal."""
    try:
        config = parse_config(args)
    except UsageError as exc:
        error(str(exc))
        return 2
    from gpu_mon.stress.stressor import run as run_stressor

    return run_stressor(config, debug=bool(getattr(args, "debug", False)))
