"""A queued job's output, as the daemon makes and writes it: the default directory made as the user under
the user's passwd home (whatever $HOME says), a job whose output cannot be opened failed with the reason,
the lines the daemon writes into the output at each stop (never through a link, never into another's
file), and the stop signal that reaches only the main process (`--stop-main-only`, `B:SIG`)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from conftest import foreign_open, wait_for
from test_queue import PY, Lab, lab, queue_body  # noqa: F401  (lab: the fixture)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them: needs root")

# The main process and one child each write down the signals they get (USR1 is recorded and survived;
# TERM recorded, then they exit).
FAMILY = r"""
import os, signal, sys, time
tag = sys.argv[1]

def recorder(who):
    def record(signum, frame):
        with open(f"{tag}-{who}", "a") as f:
            f.write(signal.Signals(signum).name + "\n")
        if signum == signal.SIGTERM:
            os._exit(0)
    return record

if os.fork() == 0:
    signal.signal(signal.SIGUSR1, recorder("child"))
    signal.signal(signal.SIGTERM, recorder("child"))
    open(f"{tag}-ready", "w").close()
    while True:
        time.sleep(0.05)
signal.signal(signal.SIGUSR1, recorder("main"))
signal.signal(signal.SIGTERM, recorder("main"))
while True:
    time.sleep(0.05)
"""


def _default_log(home: Path, job_id: int) -> Path:
    return home / ".local/state/gpu-mon/jobs" / f"{job_id}.log"


def test_the_default_output_is_made_as_the_user_under_the_passwd_home_whatever_home_says(
    lab: Lab,  # noqa: F811
    daemon_factory,
):
    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    user = lab.bob
    assert not (user.home / ".local").exists()  # a fresh account: nothing made it before
    elsewhere = user.work / "elsewhere"  # $HOME as runuser, sudo -u or an NFS setup may leave it
    elsewhere.mkdir()
    os.chown(elsewhere, user.uid, user.gid)
    job_id = lab.submit(user, *lab.job_cmd("exit", "0"), env={"HOME": str(elsewhere)})
    job = lab.wait_state(user, job_id, "done")
    assert job["exit_status"] == 0
    log = _default_log(user.home, job_id)
    assert log.exists() and log.stat().st_uid == user.uid
    for d in (user.home / ".local", log.parent.parent, log.parent):
        st = d.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (user.uid, 0o700), d
    assert not (elsewhere / ".local").exists()  # the client made nothing under $HOME


def test_a_job_whose_output_cannot_be_opened_fails_saying_which_file_and_why(lab: Lab, daemon_factory):  # noqa: F811
    d = daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    closed = lab.dir / "roots"  # root's directory: the user may not write in it (once it is submitted:
    closed.mkdir()  # submit refuses an output the user cannot open then, test_queue_submit_checks.py)
    os.chmod(closed, 0o777)
    target = closed / "out.log"
    job_id = lab.submit(lab.alice, "--hold", "--output", str(target), *lab.job_cmd("exit", "0"))
    os.chmod(closed, 0o755)
    assert lab.run(lab.alice, "release", str(job_id)).returncode == 0
    job = lab.wait_state(lab.alice, job_id, "failed")
    assert job["reason"] == f"cannot open {target}: Permission denied"
    assert not target.exists() and not lab.reports(lab.alice, job_id)  # its command never ran
    r = lab.run(lab.alice, "jobs", "--all")
    assert f"cannot open {target}: Permission denied" in r.stdout and "status 126" not in r.stdout
    d.wait_log(rf"job {job_id}: cannot open {re.escape(str(target))}: Permission denied")


def test_a_preempted_job_s_log_says_so_and_jobs_and_status_keep_it(lab: Lab, daemon_factory, sim):  # noqa: F811
    d = daemon_factory(queue_body(lab, gpus="0"), defaults={"start_delay_seconds": 0.3})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    job_id = lab.submit(lab.alice, "--stop-signal", "USR1", *lab.job_cmd("ckpt"))
    lab.wait_running(lab.alice, job_id)
    with foreign_open(sim.device(0)):
        job = lab.wait_state(lab.alice, job_id, "queued")
        log = _default_log(lab.alice.home, job_id).read_text()
        at = r"\d\d:\d\d:\d\d"
        by = r"GPU 0 \(GPU-[^)]*\) busy: root python3\[\d+\] holds [^;]*"
        line = rf"^gpu-mon: job {job_id} preempted at {at}: {by}; requeued \(restart 1\)$"
        assert re.search(line, log, re.M), log
        assert job["preempted"] and re.fullmatch(by, job["preempted_reason"])
        r = lab.run(lab.alice, "jobs", "--all")
        assert f"last preempted at {job['preempted'][11:19]}: GPU 0 (GPU-" in r.stdout
    done = lab.wait_state(lab.alice, job_id, "done")
    assert done["preempted"] == job["preempted"]  # kept after the job ran again and ended
    texts = lambda: [e["text"] for e in d.state().get("decisions", [])]  # noqa: E731
    wait_for(lambda: any(f"queue: starting job {job_id}[" in t for t in texts()), 20, "starts in status")
    assert any(re.search(rf"{by}; stopping job {job_id}$", t) for t in texts())
    assert any(f"queue: job {job_id} of gmqalice exited" in t for t in texts())


def test_cancel_writes_its_line_but_never_through_a_link_nor_into_anothers_file(lab: Lab, daemon_factory):  # noqa: F811
    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    root_file = lab.dir / "roots-file"
    root_file.write_text("root's\n")
    os.chmod(root_file, 0o644)
    plain = lab.submit(lab.alice, "--grace", "1", *lab.job_cmd("forever"))
    # This job makes its output a link to root's file, then waits to be cancelled
    out = lab.alice.work / "swapped.log"
    swap = f"rm -f {out}; ln -s {root_file} {out}; touch swapped; exec sleep 600"
    linked = lab.submit(lab.alice, "--output", str(out), "--", "/bin/sh", "-c", swap, lab.marker)
    wait_for(lambda: (lab.alice.work / "swapped").exists(), 20, "the link made")
    lab.wait_state(lab.alice, plain, "running")
    r = lab.run(lab.alice, "cancel", str(plain), str(linked))
    assert r.returncode == 0, r.stderr
    lab.wait_state(lab.alice, plain, "cancelled")
    lab.wait_state(lab.alice, linked, "cancelled")
    log = _default_log(lab.alice.home, plain).read_text()
    assert re.search(rf"^gpu-mon: job {plain} cancelled at \d\d:\d\d:\d\d by gmqalice$", log, re.M), log
    assert root_file.read_text() == "root's\n" and os.path.islink(out)


HOW = [("--stop-signal", "USR1"), ("--stop-signal", "B:USR1"), ("--stop-main-only",)]


@pytest.mark.parametrize("how", HOW)
def test_the_stop_signal_reaches_the_group_or_with_main_only_the_main_process_alone(
    lab: Lab,  # noqa: F811
    daemon_factory,
    how,
):
    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    script = lab.dir / "family.py"
    script.write_text(FAMILY)
    os.chmod(script, 0o755)
    signal_args = list(how) if how[0] == "--stop-signal" else ["--stop-signal", "USR1", *how]
    job_id = lab.submit(lab.alice, "--grace", "1", *signal_args, "--", PY, str(script), "fam", lab.marker)
    work = lab.alice.work
    wait_for(lambda: (work / "fam-ready").exists(), 20, "the child's handlers")
    assert lab.run(lab.alice, "cancel", str(job_id)).returncode == 0
    lab.wait_state(lab.alice, job_id, "cancelled")
    main_only = "B:USR1" in how or "--stop-main-only" in how
    got = {who: (work / f"fam-{who}").read_text().split() for who in ("main", "child")}
    # USR1 to the main process (alone, or with its group); SIGTERM at the grace's end to every process
    child = ["SIGTERM"] if main_only else ["SIGUSR1", "SIGTERM"]
    assert got == {"main": ["SIGUSR1", "SIGTERM"], "child": child}


CHECKPOINT = r"""
import os, signal, sys, time
tag = sys.argv[1]

def record(who, signum):
    with open(f"{tag}-{who}", "a") as f:
        f.write(signal.Signals(signum).name + "\n")

def main_stop(signum, frame):
    record("main", signum)
    if signum == signal.SIGTERM and not os.path.exists(f"{tag}-saving"):
        open(f"{tag}-saving", "w").close()
        time.sleep(0.8)  # a checkpoint being written: another SIGTERM now would come in here
        open(f"{tag}-saved", "w").close()
        sys.exit(143)

if os.fork() == 0:
    signal.signal(signal.SIGTERM, lambda s, f: (record("child", s), os._exit(0)))
    while True:
        time.sleep(0.05)
signal.signal(signal.SIGTERM, main_stop)
open(f"{tag}-ready", "w").close()
while True:
    time.sleep(0.05)
"""


def test_a_job_stopped_with_sigterm_gets_it_once_and_its_clean_exit_is_not_a_signal(
    lab: Lab,  # noqa: F811
    daemon_factory,
):
    """The daemon sends SIGTERM to the job's process group; the leader passes it on only to processes that
    left the group. Twice, a handler that checkpoints was entered again, and a Python command exiting from
    its handler died of the second (SIG_DFL again while it finalizes): `killed by signal 15`."""
    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    script = lab.dir / "checkpoint.py"
    script.write_text(CHECKPOINT)
    os.chmod(script, 0o755)
    job_id = lab.submit(lab.alice, "--grace", "10", "--", PY, str(script), "ckp", lab.marker)
    work = lab.alice.work
    wait_for(lambda: (work / "ckp-ready").exists(), 20, "the job's handler")
    assert lab.run(lab.alice, "cancel", str(job_id)).returncode == 0
    job = lab.wait_state(lab.alice, job_id, "cancelled")
    got = {who: (work / f"ckp-{who}").read_text().split() for who in ("main", "child")}
    assert got == {"main": ["SIGTERM"], "child": ["SIGTERM"]}
    assert (work / "ckp-saved").exists()
    assert (job["exit_status"], job["signal"]) == (143, None)


def test_the_line_writer_of_jobs_under_systemd_appends_only_to_a_regular_file(tmp_path: Path):
    """Where jobs are units, the job's user writes gpu-mon's lines (queue/outside.py): one line each,
    after a partial line, never through a link at the end, never opening a FIFO, never making a file."""
    import subprocess

    from gpu_mon.queue import outside

    def write(path: Path, text: str) -> None:
        argv = ["/bin/sh", "-c", outside.NOTE_SCRIPT, "gpu-mon-note", str(path), text]
        subprocess.run(argv, check=True, timeout=10)

    log = tmp_path / "job.log"
    log.write_text("partial")
    line = "gpu-mon: job 1 preempted at 10:42:07: $HOME `id` %s; requeued"
    write(log, line)
    write(log, "again")
    assert log.read_text() == f"partial\n{line}\nagain\n"
    link = tmp_path / "link"
    link.symlink_to(log)
    write(link, "through a link")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    write(fifo, "into a FIFO")  # (would block, were it opened)
    write(tmp_path / "none", "a new file")
    assert log.read_text().endswith("\nagain\n") and not (tmp_path / "none").exists()
