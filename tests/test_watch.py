"""`gpu-mon watch -- CMD` (seed 003) on simulated GPUs, with real processes and signals.

A tree whose GPUs stay idle over the window is stopped (grandchildren that left its session included) and
watch exits 124; a busy tree is never stopped and its exit status passes through; a monitoring error counts
as busy; another user's load on a GPU the tree does not use keeps nothing alive; signals are forwarded.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import List

import pytest
from conftest import GPU_MON, SimHost, kill_marked, marked, wait_for

FAST = ["-s", "0.1", "-n", "3", "-d", "1", "-x"]
# A process that sleeps and carries a marker in its command line (see conftest.marked).
SLEEPER = f"{sys.executable} -c 'import time; time.sleep(300)'"


class Watch:
    """A running `gpu-mon watch` with its stderr in a file."""

    def __init__(self, sim: SimHost, options: List[str], argv: List[str], stdin=None):
        self.err_path = sim.dir / f"watch-{uuid.uuid4().hex[:8]}.err"
        self._err = open(self.err_path, "wb")  # noqa: SIM115 - closed in wait()
        env = {k: v for k, v in os.environ.items() if k != "GPU_MON_SIM"}
        self.proc = subprocess.Popen(
            [*GPU_MON, "--sim", str(sim.path), "watch", *options, "--", *argv],
            stdin=stdin if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._err,
            cwd=str(sim.dir),
            env=env,
        )

    def log(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_log(self, pattern: str, count: int = 1, timeout: float = 20) -> None:
        rx = re.compile(pattern)
        try:
            wait_for(lambda: len(rx.findall(self.log())) >= count, timeout, f"/{pattern}/ x{count}")
        except AssertionError:
            raise AssertionError(f"no /{pattern}/ x{count} in:\n{self.log()}") from None

    def wait(self, timeout: float = 30) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._err.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._err.close()


@pytest.fixture
def watches():
    made: List[Watch] = []
    markers: List[str] = []
    yield made, markers
    for w in made:
        w.kill()
    for m in markers:
        kill_marked(m)


def start(watches, sim, options, argv, stdin=None) -> Watch:
    w = Watch(sim, options, argv, stdin)
    watches[0].append(w)
    return w


def marker(watches) -> str:
    m = f"gmw-{uuid.uuid4().hex}"
    watches[1].append(m)
    return m


def test_idle_tree_is_stopped_whole_and_exits_124(sim, watches):
    m = marker(watches)
    # A grandchild that left the session holds GPU 0; the main process ignores SIGTERM.
    script = f"trap '' TERM; setsid {SLEEPER} {m} < {sim.device(0)} & exec {SLEEPER} {m}"
    w = start(watches, sim, [*FAST, "--grace", "1"], ["sh", "-c", script, m])
    wait_for(lambda: len(marked(m)) >= 2, what="both sleeps running")
    assert w.wait() == 124, w.log()
    assert "idle (GPU 0 (" in w.log() and "below 1% for the last 3 samples" in w.log()
    assert marked(m) == []


def test_busy_tree_is_never_stopped_and_its_exit_status_passes_through(sim, watches):
    sim.set(0, utilization_pct=50)
    done = sim.dir / "done"
    code = f"import os, time\nwhile not os.path.exists({str(done)!r}): time.sleep(0.02)\nraise SystemExit(3)"
    with open(sim.device(0), "rb") as gpu:  # the command holds GPU 0 from its first instruction on
        w = start(watches, sim, FAST, [sys.executable, "-c", code], stdin=gpu)
    w.wait_log(r"sample \d+: 50%", count=8)
    done.touch()
    assert w.wait() == 3
    assert "idle" not in w.log()


def test_per_process_samples_count_only_the_tree(sim, watches):
    # GPU 0 is 90% busy with another user's process; the tree holds GPU 0 too, idle. With per-process
    # samples the tree's own share (0) is what counts; the GPU's 90% would have kept it alive.
    other = os.getpid()
    sim.set(0, utilization_pct=90, processes=[{"pid": other, "used_memory_mib": 9, "utilization_pct": 90}])
    m = marker(watches)
    w = start(watches, sim, FAST, ["sh", "-c", f"exec {SLEEPER} {m} < {sim.device(0)}"])
    assert w.wait() == 124, w.log()
    assert re.search(r"sample \d+: 0%: GPU 0 \(", w.log())
    assert marked(m) == []


def test_the_trees_own_samples_keep_it_alive(sim, watches):
    sim.set(0, utilization_pct=40)  # busy from the first sample (no per-process samples yet)
    done = sim.dir / "done"
    code = f"import os, time\nwhile not os.path.exists({str(done)!r}): time.sleep(0.02)"
    with open(sim.device(0), "rb") as gpu:
        w = start(watches, sim, FAST, [sys.executable, "-c", code], stdin=gpu)
    tree = [w.proc.pid]
    wait_for(lambda: _children(tree), what="the leader")
    leader = _children(tree)[0]
    command = wait_for(lambda: _children([leader]), what="the command")[0]  # type: ignore[index]
    procs = [{"pid": command, "used_memory_mib": 9, "utilization_pct": 40}]
    procs.append({"pid": os.getpid(), "used_memory_mib": 9, "utilization_pct": 0})
    sim.set(0, utilization_pct=40, processes=procs)
    w.wait_log(r"sample \d+: 40%", count=6)
    done.touch()
    assert w.wait() == 0


def _children(pids: List[int]) -> List[int]:
    out: List[int] = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def test_another_users_load_on_a_gpu_the_tree_does_not_use_keeps_nothing_alive(sim, watches):
    sim.set(0, utilization_pct=100)  # someone else's job on GPU 0
    m = marker(watches)
    w = start(watches, sim, FAST, ["sh", "-c", f"exec {SLEEPER} {m} < {sim.device(1)}"])
    assert w.wait() == 124, w.log()
    assert "GPU 1 (" in w.log() and "GPU 0 (" not in w.log().split("idle (")[1]


def test_a_tree_that_holds_no_gpu_is_idle(sim, watches):
    sim.set(0, utilization_pct=100)
    w = start(watches, sim, FAST, ["sleep", "300"])
    assert w.wait() == 124
    assert "no GPU held" in w.log()


def test_monitoring_error_mid_run_never_kills(sim, watches):
    sim.set(0, utilization_pct=60)
    done = sim.dir / "done"
    code = f"import os, time\nwhile not os.path.exists({str(done)!r}): time.sleep(0.02)\nraise SystemExit(7)"
    with open(sim.device(0), "rb") as gpu:
        w = start(watches, sim, FAST, [sys.executable, "-c", code], stdin=gpu)
    w.wait_log(r"sample \d+: 60%", count=2)
    sim.set(0, error="GPU is lost")
    w.wait_log("cannot tell whether the command uses its GPUs")
    w.wait_log(r"sample \d+: unknown", count=8)
    (sim.dir / "sim.json").write_text("{ not json")  # a broken sim file: the whole backend unreadable
    w.wait_log(r"sample \d+: unknown", count=14)
    done.touch()
    assert w.wait() == 7
    assert "idle" not in w.log()


def test_dry_run_never_stops(sim, watches):
    done = sim.dir / "done"
    code = f"import os, time\nwhile not os.path.exists({str(done)!r}): time.sleep(0.02)"
    w = start(watches, sim, [*FAST, "--dry-run"], [sys.executable, "-c", code])
    w.wait_log("would stop the command", count=2)
    done.touch()
    assert w.wait() == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP])
def test_signals_are_forwarded_to_the_whole_tree(sim, watches, sig):
    got = sim.dir / "got"
    # The command's child, in a session of its own, records the signal it gets and exits 5.
    child = (
        "import signal, sys, time\n"
        f"def on(s, f):\n    open({str(got)!r}, 'a').write(str(s) + '\\n'); sys.exit(5)\n"
        f"signal.signal({int(sig)}, on)\nprint('ready', flush=True)\ntime.sleep(300)"
    )
    parent = (
        f"import signal, subprocess, sys; signal.signal({int(sig)}, signal.SIG_IGN)\n"
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True); sys.exit(p.wait())"
    )
    w = start(watches, sim, ["-s", "5"], [sys.executable, "-c", parent])
    assert w.proc.stdout is not None
    assert w.proc.stdout.readline().strip() == b"ready"  # the command's stdout is ours
    w.proc.send_signal(sig)
    assert w.wait() == 5
    assert got.read_text().split() == [str(int(sig))]
    assert re.findall(r"INFO forwarded (\S+) to \d+ process\(es\)$", w.log(), re.M) == [sig.name]


def test_exit_status_of_a_command_killed_by_a_signal(sim, watches):
    w = start(watches, sim, ["-s", "5"], ["sh", "-c", "kill -KILL $$"])
    assert w.wait() == 128 + 9


def test_stdin_is_the_callers(sim, watches):
    r = subprocess.run(
        [*GPU_MON, "--sim", str(sim.path), "watch", "--", "sh", "-c", "read x; echo got:$x"],
        input=b"hello\n",
        capture_output=True,
        timeout=30,
    )
    assert (r.returncode, r.stdout) == (0, b"got:hello\n")


def test_command_not_found(sim):
    r = subprocess.run(
        [*GPU_MON, "--sim", str(sim.path), "watch", "--", "/nonexistent/cmd"], capture_output=True, text=True
    )
    assert r.returncode == 127
    assert "command '/nonexistent/cmd': No such file or directory" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "options, message",
    [
        (["-t", "0"], "-t/--threshold-percentage must be greater than 0"),
        (["-n", "0"], "-n/--num-samples must be greater than 0"),
        (["-s", "-1"], "-s/--sample-freq must be greater than 0"),
        (["-s", "nan"], "-s/--sample-freq must be greater than 0"),
        (["-d", "-1"], "-d/--delay-samples must be 0 or more"),
        (["--grace", "0"], "--grace must be greater than 0"),
        (["-n", "x"], "invalid int value: 'x'"),
    ],
)
def test_bad_options_exit_2_with_one_line(sim, options, message):
    r = subprocess.run(
        [*GPU_MON, "--sim", str(sim.path), "watch", *options, "--", "true"], capture_output=True, text=True
    )
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_no_command_is_a_usage_error(sim):
    r = subprocess.run([*GPU_MON, "--sim", str(sim.path), "watch", "-t", "5"], capture_output=True, text=True)
    assert r.returncode == 2 and "no command given" in r.stderr


def test_seed_spelling_and_command_without_double_dash(sim, tmp_path: Path):
    r = subprocess.run(
        [*GPU_MON, "--sim", str(sim.path), "watch", "--threshhold-percentage", "10", "sh", "-c", "exit 4"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 4, r.stderr


def test_works_as_a_plain_user(public_dir):
    """nobody, with the package readable by it and the system interpreter: an idle command is stopped."""
    from conftest import nobody_host

    sim, code_dir = nobody_host(public_dir)
    r = subprocess.run(
        [
            "/usr/bin/python3",
            "-m",
            "gpu_mon",
            "--sim",
            str(sim.path),
            "watch",
            *FAST,
            "--",
            "sh",
            "-c",
            f"sleep 300 < {sim.device(1)}",
        ],
        capture_output=True,
        text=True,
        user=65534,
        group=65534,
        extra_groups=[],
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(code_dir)},
        timeout=60,
    )
    assert r.returncode == 124, r.stderr
    assert "subreaper" in r.stderr and "GPU 1 (" in r.stderr
