"""Drop-ins: PATH.d/*.conf read after the config in name order, overriding it key by key; errors name the
drop-in's file and line; the trust rule holds for each drop-in and the directory; `check` lists the files.
And GPU_MON_CONFIG, the config of every command when --config is not given."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Dict

import pytest
from conftest import GPU_MON, write_config

from gpu_mon import config
from gpu_mon.config import ConfigError

TRUSTED = os.geteuid()  # root in CI; elsewhere the test user, so that modes are still checked
MAIN = "[gpu-all]\ngpus = ALL\n[defaults]\ninterval_seconds = 5\nstart_delay_seconds = 30\n"


def setup(tmp_path: Path, main: str, dropins: Dict[str, str]) -> Path:
    """A config and its PATH.d/ with these files (0600 each, as root wants them)."""
    path = write_config(tmp_path / "gpu_mon.conf", main)
    directory = tmp_path / "gpu_mon.conf.d"
    directory.mkdir(mode=0o755)
    for name, text in dropins.items():
        write_config(directory / name, text)
    return path


def errors(path: Path) -> list:
    with pytest.raises(ConfigError) as caught:
        config.load(str(path), TRUSTED)
    return caught.value.errors


def test_dropins_add_sections_and_override_keys_in_name_order(tmp_path):
    path = setup(
        tmp_path,
        MAIN,
        {
            "20-b.conf": "[defaults]\ninterval_seconds = 3\n",
            "10-a.conf": "[defaults]\ninterval_seconds = 1\n[process-x]\ncmd = /bin/true\n",
            "README": "not a config",
            ".hidden.conf": "[nonsense]\n",
            "old.conf.dpkg-old": "[nonsense]\n",
        },
    )
    c = config.load(str(path), TRUSTED)
    assert c.defaults.interval_seconds == 3.0  # 20-b after 10-a
    assert c.defaults.start_delay_seconds == 30.0  # the main file's, not overridden
    assert [p.name for p in c.processes] == ["x"]
    d = tmp_path / "gpu_mon.conf.d"
    assert (c.processes[0].path, c.gpu_sections[0].path) == (str(d / "10-a.conf"), str(path))
    assert c.files == (str(path), str(d / "10-a.conf"), str(d / "20-b.conf"))
    assert c.path == str(path)


def test_without_the_directory_only_the_config_is_read(tmp_path):
    path = write_config(tmp_path / "gpu_mon.conf", MAIN)
    assert config.load(str(path), TRUSTED).files == (str(path),)
    assert config.parse(MAIN, str(path)).files == (str(path),)


def test_errors_name_the_dropin_and_its_line_all_at_once(tmp_path):
    path = setup(
        tmp_path,
        MAIN + "full_scan_seconds = x\n",
        {
            "10-a.conf": "; an admin's\n[defaults]\nintervl_seconds = 1\n[gpu-more]\nignore_users = root\n",
            "20-b.conf": "[defaults]\nstart_delay_seconds = soon\n[defaults]\n",
        },
    )
    a, b = tmp_path / "gpu_mon.conf.d" / "10-a.conf", tmp_path / "gpu_mon.conf.d" / "20-b.conf"
    assert errors(path) == [
        f"{path}:6: [defaults] full_scan_seconds: 'x' is not a number of seconds",
        f"{a}:3: [defaults] intervl_seconds: unknown key (did you mean 'interval_seconds'?)",
        f"{a}:4: [gpu-more] gpus: missing (use ALL or a comma-separated list of GPU indices or UUIDs)",
        f"{b}:2: [defaults] start_delay_seconds: 'soon' is not a number of seconds",
        f"{b}:3: [defaults] appears twice (first at line 1)",
    ]


def test_a_key_overridden_by_a_dropin_is_checked_there_only(tmp_path):
    """The main file's value is replaced (not parsed too); a bad value in the drop-in is the drop-in's."""
    path = setup(
        tmp_path,
        "[gpu-all]\ngpus = ALL\n[defaults]\ninterval_seconds = bad\n",
        {"50.conf": "[defaults]\n\ninterval_seconds = 0.01\n"},
    )
    dropin = tmp_path / "gpu_mon.conf.d" / "50.conf"
    assert errors(path) == [f"{dropin}:3: [defaults] interval_seconds: '0.01' must be at least 0.1"]


def test_a_section_of_a_dropin_that_overlaps_another_is_named_at_the_dropin(tmp_path):
    path = setup(tmp_path, MAIN, {"gpu.conf": "\n[gpu-one]\ngpus = 0\n"})
    dropin = tmp_path / "gpu_mon.conf.d" / "gpu.conf"
    assert errors(path) == [
        f"{dropin}:2: [gpu-one] gpus: overlaps [gpu-all] which names ALL "
        "(each GPU may be named by one section)"
    ]


@pytest.mark.parametrize("mode", [0o620, 0o602])
def test_a_dropin_writable_by_others_is_refused(tmp_path, mode):
    path = setup(tmp_path, MAIN, {"a.conf": "[tty]\n"})
    dropin = tmp_path / "gpu_mon.conf.d" / "a.conf"
    os.chmod(dropin, mode)
    (line,) = errors(path)
    assert line.startswith(f"{dropin}: writable by group or others (refused")
    assert config.load(str(path), None).files[-1] == str(dropin)  # not checked when not root


def test_a_dropin_directory_writable_by_others_is_refused(tmp_path):
    path = setup(tmp_path, MAIN, {"a.conf": "[tty]\n"})
    directory = tmp_path / "gpu_mon.conf.d"
    os.chmod(directory, 0o777)
    (line,) = errors(path)
    assert line.startswith(f"{directory}: directory is writable by group or others (refused")


def test_an_empty_dropin_directory_writable_by_others_is_refused(tmp_path):
    path = setup(tmp_path, MAIN, {})
    os.chmod(tmp_path / "gpu_mon.conf.d", 0o777)
    assert "directory is writable by group or others" in errors(path)[0]


def test_a_symlinked_dropin_is_refused(tmp_path):
    path = setup(tmp_path, MAIN, {})
    target = write_config(tmp_path / "elsewhere.conf", "[tty]\n")
    (tmp_path / "gpu_mon.conf.d" / "a.conf").symlink_to(target)
    (line,) = errors(path)
    assert "a.conf: is a symlink (refused" in line


def gpu_mon(*args: str, env: Dict[str, str]) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("GPU_MON_SIM", "GPU_MON_CONFIG")}
    e.update(env)
    return subprocess.run([*GPU_MON, *args], capture_output=True, text=True, timeout=60, env=e)


def test_check_lists_the_files_it_read(tmp_path, sim):
    path = setup(tmp_path, MAIN, {"a.conf": "[process-x]\ncmd = /bin/true\nuser = root\n"})
    r = gpu_mon("--config", str(path), "--sim", str(sim.path), "check", env={})
    assert r.returncode == 0, r.stderr
    assert f"read 2 file(s): {path}, {tmp_path / 'gpu_mon.conf.d' / 'a.conf'}\n" in r.stdout


def test_check_names_a_dropins_bad_key_at_its_line(tmp_path, sim):
    path = setup(tmp_path, MAIN, {"a.conf": "[defaults]\nwatch_open = no\n"})
    r = gpu_mon("--config", str(path), "--sim", str(sim.path), "check", env={})
    assert r.returncode == 2
    dropin = tmp_path / "gpu_mon.conf.d" / "a.conf"
    assert r.stderr == f"{dropin}:2: [defaults] watch_open: unknown key (did you mean 'watch_opens'?)\n"


def test_checks_warning_about_a_dropins_section_names_the_dropin(tmp_path, sim):
    text = "[process-x]\ncmd = /nonexistent/miner\nuser = root\n"
    path = setup(tmp_path, MAIN, {"a.conf": text})
    r = gpu_mon("--config", str(path), "--sim", str(sim.path), "check", env={})
    dropin = tmp_path / "gpu_mon.conf.d" / "a.conf"
    said = [line for line in r.stdout.splitlines() + r.stderr.splitlines() if "/nonexistent/miner" in line]
    assert said and all(f"{dropin}:2: " in line for line in said), r.stdout + r.stderr


def test_gpu_mon_config_is_the_default_for_config(tmp_path, sim):
    path = setup(tmp_path, MAIN, {})
    r = gpu_mon("--sim", str(sim.path), "check", env={"GPU_MON_CONFIG": str(path)})
    assert r.returncode == 0, r.stderr
    assert f"read 1 file(s): {path}\n" in r.stdout
    other = write_config(tmp_path / "other.conf", "[gpu-x]\ngpus = 0\n")
    r = gpu_mon("--config", str(other), "--sim", str(sim.path), "check", env={"GPU_MON_CONFIG": str(path)})
    assert f"read 1 file(s): {other}\n" in r.stdout  # --config wins
    r = gpu_mon("--sim", str(sim.path), "check", env={"GPU_MON_CONFIG": str(tmp_path / "none.conf")})
    assert r.returncode == 2
    assert r.stderr.startswith(f"{tmp_path / 'none.conf'}: No such file or directory (or pass --config PATH)")
