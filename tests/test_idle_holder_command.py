"""[gpu-*] idle_holder_command: run once per idle-holder episode, beside the loop, with the holder in its
environment; its failure is one log line; the holder is never signalled. A real daemon on the sim, real
commands."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from conftest import WORKLOAD_PYTHON, pid_alive, wait_for

from gpu_mon.config import ConfigError, parse
from gpu_mon.engine.idlecommand import IdleCommands
from gpu_mon.policy.idleholders import IdleHolder

RECORD = """
import json, os, sys
keys = sorted(k for k in os.environ if k.startswith("GPU_MON_IDLE_"))
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({k: os.environ[k] for k in keys + ["PATH"]}) + "\\n")
"""


def records(path: Path) -> List[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines()]
    except OSError:
        return []


@pytest.fixture
def holder():
    p = subprocess.Popen(["sleep", "600"], start_new_session=True)
    yield p
    p.kill()
    p.wait()


def idle_gpu(command: str) -> str:
    return (
        "[gpu-all]\ngpus = ALL\nidle_holder_seconds = 0.5\nidle_holder_memory_mib = 1000\n"
        f"idle_holder_command = {command}\n"
    )


def listed(sim, pid: int, util: int) -> None:
    sim.set(
        1, processes=[{"pid": pid, "used_memory_mib": 4000, "utilization_pct": util}], memory_used_mib=4000
    )


def test_the_command_runs_once_per_episode_with_the_holder_in_its_environment(
    tmp_path, sim, daemon_factory, holder
):
    script, out = tmp_path / "record.py", tmp_path / "ran"
    script.write_text(RECORD)
    d = daemon_factory(idle_gpu(f"{WORKLOAD_PYTHON} {script} {out}"))
    listed(sim, holder.pid, 0)
    d.wait_log(rf"idle holder on GPU 1 .*sleep\[{holder.pid}\] holds 4000 MiB")
    d.wait_log(rf"INFO idle_holder_command for root sleep\[{holder.pid}\] on GPU 1 .*: .*record\.py .* done$")
    (got,) = records(out)
    assert got["GPU_MON_IDLE_USER"] == "root" and got["GPU_MON_IDLE_PID"] == str(holder.pid)
    assert got["GPU_MON_IDLE_GPU"] == sim.uuid(1) and got["GPU_MON_IDLE_MEMORY_MIB"] == "4000"
    assert int(got["GPU_MON_IDLE_SECONDS"]) >= 0
    assert set(got) == {
        "GPU_MON_IDLE_USER",
        "GPU_MON_IDLE_PID",
        "GPU_MON_IDLE_GPU",
        "GPU_MON_IDLE_MEMORY_MIB",
        "GPU_MON_IDLE_SECONDS",
        "PATH",
    }
    listed(sim, holder.pid, 40)  # it computes: the episode ends, and the command did not run again
    d.wait_log(rf"idle holder on GPU 1 .* no more: .*sleep\[{holder.pid}\]")
    assert len(records(out)) == 1
    listed(sim, holder.pid, 0)  # a new episode: once more
    d.wait_log(r"INFO idle_holder_command for .* done$", count=2)
    assert len(records(out)) == 2
    assert pid_alive(holder.pid)  # never signalled
    assert d.stop() == 0


def test_a_failing_command_is_one_line_and_changes_nothing(tmp_path, sim, daemon_factory, holder):
    fail = f"{WORKLOAD_PYTHON} -c 'import sys; sys.exit(\"no mail server\")'"
    d = daemon_factory(idle_gpu(fail))
    listed(sim, holder.pid, 0)
    (line,) = d.wait_log(r"idle_holder_command for ")
    assert line.endswith("failed (exit 1): no mail server") and " WARNING " in line, line
    missing = idle_gpu("no-such-mailer-here --to admin")
    d.write_config(missing)
    listed(sim, holder.pid, 50)
    d.wait_log(r"idle holder on GPU 1 .* no more")
    d.signal(signal.SIGHUP)  # reload with a command that is not there
    d.wait_log(r"reloaded ")
    listed(sim, holder.pid, 0)
    d.wait_log(r"WARNING idle_holder_command for .*: no-such-mailer-here: command not found$")
    assert pid_alive(holder.pid) and d.proc.poll() is None
    assert "Traceback" not in d.log()


def _popen(argv: List[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )


IDLE = IdleHolder(pid=4242, user="alice", program="python3", uuid="GPU-x", memory_mib=40960, since=0.0)


def test_the_caller_never_waits_and_a_slow_command_is_killed(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="gpu_mon")
    go, started = tmp_path / "go", tmp_path / "started"
    wait_go = (
        "import os, sys, time\nopen(sys.argv[2], 'w').close()\n"
        "while not os.path.exists(sys.argv[1]): time.sleep(0.01)"
    )
    commands = IdleCommands(_popen, timeout=30)
    commands.start(
        [sys.executable, "-c", wait_go, str(go), str(started)], IDLE, 7200.0, "alice python3[4242]"
    )
    # start() returned while the command waits for `go`: only now is `go` made.
    wait_for(started.exists, what="the command running")
    go.touch()
    wait_for(lambda: "done" in caplog.text, what="the command's end")
    slow = IdleCommands(_popen, timeout=0.3)
    slow.start([sys.executable, "-c", "import time; time.sleep(600)"], IDLE, 7200.0, "alice python3[4242]")
    wait_for(lambda: "killed" in caplog.text, what="the slow command killed")
    (line,) = [r.getMessage() for r in caplog.records if "killed" in r.getMessage()]
    assert line.startswith("idle_holder_command for alice python3[4242]: ") and "after 0.3 s" in line
    wait_for(
        lambda: not [t for t in slow.running + commands.running if t.is_alive()],
        what="the threads that waited for them gone",
    )


def test_the_environment_names_the_holder():
    from gpu_mon.engine.idlecommand import command_env

    env = command_env(IDLE, 7260.5)
    assert env["GPU_MON_IDLE_SECONDS"] == "7260" and env["GPU_MON_IDLE_MEMORY_MIB"] == "40960"
    assert env["GPU_MON_IDLE_USER"] == "alice" and env["GPU_MON_IDLE_PID"] == "4242"
    assert env["GPU_MON_IDLE_GPU"] == "GPU-x" and "/usr/bin" in env["PATH"]


def test_config_splits_the_command_like_cmd_and_reports_a_bad_one_at_its_line():
    c = parse("[gpu-all]\ngpus = ALL\nidle_holder_command = /usr/local/bin/tell 'a b' c\n")
    assert c.gpu_sections[0].idle_holder_command == ("/usr/local/bin/tell", "a b", "c")
    assert parse("[gpu-all]\ngpus = ALL\nidle_holder_command =\n").gpu_sections[0].idle_holder_command is None
    with pytest.raises(ConfigError) as info:
        parse("[gpu-all]\ngpus = ALL\n\nidle_holder_command = tell 'open\n", path="x.conf")
    (error,) = info.value.errors
    assert error.startswith("x.conf:4: [gpu-all] idle_holder_command: cannot split"), error


def test_check_warns_at_the_key_when_the_command_is_not_there(tmp_path, sim):
    from conftest import GPU_MON, write_config

    body = "[gpu-all]\ngpus = ALL\n\nidle_holder_command = no-such-mailer-here -v\n"
    conf = write_config(tmp_path / "c.conf", body)
    r = subprocess.run(
        [*GPU_MON, "--config", str(conf), "--sim", str(sim.path), "check"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr  # a warning: the daemon runs, and says so when an episode starts
    assert (
        f"warning: {conf}:4: [gpu-all] idle_holder_command: 'no-such-mailer-here' is not on its PATH"
        in r.stderr
    )
    write_config(conf, "[gpu-all]\ngpus = ALL\nidle_holder_command = /bin/true\n")
    r = subprocess.run(
        [*GPU_MON, "--config", str(conf), "--sim", str(sim.path), "check"], capture_output=True, text=True
    )
    assert "idle_holder_command" not in r.stderr
