"""`gpu-mon occupy` and the queue: a GPU that runs a queue job (anyone's, the user's own too) is not free to
an occupier (commands/occupy_queue.py), and the queue waits for an occupier as for anyone else's use.

The reader is tried on real files and a real lock; the whole is tried with a real daemon (root) on simulated
GPUs and a user made here, whose own job runs while they run `occupy on`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator, List

import pytest
from conftest import UUIDS, SimHost, kill_marked, names_held, occupy_paths_of_the_copy, wait_for
from test_queue import JOB, PY, Lab, _make_user, lab_files

from gpu_mon.api.model import GpuReading, QueueJob, Snapshot
from gpu_mon.commands.occupy_queue import QueueJobs
from gpu_mon.config import GpuSection, GpuSelection
from gpu_mon.engine import lock
from gpu_mon.outputs import statefile
from gpu_mon.policy import decide as policy
from gpu_mon.policy import words
from gpu_mon.policy.decisions import Busy

USER = "gmoqdana"  # (names of other tests' users are theirs: gmqalice, gmqbob, ...)
FAST = ["--wait-minutes", "0.02", "--refresh-minutes", "0.002"]  # 1.2 s of free GPU, a look every 0.12 s


# ---------------------------------------------------------------------------------- the state file's reader


def _state(daemon_pid: int, running: object = None, queue: bool = True) -> dict:
    doc: dict = {"daemon": {"pid": daemon_pid, "start_ticks": 0}, "gpus": []}
    if queue:
        doc["queue"] = {"jobs": {"running": 1}, "running": running if running is not None else []}
    return doc


def _entry(job: int, user: str, gpus: List[str]) -> dict:
    return {"id": job, "user": user, "name": "sweep", "state": "running", "gpus": gpus, "restarts": 0}


@pytest.fixture
def held(tmp_path: Path) -> Iterator[str]:
    """A state file path whose lock this process holds, as a live daemon does."""
    path = str(tmp_path / "run" / "state.json")
    taken = lock.DaemonLock(path)
    taken.acquire()
    yield path
    taken.release()


def test_no_daemon_is_no_queue(tmp_path):
    path = str(tmp_path / "run" / "state.json")
    assert QueueJobs(path)() == ((), "")  # no daemon has run here
    statefile.write(path, _state(os.getpid(), [_entry(3, "alice", [UUIDS[0]])]))
    gone = lock.DaemonLock(path)
    gone.acquire()
    gone.release()  # the lock file stays, held by nobody: that daemon is gone, and its jobs with it
    assert QueueJobs(path)() == ((), "")


def test_a_live_daemons_running_jobs_are_read_and_reread_when_they_change(held):
    reader = QueueJobs(held)
    assert reader()[1].startswith("the daemon (pid ")  # holds the lock, has written nothing yet
    statefile.write(held, _state(os.getpid(), [_entry(17, "alice", [UUIDS[1]])]))
    assert reader() == ((QueueJob(17, "alice", "sweep", (UUIDS[1],)),), "")
    statefile.write(held, _state(os.getpid(), []))
    assert reader() == ((), "")
    statefile.write(held, _state(os.getpid(), queue=False))  # a daemon without a [queue]
    assert reader() == ((), "")


@pytest.mark.parametrize(
    "content, why",
    [
        (b"{not json", "not valid JSON"),
        (b"[]", "not a gpu-mon state file"),
        (json.dumps(_state(os.getpid() + 1)).encode(), "written by another daemon than pid"),
        (json.dumps(_state(os.getpid(), [{"id": "x", "user": "a", "gpus": []}])).encode(), "cannot be read"),
        (json.dumps(_state(os.getpid(), [{"id": 1, "user": "a", "gpus": [7]}])).encode(), "cannot be read"),
        (json.dumps(_state(os.getpid(), {"id": 1})).encode(), "cannot be read"),
    ],
)
def test_a_live_daemons_damaged_state_leaves_the_jobs_unknown(held, content, why):
    Path(held).write_bytes(content)
    jobs, unknown = QueueJobs(held)()
    assert jobs == () and why in unknown and held in unknown


@contextlib.contextmanager
def _as_nobody() -> Iterator[None]:
    """This process with nobody's effective uid and gid for a moment (root's checks bypass permissions)."""
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


@pytest.fixture
def public_held() -> Iterator[str]:
    """As `held`, in a directory every user may enter."""
    base = Path(tempfile.mkdtemp(prefix="gpu-mon-occupy-queue-", dir="/tmp"))
    os.chmod(base, 0o755)
    path = str(base / "run" / "state.json")
    taken = lock.DaemonLock(path)
    taken.acquire()
    yield path
    taken.release()
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="makes files a plain user cannot read")
def test_a_live_daemons_state_a_plain_user_cannot_read_leaves_the_jobs_unknown(public_held):
    statefile.write(public_held, _state(os.getpid(), []))
    with _as_nobody():
        assert QueueJobs(public_held)() == ((), "")  # world-readable, as the daemon writes it
    os.chmod(public_held, 0o600)
    with _as_nobody():
        jobs, unknown = QueueJobs(public_held)()
    assert jobs == () and unknown == f"{public_held}: Permission denied"
    lock_file = lock.lock_path(public_held)
    assert os.stat(lock_file).st_mode & 0o777 == 0o600  # no user may open it: /proc/locks says who holds it
    os.chmod(os.path.dirname(public_held), 0o700)
    with _as_nobody():
        jobs, unknown = QueueJobs(public_held)()
    assert jobs == () and unknown == f"{lock_file}: Permission denied"


# -------------------------------------------------------------------------------------------- the policy


def _snap(**fields: object) -> Snapshot:
    from gpu_mon.api.model import Gpu

    gpus = tuple(Gpu(index=i, uuid=UUIDS[i], memory_used_mib=0, processes=()) for i in range(2))
    return Snapshot(now=100.0, reading=GpuReading(gpus=gpus), **fields)  # type: ignore[arg-type]


def test_a_gpu_that_runs_a_queue_job_is_busy_and_says_whose():
    rules = GpuSection(name="occupy", gpus=GpuSelection(all=True), unreadable_is_busy=False)
    snap = _snap(queue_jobs=(QueueJob(17, "alice", "sweep", (UUIDS[1],)),))
    assert policy.gpu_verdict(UUIDS[0], rules, snap, {}) == (False, [])
    busy, reasons = policy.gpu_verdict(UUIDS[1], rules, snap, {})
    assert busy and [r.kind for r in reasons] == [Busy.QUEUE_JOB]
    assert words.reason(reasons[0]) == "runs queue job 17 of alice"
    unknown = _snap(queue_unknown="/run/gpu_mon/state.json: Permission denied")
    for uuid in UUIDS[:2]:
        busy, reasons = policy.gpu_verdict(uuid, rules, unknown, {})
        assert busy and words.reason(reasons[0]) == (
            "the queue's running jobs cannot be known: /run/gpu_mon/state.json: Permission denied"
        )


# ------------------------------------------------------------------------- a real daemon, a real user

HOLDER = r"""
import os, sys, time
f = open(sys.argv[1])  # the GPU's stand-in node, held as a CUDA program holds /dev/nvidiaN
with open(sys.argv[2], "a") as out:
    out.write(f"{time.time()} {os.environ.get('CUDA_VISIBLE_DEVICES', '')}\n")
time.sleep(600)
"""


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory every user may enter (pytest's own is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="gpu-mon-occupy-queue-", dir="/tmp"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sim(base: Path) -> SimHost:
    """Two simulated GPUs the test's user can read (the daemon_factory's too)."""
    return SimHost(base, 2)


@pytest.fixture
def lab(base: Path, sim: SimHost) -> Iterator[Lab]:
    """USER with a home, the package where they can read it (its occupier's registry and limits in `base`),
    the job script, and a client config naming the queue's socket and the daemon's state file."""
    if os.geteuid() != 0:
        pytest.skip("creates a user and runs jobs and an occupier as them: needs root")
    with names_held((USER,)):
        marker = f"gmoq-{os.getpid()}-{time.monotonic_ns()}"
        try:
            user = _make_user(USER, base)
            code, job, conf = lab_files(base, JOB)
            occupy_paths_of_the_copy(code / "gpu_mon", base)
            (base / "occupiers").mkdir(mode=0o1777)
            os.chmod(base / "occupiers", 0o1777)
            conf.write_text(f"[defaults]\nstate_file = {base / 'run' / 'state.json'}\n" + conf.read_text())
            for path in (base / "dev", *(base / "dev").iterdir(), sim.path):
                os.chmod(path, 0o755 if path.is_dir() else 0o644)
            (base / "holder.py").write_text(HOLDER)
            os.chmod(base / "holder.py", 0o644)
            yield Lab(
                base, code, job, conf, base / "run" / "queue.sock", base / "queue.sqlite", user, user, marker
            )
        finally:
            if "user" in locals():
                lab_ = Lab(
                    base, base / "code", base / "job.py", base / "client.conf", base, base, user, user, marker
                )
                with contextlib.suppress(Exception):
                    lab_.run(user, "occupy", "off", "--timeout", "10", timeout=30)
            with contextlib.suppress(Exception):
                kill_marked(marker)
            subprocess.run(["pkill", "-KILL", "-u", USER], capture_output=True)  # only the test's user
            subprocess.run(["userdel", "-r", USER], capture_output=True)


def _occupy_status(lab: Lab) -> dict:
    r = lab.run(lab.alice, "occupy", "status", "--json")
    assert r.returncode in (0, 3), r.stderr
    return json.loads(r.stdout)


def test_a_users_occupier_waits_for_their_own_queue_job_and_takes_the_gpu_when_it_ends(
    lab, daemon_factory, sim
):
    body = (
        "[gpu-all]\ngpus = ALL\n"
        f"[queue]\nsocket = {lab.socket}\ndatabase = {lab.database}\ngpus = 0\n"
        "grace_seconds = 5\nlauncher = direct\n"
    )
    d = daemon_factory(
        body, defaults={"start_delay_seconds": 0, "state_file": str(lab.dir / "run" / "state.json")}
    )
    wait_for(lab.socket.exists, 20, "the queue's socket")
    user, env = lab.alice, {"GPU_MON_SIM": str(sim.path)}
    job = lab.submit(user, *lab.job_cmd("forever"))
    lab.wait_state(user, job, "running")
    wait_for(lambda: lab.reports(user, job), 20, "the job's first report")
    took = user.work / "took"
    holder = [PY, str(lab.dir / "holder.py"), sim.device(0), str(took), lab.marker]
    r = lab.run(user, "occupy", "on", "--gpus", "0", *FAST, "--", *holder, env=env)
    assert r.returncode == 0, r.stderr
    why = f"waiting: GPU 0 ({sim.uuid(0)}) busy: runs queue job {job} of {USER}"
    wait_for(lambda: why in _occupy_status(lab)["blocked_by"], 30, "the occupier waiting for the job")
    # It keeps waiting: over twice its --wait-minutes (1.2 s), looked at all along (a GPU it took would
    # show it occupying, and the daemon would stop the job for its process)
    until = time.monotonic() + 3
    while time.monotonic() < until:
        s = _occupy_status(lab)
        assert s["state"] == "waiting" and why in s["blocked_by"], s
        assert lab.jobs(user)[job]["state"] == "running"
    assert not took.exists()
    assert lab.run(user, "cancel", str(job)).returncode == 0
    ended = time.time()
    lab.wait_state(user, job, "cancelled")
    s = wait_for(
        lambda: (s := _occupy_status(lab))["state"] == "occupying" and s, 30, "the occupier occupying"
    )
    assert s["gpus"] == [sim.uuid(0)]  # type: ignore[index]
    wait_for(took.exists, 20, "the occupier's command")
    at, gpus = took.read_text().split()
    assert gpus == sim.uuid(0) and float(at) >= ended
    j = lab.jobs(user)[job]
    assert (
        j["restarts"] == 0 and j["preempted"] is None
    )  # ended by the cancel, never stopped for the occupier
    # the other way round: the queue waits for the occupier as for anyone else's use of the GPU
    second = lab.submit(user, *lab.job_cmd("forever"))
    wait_for(
        lambda: f"GPU 0 busy: {USER} python3[" in lab.jobs(user)[second]["reason"], 20, "the job waiting"
    )
    assert lab.jobs(user)[second]["state"] == "queued"
    d.wait_log(f"GPU 0 .*busy: {USER} python3")
