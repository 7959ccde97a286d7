"""The queue's store: committed before a submit returns, read back by a new daemon, a bad file moved aside."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sqlite3
import subprocess
import sys

import pytest
from conftest import ROOT

from gpu_mon.queue import jobs as J
from gpu_mon.queue.jobs import Job
from gpu_mon.queue.store import Refused, Store


def new_job(user: str = "alice", **kw: object) -> Job:
    base = dict(
        id=0,
        user=user,
        uid=1000,
        gid=1000,
        command=("python3", "train.py"),
        cwd="/home/alice",
        env=(("PATH", "/usr/bin"), ("X", "1")),
        output="",
        submitted=1.0,
    )
    base.update(kw)
    return Job(**base)  # type: ignore[arg-type]


def test_a_submitted_job_is_on_disk_before_submit_returns(tmp_path):
    path = str(tmp_path / "q.sqlite")
    store = Store.open(path, 0.0)
    job, ahead = store.submit(new_job(after=(7,), stop_signal=10, time_limit=60.0), 1000)
    assert (job.id, ahead) == (1, 0)
    # Another process (another connection) sees it at once: committed, not waiting in a buffer.
    code = (
        "import sqlite3, sys\n"
        "print(sqlite3.connect(sys.argv[1]).execute('select id, user, state from jobs').fetchall())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, path], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[(1, 'alice', 'queued')]"
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("SELECT version FROM schema_version").fetchone()[0] == 3
    assert os.stat(path).st_mode & 0o777 == 0o600  # the jobs' environments are root's alone
    store.close()
    again = Store.open(path, 0.0).get(1)
    assert again == job and again.env_dict == {"PATH": "/usr/bin", "X": "1"}
    assert (again.after, again.stop_signal, again.time_limit, again.command) == (
        (7,),
        10,
        60.0,
        ("python3", "train.py"),
    )


def test_a_start_is_committed_without_waiting_for_the_disk_and_outlives_a_crash(tmp_path):
    # A start is on a job's path (one fsync took 280 ms on a VM's disk): synchronous=NORMAL for its
    # commit alone; it is in the WAL (it outlives gpu-mon's SIGKILL), and every other write waits as before.
    path = str(tmp_path / "q.sqlite")
    code = (
        "import os, sys\n"
        "from gpu_mon.queue import jobs as J\n"
        "from gpu_mon.queue.store import Store\n"
        "from test_queue_store import new_job\n"
        "store = Store.open(sys.argv[1], 0.0)\n"
        "job, _ = store.submit(new_job(), 1000)\n"
        "said = []\n"
        "store.conn.set_trace_callback(said.append)\n"
        "store.change(job.id, lambda j: J.started(j, ('GPU-1',), 5.0, 0, 0), durable=False)\n"
        "store.conn.set_trace_callback(None)\n"
        "print([s for s in said if s.startswith(('PRAGMA', 'COMMIT'))], flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    r = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, env=env)
    assert r.returncode == -9, r.stderr
    assert r.stdout.strip() == "['PRAGMA synchronous=NORMAL', 'COMMIT', 'PRAGMA synchronous=FULL']"
    again = Store.open(path, 0.0)
    assert (again.get(1).state, again.get(1).gpus) == (J.RUNNING, ("GPU-1",))
    said = []
    again.conn.set_trace_callback(said.append)
    again.change(1, lambda j: dataclasses.replace(j, state=J.DONE, ended=9.0))
    again.submit(new_job(), 1000)
    assert [s for s in said if s.startswith("PRAGMA")] == []  # (an end, a submit: on disk, as before)
    assert again.conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_a_start_that_cannot_be_written_leaves_every_later_write_durable(tmp_path):
    path = str(tmp_path / "q.sqlite")
    store = Store.open(path, 0.0)
    job, _ = store.submit(new_job(), 1000)
    store.conn.execute("PRAGMA busy_timeout=100")
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # (another writer holds the file: the start's BEGIN fails)
    started = store.change(job.id, lambda j: J.started(j, ("GPU-1",), 5.0, 0, 0), durable=False)
    assert started is not None and store.unwritten  # (kept in memory, written with the next write)
    assert store.conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL again
    other.execute("ROLLBACK")
    said = []
    store.conn.set_trace_callback(said.append)
    store.submit(new_job(), 1000)
    store.flush(1e9)  # (the loop's next round writes what waited)
    assert "PRAGMA synchronous=NORMAL" not in said and not store.unwritten
    assert Store.open(path, 0.0).get(job.id).state == J.RUNNING


def test_ids_grow_and_ahead_counts_the_queued_ones(tmp_path):
    store = Store.open(str(tmp_path / "q.sqlite"), 0.0)
    ids = [store.submit(new_job(), 1000)[0].id for _ in range(3)]
    store.change(ids[0], J.held)
    job, ahead = store.submit(new_job("bob"), 1000)
    assert ids == [1, 2, 3] and (job.id, ahead) == (4, 2)


def test_a_user_over_max_queued_is_refused_in_one_line(tmp_path):
    store = Store.open(str(tmp_path / "q.sqlite"), 0.0)
    store.submit(new_job(), 2)
    second, _ = store.submit(new_job(), 2)
    with pytest.raises(Refused, match=r"^alice already has 2 unfinished jobs \(limit 2\)$"):
        store.submit(new_job(), 2)
    store.submit(new_job("bob"), 2)  # another user is not affected
    store.change(second.id, lambda j: J.cancelled(j, 5.0, "x"))  # an ended job no longer counts
    store.submit(new_job(), 2)


def test_a_change_applies_to_the_job_as_it_is_now(tmp_path):
    store = Store.open(str(tmp_path / "q.sqlite"), 0.0)
    job, _ = store.submit(new_job(), 10)
    stale = job
    store.change(job.id, J.held)
    # An edit that checks the state sees `held`, not the stale copy's `queued`: nothing is overwritten.
    assert (
        store.change(job.id, lambda j: J.started(j, ("GPU-0",), 2.0, 1, 1) if j.state == J.QUEUED else None)
        is None
    )
    assert store.get(job.id).state == J.HELD and stale.state == J.QUEUED


@pytest.mark.parametrize("content", [b"this is not a database at all" * 100, "sqlite"])
def test_a_corrupt_or_foreign_file_is_moved_aside_with_one_line(tmp_path, caplog, content):
    path = tmp_path / "q.sqlite"
    if content == "sqlite":
        other = sqlite3.connect(path)
        other.execute("CREATE TABLE mine (x)")
        other.commit()
        other.close()
    else:
        path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="gpu_mon"):
        store = Store.open(str(path), 0.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "is unusable" in lines[0] and "moved aside to" in lines[0]
    assert store.all() == [] and store.submit(new_job(), 10)[0].id == 1
    assert [p.name for p in tmp_path.iterdir() if ".bad-" in p.name]


def test_a_run_lost_with_an_earlier_daemon_ends_as_its_stop_meant_or_goes_back_to_the_queue():
    running = J.started(new_job(id=5), ("GPU-0",), 10.0, 123, 456)
    assert (J.run_lost(running, 20.0).state, J.run_lost(running, 20.0).restarts) == (J.QUEUED, 1)
    cancelled = J.run_lost(J.stopping(running, J.STOP_CANCEL), 20.0)
    assert (cancelled.state, cancelled.ended) == (J.CANCELLED, 20.0)
    assert J.run_lost(J.stopping(running, J.STOP_TIMEOUT), 20.0).state == J.TIMEOUT
    restart = J.run_lost(J.stopping(running, J.STOP_RESTART), 20.0)
    assert (restart.state, restart.restarts, restart.leader_pid) == (J.QUEUED, 1, 0)
    no_requeue = dataclasses.replace(running, requeue=False)
    assert J.run_lost(J.stopping(no_requeue, J.STOP_PREEMPT), 20.0).state == J.PREEMPTED


def test_prune_removes_old_finished_jobs_only_keeps_what_a_waiting_job_is_after_and_never_reuses_ids(
    tmp_path,
):
    path = str(tmp_path / "q.sqlite")
    store = Store.open(path, 0.0)
    ids = [store.submit(new_job(), 1000)[0].id for _ in range(6)]
    store.change(ids[0], lambda j: J.cancelled(j, 100.0, "x"))  # old: removed
    store.change(ids[1], lambda j: J.cancelled(j, 100.0, "x"))  # old, but job 6 waits after it: kept
    store.change(ids[2], lambda j: J.cancelled(j, 900.0, "x"))  # recent: kept
    store.change(ids[3], lambda j: J.ended(J.started(j, ("GPU-0",), 50.0, 1, 1), 150.0, 0))  # old, done
    store.change(ids[4], lambda j: J.started(j, ("GPU-0",), 50.0, 1, 1))  # running: kept
    store.change(ids[5], lambda j: dataclasses.replace(j, after=(ids[1],)))
    version = store.version
    assert store.prune(before=500.0, batch=1) == 2  # (one per transaction: the lock is let go between)
    assert sorted(j.id for j in store.all()) == [2, 3, 5, 6] and store.version > version
    assert store.prune(before=500.0) == 0
    store.close()
    again = Store.open(path, 0.0)  # gone from the file too
    assert sorted(j.id for j in again.all()) == [2, 3, 5, 6]
    assert again.submit(new_job(), 1000)[0].id == 7  # an id is never given twice


def test_the_pruner_keeps_finished_jobs_for_keep_finished_days_and_at_least_the_fair_window(tmp_path):
    from gpu_mon.config import QueueSection
    from gpu_mon.queue.prune import Pruner

    store = Store.open(str(tmp_path / "q.sqlite"), 0.0)
    for ended in (0.0, 3 * 86400.0, 6 * 86400.0):
        job, _ = store.submit(new_job(), 1000)
        store.change(job.id, lambda j, t=ended: J.cancelled(j, t, "x"))
    section = QueueSection(keep_finished_days=0)
    pruner = Pruner(store, lambda: section, lambda: 7 * 86400.0)
    assert pruner.once() == 0 and len(store.all()) == 3  # 0: for ever
    section = QueueSection(keep_finished_days=2, fair_window_hours=24 * 5)  # the window is longer
    assert pruner.once() == 1 and [j.id for j in store.all()] == [2, 3]
    section = QueueSection(keep_finished_days=2)
    assert pruner.once() == 1 and [j.id for j in store.all()] == [3]


def test_the_counts_a_submit_uses_follow_every_change_and_a_reopen(tmp_path):
    path = str(tmp_path / "q.sqlite")
    store = Store.open(path, 0.0)
    ids = [store.submit(new_job("alice" if i % 3 else "bob"), 1000)[0].id for i in range(9)]
    store.change(ids[0], J.held)
    store.change(ids[1], lambda j: J.started(j, ("GPU-0",), 1.0, 1, 1))
    store.change(ids[2], lambda j: J.cancelled(j, 2.0, "x"))
    store.change_many([(ids[3], lambda j: J.started(j, ("GPU-1",), 1.0, 1, 1)), (ids[4], J.held)])
    store.change(ids[3], lambda j: J.ended(J.stopping(j, J.STOP_PREEMPT), 3.0, 143))  # back in the queue
    store.change(ids[1], lambda j: J.ended(j, 3.0, 0))  # done
    store.prune(before=10.0)

    def recount(s: Store) -> tuple:
        jobs = s.all()
        unfinished = {
            u: sum(1 for j in jobs if j.user == u and j.state not in J.ENDED) for u in ("alice", "bob")
        }
        return unfinished, sum(1 for j in jobs if j.state == J.QUEUED)

    for s in (store, Store.open(path, 0.0)):
        unfinished, queued = recount(s)
        assert {u: s.unfinished(u) for u in unfinished} == unfinished == {"alice": 4, "bob": 3}
        assert s.submit(new_job("carol"), 1000)[1] == queued == 5


def test_a_database_written_before_the_preemption_fields_reads_back_and_keeps_new_ones(tmp_path):
    """The jobs' own fields live in the row's JSON: a row an older gpu-mon wrote (no preemption, no
    main-only stop) reads back with the defaults, and the new fields survive a reopen. The schema version
    stays 1, so an older gpu-mon still opens the file (a newer version would make it move the queue aside)."""
    path = str(tmp_path / "q.sqlite")
    store = Store.open(path, 0.0)
    old, _ = store.submit(new_job(), 1000)
    store.close()
    conn = sqlite3.connect(path)
    (text,) = conn.execute("SELECT data FROM jobs WHERE id = ?", (old.id,)).fetchone()
    data = json.loads(text)
    for key in ("stop_main_only", "preempted_at", "preempted_reason", "stopped_by"):
        del data[key]  # as an older gpu-mon wrote it
    conn.execute("UPDATE jobs SET data = ? WHERE id = ?", (json.dumps(data), old.id))
    conn.commit()
    conn.close()
    store = Store.open(path, 0.0)
    job = store.get(old.id)
    assert job is not None
    assert (job.preempted_at, job.preempted_reason, job.stop_main_only) == (None, "", False)
    running = store.change(old.id, lambda j: J.started(j, ("GPU-a",), 5.0, 1, 1))
    assert running is not None
    store.change(old.id, lambda j: J.preempted(j, 9.5, "GPU 0 busy: bob python3[4242]"))
    second, _ = store.submit(new_job(stop_main_only=True), 1000)
    store.close()
    store = Store.open(path, 0.0)
    again = store.get(old.id)
    assert again is not None and (again.state, again.reason) == (J.STOPPING, J.STOP_PREEMPT)
    assert (again.preempted_at, again.preempted_reason) == (9.5, "GPU 0 busy: bob python3[4242]")
    ended = J.ended(again, 12.0, 143)
    assert ended.state == J.QUEUED and ended.preempted_at == 9.5  # kept past the requeue
    assert store.get(second.id).stop_main_only is True  # type: ignore[union-attr]
    assert sqlite3.connect(path).execute("SELECT version FROM schema_version").fetchone() == (3,)
    store.close()


def test_the_indexes_nothing_reads_are_dropped_from_an_older_file_and_never_made(tmp_path):
    """Every read is from memory: an index on jobs only slowed each row written. A file an older gpu-mon
    made loses them at open and reads back whole; a new file never has them."""
    path = str(tmp_path / "q.sqlite")
    store = Store.open(path, 0.0)
    kept, _ = store.submit(new_job(), 1000)
    store.close()

    def indexes() -> list:
        with sqlite3.connect(path) as conn:
            rows = conn.execute("SELECT name FROM sqlite_master WHERE type='index' AND tbl_name='jobs'")
            return sorted(name for (name,) in rows if not name.startswith("sqlite_autoindex"))

    assert indexes() == []
    with sqlite3.connect(path) as conn:  # as schema 1 made them
        conn.execute("CREATE INDEX jobs_by_state ON jobs (state)")
        conn.execute("CREATE INDEX jobs_by_user_state ON jobs (user, state)")
    assert indexes() == ["jobs_by_state", "jobs_by_user_state"]
    store = Store.open(path, 0.0)
    assert store.get(kept.id) == kept
    store.close()
    assert indexes() == []
