"""`gpu-mon wait` and `submit --wait` through a restart of the daemon, and their `--timeout`: a real daemon
on simulated GPUs, users made here (their own names: other queue tests use theirs)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Iterator, Tuple

import pytest
from conftest import wait_for
from test_queue import PY, Lab, User, made_lab, queue_body

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them: needs root")

JOB = "import sys, time; time.sleep(float(sys.argv[1])); sys.exit(int(sys.argv[2]))\n"
RESTARTING = "gpu-mon: the daemon is restarting; still waiting for job {}\n"


@pytest.fixture
def lab(sim) -> Iterator[Lab]:
    with made_lab("gmw", ("gmwalma", "gmwbert"), JOB) as made:
        yield made


class Client:
    """`gpu-mon ARGS` as the user, as Lab.run does it, left running; its stderr in a file."""

    def __init__(self, lab: Lab, user: User, *args: str) -> None:
        self.err_path = lab.dir / f"stderr-{time.monotonic_ns()}"
        env = {"PATH": "/usr/bin:/bin", "HOME": str(user.home), "USER": user.name, "LANG": "C.UTF-8"}
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [PY, "-m", "gpu_mon", "--config", str(lab.client_conf), *args],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                user=user.uid,
                group=user.gid,
                cwd=str(user.work),
                env={**env, "PYTHONPATH": str(lab.code), "GMQ_MARK": lab.marker},
            )

    def said(self) -> str:
        """Its stderr so far."""
        return self.err_path.read_text()

    def end(self, timeout: float = 30) -> Tuple[int, str, str]:
        """Its exit status, stdout and stderr, once it ends."""
        out, _ = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, self.said()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def asleep(*clients: Client) -> None:
    """Wait until each client sleeps between two looks: it has had the daemon's first answer (before it,
    a client never sleeps)."""

    def sleeping(p: subprocess.Popen) -> bool:
        try:
            return "nanosleep" in Path(f"/proc/{p.pid}/wchan").read_text()
        except OSError:
            return False

    for proc in (c.proc for c in clients):
        done = lambda p=proc: sleeping(p) or p.poll() is not None  # noqa: E731
        wait_for(done, 20, f"pid {proc.pid} asleep", interval=0.02)
        assert proc.poll() is None, proc.communicate()


def told(client: Client) -> None:
    """Wait for the client's line that the daemon restarts."""
    wait_for(lambda: "the daemon is restarting" in client.said(), 20, "the client's line")


def test_wait_and_submit_wait_outlive_a_restart_and_end_with_the_jobs_status(lab, daemon_factory):
    d = daemon_factory(queue_body(lab, gpus="0"), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    held = lab.submit(lab.alice, "--hold", "--", PY, str(lab.job), "0", "3")
    waiter = Client(lab, lab.alice, "wait", str(held))
    # (submit --wait: a job that runs; the restart puts it back in the queue, it runs again and ends 0)
    submitter = Client(lab, lab.bob, "submit", "--wait", "--", PY, str(lab.job), "1", "0")
    try:
        wait_for(lambda: lab.jobs(lab.alice).get(held + 1, {}).get("state") == "running", 20, "bob's job")
        asleep(waiter, submitter)
        assert d.stop() == 0
        told(waiter)
        told(submitter)
        d.start()  # the same config, the same database
        wait_for(lab.socket.exists, 20, "the queue's socket again")
        assert lab.run(lab.alice, "release", str(held)).returncode == 0
        # the job's own status, as documented
        assert waiter.end() == (3, "", RESTARTING.format(held) + f"job {held} failed\n")
        said = RESTARTING.format(held + 1) + f"job {held + 1} done\n"
        assert submitter.end() == (0, f"job {held + 1} queued (0 ahead)\n", said)
        assert lab.jobs(lab.bob)[held + 1]["restarts"] == 1
    finally:
        waiter.kill()
        submitter.kill()


def test_wait_timeout_ends_a_wait_on_a_daemon_that_is_gone_or_a_job_that_waits(lab, daemon_factory):
    d = daemon_factory(queue_body(lab, gpus="0"), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    held = lab.submit(lab.alice, "--hold", "--", PY, str(lab.job), "0", "0")
    timed_out = f"gpu-mon: --timeout: job {held} not ended yet (it goes on)\n"
    t0 = time.monotonic()
    r = lab.run(lab.alice, "wait", "--timeout", "1", str(held))
    assert (r.returncode, r.stdout, r.stderr) == (124, "", timed_out)
    assert 1 <= time.monotonic() - t0 < 10
    waiter = Client(lab, lab.alice, "wait", "--timeout", "3", str(held))
    try:
        asleep(waiter)
        assert d.stop() == 0  # and no daemon comes back
        assert waiter.end() == (124, "", RESTARTING.format(held) + timed_out)
    finally:
        waiter.kill()
    # no daemon at the start, a bad --timeout, --timeout without --wait: one line each
    r = lab.run(lab.alice, "wait", "--timeout", "5", str(held))
    assert r.returncode == 1 and r.stderr.startswith("gpu-mon: no gpu-mon daemon answers on "), r.stderr
    r = lab.run(lab.alice, "wait", "--timeout", "soon", str(held))
    says = "gpu-mon: --timeout: 'soon' is not a duration (90, 90s, 30m, 2h, 1d)\n"
    assert (r.returncode, r.stderr) == (2, says)
    r = lab.run(lab.alice, "submit", "--timeout", "5", "--", "true")
    says = "gpu-mon: submit: --timeout is how long --wait waits: give --wait too\n"
    assert (r.returncode, r.stderr) == (2, says)


@pytest.mark.parametrize("comes_back", ["without the job", "without the queue"])
def test_wait_ends_in_one_line_when_the_restarted_daemon_has_no_such_job_or_no_queue(
    lab, daemon_factory, comes_back
):
    d = daemon_factory(queue_body(lab, gpus="0"), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    held = lab.submit(lab.alice, "--hold", "--", PY, str(lab.job), "0", "0")
    waiter = Client(lab, lab.alice, "wait", str(held))
    try:
        asleep(waiter)
        assert d.stop() == 0
        told(waiter)
        if comes_back == "without the job":
            lab.database.unlink()  # (a new database)
            d.start()
            said = f"gpu-mon: no such job: {held}\n"
        else:  # (the config the client reads has no [queue] now)
            lab.client_conf.write_text("[gpu-all]\ngpus = ALL\n")
            said = f"gpu-mon: the queue is off: {lab.client_conf} has no [queue] section\n"
        assert waiter.end() == (1, "", RESTARTING.format(held) + said)
    finally:
        waiter.kill()
