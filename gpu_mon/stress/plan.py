"""The stressor's plan: its validated options, and how the memory target is split into allocations (pure).

Nothing here imports torch: `gpu-mon stress --help`, bad options and `occupy`'s --memory check need none.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

MIB = 1 << 20
WORKLOADS = ("matmul", "elementwise", "none")
DTYPES = ("bf16", "fp16", "tf32", "fp32")
CPU_DTYPES = ("bf16", "fp32")  # CPU half-precision matmul runs at ~1 GFLOP/s: one step would outlast a stop
# How the memory is held: --chunk-mib chunks (hundreds of frees on a stop), a few blocks, or one block (the
# default: on an H100 one block frees 88% of the GPU 58 ms after a newcomer's cuInit, chunks 204 ms).
HOLDS = ("chunks", "blocks", "one")
HOLD_BLOCKS = 8  # --hold blocks: the memory to fill in this many equal blocks (15 GiB each at 88% of 141 GB)
# On a stop: free every buffer and the allocator's cache, then exit (the memory is back before the exit line);
# or exit at once and let the driver (or the kernel, on cpu) free everything with the process.
RELEASES = ("free-then-exit", "exit")
DEFAULT_SIZE = {"cuda": 8192, "cpu": 1024}
MIN_AUTO_SIZE = 128
# On CPU a target is capped at this share of available memory: filling past it would wake the OOM killer.
CPU_AVAILABLE_FRACTION = 0.9
# The CUDA caching allocator rounds blocks >= 10 MiB to 2 MiB and serves 1-10 MiB requests from 20 MiB blocks;
# chunks stay >= 10 MiB in multiples of 2 MiB so that what is reserved is what was asked for.
CUDA_ROUND = 2 * MIB
CUDA_MIN_CHUNK = 10 * MIB
OOM_MIN_CHUNK = 16 * MIB
_UNITS = {
    "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}  # fmt: skip
_AMOUNT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z%]*)\s*$")


class UsageError(Exception):
    """A bad option or an unusable device or install: one line, exit code 2."""


@dataclass(frozen=True)
class StressConfig:
    """Validated `gpu-mon stress` options; sizes in bytes, times in seconds."""

    memory_percent: Optional[float]
    memory_bytes: Optional[int]
    chunk_bytes: int
    workload: str
    dtype: Optional[str]
    size: Optional[int]
    compute_seconds: float
    sleep_seconds: float
    duration_seconds: Optional[float]
    device: str
    report_seconds: float
    verify: bool
    inject_fault_at: Optional[int]
    assume_free_bytes: Optional[int]
    hold: str = "one"
    release: str = "free-then-exit"


def parse_memory(text: str) -> Tuple[Optional[float], Optional[int]]:
    """'88%' -> (88.0, None); '20GiB' -> (None, 21474836480); anything else raises UsageError."""
    match = _AMOUNT.match(text)
    if not match:
        raise UsageError(f"--memory {text!r}: expected a positive percent (88%) or size (20GiB, 512MiB)")
    value, unit = float(match.group(1)), match.group(2).lower()
    if unit == "%":
        if not 0 < value <= 100:
            raise UsageError(f"--memory {text!r}: a percent must be above 0 and at most 100")
        return value, None
    if unit not in _UNITS:
        raise UsageError(f"--memory {text!r}: give a unit: KiB, MiB, GiB, TiB (or KB, MB, GB, TB), or %")
    nbytes = int(value * _UNITS[unit])
    if nbytes < MIB:
        raise UsageError(f"--memory {text!r}: must be at least 1MiB")
    return None, nbytes


def parse_config(args: argparse.Namespace) -> StressConfig:
    """Check every option and return them as a StressConfig; raises UsageError naming the first bad one."""
    memory_percent, memory_bytes = parse_memory(args.memory)
    device = parse_device(args.device)
    dtype = _choice("--dtype", args.dtype, DTYPES) if args.dtype is not None else None
    if device == "cpu" and dtype not in (None, *CPU_DTYPES):
        raise UsageError(
            f"--dtype {dtype}: on cpu use {' or '.join(CPU_DTYPES)}; {dtype} is for CUDA devices"
        )
    size = _number("--matmul-size", args.matmul_size, int, 16) if args.matmul_size is not None else None
    if size is not None and size > 65536:
        raise UsageError(f"--matmul-size {size}: at most 65536")
    duration = None if args.duration is None else _number("--duration", args.duration, float, 0, strict=True)
    inject = (
        None if args.inject_fault_at is None else _number("--inject-fault-at", args.inject_fault_at, int, 1)
    )
    if inject is not None and not args.verify:
        raise UsageError("--inject-fault-at needs --verify")
    free_mib = (
        None if args.assume_free_mib is None else _number("--assume-free-mib", args.assume_free_mib, float, 1)
    )
    return StressConfig(
        memory_percent=memory_percent,
        memory_bytes=memory_bytes,
        chunk_bytes=_number("--chunk-mib", args.chunk_mib, int, 1) * MIB,
        workload=_choice("--workload", args.workload, WORKLOADS),
        dtype=dtype,
        size=size,
        compute_seconds=_number("--compute-seconds", args.compute_seconds, float, 0, strict=True),
        sleep_seconds=_number("--sleep-seconds", args.sleep_seconds, float, 0),
        duration_seconds=duration,
        device=device,
        report_seconds=_number("--report-seconds", args.report_seconds, float, 0, strict=True),
        verify=bool(args.verify),
        inject_fault_at=inject,
        assume_free_bytes=None if free_mib is None else int(free_mib * MIB),
        hold=_choice("--hold", args.hold, HOLDS),
        release=_choice("--release", args.release, RELEASES),
    )


def parse_device(text: str) -> str:
    """'cpu' -> 'cpu'; 'cuda', 'cuda:N' or 'N' -> 'cuda:N'."""
    spec = text.strip().lower()
    if spec == "cpu":
        return spec
    index = spec[len("cuda:") :] if spec.startswith("cuda:") else ("0" if spec == "cuda" else spec)
    if not index.isdigit():
        raise UsageError(f"--device {text!r}: expected cuda, cuda:N, N or cpu")
    return f"cuda:{int(index)}"


def _choice(option: str, value: str, choices: Tuple[str, ...]) -> str:
    """`value` if it is one of `choices`, else UsageError."""
    if value not in choices:
        raise UsageError(f"{option} {value!r}: expected one of {', '.join(choices)}")
    return value


def _number(option: str, text: str, kind: type, low: float, strict: bool = False) -> Any:
    """`text` as an int or a finite float that is >= low (> low when strict), else UsageError."""
    try:
        value = kind(text)
    except ValueError:
        raise UsageError(
            f"{option} {text!r}: expected {'an integer' if kind is int else 'a number'}"
        ) from None
    if not math.isfinite(value):
        raise UsageError(f"{option} {text!r}: expected a finite number")
    if value < low or (strict and value == low):
        raise UsageError(f"{option} {text!r}: must be {'above' if strict else 'at least'} {low:g}")
    return value


def chunk_bytes(config: StressConfig, to_fill: int, cuda: bool) -> int:
    """The size of each allocation that fills `to_fill` bytes, as --hold asks (the last one may be smaller).

    chunks: --chunk-mib; blocks: `to_fill` in HOLD_BLOCKS equal parts, none below --chunk-mib; one: `to_fill`
    at once. On CUDA a multiple of 2 MiB of at least 10 MiB (what the caching allocator reserves exactly).
    """
    size = config.chunk_bytes
    if config.hold == "blocks":
        size = max(size, -(-to_fill // HOLD_BLOCKS))
    elif config.hold == "one":
        size = to_fill
    if not cuda:
        return size
    up = config.hold != "chunks"  # a block is cut to what is left by the fill; a chunk keeps its size
    return max(CUDA_MIN_CHUNK, (-(-size // CUDA_ROUND) if up else size // CUDA_ROUND) * CUDA_ROUND)


def matrix_size(config: StressConfig, device_type: str, target: int, need: Callable[[int], int]) -> int:
    """Side of the work matrices within the target (0 for --workload none); `need(n)`: bytes of size n."""
    if config.workload == "none":
        return 0
    if config.size is not None:
        if need(config.size) > target:
            raise UsageError(
                f"--matmul-size {config.size}: its buffers need {mib(need(config.size))} MiB, more than the "
                f"memory target of {mib(target)} MiB; lower --matmul-size or raise --memory"
            )
        return config.size
    size = DEFAULT_SIZE[device_type]
    while size > MIN_AUTO_SIZE and need(size) > target // 2:
        size //= 2
    if need(size) > target:
        raise UsageError(f"memory target of {mib(target)} MiB is too small for --workload {config.workload}")
    return size


def target_bytes(config: StressConfig, free: int, cpu_available: Optional[int]) -> Tuple[int, bool]:
    """(bytes to hold, whether capped): --memory of `free`; on cpu at most 90% of `cpu_available`."""
    target = config.memory_bytes if config.memory_percent is None else int(free * config.memory_percent / 100)
    if cpu_available is not None:
        cap = int(cpu_available * CPU_AVAILABLE_FRACTION)
        if target > cap:
            return cap, True
    return target, False


def mib(nbytes: float) -> str:
    """Bytes as MiB for log lines."""
    return f"{nbytes / MIB:.1f}"
