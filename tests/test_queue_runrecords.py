"""The queue's records of runs (runrecords.py) in a real store file: written as a run starts and ends, read
back by a daemon that comes after (a run that outlived gpu-mon keeps its counters at its start), a driver
reload, removed with their job, and the schema 2 -> 3 migration."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sqlite3

import pytest
from test_queue_store import new_job

from gpu_mon.api.model import Gpu
from gpu_mon.queue import energy
from gpu_mon.queue import jobs as J
from gpu_mon.queue.runrecords import RunRecords, with_energy
from gpu_mon.queue.runs import REQUEUED, JobRun
from gpu_mon.queue.store import NotOurs, Store, _connect

U0, U1 = "GPU-aaaa", "GPU-bbbb"


def gpus(e0, e1=None, p1=None):
    return (Gpu(0, U0, energy_mj=e0), Gpu(1, U1, energy_mj=e1, power_mw=p1))


def a_run(job_id, **kw):
    base = dict(
        job=job_id, user="alice", name="x", gpus=(U0, U1), submitted=1.0, start=10.0, wait=9.0, restart=0
    )
    return JobRun(**{**base, **kw})


def records_of(store, job_id):
    return [with_energy(json.loads(data)) for _s, _e, _h, data in store.runs_of(job_id)]


def test_a_run_that_outlives_gpu_mon_keeps_its_start_counters_and_loses_nothing(tmp_path):
    path = str(tmp_path / "q.sqlite")
    store = Store.open(path, 0.0)
    job, _ = store.submit(new_job(), 1000)
    first = RunRecords(store)
    first.seen(a_run(job.id), gpus(1_000, None, 100_000))
    first.sample(gpus(1_000, None, 100_000), 100.0)
    first.sample(gpus(1_500, None, 300_000), 102.0)  # 2 s at 100-300 W: 400 J
    first.write(everything_live=True)  # (gpu-mon stops; the job's unit goes on)
    store.close()

    store = Store.open(path, 0.0)
    second = RunRecords(store)
    run = a_run(job.id, earlier=True)
    second.seen(run, None)  # found at start, before any look
    second.sample(gpus(2_000, None, 300_000), 200.0)
    second.sample(gpus(2_400, None, 100_000), 201.0)  # 1 s at 300-100 W: 200 J
    ended = second.seen(dataclasses.replace(run, end=60.0, how=J.DONE), gpus(2_400, None, 100_000))
    second.write()
    (record,) = records_of(store, job.id)
    assert record["energy"][U0]["start_mj"] == 1_000 and record["energy"][U0]["end_mj"] == 2_400
    assert record["energy"][U1]["sampled_mj"] == 600_000.0  # both daemons' samples
    assert ended.energy_mj == record["energy_mj"] == 1_400 + 600_000
    assert (record["end"], record["how"]) == (60.0, J.DONE)
    store.close()


def test_an_earlier_daemons_run_that_ended_unseen_has_no_end_and_no_made_up_energy(tmp_path):
    store = Store.open(str(tmp_path / "q.sqlite"), 0.0)
    job, _ = store.submit(new_job(), 1000)
    records = RunRecords(store)
    ended = records.seen(a_run(job.id, earlier=True, end=99.0, how=REQUEUED), None)
    records.write()
    (record,) = records_of(store, job.id)
    assert record["end"] is None and record["energy_mj"] is None and ended.energy_mj is None
    store.close()


def test_a_counter_that_went_down_is_a_driver_reload_counted_from_the_reload_on():
    assert energy.used(5_000, 7_000) == (2_000, False)
    assert energy.used(5_000, 1_200) == (1_200, True)  # a lower bound, said so
    assert energy.used(None, 7_000) == (None, False)
    assert (
        energy.total({U0: {"start_mj": 1, "end_mj": 4}, U1: {"start_mj": None, "sampled_mj": None}}) is None
    )


def test_runs_leave_with_their_job(tmp_path):
    store = Store.open(str(tmp_path / "q.sqlite"), 0.0)
    job, _ = store.submit(new_job(), 1000)
    kept, _ = store.submit(new_job(), 1000)
    records = RunRecords(store)
    for j in (job, kept):
        records.seen(a_run(j.id), gpus(1))
    records.write()
    store.change(job.id, lambda j: J.cancelled(j, 50.0, "x"))
    assert store.prune(before=60.0) == 1
    assert store.runs_of(job.id) == [] and len(store.runs_of(kept.id)) == 1
    store.close()


def test_a_schema_2_queue_gets_its_runs_table_and_a_newer_one_is_refused(tmp_path):
    path = str(tmp_path / "q.sqlite")
    store = Store.open(path, 0.0)
    job, _ = store.submit(new_job(), 1000)
    store.close()
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("DROP TABLE runs")  # as schema 2 had it
        db.execute("UPDATE schema_version SET version = 2")
    store = Store.open(path, 0.0)
    assert store.get(job.id) == job and store.runs_of(job.id) == []
    store.close()
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        assert db.execute("SELECT version FROM schema_version").fetchone() == (3,)
        db.execute("UPDATE schema_version SET version = 4")
    with pytest.raises(NotOurs, match="newer gpu-mon"):
        _connect(path)
