"""`gpu-mon stress`: real subprocesses and signals, tiny sizes on the CPU; `gpu`-marked tests need a GPU."""

from __future__ import annotations

import os
import queue
import re
import resource
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional

import psutil
import pytest

from gpu_mon import cli
from gpu_mon.stress import plan, report

REPO = Path(__file__).resolve().parents[1]
STARTUP_S = 90.0  # importing torch on a loaded 2-core CI runner can take a while
STOPPED = -signal.SIGTERM  # a stop ends the stressor by the signal itself, in every phase
STOP_BOUND_S = 2.0  # SIGTERM -> exit; the stressor needs a fraction of this, the rest is CI slack
MIB = 1 << 20
SMALL = ("--device", "cpu", "--matmul-size", "128", "--memory", "16MiB")  # a few ms of setup, 0.4 MiB buffers


def _cuda_available() -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


needs_cuda = pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device")


def fields(line: str) -> Dict[str, str]:
    """key=value pairs of a log line (values may be double-quoted)."""
    return {k: v.strip('"') for k, v in re.findall(r'(\w+)=("[^"]*"|\S+)', line)}


class Child:
    """A `gpu-mon stress` subprocess whose output lines are collected by reader threads."""

    def __init__(self, args: List[str], env: Optional[Dict[str, str]] = None, **popen: object) -> None:
        self.proc = subprocess.Popen(
            args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
        )
        self.out: List[str] = []
        self.err: List[str] = []
        self._lines: queue.Queue = queue.Queue()
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out, True), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err, False), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, sink: List[str], announce: bool) -> None:
        for line in stream:
            sink.append(line.rstrip("\n"))
            if announce:
                self._lines.put(line.rstrip("\n"))
        if announce:
            self._lines.put(None)

    def wait_line(self, pattern: str, timeout: float = STARTUP_S) -> str:
        """The next stdout line matching `pattern`, waiting at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(left, 0.0))
            except queue.Empty:
                pytest.fail(f"no line matching {pattern!r} within {timeout}s; {self.describe()}")
            if line is None:
                self.proc.wait(timeout=10)
                pytest.fail(
                    f"exited {self.proc.returncode} before a line matching {pattern!r}; {self.describe()}"
                )
            if re.search(pattern, line):
                return line

    def wait_exit(self, timeout: float = STARTUP_S) -> int:
        """The exit code, once the process and its output are finished."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running after {timeout}s; {self.describe()}")
        for reader in self._readers:
            reader.join(timeout=10)
        return code

    def describe(self) -> str:
        """Output so far, for failure messages."""
        return f"stdout={self.out[-8:]} stderr={self.err[-8:]}"

    def kill(self) -> None:
        """SIGKILL if still running (test teardown)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def spawn():
    """Start children; any still running at teardown are killed."""
    children: List[Child] = []

    def start(*args: str, env: Optional[Dict[str, str]] = None, argv: Optional[List[str]] = None, **popen):
        child = Child(argv or [sys.executable, "-m", "gpu_mon", "stress", *args], env=env, **popen)
        children.append(child)
        return child

    yield start
    for child in children:
        child.kill()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its threads."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


# ----- option parsing (in-process: everything below fails before torch is imported) -----


@pytest.mark.parametrize(
    "text, expected",
    [
        ("88%", (88.0, None)),
        ("100%", (100.0, None)),
        ("0.5%", (0.5, None)),
        ("20GiB", (None, 20 << 30)),
        ("512MiB", (None, 512 << 20)),
        ("512mib", (None, 512 << 20)),
        ("1.5G", (None, int(1.5 * (1 << 30)))),
        ("2GB", (None, 2 * 10**9)),
        (" 64 MiB ", (None, 64 << 20)),
    ],
)
def test_parse_memory_accepts(text, expected):
    assert plan.parse_memory(text) == expected


@pytest.mark.parametrize(
    "rate, decimals, text",
    [(0.0, 3, "0.000"), (312.512, 3, "312.512"), (0.000168, 3, "0.000168"), (0.04, 1, "0.04"), (2, 1, "2.0")],
)
def test_a_slow_rate_is_not_printed_as_no_work(rate, decimals, text):
    # A 128x128 matmul on a starved CPU runs at ~0.0002 TFLOPS; "0.000" read as "nothing ran" (a test failed).
    assert report.figure(rate, decimals) == text


@pytest.mark.parametrize(
    "text", ["0%", "101%", "-5%", "20", "abc", "5 parsecs", "", "%", "1KiB", "nan%", "1e3MiB"]
)
def test_parse_memory_rejects(text):
    with pytest.raises(plan.UsageError, match="--memory"):
        plan.parse_memory(text)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--memory=101%"], "at most 100"),
        (["--memory=0%"], "above 0"),
        (["--memory", "12"], "give a unit"),
        (["--memory", "lots"], "expected a positive percent"),
        (["--chunk-mib", "0"], "--chunk-mib '0': must be at least 1"),
        (["--chunk-mib", "1.5"], "expected an integer"),
        (["--matmul-size", "8"], "at least 16"),
        (["--matmul-size", "100000"], "at most 65536"),
        (["--workload", "bitcoin"], "expected one of matmul, elementwise, none"),
        (["--dtype", "fp8"], "expected one of bf16, fp16, tf32, fp32"),
        (["--dtype", "fp16", "--device", "cpu"], "on cpu use bf16 or fp32"),
        (["--compute-seconds", "0"], "must be above 0"),
        (["--sleep-seconds", "-1"], "must be at least 0"),
        (["--duration", "-3"], "must be above 0"),
        (["--duration", "inf"], "expected a finite number"),
        (["--report-seconds", "nan"], "expected a finite number"),
        (["--inject-fault-at", "3"], "--inject-fault-at needs --verify"),
        (["--device", "tpu"], "expected cuda, cuda:N, N or cpu"),
        (["--device", "cuda:x"], "expected cuda, cuda:N, N or cpu"),
    ],
)
def test_bad_options_give_one_line_and_exit_2(capsys, args, fragment):
    assert cli.main(["stress", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("gpu-mon stress: error: ") and fragment in lines[0], lines[0]


def test_device_forms_are_normalised():
    assert [plan.parse_device(d) for d in ("cpu", "cuda", "cuda:2", "3", " CUDA:1 ")] == [
        "cpu",
        "cuda:0",
        "cuda:2",
        "cuda:3",
        "cuda:1",
    ]


# ----- environment errors (real subprocesses) -----

BLOCK_TORCH = """
import sys
class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError("No module named 'torch'", name=name)
        return None
sys.meta_path.insert(0, BlockTorch())
from gpu_mon.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_missing_torch_names_the_extra_and_exits_2(spawn):
    child = spawn(argv=[sys.executable, "-c", BLOCK_TORCH, "stress", "--device", "cpu", "--memory", "8MiB"])
    assert child.wait_exit() == 2
    assert child.out == []
    assert len(child.err) == 1, child.err
    assert "pip install 'gpu-mon[stress]'" in child.err[0]


def test_help_works_without_torch(spawn):
    child = spawn(argv=[sys.executable, "-c", BLOCK_TORCH, "stress", "--help"])
    assert child.wait_exit() == 0, child.describe()
    assert any("--memory" in line for line in child.out)
    assert not any("inject" in line or "assume-free" in line for line in child.out)  # hidden options


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "0"])
def test_cuda_device_without_cuda_exits_2(spawn, device):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # hides any GPU this machine has
    child = spawn("--device", device, "--memory", "8MiB", env=env)
    assert child.wait_exit() == 2
    assert child.out == []
    assert len(child.err) == 1 and "no CUDA device visible" in child.err[0], child.err


def test_buffers_larger_than_the_target_exit_2(spawn):
    child = spawn("--device", "cpu", "--memory", "4MiB", "--matmul-size", "1024")
    assert child.wait_exit() == 2
    assert len(child.err) == 1 and "--matmul-size 1024" in child.err[0], child.err


# ----- memory -----


def test_absolute_target_is_held_in_chunks(spawn):
    child = spawn(
        "--device",
        "cpu",
        "--memory",
        "40MiB",
        "--hold",
        "chunks",
        "--chunk-mib",
        "16",
        "--matmul-size",
        "256",
    )
    start = fields(child.wait_line(r"^stress: start "))
    assert start["target_mib"] == "40.0" and start["memory_mib"] == "40.0"
    assert start["workspace_mib"] == "0.8"  # a, b, out: 3 * 256 * 256 * 4 bytes
    assert start["chunks"] == "3"  # 16 + 16 + 7.25 MiB: the workspace counts against the target
    assert start["backoff"] == "no"
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait_exit() == STOPPED


def test_percent_target_uses_free_memory(spawn):
    child = spawn(
        "--device",
        "cpu",
        "--workload",
        "none",
        "--memory",
        "25%",
        "--assume-free-mib",
        "256",
    )
    start = fields(child.wait_line(r"^stress: start "))
    assert (start["free_mib"], start["target_mib"], start["memory_mib"], start["chunks"], start["hold"]) == (
        "256.0",
        "64.0",
        "64.0",
        "1",
        "one",
    )
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait_exit() == STOPPED


def test_held_memory_is_resident(spawn):
    """The RSS of a process holding 192 MiB exceeds that of one holding 1 MiB by about 191 MiB."""
    common = ("--device", "cpu", "--workload", "none", "--chunk-mib", "32")
    small = spawn(*common, "--memory", "1MiB")
    big = spawn(*common, "--memory", "192MiB")
    assert fields(small.wait_line(r"^stress: start "))["memory_mib"] == "1.0"
    assert fields(big.wait_line(r"^stress: start "))["memory_mib"] == "192.0"
    grown = psutil.Process(big.proc.pid).memory_info().rss - psutil.Process(small.proc.pid).memory_info().rss
    assert 0.9 * 191 * MIB < grown < 1.2 * 191 * MIB, grown / MIB
    for child in (small, big):
        child.proc.send_signal(signal.SIGTERM)
    for child in (small, big):
        assert child.wait_exit() == STOPPED
        assert fields(child.out[-1])["memory_mib"] == "0.0"  # released before the exit line


@pytest.mark.parametrize("hold", ["chunks", "blocks", "one"])
def test_out_of_memory_backs_off_and_keeps_running(spawn, hold):
    """Under an address-space limit the allocations really fail: it holds what fits and keeps computing."""
    limit = psutil.Process().memory_info().vms + 512 * MIB  # this process has torch imported too

    def cap_address_space() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    target = f"{limit // MIB + 1024}MiB"
    child = spawn(
        *SMALL,
        "--memory",
        target,
        "--chunk-mib",
        "64",
        "--hold",
        hold,
        "--report-seconds",
        "0.1",
        preexec_fn=cap_address_space,
    )
    start = fields(child.wait_line(r"^stress: start "))
    assert start["backoff"] == "yes"
    assert 64 < float(start["memory_mib"]) < limit / MIB
    iterations = [int(fields(child.wait_line(r"^stress: report "))["iterations"]) for _ in range(3)]
    assert iterations[-1] > iterations[0]
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait_exit() == STOPPED, child.describe()


# ----- workloads -----


def test_duty_cycle_alternates_compute_and_sleep(spawn):
    # Waits for the phases themselves (a --duration made this a race on a loaded machine).
    cycle = ("--compute-seconds", "0.3", "--sleep-seconds", "0.3")
    child = spawn(*SMALL, *cycle, "--report-seconds", "0.1")
    seen = ""
    while seen.count("sc") < 2:  # compute resumed after two sleeps
        seen += fields(child.wait_line(r"^stress: report "))["phase"][0]
    child.wait_line(r"^stress: report .*phase=sleep")  # and a third compute phase ended
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait_exit() == STOPPED, child.describe()
    reports = [fields(line) for line in child.out if line.startswith("stress: report ")]
    slept_at = []  # iterations done when each sleep phase began
    for before, after in zip(reports, reports[1:]):
        gap = float(after["elapsed_s"]) - float(before["elapsed_s"])
        # Nothing runs while asleep. (Reports are samples: on a starved machine two of them can be further
        # apart than a compute phase, and a whole one can lie between two "sleep" reports.)
        if before["phase"] == after["phase"] == "sleep" and gap < 0.3:
            assert after["iterations"] == before["iterations"] and after["tflops"] == "0.000", (before, after)
        if before["phase"] == "compute" and after["phase"] == "sleep":
            slept_at.append(int(after["iterations"]))
    assert len(slept_at) >= 2 and slept_at == sorted(set(slept_at)), slept_at  # and each compute phase ran
    last = fields(child.out[-1])
    assert (last["reason"], last["code"]) == ("SIGTERM", "143")
    # (the exit line's rate is the last window's: it was stopped while asleep)
    assert any(r["phase"] == "compute" and float(r["tflops"]) > 0 for r in reports)


def test_memory_only_workload_holds_and_idles(spawn):
    child = spawn("--device", "cpu", "--workload", "none", "--memory", "32MiB", "--report-seconds", "0.25")
    start = fields(child.wait_line(r"^stress: start "))
    assert start["memory_mib"] == "32.0" and "dtype" not in start
    report = fields(child.wait_line(r"^stress: report "))
    before, t_before = cpu_seconds(child.proc.pid), time.monotonic()
    for _ in range(3):
        report = fields(child.wait_line(r"^stress: report "))
    used, wall = cpu_seconds(child.proc.pid) - before, time.monotonic() - t_before
    assert report["phase"] == "idle" and report["memory_mib"] == "32.0" and "tflops" not in report
    assert used < 0.2 * wall, (used, wall)  # asleep, not polling
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait_exit() == STOPPED


def test_elementwise_workload_reports_bandwidth(spawn):
    child = spawn(*SMALL, "--workload", "elementwise", "--report-seconds", "0.2", "--duration", "0.7")
    assert child.wait_exit() == 0, child.describe()
    report = fields(next(line for line in child.out if line.startswith("stress: report ")))
    assert float(report["gb_per_s"]) > 0 and float(report["tflops"]) > 0


# ----- verify -----

VERIFY_CASES = [("matmul", "fp32"), ("matmul", "bf16"), ("elementwise", "fp32")]


@pytest.mark.parametrize("workload, dtype", VERIFY_CASES)
def test_verify_detects_an_injected_fault(spawn, workload, dtype):
    child = spawn(*SMALL, "--workload", workload, "--dtype", dtype, "--verify", "--inject-fault-at", "40")
    assert child.wait_exit() == 1, child.describe()
    assert len(child.err) == 1, child.err
    line = child.err[0]
    assert line.startswith("gpu-mon stress: FAULT: cpu: wrong ") and "faulty" in line, line
    first, last = map(int, re.search(r"iterations (\d+)-(\d+)", line).groups())
    assert first <= 40 <= last
    assert float(fields(line)["max_abs_error"]) > float(fields(line)["tolerance"])
    exit_line = fields(child.out[-1])
    assert (exit_line["reason"], exit_line["code"], exit_line["verify"]) == ("fault", "1", "failed")


@pytest.mark.parametrize("workload, dtype", VERIFY_CASES)
def test_verify_passes_on_a_healthy_device(spawn, workload, dtype):
    options = ("--workload", workload, "--dtype", dtype, "--verify")
    child = spawn(*SMALL, *options, "--duration", "0.8", "--report-seconds", "0.2")
    assert child.wait_exit() == 0, child.describe()
    assert child.err == []
    exit_line = fields(child.out[-1])
    # Several products checked (how many is the benchmark's business: bench/stress.py).
    assert exit_line["verify"] == "ok" and int(exit_line["iterations"]) >= 3


# ----- stopping -----


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_compute_quickly_and_ends_the_process_by_it(spawn, signum):
    child = spawn("--device", "cpu", "--memory", "64MiB", "--report-seconds", "0.1")  # default size: 1024
    child.wait_line(r"^stress: start ")
    report = fields(child.wait_line(r"^stress: report .*phase=compute"))
    report = fields(child.wait_line(r"^stress: report .*phase=compute"))
    assert int(report["iterations"]) > 0 and float(report["tflops"]) > 0  # it was computing
    sent = time.monotonic()
    child.proc.send_signal(signum)
    assert child.wait_exit(timeout=STOP_BOUND_S + 5) == -signum, child.describe()
    took = time.monotonic() - sent
    assert took < STOP_BOUND_S, took
    assert child.err == []
    exit_line = fields(child.out[-1])
    assert (exit_line["reason"], exit_line["code"], exit_line["memory_mib"]) == (
        signum.name,
        str(128 + signum),
        "0.0",
    )


def test_sigterm_interrupts_the_sleep_phase(spawn):
    cycle = ("--compute-seconds", "0.2", "--sleep-seconds", "600")
    child = spawn(*SMALL, *cycle, "--report-seconds", "0.1")
    child.wait_line(r"^stress: report .*phase=sleep")
    sent = time.monotonic()
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait_exit(timeout=STOP_BOUND_S + 5) == STOPPED
    assert time.monotonic() - sent < STOP_BOUND_S
    assert fields(child.out[-1])["reason"] == "SIGTERM"


@pytest.mark.parametrize("delay_s", [0.15, 0.4, 0.8])
def test_a_stop_in_any_phase_of_the_start_ends_it_at_once(spawn, delay_s):
    """SIGTERM 0.15, 0.4 or 0.8 s after launch: before its handler exists, while torch loads, or while it
    sets up. It used to wait for torch's import (~1 s). The issue's bound is 150 ms (bench/stress.py
    --stop-latency measures it); 1 s here leaves room for a loaded machine."""
    child = spawn("--device", "cpu", "--memory", "256MiB")
    time.sleep(delay_s)  # the delay is the test's input, not a wait for something to happen
    sent = time.monotonic()
    child.proc.send_signal(signal.SIGTERM)
    code = child.wait_exit(timeout=30)
    took = time.monotonic() - sent
    assert code == STOPPED, child.describe()  # the same status as a stop while computing
    assert took < 1.0, (took, child.describe())
    assert child.err == []


def _rss_above(pid: int, nbytes: int, timeout: float = STARTUP_S) -> None:
    """Wait until `pid` has more than `nbytes` resident."""
    deadline = time.monotonic() + timeout
    while psutil.Process(pid).memory_info().rss <= nbytes:
        assert time.monotonic() < deadline, "never grew"
        time.sleep(0.01)


def test_a_stop_while_filling_stops_the_fill_and_releases(spawn):
    # One 4 GiB block (a single allocation) on a cpu that writes ~1 GiB/s or less when loaded: the stop
    # comes in the middle of writing it, and must not wait for the rest.
    child = spawn("--device", "cpu", "--workload", "none", "--memory", "4GiB", "--hold", "one")
    baseline = 600 * MIB  # well above Python with torch imported, far below the block
    _rss_above(child.proc.pid, baseline)
    sent = time.monotonic()
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait_exit(timeout=30) == STOPPED, child.describe()
    took = time.monotonic() - sent
    assert took < 1.0, took
    assert not any(line.startswith("stress: start ") for line in child.out), child.out  # it never finished
    last = fields(child.out[-1])
    assert (last["reason"], last["code"], last["memory_mib"]) == ("SIGTERM", "143", "0.0")


@pytest.mark.parametrize(
    "hold, chunks, chunk_mib",
    [("chunks", "8", "8.0"), ("blocks", "8", "8.0"), ("one", "1", "64.0")],
)
def test_each_hold_fills_the_target_exactly(spawn, hold, chunks, chunk_mib):
    extra = {"chunks": ("--chunk-mib", "8"), "blocks": ("--chunk-mib", "1"), "one": ()}[hold]
    child = spawn("--device", "cpu", "--workload", "none", "--memory", "64MiB", "--hold", hold, *extra)
    start = fields(child.wait_line(r"^stress: start "))
    assert (start["memory_mib"], start["chunks"], start["chunk_mib"], start["hold"]) == (
        "64.0",
        chunks,
        chunk_mib,
        hold,
    )
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait_exit() == STOPPED
    assert fields(child.out[-1])["memory_mib"] == "0.0"


@pytest.mark.parametrize(
    "hold, to_fill, cuda, expected",
    [
        ("chunks", 100 * MIB, False, 512 * MIB),  # --chunk-mib 512 as given (the fill cuts the last one)
        ("chunks", 100 * MIB, True, 512 * MIB),
        ("blocks", 80 * (1 << 30), True, 10 * (1 << 30)),
        ("blocks", 8 * MIB + 1, False, 512 * MIB),  # never below --chunk-mib
        ("blocks", 123 * (1 << 30) + 3, True, 15744 * MIB + 2 * MIB),  # rounded up to 2 MiB on CUDA
        ("one", 123 * (1 << 30), True, 123 * (1 << 30)),
        ("one", 123 * (1 << 30) + 1, False, 123 * (1 << 30) + 1),
    ],
)
def test_chunk_size_per_hold(hold, to_fill, cuda, expected):
    config = plan.parse_config(cli.build_parser().parse_args(["stress", "--hold", hold]))
    assert plan.chunk_bytes(config, to_fill, cuda) == expected


def test_release_exit_leaves_the_memory_to_the_process_exit(spawn):
    child = spawn("--device", "cpu", "--workload", "none", "--memory", "64MiB", "--release", "exit")
    assert fields(child.wait_line(r"^stress: start "))["release"] == "exit"
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait_exit() == STOPPED
    last = fields(child.out[-1])
    assert (last["reason"], last["memory_mib"]) == ("SIGTERM", "64.0")  # still held: the exit frees it


def test_release_exit_still_frees_at_the_end_of_a_duration(spawn):
    child = spawn(
        "--device", "cpu", "--workload", "none", "--memory", "16MiB", "--release", "exit", "--duration", "0.2"
    )
    assert child.wait_exit() == 0, child.describe()
    assert fields(child.out[-1])["memory_mib"] == "0.0"


def test_only_running_the_stressor_loads_torch():
    code = (
        "import sys, gpu_mon.commands.stress, gpu_mon.stress.stressor, gpu_mon.stress.fill\n"
        "print('torch' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert r.stdout.strip() == "False"


# ----- on a real GPU -----


def _nvml_process_mib(pid: int) -> float:
    """GPU memory NVML attributes to `pid` on any GPU, in MiB."""
    import pynvml

    pynvml.nvmlInit()
    try:
        total = 0
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid and proc.usedGpuMemory:
                    total += proc.usedGpuMemory
        return total / MIB
    finally:
        pynvml.nvmlShutdown()


@pytest.mark.gpu
@needs_cuda
def test_gpu_holds_target_computes_and_stops_fast(spawn):
    child = spawn("--device", "cuda", "--memory", "2GiB", "--report-seconds", "0.5", "--verify")
    start = fields(child.wait_line(r"^stress: start "))
    assert abs(float(start["memory_mib"]) - 2048) <= 20.5, start  # within 1%
    assert start["uuid"].startswith("GPU-")
    report = fields(child.wait_line(r"^stress: report "))
    report = fields(child.wait_line(r"^stress: report "))
    assert float(report["tflops"]) > 1
    assert _nvml_process_mib(child.proc.pid) >= 2048
    sent = time.monotonic()
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait_exit(timeout=STOP_BOUND_S + 10) == STOPPED, child.describe()
    assert time.monotonic() - sent < STOP_BOUND_S
    assert fields(child.out[-1])["verify"] == "ok"
    assert _nvml_process_mib(child.proc.pid) == 0


@pytest.mark.gpu
@needs_cuda
def test_gpu_verify_detects_an_injected_fault(spawn):
    child = spawn("--device", "cuda", "--memory", "2GiB", "--verify", "--inject-fault-at", "100")
    assert child.wait_exit() == 1, child.describe()
    assert len(child.err) == 1 and "FAULT: cuda:0" in child.err[0], child.err


@pytest.mark.gpu
@needs_cuda
def test_gpu_out_of_memory_backs_off_and_keeps_running(spawn):
    child = spawn("--device", "cuda", "--memory", "4TiB", "--report-seconds", "0.5")
    start = fields(child.wait_line(r"^stress: start "))
    assert start["backoff"] == "yes" and float(start["memory_mib"]) > 0.5 * float(start["free_mib"])
    report = fields(child.wait_line(r"^stress: report "))
    report = fields(child.wait_line(r"^stress: report "))
    assert float(report["tflops"]) > 1
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait_exit(timeout=STOP_BOUND_S + 10) == STOPPED, child.describe()
