"""Job arrays (`submit --array`): the SPEC parser against hostile input, the store and placement with
thousands of elements, and the real daemon on simulated GPUs with users made here (their own names: other
queue tests use gmqalice and gmqbob)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import time
import tracemalloc
from pathlib import Path
from typing import Dict, List

import psutil
import pytest
from conftest import foreign_open, wait_for
from test_queue import Lab, made_lab, queue_body

from gpu_mon.config import QueueSection
from gpu_mon.queue import arrays, hooks, placement, rows
from gpu_mon.queue import jobs as J
from gpu_mon.queue.jobs import Job
from gpu_mon.queue.listing import elapsed
from gpu_mon.queue.store import Refused, Store

GROUP = "gmalab"
JOB = r"""
import json, os, sys, time
env = os.environ
keys = ("GPU_MON_JOB_ID", "GPU_MON_ARRAY_ID", "GPU_MON_ARRAY_INDEX", "GPU_MON_RESTART_COUNT")
start = time.time()
path = os.path.join(os.getcwd(), "report-" + env["GPU_MON_JOB_ID"] + ".jsonl")
with open(path, "a") as f:
    f.write(json.dumps({"event": "start", "t": start, **{k: env.get(k) for k in keys}}) + "\n")
print("hello from", env["GPU_MON_JOB_ID"], flush=True)
time.sleep(float(sys.argv[1]))
with open(path, "a") as f:
    f.write(json.dumps({"event": "end", "t": time.time()}) + "\n")
sys.exit(int(sys.argv[2]))
"""


# ------------------------------------------------------------------ the SPEC, pure


@pytest.mark.parametrize(
    "spec, indices, limit",
    [
        ("0-3", (0, 1, 2, 3), 0),
        ("1,3,5-7", (1, 3, 5, 6, 7), 0),
        ("0-20:5", (0, 5, 10, 15, 20), 0),
        ("0-199%8", tuple(range(200)), 8),
        ("7", (7,), 0),
        ("3,1,3,2", (1, 2, 3), 0),  # sorted, each once
        (" 0-1 ", (0, 1), 0),
        ("0-9999", tuple(range(10000)), 0),
    ],
)
def test_a_spec_as_slurm_writes_it(spec: str, indices: tuple, limit: int) -> None:
    assert arrays.parse(spec, 10000) == arrays.ArraySpec(indices, limit)


@pytest.mark.parametrize(
    "spec, says",
    [
        ("0-99999999", "index 99999999 is over the largest allowed, 9999"),
        ("5-1", "range 5-1 ends before it starts"),
        ("%0", "the %N limit must be at least 1"),
        ("0-9%0", "the %N limit must be at least 1"),
        ("1,,2", "an empty item"),
        ("0-9%-1", "the %N limit '-1' is not a whole number"),
        ("," * (1 << 20), "the array spec is too long (1048576 characters"),
        ("", "no indices given"),
        ("%4", "no indices given"),
        ("-1", "index '' is not a whole number"),
        ("0-9:0", "the step must be at least 1"),
        ("5:2", "a step needs a range"),
        ("0-9%2%3", "the %N limit '2%3' is not a whole number"),
        ("1e3", "index '1e3' is not a whole number"),
        ("٣", "index '٣' is not a whole number"),  # (a digit to int(), not to Slurm)
        ("9" * 5000, "is not a whole number"),  # (never handed to int(): no 4300-digit error)
        ("0-9999,0-9999", "more than 10000 elements"),
        ("0-9,a", "index 'a' is not a whole number"),
        ("0 - 9", "index '0 ' is not a whole number"),
    ],
)
def test_a_hostile_spec_is_refused_in_one_line_quickly(spec: str, says: str) -> None:
    t = time.monotonic()
    with pytest.raises(arrays.SpecError) as err:
        arrays.parse(spec, 10000)
    assert time.monotonic() - t < 0.5
    assert says in str(err.value) and "\n" not in str(err.value) and len(str(err.value)) < 200


def test_ranges_output_patterns_and_refs() -> None:
    assert arrays.ranges([9, 0, 1, 2, 3, 7, 10]) == "0-3,7,9-10"
    assert arrays.ranges([]) == "" and arrays.ranges([4]) == "4"
    assert arrays.expand_output("/o/%A_%a-%j.%%log", 22, 17, 5) == "/o/17_5-22.%log"
    assert arrays.expand_output("/o/%A-%a", 9, 0, 0) == "/o/9-0"  # (not an array: its own id, index 0)
    assert arrays.expand_output("/o/%x%", 9, 0, 0) == "/o/%x%"
    assert arrays.parse_ref("17") == (17, None) and arrays.parse_ref("17_5") == (17, 5)
    for bad in ("0", "17_", "_5", "17_5_1", "x", "-3", "17_-1"):
        with pytest.raises(ValueError):
            arrays.parse_ref(bad)


# ------------------------------------------------------------------ the store and placement, 10 000 elements


def _job(user: str = "ann", **kw) -> Job:
    env = tuple((f"VAR{i}", "x" * 40) for i in range(40))
    fields = dict(id=0, user=user, uid=1000, gid=1000, command=("python3", "train.py"), cwd="/tmp")
    fields.update(env=env, output="", submitted=time.time())
    fields.update(kw)
    return Job(**fields)  # type: ignore[arg-type]


def test_an_array_is_stored_in_one_transaction_with_consecutive_ids_and_read_back(tmp_path: Path) -> None:
    path = str(tmp_path / "q.sqlite")
    store = Store.open(path, time.time())
    store.submit(_job(), 100000)
    spec = arrays.parse("0-9999%8", 10000)
    t = time.monotonic()
    first, ahead = store.submit_array(_job(array_limit=spec.limit), spec.indices, 100000)
    took = time.monotonic() - t
    assert (first.id, first.array_id, first.array_index, ahead) == (2, 2, 0, 1)
    assert [j.id for j in store.elements(2)] == list(range(2, 10002))
    assert store.element(2, 9999).id == 10001 and store.unfinished("ann") == 10001
    with pytest.raises(Refused, match="10001 unfinished jobs; 3 more would pass the limit of 10003"):
        store.submit_array(_job(), (0, 1, 2), 10003)
    assert len(store.jobs) == 10001  # nothing of the refused array
    store.close()
    again = Store.open(path, time.time())
    assert again.jobs == store.jobs and again.arrays == store.arrays
    assert again.jobs[10001].array_limit == 8
    nxt, _ = again.submit(_job(), 100000)
    assert nxt.id == 10002  # ids go on after the array's
    assert took < 5  # (the bench measures it; here only that it is not one transaction an element)


def _held_array_bytes(store: Store, spec: str) -> float:
    """The memory an array of `spec`, held, takes in the store, per element."""
    indices = arrays.parse(spec, 10000).indices
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        store.submit_array(_job(state=J.HELD), indices, 100000)
        return (tracemalloc.get_traced_memory()[0] - before) / len(indices)
    finally:
        tracemalloc.stop()


def test_an_arrays_elements_take_a_few_bytes_in_memory_and_on_disk_until_they_change(tmp_path: Path) -> None:
    """(Issue 38 item 10: five held 10 000-element arrays took 110 MB of the daemon's memory.) An element as
    submitted keeps its id and nothing else in memory, and its row is its array's id and its index; one
    that changes keeps what changed; all read back alike."""
    path = str(tmp_path / "q.sqlite")
    store = Store.open(path, time.time())
    assert _held_array_bytes(store, "0-9999") < 300  # (each its own copy of every field: 2000)
    listed = store.submit_array(_job(state=J.HELD), arrays.parse("1,5,9-11", 100).indices, 100000)[0]
    assert [j.array_index for j in store.elements(listed.id)] == [1, 5, 9, 10, 11]
    store.change(7, J.released)
    store.change(listed.id + 2, lambda j: J.cancelled(j, 5.0, "cancelled by ann"))
    unchanged = store.get(8)
    assert not hasattr(unchanged, "__dict__") and unchanged.env is store.get(9).env
    assert (unchanged.array_index, unchanged.state, unchanged.env) == (7, J.HELD, _job().env)
    store.close()
    with contextlib.closing(sqlite3.connect(path)) as db:
        stored = dict(db.execute("SELECT id, data FROM jobs"))
    assert stored[8] == '{"array_id":1,"array_index":7}'
    assert stored[listed.id + 1] == '{"array_id":10001,"array_index":5}'
    assert json.loads(stored[7])["state"] == J.QUEUED
    assert json.loads(stored[listed.id + 2])["state"] == J.CANCELLED
    assert "env" not in json.loads(stored[7])  # (what the elements share, once: in the array's row)
    again = Store.open(path, time.time())
    assert again.jobs == store.jobs and again.arrays == store.arrays
    assert [j.state for j in again.elements(listed.id)] == [J.HELD, J.HELD, J.CANCELLED, J.HELD, J.HELD]
    assert again.element(1, 6).state == J.QUEUED and again.element(1, 6).id == 7
    assert again.element(listed.id, 9).id == listed.id + 2 and again.element(listed.id, 2) is None
    assert not hasattr(again.get(8), "__dict__")
    again.close()
    for spec in ("0-9999", "95-104:4", "7", "3-1000:7", "1,5,9-11"):  # (what the user's limit counts)
        indices = arrays.parse(spec, 10000).indices
        assert rows.element_rows_bytes(12, indices) == sum(len(rows.element_row(12, i)) for i in indices)


def test_placement_keeps_an_arrays_limit_and_waits_for_a_whole_array() -> None:
    gpus = [placement.GpuView(f"GPU-{i}", False, free_since=0.0) for i in range(4)]
    base = _job(array_id=1, array_limit=2)
    elements = [Job(**{**base.__dict__, "id": 1 + i, "array_index": i}) for i in range(6)]
    after = _job(user="ben", id=7, after_arrays=(1,))
    plan = placement.place([*elements, after], gpus, QueueSection(), 0, 100.0, time.time())
    assert [s.job for s in plan.starts] == [1, 2]
    assert plan.waiting[3] == placement.Waiting("array_limit", count=2, limit=2)
    assert plan.waiting[7] == placement.Waiting("after", after="1")
    done = [Job(**{**e.__dict__, "state": "done"}) for e in elements]
    plan = placement.place([*done, after], gpus, QueueSection(), 0, 100.0, time.time())
    assert [s.job for s in plan.starts] == [7]
    failed = [*done[:3], Job(**{**done[3].__dict__, "state": "failed"}), *done[4:]]
    plan = placement.place([*failed, after], gpus, QueueSection(), 0, 100.0, time.time())
    assert plan.cancels == (placement.CancelJob(7, 4, "failed", "afterok", 1),)


def test_placing_10000_elements_is_linear_not_quadratic() -> None:
    gpus = [placement.GpuView(f"GPU-{i}", False, free_since=0.0) for i in range(8)]

    def took(n: int) -> float:
        base = _job(array_id=1, array_limit=4)
        jobs = [Job(**{**base.__dict__, "id": 1 + i, "array_index": i}) for i in range(n)]
        jobs.append(_job(user="ben", id=n + 1, after_arrays=(1,)))
        best = 1e9
        for _ in range(3):
            t = time.perf_counter()
            placement.place(jobs, gpus, QueueSection(), 0, 100.0, time.time())
            best = min(best, time.perf_counter() - t)
        return best

    small, large = took(1000), took(10000)
    assert large < 30 * small, (small, large)  # linear: ~10x; quadratic: ~100x


# ------------------------------------------------------------------ the real daemon


pytestmark_root = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them")


@pytest.fixture
def alab(sim):
    """Two users of our own (gmaann, gmaben), the package where they can read it, the job script and the
    client's config; all removed afterwards."""
    with made_lab("gma", ("gmaann", "gmaben"), JOB) as lab:
        yield lab


def _reports(lab: Lab, user, job_id: int) -> List[dict]:
    path = user.work / f"report-{job_id}.jsonl"
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def _elements(lab: Lab, user) -> Dict[str, dict]:
    return {f"{j['array_id']}_{j['array_index']}": j for j in lab.jobs(user).values() if j["array_id"]}


@pytestmark_root
def test_an_array_runs_each_element_as_a_job_with_its_index_limit_and_output(alab, daemon_factory):
    lab = alab
    body = queue_body(lab, "max_queued_per_user = 20\nmax_array_size = 100\n")
    daemon_factory(body, defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    ann, ben = lab.alice, lab.bob
    # hostile specs: one line, exit 2 (1: a limit), nothing queued
    for spec, code in (
        ("0-99999999", 2),
        ("5-1", 2),
        ("%0", 2),
        ("1,,2", 2),
        ("0-9%-1", 2),
        ("," * 100000, 2),
        ("0-20", 1),
    ):
        r = lab.run(ann, "submit", "--array", spec, "--", "/bin/true")
        assert r.returncode == code and r.stderr.count("\n") == 1, (spec, r.stderr)
        assert r.stderr.startswith("gpu-mon: ") and len(r.stderr) < 200
    assert lab.jobs(ann) == {}
    out = str(lab.alice.work / "out-%A_%a.log")
    r = lab.run(
        ann,
        "submit",
        "--array",
        "0-4,8%2",
        "--hold",  # (listed before any element runs, however slow the machine: released below)
        "--output",
        out,
        "--",
        "/usr/bin/python3",
        str(lab.job),
        "0.4",
        "0",
        lab.marker,
    )
    assert r.returncode == 0 and r.stdout == "job 1: 6 elements held (0 ahead)\n", r.stderr
    # ben may see it but not touch it
    for op in ("cancel", "hold", "release"):
        for ref in ("1", "1_3"):
            r = lab.run(ben, op, ref)
            assert (r.returncode, r.stderr) == (1, f"gpu-mon: job {ref} is gmaann's, not yours\n")
    r = lab.run(ann, "jobs")
    assert r.returncode == 0 and "1_[0-4,8] (6)" in r.stdout, r.stdout
    r = lab.run(ann, "release", "1")
    assert (r.returncode, r.stdout) == (0, "job 1: queued (6 of 6 elements)\n"), r.stderr
    r = lab.run(ann, "wait", "1")
    assert r.returncode == 0, r.stderr
    jobs = _elements(lab, ann)
    assert sorted(jobs) == ["1_0", "1_1", "1_2", "1_3", "1_4", "1_8"]
    spans = []
    for ref, j in jobs.items():
        assert j["state"] == "done"
        index = int(ref.split("_")[1])
        start, end = _reports(lab, ann, j["id"])
        assert (start["GPU_MON_JOB_ID"], start["GPU_MON_ARRAY_ID"]) == (str(j["id"]), "1")
        assert start["GPU_MON_ARRAY_INDEX"] == str(index)
        log = lab.alice.work / f"out-1_{index}.log"
        assert log.read_text() == f"hello from {j['id']}\n" and log.stat().st_uid == ann.uid
        spans.append((start["t"], end["t"]))
    for t, _ in spans:  # %2: never more than two at once
        assert sum(1 for s, e in spans if s <= t < e) <= 2
    r = lab.run(ann, "jobs", "--all")
    assert "1_[0-4,8] (6)" in r.stdout, r.stdout
    r = lab.run(ann, "jobs", "--all", "--expand")
    assert "1_8 " in r.stdout and "1_[" not in r.stdout, r.stdout


@pytestmark_root
def test_cancel_hold_release_and_after_take_an_array_or_one_element(alab, daemon_factory):
    lab = alab
    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    ann, ben = lab.alice, lab.bob
    cmd = ["--", "/usr/bin/python3", str(lab.job), "0.1", "0", lab.marker]
    arr = lab.submit(ann, "--hold", "--array", "0-3", *cmd)
    after = lab.submit(ben, "--after", str(arr), *cmd)
    one = lab.submit(ben, "--after", f"{arr}_2", *cmd)
    r = lab.run(ann, "release", f"{arr}_2")
    assert (r.returncode, r.stdout) == (0, f"job {arr}_2: queued\n")
    lab.wait_state(ben, one, "done")
    assert lab.jobs(ben)[after]["state"] == "queued"  # the rest of the array is held
    r = lab.run(ann, "cancel", f"{arr}_3")
    assert r.returncode == 0, r.stderr
    r = lab.run(ann, "release", str(arr))
    assert (r.returncode, r.stdout) == (0, f"job {arr}: queued (2 of 4 elements)\n")
    cancelled = lab.wait_state(ben, after, "cancelled")
    assert cancelled["reason"] == f"dependency never met: afterok:{arr} (job {arr}_3 cancelled)"  # (as named)
    r = lab.run(ann, "logs", str(arr))
    assert r.returncode == 2 and "is an array of 4 elements: name one" in r.stderr
    r = lab.run(ann, "wait", str(arr))
    assert r.returncode == 1 and f"job {arr}_3 cancelled" in r.stderr, r.stderr  # (one element: as itself)


@pytestmark_root
def test_a_daemon_killed_mid_array_restarts_with_every_element_right_and_a_reload_keeps_them(
    alab, daemon_factory
):
    lab = alab
    d = daemon_factory(queue_body(lab, gpus="0"), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    ann = lab.alice
    first = lab.submit(ann, "--array", "0-1", "--", "/usr/bin/python3", str(lab.job), "0", "0", lab.marker)
    lab.run(ann, "wait", str(first))
    arr = lab.submit(ann, "--array", "0-3", "--", "/usr/bin/python3", str(lab.job), "60", "0", lab.marker)
    wait_for(lambda: _elements(lab, ann)[f"{arr}_0"]["state"] == "running", 30, "element 0 running")
    wait_for(lambda: _reports(lab, ann, arr), 20, "element 0's report")
    d.signal(signal.SIGKILL)
    d.proc.wait(10)
    d.start()
    d.wait_log(rf"queue: job {arr}_0(: the processes an earlier|: gpu-mon stopped while it ran)")
    jobs = wait_for(
        lambda: (j := _elements(lab, ann))[f"{arr}_0"]["state"] == "running" and j, 30, "element 0 again"
    )
    assert jobs[f"{arr}_0"]["restarts"] == 1
    assert [jobs[f"{arr}_{i}"]["state"] for i in (1, 2, 3)] == ["queued"] * 3
    assert [jobs[f"{first}_{i}"]["state"] for i in (0, 1)] == ["done"] * 2
    assert [jobs[f"{arr}_{i}"]["id"] for i in range(4)] == list(range(arr, arr + 4))
    d.signal(signal.SIGHUP)
    d.wait_log(r"reloaded ")
    again = _elements(lab, ann)
    assert {k: v["state"] for k, v in again.items()} == {k: v["state"] for k, v in jobs.items()}
    r = lab.run(ann, "cancel", str(arr))
    assert (r.returncode, r.stdout) == (0, f"job {arr}: cancelled, stopping (4 of 4 elements)\n")
    wait_for(
        lambda: all(j["state"] == "cancelled" for j in _elements(lab, ann).values() if j["array_id"] == arr),
        30,
        "every element cancelled",
    )


def _line(lab: Lab, user, prefix: str, *args: str) -> List[str]:
    """The columns of `jobs`' line that starts with prefix (ID USER STATE GPUS TIME [END] RESTARTS ...)."""
    r = lab.run(user, "jobs", *args)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, r.stdout
    return re.split(r"\s{2,}", lines[0])


@pytestmark_root
def test_a_grouped_line_shows_what_its_elements_share_or_totals_never_one_elements_value_and_jobs_name(
    alab, daemon_factory, sim
):
    lab = alab
    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    ann = lab.alice
    cmd = ["--", "/usr/bin/python3", str(lab.job), "120", "0", lab.marker]
    arr = lab.submit(ann, "--array", "0-1", "--name", "sweep", *cmd)
    other = lab.submit(ann, "--hold", "--name", "other", *cmd)
    running = lambda: all(_elements(lab, ann)[f"{arr}_{i}"]["state"] == "running" for i in (0, 1))  # noqa: E731
    wait_for(running, 30, "both elements running")
    group = f"{arr}_[0-1] (2)"
    assert _line(lab, ann, group)[2:4] == ["running", "0,1"]  # (before: one element's GPU)
    # jobs --name: only the jobs of that name (a named array: its elements)
    assert _line(lab, ann, group, "--name", "sweep")[0] == group
    r = lab.run(ann, "jobs", "--name", "other")
    assert str(other) in r.stdout and f"{arr}_" not in r.stdout, r.stdout
    assert set(lab.jobs(ann, "--name", "other")) == {other}
    assert lab.jobs(ann, "--name", "nothing") == {}
    # element 1 preempted and requeued once: the group's RESTARTS is the total, its TIME a range
    gpu = [sim.uuid(0), sim.uuid(1)].index(_elements(lab, ann)[f"{arr}_1"]["gpus"][0])
    with foreign_open(sim.device(gpu)):
        wait_for(lambda: _elements(lab, ann)[f"{arr}_1"]["restarts"] == 1, 30, "element 1 requeued")
        # (element 0 has run 4 s before element 1 may start again: their TIMEs differ by seconds)
        wait_for(lambda: elapsed(_elements(lab, ann)[f"{arr}_0"], time.time()) >= 4, 30, "4 s of element 0")
    wait_for(running, 30, "element 1 running again")
    jobs = _elements(lab, ann)
    assert (jobs[f"{arr}_0"]["restarts"], jobs[f"{arr}_1"]["restarts"]) == (0, 1)
    columns = _line(lab, ann, group)
    assert columns[2:4] == ["running", "0,1"] and columns[5] == "1", columns  # (before: element 0's 0)
    assert re.fullmatch(r"\d+ s-\d+ s", columns[4]), columns  # (element 1 started later)
    r = lab.run(ann, "cancel", str(arr))
    assert r.returncode == 0, r.stderr
    # two elements that failed with their own statuses: the line says they differ; wait gives the first's
    sh = lab.submit(ann, "--array", "0-1", "--", "/bin/sh", "-c", "exit $((GPU_MON_ARRAY_INDEX + 3))")
    r = lab.run(ann, "wait", str(sh))
    assert r.returncode == 3 and f"job {sh}_[0-1] failed" in r.stderr, (r.returncode, r.stderr)
    columns = _line(lab, ann, f"{sh}_[0-1] (2)", "--all")
    assert columns[2] == "failed" and columns[-1] == "their exit statuses differ (jobs --expand)", columns


HOOK = """#!/bin/sh
# a user's hook: what it was given, where and as whom it ran
{ env; echo "UID=$(id -u)"; echo "CWD=$(pwd)"; } > ".part-$$"
mv ".part-$$" "hook-$GPU_MON_JOB_ID-$GPU_MON_JOB_STATE.env"  # (whole when it appears)
echo "hook ran for $GPU_MON_JOB_ID"
"""


def _hook_runs(user) -> Dict[str, Dict[str, str]]:
    out = {}
    for path in user.work.glob("hook-*.env"):
        lines = path.read_text().splitlines()
        out[path.name[5:-4]] = dict(line.split("=", 1) for line in lines if "=" in line)
    return out


@pytestmark_root
def test_hooks_run_as_the_user_in_the_jobs_directory_once_per_array_and_a_failure_is_one_line(
    alab, daemon_factory
):
    lab = alab
    d = daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    ann, ben = lab.alice, lab.bob
    hook = ann.home / ".config" / "gpu-mon" / "notify"
    hook.parent.mkdir(parents=True)
    hook.write_text(HOOK)
    os.chmod(hook, 0o755)
    for path in (hook.parent.parent, hook.parent, hook):
        os.chown(path, ann.uid, ann.gid)
    job = ["--", "/usr/bin/python3", str(lab.job)]
    single = lab.submit(ann, *job, "0", "3", lab.marker)  # the default hook: failed, exit 3
    explicit = ann.work / "explicit.sh"
    explicit.write_text(HOOK.replace("hook-", "explicit-"))
    os.chmod(explicit, 0o755)
    arr = lab.submit(ann, "--array", "0-2", "--notify", f"sh {explicit}", *job, "0", "0", lab.marker)
    each = lab.submit(ann, "--array", "0-1", "--notify-each", *job, "0", "0", lab.marker)
    bad = lab.submit(ben, "--notify", "echo failing; exit 7", *job, "0", "0", lab.marker)
    runs = wait_for(lambda: len(r := _hook_runs(ann)) >= 3 and r, 30, "the default hook's three runs")
    assert sorted(runs) == sorted([f"{single}-failed", f"{each}-done", f"{each + 1}-done"])
    env = runs[f"{single}-failed"]
    assert (env["GPU_MON_JOB_EXIT"], env["UID"], env["CWD"]) == ("3", str(ann.uid), str(ann.work))
    assert env["GPU_MON_JOB_NAME"] == "" and "GPU_MON_ARRAY_ID" not in env and env["GMQ_MARK"] == lab.marker
    assert runs[f"{each + 1}-done"]["GPU_MON_ARRAY_INDEX"] == "1"
    # each named as `jobs` names it (GPU_MON_JOB_ID: its own number, as before)
    assert runs[f"{each + 1}-done"]["GPU_MON_JOB_REF"] == f"{each}_1"
    assert env["GPU_MON_JOB_REF"] == str(single)
    log = ann.home / ".local/state/gpu-mon/jobs" / f"{single}.log"
    wait_for(lambda: f"hook ran for {single}\n" in log.read_text(), 10, "the hook's output in the job's log")
    # an array without --notify-each: once, when its last element ended
    wait_for(lambda: list(ann.work.glob("explicit-*.env")), 30, "the array's notice")
    (notice,) = ann.work.glob("explicit-*.env")
    env = dict(line.split("=", 1) for line in notice.read_text().splitlines() if "=" in line)
    assert (env["GPU_MON_ARRAY_ID"], env["GPU_MON_JOB_STATE"]) == (str(arr), "done")
    assert env["GPU_MON_ARRAY_COUNTS"] == "done=3" and env["GPU_MON_JOB_EXIT"] == "0"
    assert env["GPU_MON_JOB_REF"] == f"{arr}_{env['GPU_MON_ARRAY_INDEX']}"  # (its last element's)
    # a failing hook: one line in the daemon's log and one in the job's (ben's, as ben)
    d.wait_log(rf"queue: job {bad}: its hook exited with status 7")
    ben_log = ben.home / ".local/state/gpu-mon/jobs" / f"{bad}.log"
    wait_for(lambda: f"gpu-mon: job {bad}: its hook exited with status 7\n" in ben_log.read_text(), 10)
    assert "failing\n" in ben_log.read_text()
    assert not _hook_runs(ben)  # ann's default hook is hers alone
    assert all("notify" not in j for j in lab.jobs(ben).values())  # nobody sees another's hook


# a hook that outlives its welcome: SIGTERM ignored (by it and by its child), the pids in PIDS
STUBBORN = "trap '' TERM; sleep 300 & echo $$ $! > PIDS; wait"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pids(path: Path) -> List[int]:
    text = path.read_text() if path.exists() else ""
    return [int(p) for p in text.split()] if text.endswith("\n") else []


def test_a_hooks_own_timeout_ends_its_whole_group_without_gpu_mon(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    argv = hooks.wrapper_argv(str(tmp_path / "log"), str(tmp_path), STUBBORN.replace("PIDS", str(pids)), 1)
    popen = subprocess.Popen(argv, start_new_session=True)
    try:
        shell, child = wait_for(lambda: _pids(pids), 20, "the hook's pids")
        # nobody signals it: `timeout` does, SIGTERM after 1 s then SIGKILL (ignored TERM) to the group
        wait_for(lambda: popen.poll() is not None and not _alive(shell) and not _alive(child), 20, "its end")
    finally:
        with contextlib.suppress(OSError):
            os.killpg(popen.pid, signal.SIGKILL)
        popen.wait()


@pytestmark_root
def test_a_hook_left_by_a_killed_daemon_is_ended_by_its_leader_and_a_stopping_daemon_ends_its_hooks(
    alab, daemon_factory
):
    lab = alab
    d = daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    ann = lab.alice
    job = ["--", "/usr/bin/python3", str(lab.job), "0", "0", lab.marker]
    # SIGKILL: the hook's leader hears it (its parent-death signal) and ends all of the hook by itself
    # (SIGTERM, ignored here, then SIGKILL a second later); its own `timeout` is there too
    first = ann.work / "first.pids"
    lab.submit(ann, "--notify", STUBBORN.replace("PIDS", str(first)), *job)
    shell, child = wait_for(lambda: _pids(first), 30, "the first hook's pids")
    try:
        limit = psutil.Process(shell).parent().cmdline()
        assert os.path.basename(limit[0]) == "timeout" and limit[1:6] == ["-k", "2", "31", "/bin/sh", "-c"]
        d.signal(signal.SIGKILL)
        d.proc.wait(10)
        wait_for(lambda: not _alive(shell) and not _alive(child), hooks.KILL_AFTER + 10, "the hook ended")
    finally:
        with contextlib.suppress(OSError):
            os.killpg(os.getpgid(shell), signal.SIGKILL)
    # SIGTERM: gpu-mon ends its running hooks (TERM to the group, then KILL) before it exits, quickly
    d.start()
    d.wait_log(r"queue: listening on ", count=2)
    second = ann.work / "second.pids"
    ref = lab.submit(ann, "--notify", STUBBORN.replace("PIDS", str(second)), *job)
    shell, child = wait_for(lambda: _pids(second), 30, "the second hook's pids")
    began = time.monotonic()
    assert d.stop() == 0
    took = time.monotonic() - began
    assert not _alive(shell) and not _alive(child)
    d.wait_log(rf"queue: job {ref}: its hook was still running when gpu-mon stopped: killed")
    assert took < hooks.STOP_GRACE + hooks.KILL_AFTER + 8, took


def test_a_group_line_reads_the_same_from_the_elements_alike_as_from_every_one(tmp_path):
    """grouped() reads one of an array's elements still as submitted for all of them: its line is the one
    made from every element, whatever changed (restarts, a start, an end, a preemption)."""
    import dataclasses

    from gpu_mon.queue import grouped as G
    from gpu_mon.queue import jobs as J
    from gpu_mon.queue.jobs import Job
    from gpu_mon.queue.store import Store

    store = Store.open(str(tmp_path / "q.sqlite"), 0.0)
    base = Job(
        id=0, user="alice", uid=1000, gid=1000, command=("true",), cwd="/", env=(("PATH", "/bin"),),
        output="", submitted=1.0, state=J.QUEUED,
    )  # fmt: skip
    first, _ = store.submit_array(base, range(40), 1000)
    edits = {
        3: lambda j: dataclasses.replace(j, restarts=2, preempted_at=7.0, preempted_reason="GPU 0 busy"),
        9: lambda j: dataclasses.replace(j, restarts=1),
        20: lambda j: dataclasses.replace(j, priority=5),
    }
    for index, edit in edits.items():
        store.change(first.id + index, edit)

    def line(members):
        return G.grouped({"reason": "waiting"}, members, {}, lambda j: (j.state, j.reason))

    elements = store.elements(first.array_id)
    assert sum(J.as_submitted(m) for m in elements) == 37
    whole = [Job(**J.values_of(m)) for m in elements]  # (none as submitted: every one read)
    assert not any(J.as_submitted(m) for m in whole)
    assert line(elements) == line(whole)
    assert line(elements)["restarts"] == 3 and line(elements)["priority"] is None
    untouched = [m for m in elements if J.as_submitted(m)]
    assert line(untouched) == line([Job(**J.values_of(m)) for m in untouched])
    store.close()
