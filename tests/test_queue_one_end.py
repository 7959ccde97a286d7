"""Exactly one end per job across a crash: a job whose command ended while gpu-mon was stopped (SIGSTOP)
and then killed is recorded with its own end by the next daemon (its hook told), never run again; a job
whose command still ran when gpu-mon died goes back to the queue, as before. Real daemon, users made here."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import List

import psutil
import pytest
from conftest import wait_for
from test_queue import JOB, Lab, User, made_lab, queue_body

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them: needs root")


@pytest.fixture
def lab(sim):
    """Two users of this file's own (other queue tests use theirs)."""
    with made_lab("gmo", ("gmoann", "gmoben"), JOB) as made:
        yield made


def _leaders(d) -> List[psutil.Process]:
    return [p for p in psutil.Process(d.proc.pid).children() if "gpu-mon-leader" in " ".join(p.cmdline())]


def _lines(path: Path) -> List[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def _kill_stopped_and_restart(d, leader: psutil.Process) -> None:
    d.signal(signal.SIGKILL)
    d.proc.wait(10)
    wait_for(lambda: not leader.is_running() or leader.status() == psutil.STATUS_ZOMBIE, 20, "the old leader")
    d.start()  # the same config, the same database
    d.wait_log(r"queue: listening on", count=2)


def _submit_and_stop_daemon(lab: Lab, d, user: User, script: str) -> psutil.Process:
    hook = "echo $GPU_MON_JOB_STATE $GPU_MON_JOB_EXIT >> hook.log"
    job = lab.submit(user, "--notify", hook, "--", "sh", "-c", script)
    assert job == 1
    lab.wait_state(user, job, "running")
    (leader,) = wait_for(lambda: _leaders(d), 20, "the job's leader")
    wait_for(lambda: (user.work / "started").exists(), 20, "the command's start")
    d.signal(signal.SIGSTOP)
    return leader


@pytest.mark.parametrize("containment", ["subreaper", "auto"])
def test_a_job_that_ended_while_gpu_mon_was_stopped_is_recorded_with_its_end_and_never_runs_again(
    lab, daemon_factory, containment
):
    d = daemon_factory(
        queue_body(lab, gpus="0"), defaults={"start_delay_seconds": 0, "containment": containment}
    )
    wait_for(lab.socket.exists, 20, "the queue's socket")
    user = lab.alice
    runs = user.work / "runs.log"
    leader = _submit_and_stop_daemon(lab, d, user, "touch started; sleep 1; echo run >> runs.log; exit 3")
    wait_for(lambda: _lines(runs), 20, "the command's end")
    # the leader saw the end (and wrote it down) while the daemon was stopped: it has exited
    wait_for(lambda: leader.status() == psutil.STATUS_ZOMBIE, 20, "the leader's end")
    _kill_stopped_and_restart(d, leader)
    job = lab.wait_state(user, 1, "failed")
    assert (job["exit_status"], job["restarts"]) == (3, 0)
    d.wait_log(r"queue: job 1 exited with status 3 while gpu-mon was not there to see it: failed")
    # its hook was told of its own end, once
    wait_for(lambda: _lines(user.work / "hook.log") == ["failed 3"], 20, "the hook")
    # and it never ran again: another job runs to its end on the same GPU meanwhile
    after = lab.submit(user, "--", "true")
    lab.wait_state(user, after, "done")
    assert _lines(runs) == ["run"]
    assert not list(lab.database.parent.glob("gpu-mon-job-*.end*"))  # (taken, removed)
    # kept beside the database, never in the runtime directory (systemd deletes that with gpu-mon's unit)
    assert not list(Path(d.state_path).parent.glob("gpu-mon-job-*.end*"))
    said = (user.home / ".local/state/gpu-mon/jobs/1.log").read_text()
    assert "gpu-mon: job 1 exited with status 3 at " in said and "while gpu-mon was away: failed" in said, (
        said
    )


def test_the_issues_reproduction_done_with_status_0_after_the_restart(lab, daemon_factory):
    d = daemon_factory(queue_body(lab, gpus="0"), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    user = lab.alice
    runs = user.work / "runs.log"
    leader = _submit_and_stop_daemon(lab, d, user, "touch started; sleep 2; echo run >> runs.log")
    wait_for(lambda: _lines(runs), 20, "the command's end")
    wait_for(lambda: leader.status() == psutil.STATUS_ZOMBIE, 20, "the leader's end")
    _kill_stopped_and_restart(d, leader)
    job = lab.wait_state(user, 1, "done")
    assert (job["exit_status"], job["restarts"]) == (0, 0)
    wait_for(lambda: _lines(user.work / "hook.log") == ["done 0"], 20, "the hook")
    lab.wait_state(user, lab.submit(user, "--", "true"), "done")
    assert _lines(runs) == ["run"]


def test_a_job_still_running_when_a_stopped_gpu_mon_is_killed_goes_back_to_the_queue(lab, daemon_factory):
    d = daemon_factory(queue_body(lab, gpus="0"), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    user = lab.alice
    script = 'touch started; echo "start $GPU_MON_RESTART_COUNT" >> runs.log; exec sleep 600'
    leader = _submit_and_stop_daemon(lab, d, user, script)
    _kill_stopped_and_restart(d, leader)  # (the old leader stops the command: gpu-mon died)
    wait_for(lambda: _lines(user.work / "runs.log") == ["start 0", "start 1"], 30, "the second run")
    job = lab.wait_state(user, 1, "running")
    assert job["restarts"] == 1
    assert lab.run(user, "cancel", "1").returncode == 0
    lab.wait_state(user, 1, "cancelled")


def test_the_end_record_is_roots_and_whole_or_not_taken(tmp_path):
    from gpu_mon.engine.workloads import ends

    where = ends.path(str(tmp_path), 17, 2)
    assert where.endswith("/gpu-mon-job-17-r2.end")
    ends.write(where, ends.End(143, 15, 1700000000.5))
    assert ends.read(where) == ends.End(143, 15, 1700000000.5)
    assert os.stat(where).st_mode & 0o777 == 0o600
    os.chown(where, 65534, 65534)  # (one another user made there is not a record)
    assert ends.read(where) is None
    ends.remove(where)
    Path(where).write_text("0 0")  # (half a record)
    assert ends.read(where) is None
    os.unlink(where)
    os.symlink(tmp_path / "elsewhere", where)
    assert ends.read(where) is None
    # a unit's end: what systemd-run said of the main process
    said = "Running as unit: u\nMain processes terminated with: code=killed/status=TERM\nCPU time: 1s\n"
    assert ends.of_unit(said) == (143, 15)
    assert ends.of_unit("Main processes terminated with: code=exited/status=3\n") == (3, 0)
    assert ends.of_unit("Failed to start transient service unit\n") is None


def test_a_units_record_in_systemds_words_and_its_stop_mark(tmp_path):
    """What a unit's ExecStopPost= writes (`unit $EXIT_CODE $EXIT_STATUS`, its time the file's) reads as
    the leader's would; the ExecStop= mark says systemd stopped it, and goes with the record."""
    from gpu_mon.engine.workloads import ends

    where = ends.path(str(tmp_path), 5, 0)
    for text, want in (
        ("unit exited 3", (3, 0)),
        ("unit killed TERM", (143, 15)),
        ("unit dumped 11", (139, 11)),
    ):
        Path(where).write_text(text + "\n")
        os.chmod(where, 0o600)
        end = ends.read(where)
        assert end is not None and (end.code, end.signal) == want, text
        assert abs(end.wall - os.stat(where).st_mtime) < 1e-6
    for bad in ("unit exited", "unit killed NOPE", "unit other 3", "unit  "):
        Path(where).write_text(bad + "\n")
        assert ends.read(where) is None, bad
    assert not ends.stopped_by_systemd(where)
    Path(ends.stop_mark(where)).write_text("")
    assert ends.stop_mark(where).endswith("/gpu-mon-job-5-r0.stopped") and ends.stopped_by_systemd(where)
    ends.remove(where)
    assert not os.path.exists(where) and not ends.stopped_by_systemd(where)
