"""What root writes into or reads from a user's job output goes through no link the user made: the lines
gpu-mon writes into a job's log (a directory of the path swapped for a link after the start), and root's
`gpu-mon logs [--follow] ID` (the output made a link to /etc/shadow). Real daemon, real users made here
(gmlann, gmlben)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
from conftest import wait_for
from test_queue import JOB, PY, Lab, made_lab, queue_body

from gpu_mon import safefile
from gpu_mon.queue.outside import NOTE_SCRIPT

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them")


@pytest.fixture
def llab(sim) -> Iterator[Lab]:
    with made_lab("gml", ("gmlann", "gmlben"), JOB) as lab:
        yield lab


def _daemon(lab: Lab, daemon_factory):
    d = daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    return d


def _as_user(lab: Lab, path: Path) -> None:
    os.chown(path, lab.alice.uid, lab.alice.gid, follow_symlinks=False)


@root_only
def test_a_line_into_a_jobs_log_goes_through_no_directory_link_swapped_in_after_the_start(
    llab: Lab, daemon_factory
) -> None:
    _daemon(llab, daemon_factory)
    ann = llab.alice
    logs, elsewhere = ann.work / "logs", ann.work / "elsewhere"
    for path in (logs, elsewhere):
        path.mkdir()
        _as_user(llab, path)
    other = elsewhere / "out.log"
    other.write_text("")
    _as_user(llab, other)
    job = llab.submit(ann, "--output", str(logs / "out.log"), *llab.job_cmd("forever"))
    llab.wait_running(ann, job)
    # the user swaps the log's directory for a link to another of theirs, with a file of theirs there
    logs.rename(ann.work / "logs.real")
    os.symlink(elsewhere, logs)
    _as_user(llab, logs)
    r = llab.run(ann, "cancel", str(job))
    assert r.returncode == 0, r.stderr
    llab.wait_state(ann, job, "cancelled")
    assert other.read_text() == ""  # (before: `gpu-mon: job 1 cancelled at ...` written there)


def test_the_note_writer_of_a_unit_follows_no_link_in_any_component(tmp_path: Path) -> None:
    real = tmp_path / "real"
    (real / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    log = real / "sub" / "out.log"
    log.write_text("partial")
    for path, text in ((tmp_path / "link/sub/out.log", "via a link"), (log, "direct")):
        subprocess.run(["/bin/sh", "-c", NOTE_SCRIPT, "gpu-mon-note", str(path), text], check=True)
    assert log.read_text() == "partial\ndirect\n"


def test_open_no_links_refuses_a_link_in_any_component(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    os.close(safefile.open_no_links(str(tmp_path / "real" / "f"), os.O_RDONLY))
    with pytest.raises(safefile.UnsafeFile, match=r"not a directory|symlink"):
        safefile.open_no_links(str(tmp_path / "link" / "f"), os.O_RDONLY)


@root_only
def test_roots_logs_of_a_job_whose_output_is_a_link_to_shadow_is_a_one_line_refusal(
    llab: Lab, daemon_factory
) -> None:
    _daemon(llab, daemon_factory)
    ann = llab.alice
    out = ann.work / "out.log"
    job = llab.submit(ann, "--output", str(out), *llab.job_cmd("exit", "0"))
    llab.wait_state(ann, job, "done")
    out.unlink()
    os.symlink("/etc/shadow", out)
    _as_user(llab, out)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(llab.code), "LANG": "C.UTF-8"}
    cli = [PY, "-m", "gpu_mon", "--config", str(llab.client_conf), "logs", str(job)]
    for follow in ([], ["--follow"]):  # (--follow printed nothing and exited 0: issue 46, item 6)
        r = subprocess.run([*cli, *follow], capture_output=True, text=True, env=env, cwd="/", timeout=60)
        assert "root:" not in r.stdout and r.stdout == ""
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Permission denied" in r.stderr, r.stderr
    # the same file as a plain file of hers: root reads it (as her)
    out.unlink()
    out.write_text("hers\n")
    _as_user(llab, out)
    out.chmod(0o600)
    for follow in ([], ["--follow"]):
        r = subprocess.run([*cli, *follow], capture_output=True, text=True, env=env, cwd="/", timeout=60)
        assert (r.returncode, r.stdout) == (0, "hers\n"), r.stderr
