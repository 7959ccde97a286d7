"""The command line as an admin meets it: exit codes, one-line errors, status output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import GPU_MON, ROOT, UUIDS, SimHost, nobody_host, run_as_nobody, wait_for, write_config

GOOD = "[gpu-all]\ngpus = ALL\n[process-m]\ncmd = /bin/true\nuser = root\n"


def gpu_mon(*args: str, env=None, timeout: float = 60) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.pop("GPU_MON_SIM", None)
    e.update(env or {})
    return subprocess.run([*GPU_MON, *args], capture_output=True, text=True, timeout=timeout, env=e)


def no_traceback(r: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    return write_config(tmp_path / "gpu_mon.conf", GOOD)


def test_check_ok(conf, sim):
    r = gpu_mon("--config", str(conf), "--sim", str(sim.path), "check")
    assert r.returncode == 0, r.stderr
    assert "OK: 1 [gpu-*] and 1 [process-*] section(s); 2 GPU(s) seen" in r.stdout
    assert "root (written explicitly)" in r.stderr  # a warning, still exit 0


def test_options_after_the_command(conf, sim):
    r = gpu_mon("check", "--config", str(conf), "--sim", str(sim.path))
    assert r.returncode == 0, r.stderr


def test_sim_from_environment(conf, sim):
    r = gpu_mon("--config", str(conf), "check", env={"GPU_MON_SIM": str(sim.path)})
    assert r.returncode == 0 and "simulated GPUs" in r.stdout


def test_check_bad_config_lists_every_error(tmp_path, sim):
    path = write_config(tmp_path / "bad.conf", "[gpu-all]\ngpus = 0,x\n[process-m]\ngpus = 0\n[tyy]\n")
    r = gpu_mon("--config", str(path), "--sim", str(sim.path), "check")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert lines == [
        f"{path}:2: [gpu-all] gpus: 'x' is not a GPU index or UUID",
        f"{path}:3: [process-m] cmd: missing (the command to run)",
        f"{path}:5: [tyy]: unknown section (did you mean [tty]?); known: [defaults], [tty], "
        "[sentinel], [history], [metrics], [occupy], [queue], [slurm], [gpu-NAME], [process-NAME]",
    ]
    no_traceback(r)


def test_check_gpu_that_does_not_exist_is_an_error(tmp_path, sim):
    path = write_config(tmp_path / "c.conf", f"[gpu-a]\ngpus = 0,7,{UUIDS[5]}\n")
    r = gpu_mon("--config", str(path), "--sim", str(sim.path), "check")
    assert r.returncode == 2
    assert f"{path}:2: [gpu-a] gpus: no GPU with index 7 (this host has 2)" in r.stderr
    assert f"no GPU with UUID {UUIDS[5]} on this host" in r.stderr


def test_check_warns_about_placeholders(tmp_path, sim):
    path = write_config(
        tmp_path / "c.conf",
        "[gpu-a]\ngpus = ALL\n[process-m]\ncmd = miner-run --x\n"
        "dir = /nonexistent/dir\n[tty]\nwhitelist = user1,user2\n",
    )
    r = gpu_mon("--config", str(path), "--sim", str(sim.path), "check")
    assert r.returncode == 0, r.stderr
    assert "'miner-run' is not on the workload's PATH" in r.stderr
    assert "'/nonexistent/dir' does not exist" in r.stderr
    assert "no user 'user1' on this host" in r.stderr


def test_check_without_gpu_or_driver_is_a_runtime_failure(conf):
    # No --sim: the real NVML, and there is no NVIDIA driver on a CI machine. Every GPU would count as busy
    # and nothing would ever run, so `gpu-mon check && systemctl restart gpu-mon` must stop here.
    r = gpu_mon("--config", str(conf), "check")
    if r.returncode == 0 and "NVML" in r.stdout:
        pytest.fail("expected a machine without NVIDIA GPUs; run the gpu-marked tests on GPU machines")
    assert r.returncode == 1, r.stderr
    assert r.stdout == ""
    lines = [line for line in r.stderr.splitlines() if not line.startswith("warning: ")]
    assert len(lines) == 1 and lines[0].startswith("NVML: ") and "every GPU would count as busy" in lines[0]
    no_traceback(r)


def test_check_with_an_unreadable_gpu_the_config_names_is_a_runtime_failure(tmp_path, sim):
    path = write_config(tmp_path / "c.conf", "[gpu-one]\ngpus = 1\n")
    sim.set(0, error="GPU is lost")  # not named: a warning-free pass
    r = gpu_mon("--config", str(path), "--sim", str(sim.path), "check")
    assert r.returncode == 0, r.stderr
    sim.set(0, error=None)
    sim.gpus[1]["memory_used_mib"] = None  # (set() would drop the key)
    sim.write()
    r = gpu_mon("--config", str(path), "--sim", str(sim.path), "check")
    assert r.returncode == 1, r.stderr
    assert f"GPU 1 ({sim.uuid(1)}) cannot be read (memory: unreadable (simulated))" in r.stderr
    all_conf = write_config(tmp_path / "all.conf", "[gpu-all]\ngpus = ALL\n")
    sim.set(1, memory_used_mib=0)
    sim.set(0, error="GPU is lost")  # under `gpus = ALL`
    r = gpu_mon("--config", str(all_conf), "--sim", str(sim.path), "check")
    assert r.returncode == 1 and "GPU is lost" in r.stderr, r.stderr
    bad = write_config(tmp_path / "bad.conf", "[gpu-all]\ngpus = ALL\nbusy_memory = 3\n")
    r = gpu_mon("--config", str(bad), "--sim", str(sim.path), "check")
    assert r.returncode == 2, r.stderr  # a bad config says so first


@pytest.mark.parametrize(
    "args,code,fragment",
    [
        (["--config", "/nonexistent/gpu_mon.conf", "check"], 2, "/nonexistent/gpu_mon.conf: No such file"),
        (["--config", "/", "check"], 2, "/: not a file name"),
        (["--config", "/etc", "check"], 2, "/etc: not a regular file"),
        (["bogus"], 2, "invalid choice: 'bogus'"),
        ([], 2, "the following arguments are required: COMMAND"),
        (["status", "--jsno"], 2, "unrecognized arguments: --jsno (did you mean --json?)"),
        (
            ["submit", "--arrya", "0-3", "--", "true"],
            2,
            "unrecognized arguments: --arrya (did you mean --array?)",
        ),
        (["jobs", "--zzz"], 2, "unrecognized arguments: --zzz\n"),
    ],
    ids=[
        "missing",
        "root-dir",
        "directory",
        "unknown-command",
        "no-command",
        "bad-option",
        "near-option",
        "far-option",
    ],
)
def test_usage_errors(args, code, fragment):
    r = gpu_mon(*args)
    assert r.returncode == code
    assert fragment in r.stderr
    no_traceback(r)


@pytest.mark.parametrize(
    "content,fragment",
    [
        ("{not json", "not valid JSON"),
        ('{"gpus": [{"uuid": "nope"}]}', 'gpus[0].uuid: expected a string like "GPU-5a1c..."'),
        (
            '{"gpus": [{"uuid": "GPU-1", "memory_used_mib": -5}]}',
            "gpus[0].memory_used_mib: expected a number >= 0",
        ),
    ],
    ids=["json", "uuid", "negative"],
)
def test_bad_sim_file_is_one_line_and_exit_2(tmp_path, conf, content, fragment):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    for command in ("check", "status", "run"):
        r = gpu_mon("--config", str(conf), "--sim", str(bad), command)
        assert r.returncode == 2, (command, r.stderr)
        assert r.stderr.count("\n") == 1 and fragment in r.stderr and str(bad) in r.stderr
        no_traceback(r)


def test_run_with_bad_config_exits_2_without_traceback(tmp_path, sim):
    path = write_config(tmp_path / "c.conf", "[defaults]\ninterval_seconds = -1\n")
    r = gpu_mon("--config", str(path), "--sim", str(sim.path), "run")
    assert r.returncode == 2
    assert r.stderr.strip() == f"{path}:2: [defaults] interval_seconds: '-1' must be at least 0.1"


def holder_process(path: str) -> subprocess.Popen:
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; f = open(sys.argv[1]); print(1, flush=True); sys.stdin.read()",
            path,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert p.stdout.readline() == b"1\n"
    return p


def test_status_fresh_look_text_and_json(conf, sim):
    sim.set(1, memory_used_mib=3000, utilization_pct=97)
    p = holder_process(sim.device(0))
    try:
        r = gpu_mon("--config", str(conf), "--sim", str(sim.path), "status")
        assert r.returncode == 0, r.stderr
        assert "no daemon: a single look at the host" in r.stdout
        assert f"GPU 0 ({UUIDS[0]})  Sim GPU 0" in r.stdout
        name = (
            Path(f"/proc/{p.pid}/comm").read_text().strip()
        )  # python3, python3.11...: whatever runs the tests
        assert f"busy: root {name}[{p.pid}] holds {sim.device(0)}" in r.stdout
        assert "busy: 3000 MiB used by others (more than busy_memory_mib = 1024)" in r.stdout
        assert "3000/81559 MiB  97%" in r.stdout
        j = gpu_mon("--config", str(conf), "--sim", str(sim.path), "status", "--json")
        doc = json.loads(j.stdout)
        g0 = doc["gpus"][0]
        assert g0["uuid"] == UUIDS[0] and g0["busy"] is True
        assert g0["holders"] == [
            {"pid": p.pid, "user": "root", "name": name, "ours": False, "ignored": False}
        ]
        assert doc["daemon"] is None and doc["workloads"][0]["key"] == "m"
    finally:
        p.kill()
        p.wait()


def test_status_without_any_config_shows_the_host(sim):
    r = gpu_mon("--sim", str(sim.path), "status")
    assert r.returncode == 0, r.stderr
    assert "(missing: showing the host only)" in r.stdout or "config /etc/gpu_mon.conf" in r.stdout
    assert "(not watched)" in r.stdout or "[gpu-" in r.stdout


def test_status_with_nvml_unavailable_exits_1(conf):
    r = gpu_mon("--config", str(conf), "status")
    if "GPUs cannot be read" not in r.stdout:
        pytest.fail("expected a machine without an NVIDIA driver")
    assert r.returncode == 1
    no_traceback(r)


def test_status_reads_a_running_daemons_state(tmp_path, sim, daemon_factory):
    d = daemon_factory("[gpu-all]\ngpus = ALL\n[process-m]\ncmd = sleep 600\nuser = root\ngpus = 1\n")
    d.wait_running("m")
    r = gpu_mon("--config", str(d.config_path), "status")
    assert r.returncode == 0, r.stderr
    assert f"daemon running (pid {d.proc.pid}" in r.stdout
    assert "running m" in r.stdout
    assert "starting m[" in r.stdout  # recent decisions
    # After the daemon is gone (even by SIGKILL), status does not trust its stale state file.
    d.proc.kill()
    d.proc.wait()
    r = gpu_mon("--config", str(d.config_path), "--sim", str(sim.path), "status")
    assert "no daemon: a single look" in r.stdout


def test_python_dash_m_and_version():
    r = subprocess.run([sys.executable, "-m", "gpu_mon", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("gpu-mon 0.")


def test_example_demo_config_checks(tmp_path):
    # The README's demo must work from any checkout.
    r = gpu_mon(
        "--config",
        str(ROOT / "examples" / "demo.conf"),
        "--sim",
        str(ROOT / "examples" / "sim-host.json"),
        "check",
    )
    assert r.returncode == 0, r.stderr


@pytest.fixture
def root_only():
    if os.geteuid() != 0:
        pytest.fail("the root-safety checks apply when gpu-mon runs as root; run the suite as root (CI does)")


@pytest.mark.parametrize(
    "setup,fragment",
    [
        (lambda d, f: os.chmod(f, 0o620), "writable by group or others (refused"),
        (lambda d, f: os.chmod(f, 0o602), "writable by group or others (refused"),
        (lambda d, f: os.chown(f, 65534, 65534), "owned by uid 65534, not root (refused"),
        (
            lambda d, f: os.chmod(d, 0o777),
            "directory is writable by group or others (refused); chmod go-w it",
        ),
        (
            lambda d, f: os.chown(d, 65534, 65534),
            "directory is owned by uid 65534, not root (refused: whoever owns it could swap the config)",
        ),
    ],
    ids=["group-writable", "world-writable", "other-owned", "writable-parent", "other-owned-parent"],
)
def test_root_refuses_configs_others_could_change(tmp_path, sim, root_only, setup, fragment):
    d = tmp_path / "etc"
    d.mkdir()
    f = write_config(d / "gpu_mon.conf", GOOD)
    setup(d, f)
    for command in ("check", "run", "status"):
        r = gpu_mon("--config", str(f), "--sim", str(sim.path), command)
        assert r.returncode == 2, (command, r.stdout, r.stderr)
        assert fragment in r.stderr and r.stderr.count("\n") == 1
        no_traceback(r)


def test_root_refuses_a_symlinked_config(tmp_path, sim, root_only):
    real = write_config(tmp_path / "real.conf", GOOD)
    link = tmp_path / "gpu_mon.conf"
    link.symlink_to(real)
    r = gpu_mon("--config", str(link), "--sim", str(sim.path), "check")
    assert r.returncode == 2
    assert r.stderr.strip() == f"{link}: is a symlink (refused: it could be redirected)"


def test_root_accepts_a_config_in_a_sticky_root_directory(sim, root_only):
    import tempfile

    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        os.chmod(d, 0o1777)
        path = write_config(Path(d) / "gpu_mon.conf", GOOD)
        r = gpu_mon("--config", str(path), "--sim", str(sim.path), "check")
        assert r.returncode == 0, r.stderr


def test_shipped_config_is_valid(sim):
    shipped = ROOT / "conf" / "gpu_mon.conf"
    r = gpu_mon("--config", str(shipped), "--sim", str(sim.path), "check")
    assert r.returncode == 0, r.stderr


def test_sim_host_example_status(tmp_path):
    host = SimHost(tmp_path, 3)
    r = gpu_mon("--sim", str(host.path), "status", "--json")
    assert [g["index"] for g in json.loads(r.stdout)["gpus"]] == [0, 1, 2]


def test_check_and_status_create_nothing_next_to_the_sim_file(tmp_path, conf):
    # A shipped sim file in a directory we should not write to: `check` and `status` only look.
    sim_dir = tmp_path / "packaged"
    sim_dir.mkdir()
    (sim_dir / "sim.json").write_text('{"gpus": [{"uuid": "GPU-0000aaaa", "device": "dev/nvidia0"}]}')
    for command in ("check", "status"):
        r = gpu_mon("--config", str(conf), "--sim", str(sim_dir / "sim.json"), command)
        no_traceback(r)
    assert sorted(os.listdir(sim_dir)) == ["sim.json"]


def test_status_without_config_points_at_the_daemon_it_did_not_look_for(tmp_path, sim, daemon_factory):
    # The demo runs with its own config; `status` without --config looks at /etc's: it must say so.
    d = daemon_factory("[gpu-all]\ngpus = ALL\n")
    wait_for(lambda: d.state(), what="the daemon's state file")
    r = gpu_mon("--sim", str(sim.path), "status")
    assert "no daemon: a single look" in r.stdout
    assert "looked for a daemon holding /run/gpu_mon/state.json.lock" in r.stdout
    assert f"a gpu-mon daemon runs as pid {d.proc.pid} with --config {d.config_path}" in r.stdout


def test_check_without_a_config_says_where_to_start(tmp_path):
    if os.path.exists("/etc/gpu_mon.conf"):
        pytest.fail("this test needs a machine without /etc/gpu_mon.conf")
    r = gpu_mon("check")
    assert r.returncode == 2
    assert r.stderr.strip().startswith("/etc/gpu_mon.conf: No such file or directory; start from ")
    assert "(or pass --config PATH)" in r.stderr


@pytest.mark.parametrize(
    "command,shown,hidden",
    [
        (["run"], ("--config PATH", "--sim FILE", "--debug"), ()),
        (["check"], ("--config PATH", "--sim FILE", "--debug"), ()),
        (["status"], ("--config PATH", "--sim FILE", "--debug"), ()),
        (["report"], ("--config PATH", "--debug"), ("--sim",)),
        (["occupy", "on"], ("--config PATH", "--sim FILE", "--debug"), ()),
        (["stress"], ("--debug",), ("--config", "--sim")),
        (["sentinel"], ("--sim FILE", "--debug"), ("--config",)),
        (["watch"], ("--sim FILE", "--debug"), ("--config",)),
        (["occupy", "off"], ("--debug",), ("--config", "--sim")),
        (["occupy", "status"], ("--debug",), ("--config", "--sim")),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_subcommand_help_lists_the_common_options_it_reads(command, shown, hidden):
    r = gpu_mon(*command, "--help")
    assert r.returncode == 0
    for option in shown:
        assert option in r.stdout, (command, option)
    for option in hidden:
        assert option not in r.stdout, (command, option)


def test_check_reports_syntax_and_host_problems_at_once(tmp_path, sim):
    # Before: the GPU that does not exist was reported only after the syntax error was fixed.
    path = write_config(
        tmp_path / "c.conf",
        "[gpu-a]\ngpus = 0,7\n[process-m]\ncmd = x\nuser = nosuchuser\ngpus = 0\n[tty]\nenabled = maybe\n",
    )
    r = gpu_mon("--config", str(path), "--sim", str(sim.path), "check")
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"{path}:2: [gpu-a] gpus: no GPU with index 7 (this host has 2)",
        f"{path}:5: [process-m] user: no such user 'nosuchuser'",
        f"{path}:8: [tty] enabled: 'maybe' is not a boolean (use yes/no, true/false, on/off or 1/0)",
    ]


# ------------------------------------------------------------------------ state_file, host checks, messages


def test_check_reports_a_state_file_whose_directory_cannot_be_created(tmp_path, sim):
    path = write_config(tmp_path / "c.conf", f"[defaults]\n\nstate_file = /proc/nope/state.json\n{GOOD}")
    r = gpu_mon("--config", str(path), "--sim", str(sim.path), "check")
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines()[-1] == (
        f"{path}:3: [defaults] state_file: /proc/nope: No such file or directory: the daemon keeps its state "
        "(/proc/nope/state.json) and its lock (/proc/nope/state.json.lock) there; choose a state_file "
        "whose directory can be created"
    )
    assert not os.path.exists("/proc/nope")


def test_check_creates_nothing_when_it_tries_a_state_directory(tmp_path, sim):
    state_dir = tmp_path / "run"
    state_dir.mkdir()
    path = write_config(tmp_path / "c.conf", f"[defaults]\nstate_file = {state_dir}/a/b/state.json\n{GOOD}")
    r = gpu_mon("--config", str(path), "--sim", str(sim.path), "check")
    assert r.returncode == 0, r.stderr
    assert os.listdir(state_dir) == []


def test_run_refuses_a_state_file_whose_directory_cannot_be_created(tmp_path, sim):
    path = write_config(tmp_path / "c.conf", f"{GOOD}[defaults]\nstate_file = /proc/nope/state.json\n")
    r = gpu_mon("--config", str(path), "--sim", str(sim.path), "run", timeout=30)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"{path}:7: [defaults] state_file: /proc/nope: No such file or directory: ")
    assert "its lock (/proc/nope/state.json.lock)" in r.stderr
    no_traceback(r)


def test_a_plain_user_running_roots_config_is_told_to_run_as_root_or_use_a_state_file_of_its_own(
    public_dir, root_only
):
    """root ran the config (its lock is root's, in a directory only root writes); nobody runs it next."""
    sim, code_dir = nobody_host(public_dir)
    etc = public_dir / "etc"
    etc.mkdir()
    config = write_config(etc / "demo.conf", "[defaults]\nstate_file = state.json\n[gpu-all]\ngpus = ALL\n")
    os.chmod(config, 0o644)
    (etc / "state.json.lock").write_text("")
    os.chmod(etc, 0o755)

    def as_nobody(command: str) -> subprocess.CompletedProcess:
        return run_as_nobody(
            ["/usr/bin/python3", "-m", "gpu_mon", "--config", str(config), "--sim", str(sim.path), command],
            {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(code_dir)},
        )

    r = as_nobody("run")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (
        f"{config}:2: [defaults] state_file: {etc}/state.json.lock: Permission denied: this user may not "
        f"write the daemon's state ({etc}/state.json) or its lock ({etc}/state.json.lock) there; run gpu-mon "
        "as root, or give this daemon a state_file of its own"
    )
    r = as_nobody("check")  # root's config, checked by a plain user: a warning, not an error
    assert r.returncode == 0, r.stderr
    assert "run gpu-mon as root, or give this daemon a state_file of its own" in r.stderr


def test_host_check_problems_point_at_the_line_of_the_key(tmp_path, sim):
    path = write_config(
        tmp_path / "typo.conf",
        "[gpu-all]\ngpus = ALL\n\n[process-burn]\n; what it runs\nuser = root\n\n"
        "cmd = no-such-burner --x\ndir = /nonexistent/dir\n\ngpus = 7\n",
    )
    r = gpu_mon("--config", str(path), "--sim", str(sim.path), "check")
    assert r.returncode == 2
    assert f"{path}:11: [process-burn] gpus: no GPU with index 7 (this host has 2)" in r.stderr
    assert (
        f"warning: {path}:8: [process-burn] cmd: 'no-such-burner' is not on the workload's PATH" in r.stderr
    )
    assert f"warning: {path}:9: [process-burn] dir: '/nonexistent/dir' does not exist" in r.stderr


def test_a_reload_says_which_sections_it_added_changed_and_removed(tmp_path, sim, daemon_factory):
    body = "[gpu-all]\ngpus = ALL\n[process-old]\ncmd = sleep 600\nuser = root\ngpus = 0\n"
    d = daemon_factory(body)
    d.wait_running("old")
    d.write_config(
        "[gpu-all]\ngpus = ALL\nbusy_memory_mib = 10\n[process-new]\ncmd = sleep 600\nuser = root\n"
    )
    d.signal(signal.SIGHUP)
    d.wait_log(r"\[process-old\] removed from the config; stopping old")
    d.wait_log(r"reloaded .*; added: \[process-new\]; changed: \[gpu-all\]; removed: \[process-old\]$")
    d.wait_running("new")


@pytest.mark.parametrize(
    "args,usage,error",
    [
        (["stauts"], "usage: gpu-mon [-h]", "invalid choice: 'stauts' (did you mean status?)"),
        (["chek"], "usage: gpu-mon [-h]", "invalid choice: 'chek' (did you mean check?)"),
        (["occupy", "of"], "usage: gpu-mon occupy [-h]", "invalid choice: 'of' (did you mean off?)"),
        (
            ["status", "--jsn"],
            "usage: gpu-mon status [-h]",
            "gpu-mon status: error: unrecognized arguments: --jsn",
        ),
        (
            ["check", "--jsn"],
            "usage: gpu-mon check [-h]",
            "gpu-mon check: error: unrecognized arguments: --jsn",
        ),
        (
            ["occupy", "on", "--yeild"],
            "usage: gpu-mon occupy on [-h]",
            "gpu-mon occupy on: error: unrecognized arguments: --yeild",
        ),
    ],
    ids=["command", "command-2", "occupy-command", "status-option", "check-option", "occupy-on-option"],
)
def test_a_mistyped_command_or_option_gets_the_usage_it_belongs_to(args, usage, error):
    r = gpu_mon(*args)
    assert r.returncode == 2
    assert r.stderr.startswith(usage), r.stderr
    assert error in r.stderr.splitlines()[-1]
    assert sum("error:" in line for line in r.stderr.splitlines()) == 1


def test_occupy_does_not_offer_its_internal_command():
    r = gpu_mon("occupy", "bogus")
    assert r.returncode == 2
    assert "choose from on, off, status" in r.stderr and "serve" not in r.stderr
    assert "serve" not in gpu_mon("occupy", "--help").stdout


@pytest.mark.parametrize("command", ["run", "check"])
def test_run_and_check_help_say_what_they_do(command):
    r = gpu_mon(command, "--help")
    assert r.returncode == 0
    description = r.stdout.split("\n\n")[1]
    assert not description.startswith("options:") and len(description) > 80, r.stdout


def _parsers(parser):
    yield parser
    for action in parser._actions:
        for sub in (action.choices or {}).values() if hasattr(action, "_choices_actions") else ():
            yield from _parsers(sub)


def test_no_option_is_listed_twice():
    from gpu_mon.cli import build_parser

    for parser in _parsers(build_parser()):
        for action in parser._actions:
            assert len(set(action.option_strings)) == len(action.option_strings), (parser.prog, action)
    help_text = gpu_mon("sentinel", "--help").stdout
    assert "--command CMD, --command CMD" not in help_text and "--command CMD" in help_text


@pytest.mark.parametrize("how", ["option", "environment"])
def test_a_missing_sim_file_says_where_its_path_came_from(conf, how):
    missing = "/nonexistent/sim.json"
    if how == "option":
        r = gpu_mon("--config", str(conf), "--sim", missing, "check")
        named = "--sim"
    else:
        r = gpu_mon("--config", str(conf), "check", env={"GPU_MON_SIM": missing})
        named = "GPU_MON_SIM"
    assert r.returncode == 2
    assert r.stderr.strip() == f"gpu-mon: {named}: {missing}: No such file or directory"


def test_check_does_not_warn_of_a_simulated_device_the_daemon_makes(tmp_path):
    """Before the first run a simulated GPU's device file is missing: the daemon makes it, so check says
    nothing of it (and makes nothing); a device path that is something else than missing is still named."""
    sim_file = tmp_path / "sim.json"
    gpus = [{"uuid": UUIDS[0], "memory_total_mib": 1000, "memory_used_mib": 0, "device": "dev/nvidia0"}]
    gpus.append({"uuid": UUIDS[1], "memory_total_mib": 1000, "memory_used_mib": 0, "device": "dir/nvidia1"})
    sim_file.write_text(json.dumps({"gpus": gpus}))
    (tmp_path / "dir" / "nvidia1").mkdir(parents=True)  # a directory: no device, and the daemon makes none
    conf = write_config(tmp_path / "c.conf", GOOD)
    r = gpu_mon("--config", str(conf), "--sim", str(sim_file), "check")
    assert r.returncode == 0, r.stderr
    assert "nvidia0" not in r.stderr and not (tmp_path / "dev").exists()
    assert "nvidia1" in r.stderr and "always count as busy" in r.stderr
