"""What one user can make the root daemon store is bounded (issue 36, item 3): jobs kept per user, finished
ones included, and their bytes (that user's oldest finished jobs go first, never another user's); an
array's environment is stored once; a full disk refuses a submit in one line, loses nothing, and stops no
workload. Real daemons, real users made here (gmslann, gmslbob), real SQLite files."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sqlite3
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, List

import pytest
from conftest import wait_for
from test_queue import JOB, PY, Lab, made_lab, queue_body

from gpu_mon.api import historydb
from gpu_mon.queue.store import MIB, Store

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them: needs root")


@pytest.fixture
def lab(sim) -> Iterator[Lab]:
    with made_lab("gmsl", ("gmslann", "gmslbob"), JOB) as made:
        yield made


def _ids(database: Path) -> Dict[str, List[int]]:
    """Each user's job ids as the database holds them."""
    out: Dict[str, List[int]] = {}
    with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
        for user, job_id in db.execute("SELECT user, id FROM jobs ORDER BY id"):
            out.setdefault(user, []).append(job_id)
    return out


def _state(database: Path, job_id: int) -> str:
    with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
        row = db.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
    return row[0] if row else ""


def _held_array(lab: Lab, spec: str) -> int:
    return lab.submit(lab.alice, "--hold", "--array", spec, *lab.job_cmd("exit", "0"))


def _refused(r: subprocess.CompletedProcess, words: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_cancelled_flood_keeps_a_user_within_the_cap_oldest_finished_first_another_users_untouched(
    lab, daemon_factory
):
    body = queue_body(lab, "max_queued_per_user = 20\nmax_kept_per_user = 30\nmax_array_size = 100\n")
    daemon_factory(body, defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    bobs = [lab.submit(lab.bob, *lab.job_cmd("exit", "0")) for _ in range(2)]
    for job_id in bobs:
        lab.wait_state(lab.bob, job_id, "done")
    flood = []
    for _ in range(6):  # 60 cancelled elements: twice what alice may keep
        flood.append(_held_array(lab, "0-9"))
        assert lab.run(lab.alice, "cancel", str(flood[-1])).returncode == 0
    kept = _ids(lab.database)
    assert kept[lab.alice.name] == list(range(flood[3], flood[3] + 30))  # the 30 newest: the oldest went
    assert kept[lab.bob.name] == bobs  # never another user's
    # Finished elements of an array that still has unfinished ones stay (as keep_finished_days keeps them):
    # with every other finished job of alice's gone, a submit over the cap is refused, in one line.
    mixed = _held_array(lab, "0-19")  # (removes flood[3] and flood[4])
    cancel = lab.run(lab.alice, "cancel", *(f"{mixed}_{i}" for i in range(15)))
    assert cancel.returncode == 0, cancel.stderr
    _held_array(lab, "0-9")  # (removes flood[5])
    r = lab.run(lab.alice, "submit", "--hold", *lab.job_cmd("exit", "0"))
    _refused(r, "more would pass the limit of 30 ([queue] max_kept_per_user)")
    assert len(_ids(lab.database)[lab.alice.name]) == 30
    assert _ids(lab.database)[lab.bob.name] == bobs
    assert lab.submit(lab.bob, "--hold", *lab.job_cmd("exit", "0"))  # bob is not alice's limit


def test_a_users_stored_bytes_are_capped_oldest_finished_first_then_refused(lab, daemon_factory):
    body = queue_body(lab, "max_stored_mib_per_user = 1\n")
    daemon_factory(body, defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    bob = lab.submit(lab.bob, *lab.job_cmd("exit", "0"))
    lab.wait_state(lab.bob, bob, "done")
    big = {f"BIG{i}": "x" * 50_000 for i in range(4)}  # (one variable may be 128 KiB at most)
    old = []
    for _ in range(3):
        old.append(lab.submit(lab.alice, "--hold", *lab.job_cmd("exit", "0"), env=big))
        assert lab.run(lab.alice, "cancel", str(old[-1])).returncode == 0
    held = [lab.submit(lab.alice, "--hold", *lab.job_cmd("exit", "0"), env=big) for _ in range(3)]
    mine = _ids(lab.database)[lab.alice.name]
    assert old[0] not in mine and old[-1] in mine and set(held) <= set(mine)  # the oldest finished went
    for _ in range(10):
        r = lab.run(lab.alice, "submit", "--hold", *lab.job_cmd("exit", "0"), env=big)
        if r.returncode != 0:
            break
    _refused(r, "MiB ([queue] max_stored_mib_per_user)")
    assert not set(old) & set(_ids(lab.database)[lab.alice.name])  # every finished one went first
    assert _ids(lab.database)[lab.bob.name] == [bob]


def _db_bytes(database: Path) -> int:
    return sum(p.stat().st_size for p in database.parent.glob(database.name + "*"))


def test_an_arrays_environment_is_stored_once_on_disk_and_in_memory(lab, daemon_factory):
    d = daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    big = {"BIG": "y" * 100_000}  # (the client sends its whole environment)
    second = lab.submit(lab.alice, "--hold", "--array", "0-999", *lab.job_cmd("exit", "0"), env=big)
    assert lab.run(lab.alice, "cancel", str(second)).returncode == 0
    lab.wait_state(lab.alice, second, "cancelled")
    d.stop()
    size = _db_bytes(lab.database)
    assert size < 4 * 1024 * 1024, f"{size} bytes for a 1000-element array with a 100 KB environment"
    store = Store.open(str(lab.database), time.time())
    try:
        elements = store.elements(second)
        assert len(elements) == 1000 and elements[999].env_dict["BIG"] == big["BIG"]
        assert all(e.env is elements[0].env and e.command is elements[0].command for e in elements)
        assert {e.state for e in elements} == {"cancelled"}
    finally:
        store.close()


def _fill(path: Path) -> None:
    """Write a file until the device is full."""
    with open(path, "wb") as f:
        chunk = b"\0" * 65536
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC, err
    with contextlib.suppress(OSError), open(path, "ab") as f:  # (the last bytes a smaller write fits)
        while True:
            f.write(b"\0" * 512)
            f.flush()


@contextlib.contextmanager
def _small_disk() -> Iterator[Path]:
    disk = Path(tempfile.mkdtemp(prefix="gmsl-disk-", dir="/tmp"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
        disk.rmdir()


def test_a_full_disk_refuses_a_submit_in_one_line_loses_no_end_and_stops_no_workload(lab, daemon_factory):
    with _small_disk() as disk:
        database = disk / "queue.sqlite"
        body = queue_body(lab, gpus="0").replace(f"database = {lab.database}", f"database = {database}")
        body += f"[process-miner]\ncmd = {PY} -c 'import time; time.sleep(600)' {lab.marker}\ngpus = 1\n"
        d = daemon_factory(body, defaults={"start_delay_seconds": 0})
        try:
            wait_for(lab.socket.exists, 20, "the queue's socket")
            miner = d.wait_running("miner")
            go = lab.bob.work / "go"
            wait = "until [ -e go ]; do sleep 0.05; done"
            job = lab.submit(lab.bob, "--", "/bin/sh", "-c", wait, lab.marker)
            lab.wait_state(lab.bob, job, "running")
            _fill(disk / "filler")
            r = lab.run(lab.alice, "submit", *lab.job_cmd("exit", "0"))
            _refused(r, f"cannot store the job: no space left on the device of {disk}: nothing queued")
            go.touch()  # bob's job ends by itself; its end cannot be written now
            lab.wait_state(lab.bob, job, "done")
            d.wait_log(r"queue: cannot write to .*: jobs' changes are kept in memory")
            assert _state(database, job) == "running"  # (not written yet: the disk was full)
            (disk / "filler").unlink()
            wait_for(lambda: _state(database, job) == "done", 20, "bob's end written")
            d.wait_log(r"queue: .* is written again")
            assert lab.submit(lab.alice, "--hold", *lab.job_cmd("exit", "0"))
            log = d.log()
            assert log.count("queue: cannot write to") == 1 and "internal error" not in log, log
            w = d.workload("miner")
            assert (w.get("state"), w.get("command_pid"), w.get("restarts")) == ("running", miner, 0), w
            assert d.proc is not None and d.proc.poll() is None
        finally:
            d.stop()


def _wal_bytes(database: Path) -> int:
    wal = database.parent / (database.name + "-wal")
    return wal.stat().st_size if wal.exists() else 0


def test_the_write_ahead_log_stays_bounded_when_a_user_at_the_cap_cancels_and_their_jobs_are_pruned(
    lab, daemon_factory
):
    """Issue 46, item 5: SQLite never shrinks its WAL by itself; a cancel of many big jobs (one transaction)
    and the prune of them (Debian's SQLite zeroes what it deletes) each wrote more than the cap's worth."""
    body = queue_body(lab, "max_stored_mib_per_user = 6\nmax_queued_per_user = 100\n")
    d = daemon_factory(body, defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    big = {f"BIG{i}": "z" * 120_000 for i in range(2)}  # (~240 KB a job: 24 of them near the 6 MiB cap)
    held = [lab.submit(lab.alice, "--hold", *lab.job_cmd("exit", "0"), env=big) for _ in range(24)]
    assert _wal_bytes(lab.database) <= historydb.WAL_BYTES
    assert lab.run(lab.alice, "cancel", *map(str, held)).returncode == 0  # 6 MB rewritten at once
    assert _wal_bytes(lab.database) <= historydb.WAL_BYTES, _wal_bytes(lab.database)
    d.write_config(body + "keep_finished_days = 0.00001\nfair_window_hours = 0.0001\n")
    ended = time.time()
    wait_for(lambda: time.time() > ended + 1.0, 5, "the jobs to be a second old")
    d.signal(signal.SIGHUP)
    d.wait_log(r"queue: 24 finished job\(s\) older than")
    assert _wal_bytes(lab.database) <= historydb.WAL_BYTES, _wal_bytes(lab.database)
    assert _db_bytes(lab.database) < 9 * MIB, _db_bytes(lab.database)  # the cap's 6, not 6 + 6
    assert lab.submit(lab.alice, "--hold", *lab.job_cmd("exit", "0"), env=big)  # the room is used again
    d.stop()
