"""The documented set-up commands: CI runs exactly README's test command, and that command installs only
what the tests use (no recommended packages, no init system, the CPU build of the pinned torch); the users'
guide's queue try-it runs as written."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
import zipfile
from pathlib import Path
from typing import Iterator, Tuple

import pytest
from conftest import names_held, wait_for

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
USERS_GUIDE = (ROOT / "docs" / "users-guide.md").read_text()


def ci_command() -> str:
    (line,) = [x for x in (ROOT / ".ci" / "run").read_text().splitlines() if x.startswith("export ")]
    return line


def test_ci_runs_the_readme_command():
    assert f"```sh\n{ci_command()}\n```" in README


def test_apt_installs_no_recommends_and_no_init_system():
    apt = re.search(r"apt-get install ([^&]*)&&", ci_command())
    assert apt, ci_command()
    words = apt.group(1).split()
    assert "--no-install-recommends" in words
    assert not {"systemd-sysv", "init", "prometheus-node-exporter"} & set(words)


def test_torch_comes_from_the_cpu_index_at_the_tested_pin():
    extras = configparser.ConfigParser()
    extras.read(ROOT / "setup.cfg")
    (pin,) = [x for x in extras["options.extras_require"]["test"].split() if x.startswith("torch")]
    step = f"pip install --no-deps {pin} --index-url https://download.pytorch.org/whl/cpu &&"
    assert step in ci_command()
    assert ci_command().index(step) < ci_command().index("pip install -e '.[test]'")


# ------------------------------------------------------------------ the queue's try-it, as a second user

QUEUE_TRY_IT = "**Try it on the simulated host** (root, a scratch directory)"
INSTALL_TO = (
    "/opt/gpu-mon"  # the one place the try-it's text is changed: its venv goes to the test's directory
)
SYSTEM_SITE = Path("/usr/lib/python3/dist-packages")  # Debian's python3-wheel (CI's apt installs it)


def try_it_commands(to: str, user: str, conf: str) -> Tuple[str, str, str]:
    """The queue try-it's install, chmod and submit commands as the users' guide writes them, with
    INSTALL_TO, its user (`alice`) and CONF replaced."""
    start = USERS_GUIDE.index(QUEUE_TRY_IT)
    text = USERS_GUIDE[start : USERS_GUIDE.index("\n\n", start)].replace("\n", " ")
    spans = re.findall(r"`([^`]*)`", text)
    (install,) = [s for s in spans if s.startswith("/usr/bin/python3 -m venv")]
    (chmod,) = [s for s in spans if s.startswith("chmod ")]
    (submit,) = [s for s in spans if "runuser -u alice" in s]
    return tuple(  # type: ignore[return-value]
        s.replace(INSTALL_TO, to).replace("alice", user).replace("CONF", conf)
        for s in (install, chmod, submit)
    )


def _dist_info(site: Path, project: str) -> Path:
    found = sorted(site.glob(f"{project.replace('-', '_')}-*.dist-info")) or sorted(
        site.glob(f"{project.replace('-', '_')}-*.egg-info")
    )
    if not found:
        pytest.fail(f"{project} is not installed in {site}: the offline install needs it", pytrace=False)
    return found[-1]


def repack(site: Path, project: str, out: Path) -> None:
    """A wheel of an installed distribution, from its files (pip then installs the try-it offline)."""
    info = _dist_info(site, project)
    version = info.name[len(project) + 1 :].rsplit(".", 1)[0]
    name = project.replace("-", "_")
    if info.suffix == ".dist-info":
        files = [line.split(",")[0] for line in (info / "RECORD").read_text().splitlines() if line]
        files = [f for f in files if not f.startswith("..") and "__pycache__" not in f]
        wheel_meta = (info / "WHEEL").read_text()
        tag = next(x.split(":", 1)[1].strip() for x in wheel_meta.splitlines() if x.startswith("Tag:"))
        extra: dict = {}
    else:  # an egg-info (Debian's packages): its top-level packages, and metadata made from PKG-INFO
        tops = (info / "top_level.txt").read_text().split()
        files = [str(p.relative_to(site)) for t in tops for p in (site / t).rglob("*.py")]
        tag, new = "py3-none-any", f"{name}-{version}.dist-info"
        extra = {
            f"{new}/METADATA": (info / "PKG-INFO").read_text(),
            f"{new}/WHEEL": f"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: {tag}\n",
            f"{new}/RECORD": "".join(f"{f},,\n" for f in files)
            + f"{new}/METADATA,,\n{new}/WHEEL,,\n{new}/RECORD,,\n",
        }
    with zipfile.ZipFile(out / f"{name}-{version}-{tag}.whl", "w") as z:
        for f in files:
            z.write(site / f, f)
        for path, text in extra.items():
            z.writestr(path, text)


def offline_wheels(out: Path) -> None:
    """What `pip install .` of the checkout needs, as wheels: the build's setuptools and wheel, and the
    runtime requirements, repacked from what the test suite runs on (no network)."""
    ours = Path(sysconfig.get_paths()["purelib"])
    for project in ("setuptools", "psutil", "nvidia-ml-py", "sdnotify"):
        repack(ours, project, out)
    repack(SYSTEM_SITE, "wheel", out)


@pytest.fixture
def newbie() -> Iterator[Tuple[str, Path]]:
    """A second user with a home in a directory every user may enter: (name, that directory). Requested
    before daemon_factory, it is removed after the daemon (and its jobs) stopped."""
    if os.geteuid() != 0:
        pytest.skip("makes a user and runs gpu-mon as them: needs root")
    from test_queue import _make_user

    base = Path(tempfile.mkdtemp(prefix="gpu-mon-try-it-", dir="/tmp"))
    os.chmod(base, 0o755)
    user = "gmsdnewbie"  # (other tests' users have names of their own)
    with names_held((user,)):
        try:
            _make_user(user, base)
            yield user, base
        finally:
            subprocess.run(["pkill", "-KILL", "-u", user], capture_output=True)  # only the test's user
            wait_for(
                lambda: subprocess.run(["pgrep", "-u", user]).returncode == 1, 10, f"{user}'s processes gone"
            )
            subprocess.run(["userdel", "-r", user], capture_output=True)
            shutil.rmtree(base, ignore_errors=True)


def test_the_queue_try_it_runs_as_written_for_a_second_user(newbie, daemon_factory, sim):
    user, base = newbie
    wheels, checkout = base / "wheels", base / "checkout"
    wheels.mkdir()
    offline_wheels(wheels)
    shutil.copytree(ROOT / "gpu_mon", checkout / "gpu_mon", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "bin", checkout / "bin")  # (the gpu-mon executable setup.cfg installs)
    for name in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, checkout / name)
    d = daemon_factory(
        f"[gpu-all]\ngpus = ALL\n[queue]\nsocket = {base / 'run' / 'queue.sock'}\n"
        f"database = {base / 'queue.sqlite'}\nlauncher = direct\n",
        defaults={"start_delay_seconds": 0},
        start=False,
    )
    d.config_path = base / "gpu_mon.conf"  # (the try-it's CONF, where the user can reach it)
    d.write_config(d.body)
    d.start()
    install, chmod, submit = try_it_commands(str(base / "gpu-mon"), user, str(d.config_path))
    offline = {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels)}
    r = subprocess.run(
        install, shell=True, cwd=checkout, env={**os.environ, **offline}, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    subprocess.run(chmod, shell=True, check=True)
    wait_for(lambda: (base / "run" / "queue.sock").exists(), 20, "the queue's socket")
    r = subprocess.run(submit, shell=True, capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (0, "job 1 queued (0 ahead)\n", "")
    log = base / user / ".local/state/gpu-mon/jobs/1.log"
    uuids = (sim.uuid(0), sim.uuid(1))
    wait_for(lambda: log.exists() and log.read_text().strip() in uuids, 30, "the job's output")
    d.wait_log(rf"queue: starting job 1\[\d+\] of {user} ")
