"""Benchmark of `gpu-mon stress`; one command: `python bench/stress.py` (options: --help).

Measures in one run and prints a table:
  (a) the stressor's matmul TFLOP/s (a real `gpu-mon stress` subprocess) against a plain `torch.matmul` loop
      of the same size and dtype in this process, alternated A-B-B-A over the repeats (target ratio >= 0.95);
  (b) the memory it holds against its target (target: within 1%);
  (c) SIGTERM to the subprocess -> it exits, and (CUDA) NVML shows its memory released, sampled every 5 ms
      (target < 1 s).
On a machine without CUDA it runs small CPU sizes and marks the NVML rows "n/a (no GPU)".
`--json FILE` also writes the table's rows and the figures behind them (what bench/gpu_proof.py reads).

`--stop-latency` measures only how fast a stop ends a stressor that is still starting: `gpu-mon stress` (on
--device, default cpu) gets SIGTERM 0.15, 0.4 and 0.8 s after its launch (--delays), --trials times each;
the table gives SIGTERM -> exit p50 and worst per delay (target < 150 ms), the exit status, and in how many
trials the stressor had begun allocating (an exit line) rather than ended by the default action.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20
START_TIMEOUT_S = 180.0
NVML_POLL_S = 0.005
RELEASE_TIMEOUT_S = 15.0
STOPPED = -signal.SIGTERM  # a stopped stressor ends by the signal (after its exit line), in every phase


def import_torch() -> Any:
    """torch, without the NumPy warning of minimal installs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
    return torch


def fields(line: str) -> Dict[str, str]:
    """key=value pairs of a stressor log line."""
    return {k: v.strip('"') for k, v in re.findall(r'(\w+)=("[^"]*"|\S+)', line)}


def one_line(exc: BaseException) -> str:
    """First line of an exception, with its type."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


class Nvml:
    """Device memory used, read through NVML (pynvml) for one GPU named by UUID."""

    def __init__(self, uuid: str) -> None:
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        try:
            self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception:
            self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid.encode())

    def used_mib(self) -> float:
        """Memory used on the GPU (all processes), MiB."""
        return self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used / MIB

    def process_mib(self, pid: int) -> Optional[float]:
        """Memory NVML attributes to `pid` (CUDA context included), MiB; None if not listed."""
        for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if proc.pid == pid and proc.usedGpuMemory is not None:
                return proc.usedGpuMemory / MIB
        return None

    def driver(self) -> str:
        """The driver version."""
        version = self.nvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)


class Stressor:
    """A `gpu-mon stress` subprocess with its stdout lines collected by a thread."""

    def __init__(self, args: List[str]) -> None:
        self.command = [sys.executable, "-m", "gpu_mon", "stress", *args]
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        )
        self.proc = subprocess.Popen(
            self.command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.lines: List[str] = []
        self.errors: List[str] = []
        self.changed = threading.Condition()
        self.readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.lines), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.errors), daemon=True),
        ]
        for reader in self.readers:
            reader.start()

    def _read(self, stream: Any, sink: List[str]) -> None:
        for line in stream:
            with self.changed:
                sink.append(line.rstrip("\n"))
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait_line(self, prefix: str, timeout: float) -> Dict[str, str]:
        """Fields of the first stdout line starting with `prefix`; RuntimeError after `timeout` or exit."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for line in self.lines:
                    if line.startswith(prefix):
                        return fields(line)
                left = deadline - time.monotonic()
                if left <= 0 or (
                    self.proc.poll() is not None and not any(r.is_alive() for r in self.readers)
                ):
                    raise RuntimeError(f"no {prefix!r} line (exit {self.proc.poll()}): {self.errors[-1:]}")
                self.changed.wait(min(left, 0.5))

    def stop(self) -> None:
        """SIGKILL if still running."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def plain_tflops(torch: Any, device: str, dtype: str, size: int, seconds: float) -> float:
    """TFLOP/s of a plain `torch.matmul` loop: warm up, then time N back-to-back products with one sync.

    The product goes to a preallocated `out=` like the stressor's, so that neither side pays for allocation
    (on CPU a fresh 1 MiB result per product costs ~30% of the rate).
    """
    scalar = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    a = torch.randn(size, size, device=device, dtype=scalar) * size**-0.25
    b = torch.randn(size, size, device=device, dtype=scalar) * size**-0.25
    c = torch.empty_like(a)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    sync()
    start = time.perf_counter()
    for _ in range(5):
        torch.matmul(a, b, out=c)
    sync()
    count = max(5, int(seconds / ((time.perf_counter() - start) / 5)))
    start = time.perf_counter()
    for _ in range(count):
        torch.matmul(a, b, out=c)
    sync()
    elapsed = time.perf_counter() - start
    del a, b, c
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return 2.0 * size**3 * count / elapsed / 1e12


def run_ours(
    device: str, dtype: str, size: int, seconds: float, memory: str, extra: List[str]
) -> Dict[str, Any]:
    """Run the real stressor for `seconds` after its start line, SIGTERM it, and time the release."""
    args = ["--device", device, "--dtype", dtype, "--matmul-size", str(size), "--memory", memory]
    args += ["--report-seconds", f"{max(seconds / 2, 0.5):g}", *extra]
    nvml = baseline = None
    if device.startswith("cuda"):
        nvml = Nvml(gpu_uuid())
        baseline = nvml.used_mib()
    child = Stressor(args)
    result: Dict[str, Any] = {"command": " ".join(["gpu-mon", "stress", *args])}
    try:
        start = child.wait_line("stress: start ", START_TIMEOUT_S)
        result.update(start=start, target_mib=float(start["target_mib"]), held_mib=float(start["memory_mib"]))
        if nvml is not None:
            result["nvml_process_mib"] = nvml.process_mib(child.proc.pid)
            result["nvml_used_mib"] = nvml.used_mib()
        else:
            import psutil

            result["rss_mib"] = psutil.Process(child.proc.pid).memory_info().rss / MIB
        time.sleep(seconds)  # the measured run
        if child.proc.poll() is not None:
            raise RuntimeError(f"stressor exited early with {child.proc.returncode}: {child.errors[-1:]}")
        result.update(release_times(child, nvml, baseline))
        exit_line = child.wait_line("stress: exit ", 10)
        result.update(
            exit=exit_line, tflops=float(exit_line.get("tflops", "nan")), code=child.proc.returncode
        )
        if child.errors:
            result["stderr"] = child.errors[-1]
        return result
    finally:
        child.stop()


def release_times(child: Stressor, nvml: Optional[Nvml], baseline: Optional[float]) -> Dict[str, float]:
    """Milliseconds from SIGTERM to: held memory back (NVML), process exit, all memory back (NVML)."""
    held = nvml.used_mib() - baseline if nvml is not None else 0.0
    sent = time.perf_counter()
    child.proc.send_signal(signal.SIGTERM)
    times: Dict[str, float] = {}
    while time.perf_counter() - sent < RELEASE_TIMEOUT_S:
        now_ms = (time.perf_counter() - sent) * 1e3
        if "exit_ms" not in times and child.proc.poll() is not None:
            times["exit_ms"] = now_ms
        if nvml is not None:
            used = nvml.used_mib() - baseline
            if "released_ms" not in times and used <= max(1024.0, 0.02 * held):  # all but the CUDA context
                times["released_ms"] = now_ms
            if "all_released_ms" not in times and used <= 64.0:
                times["all_released_ms"] = now_ms
        if "exit_ms" in times and (nvml is None or "all_released_ms" in times):
            break
        time.sleep(NVML_POLL_S)
    return times


_UUID: Dict[str, str] = {}


def gpu_uuid() -> str:
    """UUID of cuda:0 as the stressor sees it (asked once from torch, no CUDA context needed for NVML)."""
    if "uuid" not in _UUID:
        torch = import_torch()
        uuid = str(torch.cuda.get_device_properties(0).uuid)
        _UUID["uuid"] = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    return _UUID["uuid"]


class Table:
    """Rows of the final table, printed at the end."""

    def __init__(self) -> None:
        self.rows: List[List[str]] = []
        self.figures: Dict[str, Any] = {}  # the numbers behind the rows, for --json

    def add(self, *cells: str) -> None:
        """One row: measurement, ours, reference, ratio, target, verdict."""
        self.rows.append([str(c) for c in cells])

    def attempt(self, name: str, measure: Callable[[], None]) -> None:
        """Run one measurement; a failure becomes an error row and the bench goes on."""
        try:
            measure()
        except Exception as exc:
            print(f"error: {name}: {one_line(exc)}", flush=True)
            self.add(name, "error", one_line(exc)[:60], "", "", "ERROR")

    def print(self) -> None:
        """The table, aligned."""
        header = ["measurement", "ours", "reference", "ratio", "target", "result"]
        rows = [header, *self.rows]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for index, row in enumerate(rows):
            print(" | ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
            if index == 0:
                print("-+-".join("-" * w for w in widths))

    def write_json(self, path: str, host: Dict[str, Any]) -> None:
        """The rows (as the table prints them) and the figures behind them."""
        keys = ["measurement", "ours", "reference", "ratio", "target", "result"]
        rows = [dict(zip(keys, row)) for row in self.rows]
        doc = {"host": host, "rows": rows, "figures": self.figures}
        Path(path).write_text(json.dumps(doc, indent=1, default=str) + "\n")


def verdict(ok: bool) -> str:
    """PASS or MISS."""
    return "PASS" if ok else "MISS"


def bench_rate(
    table: Table,
    opts: argparse.Namespace,
    torch: Any,
    dtype: str,
    repeats: int,
    seconds: float,
    memory: str,
    first: bool,
) -> float:
    """Row (a) for one dtype, plus (b) and (c) from the stressor runs when `first`; returns the plain rate."""
    ours: List[Dict[str, Any]] = []
    plain: List[float] = []
    for repeat in range(repeats):
        order = ("ours", "plain") if repeat % 2 == 0 else ("plain", "ours")
        for which in order:
            if which == "ours":
                result = run_ours(opts.device, dtype, opts.size, seconds, memory, [])
                print(f"  ours  {dtype} repeat {repeat + 1}: {describe(result)}", flush=True)
                ours.append(result)
            else:
                rate = plain_tflops(torch, opts.device, dtype, opts.size, seconds)
                print(f"  plain {dtype} repeat {repeat + 1}: {rate:.3f} TFLOP/s", flush=True)
                plain.append(rate)
    ours_rate, plain_rate = statistics.median(r["tflops"] for r in ours), statistics.median(plain)
    ratio = ours_rate / plain_rate
    table.figures.setdefault("rates", {})[dtype] = {
        "ours_tflops": [r["tflops"] for r in ours],
        "plain_tflops": plain,
        "ratio": ratio,
    }
    table.add(
        f"(a) matmul {dtype} n={opts.size} TFLOP/s (median of {repeats})",
        f"{ours_rate:.3f}",
        f"{plain_rate:.3f} plain",
        f"{ratio:.3f}",
        ">= 0.95",
        verdict(ratio >= 0.95),
    )
    if first:
        memory_rows(table, ours, memory)
        release_rows(table, ours, opts.device)
    return plain_rate


def describe(result: Dict[str, Any]) -> str:
    """One line per stressor run, with everything needed to quote it."""
    keys = ("tflops", "target_mib", "held_mib", "nvml_process_mib", "rss_mib", "released_ms", "exit_ms")
    digits = {"tflops": 3}
    parts = [
        f"{k}={result[k]:.{digits.get(k, 1)}f}"
        if isinstance(result.get(k), float)
        else f"{k}={result.get(k)}"
        for k in keys
    ]
    return " ".join(p for p in parts if not p.endswith("=None")) + f" code={result.get('code')}"


def memory_rows(table: Table, ours: List[Dict[str, Any]], memory: str) -> None:
    """(b): held against target, worst run."""
    worst = max(ours, key=lambda r: abs(r["held_mib"] - r["target_mib"]) / r["target_mib"])
    error = (worst["held_mib"] - worst["target_mib"]) / worst["target_mib"]
    table.figures["memory"] = {k: worst.get(k) for k in ("held_mib", "target_mib", "nvml_process_mib")}
    table.add(
        f"(b) memory held vs target ({memory})",
        f"{worst['held_mib']:.1f} MiB",
        f"{worst['target_mib']:.1f} MiB",
        f"{1 + error:.4f}",
        "within 1%",
        verdict(abs(error) <= 0.01),
    )
    if worst.get("nvml_process_mib") is not None:
        table.add(
            "    NVML: process memory (CUDA context included)",
            f"{worst['nvml_process_mib']:.1f} MiB",
            f"free at start {float(worst['start']['free_mib']):.1f} MiB",
            "",
            "",
            "info",
        )


def release_rows(table: Table, ours: List[Dict[str, Any]], device: str) -> None:
    """(c): SIGTERM to exit, and to NVML showing the memory released (worst run)."""
    exits = [r["exit_ms"] for r in ours if "exit_ms" in r]
    keys = ("exit_ms", "released_ms", "all_released_ms", "code")
    table.figures["release"] = [{k: r.get(k) for k in keys} for r in ours]
    table.add(
        "(c) SIGTERM -> process exit, ended by SIGTERM (worst)",
        f"{max(exits):.0f} ms" if exits else "n/a",
        "",
        "",
        "< 1000 ms",
        verdict(bool(exits) and max(exits) < 1000 and all(r["code"] == STOPPED for r in ours)),
    )
    if not device.startswith("cuda"):
        table.add("(c) SIGTERM -> memory released (NVML)", "n/a (no GPU)", "", "", "< 1000 ms", "n/a")
        return
    for key, label in (
        ("released_ms", "held memory released"),
        ("all_released_ms", "all memory incl. context"),
    ):
        values = [r.get(key) for r in ours]
        ok = all(v is not None for v in values)
        worst = f"{max(values):.0f} ms" if ok else "not seen"
        table.add(
            f"(c) SIGTERM -> {label} (NVML, worst)",
            worst,
            "",
            "",
            "< 1000 ms",
            verdict(ok and max(values) < 1000),
        )


def bench_verify(
    table: Table,
    opts: argparse.Namespace,
    dtype: str,
    seconds: float,
    memory: str,
    reference: Optional[float],
) -> None:
    """The rate with --verify (each result compared with the reference), against the plain loop."""
    result = run_ours(opts.device, dtype, opts.size, seconds, memory, ["--verify"])
    print(f"  ours  {dtype} --verify: {describe(result)}", flush=True)
    ok = result["code"] == STOPPED and result["exit"].get("verify") == "ok"
    table.figures["verify"] = {"tflops": result["tflops"], "ok": ok, "reference_tflops": reference}
    ratio = f"{result['tflops'] / reference:.3f}" if reference else ""
    table.add(
        f"    matmul {dtype} --verify TFLOP/s",
        f"{result['tflops']:.3f}",
        "plain (above)",
        ratio,
        "verify=ok",
        "PASS" if ok else "FAIL",
    )


def stop_latency(opts: argparse.Namespace) -> int:
    """--stop-latency: SIGTERM at each delay after launch, --trials times; a table of SIGTERM -> exit."""
    device = "cpu" if opts.device == "auto" else opts.device
    args = ["--device", device] + (["--memory", opts.memory] if opts.memory else [])
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    print(f"gpu-mon stress {' '.join(args)}: SIGTERM after each delay, {opts.trials} trials", flush=True)
    rows, figures = [], {}
    for delay in (float(d) for d in opts.delays.split(",")):
        took, statuses, handled = [], set(), 0
        for _ in range(opts.trials):
            launched = time.monotonic()
            child = subprocess.Popen(
                [sys.executable, "-m", "gpu_mon", "stress", *args],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            time.sleep(max(0.0, launched + delay - time.monotonic()))
            sent = time.monotonic()
            child.send_signal(signal.SIGTERM)
            statuses.add(child.wait())  # a blocking waitpid: returns when the process has ended
            took.append((time.monotonic() - sent) * 1e3)
            handled += any(line.startswith("stress: exit ") for line in child.stdout.read().splitlines())
            child.stdout.close()
        figures[f"{delay:g}"] = {"ms": took, "statuses": sorted(statuses), "handled": handled}
        p50, worst = statistics.median(took), max(took)
        rows.append(
            [f"{delay:g} s", f"{p50:.0f}", f"{worst:.0f}", ",".join(map(str, sorted(statuses))),
             f"{handled}/{opts.trials}", verdict(worst < 150)]
        )  # fmt: skip
    header = ["SIGTERM after", "-> exit p50 ms", "worst ms", "status", "exit line", "< 150 ms"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print()
    for index, row in enumerate([header, *rows]):
        print(" | ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        if index == 0:
            print("-+-".join("-" * w for w in widths))
    if opts.json:
        Path(opts.json).write_text(json.dumps({"command": args, "delays": figures}, indent=1) + "\n")
    return 0


def parse_args() -> argparse.Namespace:
    """Options; defaults depend on the device (realistic on CUDA, tiny on CPU)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cuda, or cpu")
    parser.add_argument("--dtype", default=None, help="main dtype (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--size", type=int, default=None, help="matmul N (default: 8192 on CUDA, 512 on CPU)")
    parser.add_argument("--repeats", type=int, default=2, help="stressor/plain pairs for the main dtype")
    parser.add_argument(
        "--seconds", type=float, default=None, help="length of each timed run (10 CUDA, 3 CPU)"
    )
    parser.add_argument(
        "--memory", default=None, help="stressor --memory (default: 88%% on CUDA, 256MiB on CPU)"
    )
    parser.add_argument(
        "--extra-dtypes", default=None, help="comma list run briefly (default: fp16,tf32 on CUDA)"
    )
    parser.add_argument("--json", metavar="FILE", help="also write the rows and their figures as JSON")
    parser.add_argument(
        "--stop-latency", action="store_true", help="only time SIGTERM -> exit of a stressor that is starting"
    )
    parser.add_argument("--delays", default="0.15,0.4,0.8", help="--stop-latency: seconds after launch")
    parser.add_argument("--trials", type=int, default=5, help="--stop-latency: trials per delay")
    return parser.parse_args()


def main() -> int:
    """Run every measurement, then print the table."""
    opts = parse_args()
    if opts.stop_latency:
        return stop_latency(opts)
    torch = import_torch()
    if opts.device == "auto":
        opts.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = opts.device.startswith("cuda")
    if cuda and opts.device != "cuda":
        print("note: the stressor names its device within CUDA_VISIBLE_DEVICES; use that to pick a GPU")
        opts.device = "cuda"
    opts.dtype = opts.dtype or (
        "bf16" if cuda and torch.cuda.get_device_capability(0)[0] >= 8 else "fp16" if cuda else "fp32"
    )
    opts.size = opts.size or (8192 if cuda else 512)
    seconds = opts.seconds or (10.0 if cuda else 3.0)
    memory = opts.memory or ("88%" if cuda else "256MiB")
    extras = [
        d
        for d in (opts.extra_dtypes or ("fp16,tf32" if cuda else "bf16")).split(",")
        if d and d != opts.dtype
    ]
    host = describe_host(torch, cuda)
    table = Table()
    reference: Dict[str, float] = {}

    def main_rate() -> None:
        reference[opts.dtype] = bench_rate(
            table, opts, torch, opts.dtype, opts.repeats, seconds, memory, True
        )

    print(f"\n(a)-(c): {opts.repeats} x stressor ({memory}) and plain loop, {seconds:g} s each", flush=True)
    table.attempt(f"matmul {opts.dtype}", main_rate)
    brief = max(seconds / 2, 1.0)
    small_memory = "4GiB" if cuda else "64MiB"
    table.attempt(
        "--verify",
        lambda: bench_verify(table, opts, opts.dtype, brief, small_memory, reference.get(opts.dtype)),
    )
    for dtype in extras:
        table.attempt(
            f"matmul {dtype}",
            lambda d=dtype: bench_rate(table, opts, torch, d, 1, brief, small_memory, first=False),
        )
    print()
    table.print()
    if opts.json:
        table.write_json(opts.json, {**host, "dtype": opts.dtype, "size": opts.size, "memory": memory})
    return 0


def describe_host(torch: Any, cuda: bool) -> Dict[str, Any]:
    """Header: what ran where (printed, and returned for --json)."""
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}")
    host: Dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": "cpu"}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        try:
            driver = Nvml(gpu_uuid()).driver()
        except Exception as exc:
            driver = f"unknown ({one_line(exc)})"
        print(
            f"device cuda:0 {props.name} ({props.total_memory / MIB:.0f} MiB), {gpu_uuid()}, driver {driver}"
        )
        print(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}")
        host.update(device=props.name, driver=driver)
    else:
        threads = torch.get_num_threads()
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"device cpu ({os.cpu_count()} cores, torch threads {threads}, load {load}); NVML rows n/a")
        print("note: CPU rates move with whatever else the machine runs; quote them from an idle host")
    return host


if __name__ == "__main__":
    sys.exit(main())
