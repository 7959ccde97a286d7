"""A checkpoint-friendly stop: stop_signal, the full grace for a terminal user, a reload or a shutdown, the
urgent grace when a foreign process opens the GPU; the example workload of docs/admin-guide.md
(examples/checkpoint_workload.py) run under the daemon."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Optional

import pytest
from conftest import (
    ROOT,
    WORKLOAD_PYTHON,
    foreign_opener_cmd,
    idle_terminal,
    pid_alive,
    tty_section,
    wait_for,
)

from gpu_mon import config
from gpu_mon.engine.workloads.stopping import StopRule, rule_for

EXAMPLE = ROOT / "examples" / "checkpoint_workload.py"


# ---------------------------------------------------------------------------------------------- config


def test_stop_settings_parse_per_process_over_defaults():
    c = config.parse(
        "[defaults]\nstop_timeout_seconds = 30\nurgent_stop_timeout_seconds = 3\n"
        "[gpu-a]\ngpus = ALL\n"
        "[process-a]\ncmd = a\nuser = root\nstop_signal = usr1\nstop_timeout_seconds = 60\n"
        "[process-b]\ncmd = b\nuser = root\nstop_signal = SIGINT\nurgent_stop_timeout_seconds = 0.5\n"
        "[process-c]\ncmd = c\nuser = root\n"
    )
    a, b, c_ = (rule_for(p, c.defaults) for p in c.processes)
    assert a == StopRule(signal.SIGUSR1, 60.0, 3.0)
    assert b == StopRule(signal.SIGINT, 30.0, 0.5)
    assert c_ == StopRule(signal.SIGTERM, 30.0, 3.0)


def test_steps():
    usr1 = StopRule(signal.SIGUSR1, 60.0, 2.0)
    assert usr1.steps(urgent=False) == ((signal.SIGUSR1, 60.0), (signal.SIGTERM, 1.0))
    assert usr1.steps(urgent=True) == ((signal.SIGUSR1, 2.0), (signal.SIGTERM, 1.0))
    # The urgent grace is never longer than the full one; SIGTERM alone is one step.
    assert StopRule(signal.SIGTERM, 1.0, 2.0).steps(urgent=True) == ((signal.SIGTERM, 1.0),)
    short = StopRule(signal.SIGINT, 0.5, 2.0)
    assert short.steps(urgent=False) == ((signal.SIGINT, 0.5), (signal.SIGTERM, 0.5))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("SIGKILL", "'SIGKILL' is not one of SIGTERM, SIGINT"),
        ("9", "'9' is not one of"),
        ("SIGSTOP", "is not one of"),
        ("", "is not one of"),
        ("USR3", "is not one of"),
    ],
)
def test_a_bad_stop_signal_is_one_line_with_its_place(value, message):
    with pytest.raises(config.ConfigError) as err:
        text = f"[gpu-a]\ngpus = ALL\n[process-a]\ncmd = a\nuser = root\nstop_signal = {value}\n"
        config.parse(text, "f.conf")
    assert len(err.value.errors) == 1
    assert err.value.errors[0].startswith("f.conf:6: [process-a] stop_signal: ")
    assert message in err.value.errors[0]


def test_stop_settings_are_not_in_the_fingerprint():
    base = "[gpu-a]\ngpus = ALL\n[process-a]\ncmd = a\nuser = root\n"
    one = config.parse(base).processes[0]
    two = config.parse(base + "stop_signal = USR1\nstop_timeout_seconds = 99\n").processes[0]
    assert one.fingerprint == two.fingerprint  # a reload applies them without restarting the workload


# ---------------------------------------------------------------------------------------------- daemon


def _body(
    tmp_path: Path, ckpt: Path, save_seconds: float, extra: str = "", term: Optional[Path] = None
) -> str:
    script = tmp_path / "checkpoint_workload.py"
    shutil.copy(EXAMPLE, script)
    tty = tty_section(term) if term else ""
    return (
        "[gpu-all]\ngpus = ALL\n\n[process-train]\n"
        f"cmd = {WORKLOAD_PYTHON} {script} {ckpt} --save-seconds {save_seconds}\n"
        f"gpus = 0\nuser = root\n{extra}{tty}"
    )


def catches(pid: int, sig: int) -> bool:
    """Whether the process has a handler for the signal (SigCgt in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) & (1 << (sig - 1)))


def _stopped(d) -> tuple:
    """(milliseconds, the step's signals) of the first `stopped in` line."""
    line = d.wait_log(r"train\[\d+\] stopped (in|by)")[0]
    m = re.search(r"stopped in (\d+) ms \(([A-Z0-9, ]+?)(?: after ([A-Z0-9, ]+))?\)", line)
    assert m, line
    return int(m.group(1)), m.group(2), m.group(3)


LONG = {"stop_timeout_seconds": 20, "restart_delay_seconds": 300, "restart_delay_max_seconds": 300}


def test_a_terminal_user_gives_the_full_grace_and_the_checkpoint_is_complete(tmp_path, sim, daemon_factory):
    ckpt = tmp_path / "ckpt.json"
    term = idle_terminal(tmp_path)
    # Saving takes 3 s: longer than the urgent grace (2 s), well within stop_timeout (20 s).
    d = daemon_factory(_body(tmp_path, ckpt, 3.0, "stop_signal = SIGUSR1\n", term), defaults=LONG)
    d.wait_log(r"train\[\d+\]: resuming at step 0")
    wait_for(lambda: d.workload("train").get("command_pid"), what="the command's pid")
    os.utime(term, None)  # a terminal user arrives
    ms, sig, after = _stopped(d)
    assert (sig, after) == ("SIGUSR1", None)
    assert 3000 <= ms < 20000
    saved = json.loads(ckpt.read_text())
    assert saved["complete"] is True and saved["step"] > 0
    assert "checkpoint saved" in d.log()


def test_a_foreign_open_gives_the_urgent_grace(tmp_path, sim, daemon_factory):
    ckpt = tmp_path / "ckpt.json"
    ckpt.write_text('{"step": 7, "complete": true}\n')
    # Saving would take 60 s: the urgent stop cannot wait for it. The old checkpoint must stay whole.
    d = daemon_factory(_body(tmp_path, ckpt, 60.0, "stop_signal = SIGUSR1\n"), defaults=LONG)
    d.wait_log(r"train\[\d+\]: resuming at step 7")
    wait_for(lambda: d.workload("train").get("command_pid"), what="the command's pid")
    opener = subprocess.Popen(foreign_opener_cmd(sim.device(0)), stdout=subprocess.PIPE)
    try:
        ms, sig, after = _stopped(d)
    finally:
        opener.kill()
        opener.wait()
    assert (sig, after) == ("SIGTERM", "SIGUSR1")
    # SIGUSR1, then SIGTERM when the 2 s urgent grace is over (not the 20 s of stop_timeout_seconds).
    assert 2000 <= ms < 5000
    assert json.loads(ckpt.read_text()) == {"step": 7, "complete": True}


def test_a_stop_under_way_is_hurried_by_a_foreign_open(tmp_path, sim, daemon_factory):
    ckpt = tmp_path / "ckpt.json"
    term = idle_terminal(tmp_path)
    d = daemon_factory(_body(tmp_path, ckpt, 60.0, "stop_signal = SIGUSR1\n", term), defaults=LONG)
    d.wait_log(r"train\[\d+\]: resuming at step 0")
    wait_for(lambda: d.workload("train").get("command_pid"), what="the command's pid")
    os.utime(term, None)  # the full grace (20 s) begins
    d.wait_log(r"pausing all work")
    opener = subprocess.Popen(foreign_opener_cmd(sim.device(0)), stdout=subprocess.PIPE)
    try:
        ms, sig, after = _stopped(d)
    finally:
        opener.kill()
        opener.wait()
    assert (sig, after) == ("SIGTERM", "SIGUSR1")
    assert ms < 10000


def test_a_workload_that_ignores_every_signal_gets_each_step_then_sigkill(tmp_path, sim, daemon_factory):
    code = (
        "import signal, time\n"
        "for s in (signal.SIGINT, signal.SIGTERM): signal.signal(s, signal.SIG_IGN)\n"
        "print('deaf', flush=True)\n"
        "time.sleep(600)\n"
    )
    script = tmp_path / "deaf.py"
    script.write_text(code)
    body = (
        "[gpu-all]\ngpus = ALL\n\n[process-train]\n"
        f"cmd = {WORKLOAD_PYTHON} {script}\ngpus = 0\nuser = root\n"
        "stop_signal = INT\nstop_timeout_seconds = 1\n"
    )
    d = daemon_factory(body, defaults=LONG)
    d.wait_log(r"train\[\d+\]: deaf")
    pid = d.wait_running("train")
    d.signal(signal.SIGTERM)  # a shutdown: the full grace (1 s), then SIGTERM (1 s), then SIGKILL
    assert d.proc.wait(30) == 0
    line = d.wait_log(r"train\[\d+\] stopped by SIGKILL")[0]
    assert re.search(r"after 2\.\d s \(SIGINT, SIGTERM first\)", line), line
    assert re.search(r"still running 1\.\d s after SIGTERM", d.log())
    assert not pid_alive(pid)


def test_the_leader_stops_with_the_stop_signal_when_the_daemon_is_killed(tmp_path, sim, daemon_factory):
    ckpt = tmp_path / "ckpt.json"
    d = daemon_factory(_body(tmp_path, ckpt, 0.0, "stop_signal = SIGUSR1\n"), defaults=LONG)
    d.wait_log(r"train\[\d+\]: resuming at step 0")
    pid = d.wait_running("train")
    d.proc.kill()
    d.proc.wait()
    wait_for(lambda: ckpt.exists(), timeout=10, what="the checkpoint the workload saves on SIGUSR1")
    assert json.loads(ckpt.read_text())["complete"] is True
    wait_for(lambda: not pid_alive(pid), timeout=10, what="the workload gone")


def test_a_reload_changes_the_stop_signal_without_a_restart(tmp_path, sim, daemon_factory):
    ckpt = tmp_path / "ckpt.json"
    d = daemon_factory(_body(tmp_path, ckpt, 0.0), defaults=LONG)
    d.wait_log(r"train\[\d+\]: resuming at step 0")
    pid = d.wait_running("train")
    d.write_config(d.body + "stop_signal = SIGUSR1\n")
    d.signal(signal.SIGHUP)
    d.wait_log(r"reloaded .*; changed: \[process-train\]$")
    assert d.wait_running("train") == pid
    d.signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0
    _ms, sig, after = _stopped(d)
    assert (sig, after) == ("SIGUSR1", None)
    assert json.loads(ckpt.read_text())["complete"] is True


def test_the_admin_guides_example_checkpoints_when_a_terminal_user_arrives(tmp_path, sim, daemon_factory):
    guide = (ROOT / "docs" / "admin-guide.md").read_text()
    section = guide.split("### Stopping: signals and graces", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "guide_example.py"
    script.write_text(code)
    ckpt = tmp_path / "ckpt.json"  # (state.json is the daemon's)
    term = idle_terminal(tmp_path)
    tty = tty_section(term)
    body = (
        "[gpu-all]\ngpus = ALL\n\n[process-train]\n"
        f"cmd = {WORKLOAD_PYTHON} {script} {ckpt}\ngpus = 0\nuser = root\nstop_signal = SIGUSR1\n{tty}"
    )
    d = daemon_factory(body, defaults=LONG)
    pid = d.wait_running("train")
    wait_for(lambda: catches(pid, signal.SIGUSR1), what="the example's SIGUSR1 handler")
    os.utime(term, None)
    _ms, sig, after = _stopped(d)
    assert (sig, after) == ("SIGUSR1", None)
    assert json.loads(ckpt.read_text())["step"] > 0


def test_a_second_sigterm_skips_every_step_to_sigkill(tmp_path, sim, daemon_factory):
    script = tmp_path / "deaf.py"
    script.write_text(
        "import signal, time\n"
        "for s in (signal.SIGINT, signal.SIGTERM): signal.signal(s, signal.SIG_IGN)\n"
        "print('deaf', flush=True)\n"
        "time.sleep(600)\n"
    )
    body = (
        "[gpu-all]\ngpus = ALL\n\n[process-train]\n"
        f"cmd = {WORKLOAD_PYTHON} {script}\ngpus = 0\nuser = root\nstop_signal = INT\n"
    )
    d = daemon_factory(body, defaults=LONG)  # a 20 s grace, then SIGTERM for 1 s
    d.wait_log(r"train\[\d+\]: deaf")
    d.signal(signal.SIGTERM)
    d.wait_log(r"stopping on SIGTERM: 1 workload\(s\) to stop")
    d.signal(signal.SIGTERM)
    assert d.proc.wait(15) == 0
    line = d.wait_log(r"train\[\d+\] stopped by SIGKILL")[0]
    assert re.search(r"after \d\.\d s \(SIGINT first\)", line), line


def _blocked(pid: int, sig: int) -> bool:
    """Whether a process blocks a signal (SigBlk in /proc/PID/status)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(re.search(r"^SigBlk:\s*([0-9a-f]+)", text, re.M).group(1), 16)
    return bool(mask >> (sig - 1) & 1)


def test_a_stop_signal_sent_before_the_command_started_reaches_it():
    # The daemon signals the leader's group; a stop that comes before the leader has started the command
    # (a restart right after a start) reached only the leader, which blocks it: the command never saw it and
    # was killed at the end of its grace. The leader now passes it on once the command runs.
    import sys

    from gpu_mon.engine.workloads import supervisor

    status_r, status_w = os.pipe()
    code = supervisor._LEADER_CODE.format(supervisor._PACKAGE_PARENT)
    leader = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, pass_fds=(status_w,), start_new_session=True
    )
    os.close(status_w)
    try:
        wait_for(lambda: _blocked(leader.pid, signal.SIGUSR1), what="the leader to block the stop signal")
        os.killpg(leader.pid, signal.SIGUSR1)  # (before the command exists)
        spec = {
            "status_fd": status_w,
            "stop_timeout_seconds": 30,
            "stop_signal": int(signal.SIGUSR1),
            "argv": ["sleep", "15"],
            "dir": "/",
            "env": {"PATH": "/usr/bin:/bin"},
            "daemon_pid": os.getpid(),
        }
        leader.stdin.write(json.dumps(spec).encode())
        leader.stdin.close()
        with os.fdopen(status_r, "rb") as lines:
            assert lines.readline().startswith(b"started ")
            status = int(lines.readline().split()[1])  # `exit STATUS`: sleep's default action for SIGUSR1
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGUSR1
        assert leader.wait(20) == 128 + signal.SIGUSR1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


@pytest.mark.parametrize("value", ["²", "٣", "𝟗", " ¹5 "])
def test_a_stop_signal_in_digits_other_than_ascii_is_refused_in_one_line(value):
    # (str.isdigit takes them and int() raised on some: with a checked submit, a traceback in the
    # daemon's log for every such request, one user's way to flood the journal)
    from gpu_mon.queue import fields

    with pytest.raises(fields.Bad, match="not a signal name"):
        fields.stop_signal(value)
