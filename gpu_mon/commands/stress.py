"""`gpu-mon stress`: hold a GPU's memory, keep its SMs busy, check the results, and leave at once when told.

The only module of gpu_mon that imports torch, and only inside `run`, so every other command works without it.

Budget: the target counts everything the stressor holds (compute buffers, cuBLAS workspace, reduction scratch,
memory chunks). All compute buffers are allocated and exercised once before the chunks fill the rest, so the
loop itself allocates nothing new. Stop path: SIGTERM/SIGINT only set a flag and wake a pipe; the loop checks
the flag between windows of ~25 ms of GPU work and never has more than two windows queued on the stream.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import select
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

MIB = 1 << 20
WORKLOADS = ("matmul", "elementwise", "none")
DTYPES = ("bf16", "fp16", "tf32", "fp32")
CPU_DTYPES = ("bf16", "fp32")  # CPU half-precision matmul runs at ~1 GFLOP/s: one step would outlast a stop
DEFAULT_SIZE = {"cuda": 8192, "cpu": 1024}
MIN_AUTO_SIZE = 128
# Verify tolerance relative to the largest |reference| value: two units in the last place of the result type
# (bf16 keeps 8 significant bits, fp16 11). fp32/tf32 results can differ only by summation order, if at all.
REL_TOLERANCE = {"bf16": 2.0**-6, "fp16": 2.0**-9, "tf32": 2.0**-12, "fp32": 2.0**-14}
# A window is this much GPU work; at most two are queued, so a stop waits for at most ~50 ms of kernels.
WINDOW_SECONDS = 0.025
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


class _Fault(Exception):
    """A verify window whose results differ from the reference by more than the tolerance."""


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `stress` options to its subparser (values are checked by `parse_config`, one line each)."""
    parser.description = (
        "Hold a GPU's memory and keep its SMs busy until stopped (SIGTERM/SIGINT: exit 0 within a "
        "fraction of a second). Exit codes: 0 stopped or --duration reached; 1 runtime failure or a "
        "--verify mismatch; 2 bad options, no torch, or no such device."
    )
    add = parser.add_argument
    add(
        "--memory",
        default="88%",
        metavar="AMOUNT",
        help="memory to hold, buffers included: a percent of the device's free memory at start, or a size "
        "such as 20GiB or 512MiB (default: 88%%)",
    )
    add(
        "--chunk-mib",
        default="512",
        metavar="MIB",
        help="allocate memory in chunks of this size (default: 512; at least 10 on CUDA)",
    )
    add(
        "--workload",
        default="matmul",
        metavar="{matmul,elementwise,none}",
        help="matmul: dense N*N matrix products; elementwise: a*b+a over N*N buffers (memory bandwidth); "
        "none: hold memory only (default: matmul)",
    )
    add(
        "--dtype",
        default=None,
        metavar="{bf16,fp16,tf32,fp32}",
        help="data type (default: bf16 on compute capability >= 8.0, else fp16; fp32 on cpu)",
    )
    add(
        "--matmul-size",
        "--size",
        dest="matmul_size",
        default=None,
        metavar="N",
        help="side of the N*N work matrices (default: 8192 on CUDA, 1024 on cpu, halved while the buffers "
        "take over half of the memory target or one product takes over 50 ms)",
    )
    add(
        "--compute-seconds",
        default="60",
        metavar="SECONDS",
        help="length of each compute phase of the duty cycle (default: 60)",
    )
    add(
        "--sleep-seconds",
        default="0",
        metavar="SECONDS",
        help="idle pause after each compute phase, memory still held (default: 0, compute continuously)",
    )
    add(
        "--duration",
        default=None,
        metavar="SECONDS",
        help="stop this long after the start line (default: run until signalled)",
    )
    add(
        "--device",
        default="cuda",
        metavar="DEVICE",
        help="cuda (the first visible), cuda:N or N (within CUDA_VISIBLE_DEVICES), or cpu (default: cuda)",
    )
    add(
        "--report-seconds",
        default="10",
        metavar="SECONDS",
        help="print throughput and memory held this often (default: 10)",
    )
    add(
        "--verify",
        action="store_true",
        help="compare every result with a reference computed once; a mismatch exits 1 (faulty GPU)",
    )
    add("--inject-fault-at", default=None, help=argparse.SUPPRESS)  # tests: corrupt the result of iteration N
    add("--assume-free-mib", default=None, help=argparse.SUPPRESS)  # tests: free memory for percent targets


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
    device = _parse_device(args.device)
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
    )


def run(args: argparse.Namespace) -> int:
    """Run `gpu-mon stress` with parsed arguments; returns the exit code (0, 1 or 2)."""
    debug = bool(getattr(args, "debug", False))
    try:
        config = parse_config(args)
    except UsageError as exc:
        _error(str(exc))
        return 2
    with _StopSignal() as stop:
        stressor = _Stressor(config, stop)
        try:
            return stressor.run()
        except UsageError as exc:
            _error(str(exc))
            return 2
        except Exception as exc:
            if debug:
                raise
            _error(f"{config.device}: {_one_line(exc)}")
            return 1
        finally:
            stressor.release()


def _parse_device(text: str) -> str:
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


def _say(line: str) -> None:
    """One log line on stdout, flushed: under the daemon stdout is read line by line."""
    print(f"stress: {line}", flush=True)


def _error(line: str) -> None:
    """One error line on stderr."""
    print(f"gpu-mon stress: error: {line}", file=sys.stderr, flush=True)


def _one_line(exc: BaseException) -> str:
    """The first line of an exception's message, with its type."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _mib(nbytes: float) -> str:
    """Bytes as MiB for log lines."""
    return f"{nbytes / MIB:.1f}"


def _figure(rate: float, decimals: int) -> str:
    """A rate with `decimals` places, or 3 significant digits when that would print a nonzero rate as 0.

    A small matmul on a busy CPU does real work at 0.0002 TFLOPS; "0.000" would read as no work at all.
    """
    text = f"{rate:.{decimals}f}"
    return f"{rate:.3g}" if rate > 0 and float(text) == 0 else text


class _StopSignal:
    """SIGTERM and SIGINT only record themselves and wake `wait`; the previous handlers return on exit."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        self._saved: List[Tuple[int, Any]] = []
        self._saved_fd: Optional[int] = None

    def __enter__(self) -> _StopSignal:
        try:
            self._saved_fd = signal.set_wakeup_fd(self._wfd, warn_on_full_buffer=False)
        except ValueError:  # not the main thread: no signals reach us; --duration still ends the run
            return self
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._saved.append((signum, signal.signal(signum, self._handle)))
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._saved:
            signal.signal(signum, handler)
        if self._saved_fd is not None:
            signal.set_wakeup_fd(self._saved_fd)
        os.close(self._rfd)
        os.close(self._wfd)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum

    @property
    def reason(self) -> Optional[str]:
        """The name of the stop signal received, or None."""
        return None if self.signum is None else signal.Signals(self.signum).name

    def wait(self, seconds: float) -> None:
        """Sleep up to `seconds`; a signal's byte on the wakeup pipe ends the sleep at once."""
        if self.signum is None and seconds > 0:
            select.select([self._rfd], [], [], seconds)
        try:
            while os.read(self._rfd, 512):
                pass
        except BlockingIOError:
            pass


def _import_torch() -> Any:
    """torch, imported now (not at module load) so that gpu-mon works without it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Failed to initialize NumPy" on installs without numpy
            import torch
    except ImportError as exc:
        raise UsageError(
            f"cannot import torch ({exc}); the stressor needs the stress extra: "
            "pip install 'gpu-mon[stress]' (with the torch build that matches your CUDA driver)"
        ) from None
    return torch


def _open_device(torch: Any, spec: str) -> Any:
    """The torch.device for 'cpu' or 'cuda:N', made current; UsageError when it is not visible."""
    if spec == "cpu":
        return torch.device("cpu")
    index = int(spec.split(":")[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a broken driver warns once; our line below says it all
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        why = (
            f"this torch {torch.__version__} has no CUDA support"
            if torch.version.cuda is None
            else "none found"
        )
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        raise UsageError(f"--device {spec}: no CUDA device visible ({why}; CUDA_VISIBLE_DEVICES={visible})")
    if index >= count:
        raise UsageError(f"--device {spec}: only {count} CUDA device(s) visible (cuda:0..cuda:{count - 1})")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _is_oom(exc: BaseException) -> bool:
    """Whether an allocation or launch failed for lack of memory (CUDA or CPU allocator)."""
    return (
        isinstance(exc, MemoryError)
        or type(exc).__name__ == "OutOfMemoryError"
        or (
            isinstance(exc, RuntimeError)
            and ("out of memory" in str(exc) or "can't allocate memory" in str(exc))
        )
    )


class _Work:
    """Preallocated buffers and one step of a compute workload; a step allocates nothing."""

    def __init__(self, torch: Any, device: Any, kind: str, dtype: str, size: int) -> None:
        self.torch, self.kind, self.dtype, self.size = torch, kind, dtype, size
        self.scalar = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
        gen = torch.Generator(device=device).manual_seed(1234)
        self.a = torch.randn((size, size), generator=gen, device=device, dtype=self.scalar)
        self.b = torch.randn((size, size), generator=gen, device=device, dtype=self.scalar)
        if kind == "matmul":  # entries of a@b come out ~N(0, 1): no overflow in fp16
            self.a.mul_(size**-0.25)
            self.b.mul_(size**-0.25)
        self.out = torch.empty_like(self.a)
        self.flops = 2.0 * size**3 if kind == "matmul" else 2.0 * size**2
        self.bytes_moved = 3.0 * size * size * self.a.element_size()
        self.ref: Any = None

    @staticmethod
    def workspace_bytes(kind: str, dtype: str, size: int, verify: bool) -> int:
        """Bytes of the buffers a workload of this kind, type and size allocates."""
        element = 2 if dtype in ("bf16", "fp16") else 4
        return (3 + verify) * size * size * element + (4 * size * element if verify else 0)

    def nbytes(self) -> int:
        """Bytes held by this workload's own tensors."""
        tensors = [self.a, self.b, self.out] + (
            [self.ref, self.rows, self.acc] if self.ref is not None else []
        )
        return sum(t.numel() * t.element_size() for t in tensors)

    def step(self) -> None:
        """One unit of work into the preallocated output."""
        if self.kind == "matmul":
            self.torch.mm(self.a, self.b, out=self.out)
        else:
            self.torch.addcmul(self.a, self.a, self.b, out=self.out)

    def enable_verify(self) -> None:
        """Keep the current output as the reference and set up the error buffers (setup time, allocates)."""
        torch, n = self.torch, self.size
        self.step()
        self.ref = self.out.clone()
        scale = float(self.ref.abs().max())
        self.tolerance = REL_TOLERANCE[self.dtype] * max(scale, 1e-3)
        self.fault = 4.0 * max(scale, 1.0)
        self.rows = torch.empty((2, n), device=self.out.device, dtype=self.scalar)  # per row: -min, max
        self.acc = torch.zeros((2, n), device=self.out.device, dtype=self.scalar)
        pin = self.out.device.type == "cuda"
        self.host = [torch.zeros((2, n), dtype=self.scalar, pin_memory=pin) for _ in range(2)]

    def accumulate_error(self) -> None:
        """Fold max|out - ref| per row into the window's error buffer (NaN propagates).

        Two kernels over the output (subtract; min and max in one reduction) move 4 n*n elements, where
        sub/abs/amax would move 6: on an H100 (bf16, n=8192) --verify runs ~12% below the rate without.
        """
        self.out.sub_(self.ref)
        self.torch.aminmax(self.out, dim=1, out=(self.rows[0], self.rows[1]))
        self.rows[0].neg_()
        self.torch.maximum(self.acc, self.rows, out=self.acc)

    def flush_error(self, slot: int) -> None:
        """Queue the window's error buffer to host buffer `slot` and reset it."""
        self.host[slot].copy_(self.acc, non_blocking=True)
        self.acc.zero_()

    def window_error(self, slot: int) -> float:
        """The largest error of a finished window (read after its event completed)."""
        return float(self.host[slot].max())

    def corrupt(self, amount: Optional[float] = None) -> None:
        """Add a wrong value to one element of the output, as a silent hardware error would."""
        self.out.view(-1)[0].add_(self.fault if amount is None else amount)


class _Stressor:
    """One run: plan the memory, set up the workload, fill memory, loop until stopped, release everything."""

    def __init__(self, config: StressConfig, stop: _StopSignal) -> None:
        self.cfg, self.stop = config, stop
        self.torch: Any = None
        self.device: Any = None
        self.work: Optional[_Work] = None
        self.chunks: List[Any] = []
        self.events: List[Any] = []
        self.inflight: List[Tuple[int, int, int]] = []  # (slot, first, last iteration) launched, not retired
        self.iterations = self.completed = self.windows = 0
        self.window_iterations = 1
        self.step_ms = 0.0
        self.looping = False  # iterations are numbered (and faults injected) from the loop's start
        self.busy_seconds = 0.0
        self.busy_since: Optional[float] = None
        self.t0 = time.monotonic()
        self.marks = (0, 0.0)  # (completed iterations, busy seconds) at the last report

    def run(self) -> int:
        """Set up and loop; returns 0 when stopped or done, 1 on a verify mismatch."""
        self.torch = _import_torch()
        if self.stop.reason is not None:  # signalled while torch was loading: no need for a CUDA context
            return self._finish(self.stop.reason, 0)
        self.device = _open_device(self.torch, self.cfg.device)
        target, free, capped = self._target()
        dtype, size = self._dtype(), self._size(target)
        try:
            if size and self.stop.reason is None:
                size = self._setup_work(dtype, size)
            oom = self.stop.reason is None and self._fill(target)
            if oom:
                self._back_off()
            if self.stop.reason is not None:
                return self._finish(self.stop.reason, 0)
            self._say_start(target, free, capped or oom, dtype, size)
            reason = self._loop()
            self._drain()
        except _Fault as fault:
            print(
                f"gpu-mon stress: FAULT: {self._where()}: {fault}; this device may be faulty",
                file=sys.stderr,
                flush=True,
            )
            return self._finish("fault", 1)
        return self._finish(reason, 0)

    def release(self) -> None:
        """Drop every buffer and give device memory back to the driver (all but the CUDA context)."""
        self.chunks.clear()
        self.work = None
        self.events = []
        if self.device is not None and self.device.type == "cuda":
            torch = self.torch
            try:
                torch.cuda.synchronize(self.device)
                # cuBLAS keeps its workspace (32 MiB on H100) until exit; this private helper, where present,
                # hands it to the cache so that empty_cache returns it too.
                getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
                torch.cuda.empty_cache()
            except Exception:  # a failed GPU: the driver frees everything when the process exits
                pass

    def _target(self) -> Tuple[int, int, bool]:
        """(target bytes, free bytes at start, whether the target was capped to what the host has)."""
        cfg, torch = self.cfg, self.torch
        if cfg.assume_free_bytes is not None:
            free = cfg.assume_free_bytes
        elif self.device.type == "cuda":
            free = int(torch.cuda.mem_get_info(self.device)[0])
        else:
            free = _cpu_available()
        target = cfg.memory_bytes if cfg.memory_percent is None else int(free * cfg.memory_percent / 100)
        if self.device.type == "cpu":
            cap = int(_cpu_available() * CPU_AVAILABLE_FRACTION)
            if target > cap:
                return cap, free, True
        return target, free, False

    def _dtype(self) -> str:
        """The configured dtype, or the fastest one the device has tensor cores for."""
        if self.cfg.dtype is not None:
            return self.cfg.dtype
        if self.device.type == "cpu":
            return "fp32"
        return "bf16" if self.torch.cuda.get_device_capability(self.device)[0] >= 8 else "fp16"

    def _size(self, target: int) -> int:
        """Side of the work matrices, within the target (0 for --workload none)."""
        cfg = self.cfg
        if cfg.workload == "none":
            return 0
        dtype = self._dtype()

        def need(n: int) -> int:
            return _Work.workspace_bytes(cfg.workload, dtype, n, cfg.verify)

        if cfg.size is not None:
            if need(cfg.size) > target:
                raise UsageError(
                    f"--matmul-size {cfg.size}: its buffers need {_mib(need(cfg.size))} MiB, more than the "
                    f"memory target of {_mib(target)} MiB; lower --matmul-size or raise --memory"
                )
            return cfg.size
        size = DEFAULT_SIZE[self.device.type]
        while size > MIN_AUTO_SIZE and need(size) > target // 2:
            size //= 2
        if need(size) > target:
            raise UsageError(
                f"memory target of {_mib(target)} MiB is too small for --workload {cfg.workload}"
            )
        return size

    def _setup_work(self, dtype: str, size: int) -> int:
        """Set up the workload, halving a default size while a step outlasts two windows; returns the size."""
        while True:
            step_seconds = self._build_work(dtype, size)
            if step_seconds <= 2 * WINDOW_SECONDS or self.cfg.size is not None or size <= MIN_AUTO_SIZE:
                break
            size //= 2  # a slow device: 8x less work per step keeps a stop prompt
            self.work = None
            if self.device.type == "cuda":
                self.torch.cuda.empty_cache()
        self.window_iterations = max(1, min(1000, int(WINDOW_SECONDS / step_seconds)))
        self.step_ms = step_seconds * 1e3
        self._flush(0)
        self._sync()
        self._check(0, "warm-up")
        return size

    def _build_work(self, dtype: str, size: int) -> float:
        """Allocate the workload and run every kernel of the loop once; returns the seconds of one step."""
        torch, cfg = self.torch, self.cfg
        self.work = _Work(torch, self.device, cfg.workload, dtype, size)
        if self.device.type == "cuda":
            self.events = [torch.cuda.Event(blocking=True) for _ in range(2)]  # blocking: no CPU spin
        if cfg.verify:
            self.work.enable_verify()
        if cfg.inject_fault_at is not None:
            self.work.corrupt(0.0)  # load its kernel now, not on a full device
        self._iterate(2)  # first launches load kernels and create the cuBLAS workspace
        self._sync()
        start, count = time.perf_counter(), 0
        while count < 1 or (time.perf_counter() - start < 0.05 and count < 1000):
            self._iterate(1)
            self._sync()
            count += 1
        return (time.perf_counter() - start) / count

    def _iterate(self, count: int) -> None:
        """Launch `count` steps (with fault injection and error folding as configured)."""
        work, cfg = self.work, self.cfg
        for _ in range(count):
            self.iterations += 1
            work.step()
            if self.looping and self.iterations == cfg.inject_fault_at:
                work.corrupt()
            if cfg.verify:
                work.accumulate_error()

    def _sync(self) -> None:
        """Wait for all launched work on the device."""
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _flush(self, slot: int) -> None:
        """Queue the verify error of the current window to host buffer `slot`."""
        if self.cfg.verify:
            self.work.flush_error(slot)

    def _check(self, slot: int, span: str) -> None:
        """Raise _Fault when the finished window in `slot` exceeds the tolerance."""
        if not self.cfg.verify:
            return
        work = self.work
        error = work.window_error(slot)
        if not error <= work.tolerance:  # NaN fails too
            raise _Fault(
                f"wrong {work.kind} results in {span}: max_abs_error={error:.6g} > "
                f"tolerance={work.tolerance:.6g} ({work.dtype}, n={work.size})"
            )

    def _fill(self, target: int) -> bool:
        """Allocate chunks until the held memory reaches the target; returns True if an allocation failed."""
        torch, cuda = self.torch, self.device.type == "cuda"
        chunk, oom = self._chunk_bytes(), False
        while self.stop.reason is None:
            want = min(chunk, target - self._held())
            if cuda:
                want = want // CUDA_ROUND * CUDA_ROUND
                if want < CUDA_MIN_CHUNK:
                    break
            elif want <= 0:
                break
            try:
                block = torch.empty(want, dtype=torch.uint8, device=self.device)
            except Exception as exc:
                if not _is_oom(exc):
                    raise
                oom = True
                if chunk <= OOM_MIN_CHUNK:
                    break
                chunk //= 2
                continue
            if not cuda:
                block.fill_(0x5A)  # CPU pages become resident only when written
            self.chunks.append(block)
        return oom

    def _back_off(self) -> None:
        """After an out-of-memory: give back a chunk as slack and re-run the loop's work until it fits."""
        while True:
            if self.chunks:
                self.chunks.pop()
            if self.device.type == "cuda":
                self.torch.cuda.empty_cache()  # the failed allocation also emptied the scratch cache
            if self.work is None:
                return
            try:
                self._iterate(1)
                self._flush(0)
                self._sync()
                self._check(0, "warm-up")
                return
            except Exception as exc:
                if not (_is_oom(exc) and self.chunks):
                    raise

    def _held(self) -> int:
        """Bytes held now: what the CUDA allocator has reserved, or our CPU tensors."""
        if self.device.type == "cuda":
            return int(self.torch.cuda.memory_reserved(self.device))
        work = self.work.nbytes() if self.work is not None else 0
        return work + sum(c.numel() for c in self.chunks)

    def _chunk_bytes(self) -> int:
        """--chunk-mib, raised on CUDA to the smallest size the caching allocator reserves exactly."""
        if self.device.type == "cuda":
            return max(CUDA_MIN_CHUNK, self.cfg.chunk_bytes // CUDA_ROUND * CUDA_ROUND)
        return self.cfg.chunk_bytes

    def _identity(self) -> Tuple[str, str]:
        """(name, UUID) of the CUDA device; ('', '') on cpu."""
        if self.device.type != "cuda":
            return "", ""
        props = self.torch.cuda.get_device_properties(self.device)
        uuid = str(getattr(props, "uuid", ""))
        return props.name, (uuid if not uuid or uuid.startswith("GPU-") else f"GPU-{uuid}")

    def _where(self) -> str:
        """The device for messages: cuda:N with its name and UUID, or cpu."""
        name, uuid = self._identity()
        return f"{self.device} ({name}, {uuid})" if name else str(self.device)

    def _say_start(self, target: int, free: int, backoff: bool, dtype: str, size: int) -> None:
        """The start line: device, target, what is held."""
        cfg, work = self.cfg, self.work
        how = f"{cfg.memory_percent:g}% of free" if cfg.memory_percent is not None else "absolute"
        name, uuid = self._identity()
        ident = f' name="{name}" uuid={uuid}' if name else ""
        line = (
            f"start device={self.device}{ident} workload={cfg.workload} target_mib={_mib(target)} ({how}) "
            f"free_mib={_mib(free)} memory_mib={_mib(self._held())} chunks={len(self.chunks)} "
            f"chunk_mib={_mib(self._chunk_bytes())} backoff={'yes' if backoff else 'no'}"
        )
        if work is not None:
            line += (
                f" dtype={dtype} size={size} workspace_mib={_mib(work.nbytes())} step_ms={self.step_ms:.3f} "
                f"window_iterations={self.window_iterations} verify={'yes' if cfg.verify else 'no'}"
            )
        if cfg.sleep_seconds > 0 and work is not None:
            line += f" compute_seconds={cfg.compute_seconds:g} sleep_seconds={cfg.sleep_seconds:g}"
        _say(line)
        self.t0 = time.monotonic()

    def _loop(self) -> str:
        """Compute (or idle) until a signal or --duration; returns why it ended."""
        cfg, now = self.cfg, self.t0
        end = now + cfg.duration_seconds if cfg.duration_seconds is not None else math.inf
        next_report = now + cfg.report_seconds
        phase = "compute" if self.work is not None else "idle"
        phase_end = now + cfg.compute_seconds if phase == "compute" and cfg.sleep_seconds > 0 else math.inf
        self.busy_since = now if phase == "compute" else None
        self.iterations = self.completed = 0
        self.looping = True
        self.marks = (0, 0.0)
        while True:
            if self.stop.reason is not None:
                return self.stop.reason
            now = time.monotonic()
            if now >= end:
                return "duration"
            if now >= phase_end:
                if phase == "compute":
                    self._drain()
                    phase, phase_end = "sleep", time.monotonic() + cfg.sleep_seconds
                else:
                    phase, phase_end = "compute", now + cfg.compute_seconds
                    self.busy_since = now
                continue
            if now >= next_report:
                self._report(now, phase)
                next_report = max(next_report + cfg.report_seconds, now + cfg.report_seconds / 2)
            if phase == "compute":
                self._window()
            else:
                self.stop.wait(min(end, phase_end, next_report) - now)

    def _window(self) -> None:
        """Launch one window of work, then wait until the window before it has finished."""
        slot, first = self.windows % 2, self.iterations + 1
        self._iterate(self.window_iterations)
        self._flush(slot)
        if self.events:
            self.events[slot].record()
        self.inflight.append((slot, first, self.iterations))
        self.windows += 1
        while len(self.inflight) > 1:
            self._retire()

    def _retire(self) -> None:
        """Wait for the oldest launched window and check its results."""
        slot, first, last = self.inflight.pop(0)
        if self.events:
            self.events[slot].synchronize()
        self.completed = last
        self._check(slot, f"iterations {first}-{last}")

    def _drain(self) -> None:
        """Wait for every launched window; close the busy interval."""
        while self.inflight:
            self._retire()
        if self.busy_since is not None:
            self.busy_seconds += time.monotonic() - self.busy_since
            self.busy_since = None

    def _busy(self, now: float) -> float:
        """Seconds spent in compute phases so far."""
        return self.busy_seconds + (now - self.busy_since if self.busy_since is not None else 0.0)

    def _rates(self, iterations: int, seconds: float) -> str:
        """Throughput fields for `iterations` done in `seconds` of compute."""
        if self.work is None:
            return ""
        tflops = iterations * self.work.flops / seconds / 1e12 if seconds > 0 else 0.0
        line = f" iterations={self.completed} tflops={_figure(tflops, 3)}"
        if self.work.kind == "elementwise":
            gb_per_s = iterations * self.work.bytes_moved / seconds / 1e9 if seconds > 0 else 0.0
            line += f" gb_per_s={_figure(gb_per_s, 1)}"
        return line

    def _report(self, now: float, phase: str) -> None:
        """A periodic line: phase, throughput since the last report, memory held."""
        done, busy = self.marks
        self.marks = (self.completed, self._busy(now))
        rates = self._rates(self.completed - done, self.marks[1] - busy)
        _say(f"report elapsed_s={now - self.t0:.1f} phase={phase}{rates} memory_mib={_mib(self._held())}")

    def _finish(self, reason: str, code: int) -> int:
        """Release everything, print the exit line (memory held after the release), return the exit code."""
        now = time.monotonic()
        rates = self._rates(self.completed, self._busy(now))
        verify = f" verify={'failed' if reason == 'fault' else 'ok'}" if self.cfg.verify and self.work else ""
        self.release()
        held = self._held() if self.device is not None else 0
        elapsed = now - self.t0
        _say(
            f"exit reason={reason} code={code} elapsed_s={elapsed:.1f}{rates}{verify} memory_mib={_mib(held)}"
        )
        return code


def _cpu_available() -> int:
    """Bytes of memory the kernel reports available (psutil)."""
    import psutil

    return int(psutil.virtual_memory().available)
