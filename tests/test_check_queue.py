"""`gpu-mon check` says what it found of [queue]: the socket (does a daemon answer, what its queue holds),
the database, the launcher, the GPUs and every limit; for root and for a plain user; and it starts or
changes nothing. The real daemon on simulated GPUs, users made here."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import wait_for
from test_queue import PY, made_lab, queue_body

from gpu_mon.commands.checkqueue import limits
from gpu_mon.config import QueueSection

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them: needs root")


@pytest.fixture
def clab(sim):
    with made_lab("gmc", ("gmcann", "gmcben"), "import time; time.sleep(600)\n") as lab:
        yield lab


def _check(lab, config: Path, sim, user=None) -> subprocess.CompletedProcess:
    argv = ["--config", str(config), "--sim", str(sim.path), "check"]
    if user is not None:  # (the simulated GPUs where the user may read them)
        shutil.copy(sim.path, lab.dir / "sim.json")
        os.chmod(lab.dir / "sim.json", 0o644)
        return lab.run(user, *argv[:2], "--sim", str(lab.dir / "sim.json"), "check")
    env = {**os.environ, "PYTHONPATH": str(lab.code)}
    return subprocess.run([PY, "-m", "gpu_mon", *argv], capture_output=True, text=True, env=env, timeout=60)


def _queue_lines(r: subprocess.CompletedProcess) -> dict:
    assert r.returncode == 0 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    lines = [line[len("queue: ") :] for line in r.stdout.splitlines() if line.startswith("queue: ")]
    return {line.split(" ", 1)[0].rstrip(":"): line for line in lines}


def test_every_limit_key_is_listed_from_the_section() -> None:
    q = QueueSection(max_running_per_user=2, grace_seconds=9)
    text = limits(q)
    assert "max_running_per_user = 2" in text and "max_array_size = 10000" in text
    assert "max_grace_seconds = 600" in text and "grace_seconds = 9" not in text.replace("max_grace", "")


def test_check_says_what_it_finds_of_the_queue_for_root_and_a_user_and_changes_nothing(
    clab, daemon_factory, sim
):
    lab = clab
    body = queue_body(lab, extra="max_running_per_user = 3\nusers = gmcann\n", gpus="0")
    d = daemon_factory(body, defaults={"start_delay_seconds": 0}, start=False)
    d.write_config(body)
    config = d.config_path
    # before the daemon: nothing there, and check makes nothing
    found = _queue_lines(_check(lab, config, sim))
    assert found["socket"].endswith("not there: no daemon runs this queue now"), found
    assert "not there yet" in found["database"], found
    assert "max_running_per_user = 3" in found["limits"] and "max_array_size = 10000" in found["limits"]
    assert "launcher direct: jobs run as the daemon's own children" in found["launcher"]
    assert "who may submit: gmcann" in found["GPUs"] and "GPUs: 0;" in found["GPUs"]
    assert not lab.socket.exists() and not lab.database.exists()
    # with the daemon: it answers, and says what its queue holds
    d.start()
    wait_for(lab.socket.exists, 20, "the queue's socket")
    job = lab.submit(lab.alice, "--hold", "--", PY, str(lab.job))
    wait_for(lambda: lab.jobs(lab.alice)[job]["state"] == "held", 20, "the job held")
    before = lab.database.stat().st_mtime_ns, lab.jobs(lab.alice)
    found = _queue_lines(_check(lab, config, sim))
    assert "a daemon answers (0 running or stopping, 1 queued or held)" in found["socket"], found
    assert "MiB, root's, mode 0" in found["database"], found
    # a plain user, with a copy of the config it may read: what it may see, one line each
    mine = lab.dir / "readable.conf"
    shutil.copy(config, mine)
    os.chmod(mine, 0o644)
    found = _queue_lines(_check(lab, mine, sim, user=lab.bob))
    assert "a daemon answers" in found["socket"], found
    assert "MiB, root's" in found["database"] or "cannot be looked at by you" in found["database"], found
    assert (lab.database.stat().st_mtime_ns, lab.jobs(lab.alice)) == before  # nothing changed


def test_check_says_when_the_queue_is_off(tmp_path: Path, sim) -> None:
    config = tmp_path / "gpu_mon.conf"
    config.write_text("[gpu-all]\ngpus = ALL\n")
    os.chmod(config, 0o600)
    r = subprocess.run(
        [PY, "-m", "gpu_mon", "--config", str(config), "--sim", str(sim.path), "check"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    assert r.returncode == 0, r.stderr
    assert f"queue: off ({config} has no [queue] section): `gpu-mon submit` is refused\n" in r.stdout
