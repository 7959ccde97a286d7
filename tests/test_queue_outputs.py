"""The queue in `status`, the history (`report --by job`, `--by user`) and the metrics: a real daemon on the
simulated GPUs, jobs of users created here (their own names: test_queue.py's may run beside), a real
preemption by a foreign open, the real endpoint checked by promtool, and a history file migrated forward."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time
from typing import Dict, List

import pytest
from conftest import GPU_MON, foreign_open, wait_for
from test_metrics import free_port, promtool_check, scrape, value
from test_queue import Lab, made_lab, queue_body

from gpu_mon.api import historydb
from gpu_mon.queue import jobs as J

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them: needs root")

# A job that says when each run starts and stops, and finishes when its finish file appears.
JOB = r"""
import json, os, signal, sys, time
env = os.environ
job = env.get("GPU_MON_JOB_ID", "x")
restart = int(env.get("GPU_MON_RESTART_COUNT", "-1"))

def say(event):
    with open(os.path.join(os.getcwd(), "runs-" + job + ".jsonl"), "a") as f:
        f.write(json.dumps(dict(event=event, t=time.time(), restart=restart)) + "\n")

def stop(signum, frame):
    say("stop")
    sys.exit(143)

signal.signal(signal.SIGTERM, stop)
say("start")
while not os.path.exists(os.path.join(os.getcwd(), "finish-" + job)):
    time.sleep(0.02)
say("end")
"""


@pytest.fixture
def lab(sim):
    """Two users of this file's own (gmqcarol, gmqdan), the package where they can read it, the job."""
    with made_lab("gmqout", ("gmqcarol", "gmqdan"), JOB) as made:
        yield made


def runs(lab: Lab, user, job_id: int) -> List[dict]:
    """What the job said of its runs: start, stop (signalled) or end (finished), with times."""
    path = user.work / f"runs-{job_id}.jsonl"
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def finish(user, job_id: int) -> None:
    """Let the job end by itself (exit 0)."""
    (user.work / f"finish-{job_id}").write_text("")


def ran_for(events: List[dict], at_least: float) -> None:
    """Wait until the job's current run has lasted `at_least` seconds (by its own clock)."""
    start = [e for e in events if e["event"] == "start"][-1]["t"]
    wait_for(lambda: time.time() - start >= at_least, at_least + 5, f"a run of {at_least} s")


def seconds_ran(events: List[dict]) -> float:
    """The job's own measure of its runs: each start to its stop or end."""
    total, start = 0.0, None
    for e in events:
        if e["event"] == "start":
            start = e["t"]
        elif start is not None:
            total, start = total + e["t"] - start, None
    return total


def status(d, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [*GPU_MON, "--config", str(d.config_path), "status", *args], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    return r


def report(d, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [*GPU_MON, "--config", str(d.config_path), "report", "--since", "1h", *args],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    return r


def report_json(d) -> dict:
    return json.loads(report(d, "--json").stdout)


def by(rows: List[dict], key: str) -> Dict[object, dict]:
    return {r[key]: r for r in rows}


# ------------------------------------------------------------------------------------------------------


def test_status_history_report_and_metrics_follow_jobs_through_a_preemption(lab, daemon_factory, sim):
    port = free_port()
    metrics = f"[metrics]\nlisten = {port}\ntextfile = {lab.dir / 'gpu_mon.prom'}\n"
    d = daemon_factory(queue_body(lab, "order = fifo\n" + metrics, gpus="0"), {"start_delay_seconds": 0.3})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    carol, dan = lab.alice, lab.bob
    a = lab.submit(carol, "--name", "trainA", *lab.job_cmd())
    lab.wait_state(carol, a, "running")
    b = lab.submit(dan, *lab.job_cmd())
    c = lab.submit(carol, "--hold", *lab.job_cmd())

    # status: the job on GPU 0, and the queue's length
    def shown() -> dict:
        doc = json.loads(status(d, "--json").stdout)
        q = doc.get("queue", {}).get("jobs", {})
        return doc if (q.get("running"), q.get("queued"), q.get("held")) == (1, 1, 1) else {}

    doc = wait_for(shown, 20, "status to show 1 running, 1 queued, 1 held")
    g0, g1 = doc["gpus"]
    assert g0["job"]["id"] == a and g0["job"]["user"] == "gmqcarol" and g0["job"]["name"] == "trainA"
    assert g0["job"]["state"] == "running" and g0["job"]["restarts"] == 0 and g1["job"] is None
    assert set(doc["queue"]["jobs"]) == set(J.STATES)
    assert [j["id"] for j in doc["queue"]["running"]] == [a]
    text = status(d).stdout
    assert "    job 1 gmqcarol trainA (running " in text
    assert "Queue: 1 running, 1 queued, 1 held (gpu-mon jobs lists them)" in text

    # someone else opens GPU 0: job A is preempted, and comes back when the GPU is let go
    wait_for(lambda: runs(lab, carol, a), 20, "job A's first run")
    ran_for(runs(lab, carol, a), 2.0)
    with foreign_open(sim.device(0)) as opener:
        d.wait_log(r"busy: root .*; stopping job 1")
        assert lab.wait_state(carol, a, "queued")["restarts"] == 1
        wait_for(lambda: "busy" in lab.jobs(carol)[a]["reason"], 10, "A waiting for the busy GPU")
    lab.wait_state(carol, a, "running")
    wait_for(lambda: len(runs(lab, carol, a)) == 3, 20, "A's second run")
    doc = wait_for(lambda: (s := json.loads(status(d, "--json").stdout))["gpus"][0]["job"] and s, 10)
    assert doc["gpus"][0]["job"]["restarts"] == 1
    assert "    job 1 gmqcarol trainA (running " in status(d).stdout and ", restart 1)" in status(d).stdout
    ran_for(runs(lab, carol, a), 2.0)
    finish(carol, a)
    lab.wait_state(carol, a, "done")
    lab.wait_state(dan, b, "running")
    wait_for(lambda: runs(lab, dan, b), 20, "job B's run")
    ran_for(runs(lab, dan, b), 1.5)
    finish(dan, b)
    lab.wait_state(dan, b, "done")
    assert lab.run(carol, "cancel", str(c)).returncode == 0
    lab.wait_state(carol, c, "cancelled")
    measured_a, measured_b = seconds_ran(runs(lab, carol, a)), seconds_ran(runs(lab, dan, b))
    assert [e["event"] for e in runs(lab, carol, a)] == ["start", "stop", "start", "end"]

    # metrics: the preemption, the three starts' waits, every state's count
    def counted() -> str:
        t = scrape(port)
        return t if value(t, "gpu_mon_queue_jobs", state="cancelled") == 1 else ""

    text = wait_for(counted, 20, "the metrics to count the cancel")
    promtool_check(text)
    assert value(text, "gpu_mon_job_preemptions_total") == 1
    assert value(text, "gpu_mon_queue_wait_seconds_count") == 3
    assert value(text, "gpu_mon_queue_wait_seconds_sum") > 0
    assert value(text, "gpu_mon_queue_wait_seconds_bucket", le="86400.0") == 3
    jobs = {s: value(text, "gpu_mon_queue_jobs", state=s) for s in J.STATES}
    assert jobs == {**dict.fromkeys(J.STATES, 0), "done": 2, "cancelled": 1}
    wait_for(
        lambda: "gpu_mon_job_preemptions_total 1.0" in (lab.dir / "gpu_mon.prom").read_text(),
        10,
        "the textfile",
    )

    # the history, through report: per job and per user, close to what the jobs measured themselves
    def recorded() -> dict:
        doc = report_json(d)
        rows = by(doc.get("jobs", []), "job")
        return doc if rows.get(b, {}).get("last") == "done" else {}

    doc = wait_for(recorded, 30, "the history to have job B done")
    jobs_ = by(doc["jobs"], "job")
    assert set(jobs_) == {a, b}  # job C never ran
    ja, jb = jobs_[a], jobs_[b]
    assert [ja[k] for k in ("user", "name", "runs", "preemptions", "last")] == [
        "gmqcarol",
        "trainA",
        2,
        1,
        "done",
    ]
    assert (jb["user"], jb["runs"], jb["preemptions"]) == ("gmqdan", 1, 0)
    (why,) = ja["preempted_by"]  # who took the GPU, as `jobs` and the job's log say it
    gpu0 = f"GPU 0 ({sim.uuid(0)})"
    assert why == f"{gpu0} busy: root python3[{opener.pid}] holds {sim.device(0)}"
    assert jb["preempted_by"] == []
    assert ja["gpu_seconds"] == pytest.approx(measured_a, abs=1.5)
    assert jb["gpu_seconds"] == pytest.approx(measured_b, abs=1.0)
    assert ja["wait_seconds"] > 0
    assert jb["wait_seconds"] >= measured_a - 1  # it waited for A's two runs at least
    users = by(doc["users"], "user")
    assert users["gmqcarol"]["jobs"] == 1 and users["gmqcarol"]["job_preemptions"] == 1
    assert users["gmqcarol"]["job_gpu_seconds"] == ja["gpu_seconds"]
    assert users["gmqdan"]["job_gpu_seconds"] == jb["gpu_seconds"]
    assert users["gmqdan"]["job_wait_seconds"] == jb["wait_seconds"]
    lines = report(d, "--by", "job").stdout.splitlines()
    heads = "job  user  name  runs  GPU time  preemptions  waited  last run  kWh  preempted by"
    assert lines[2].split() == heads.split()
    assert lines[3].split()[:4] == ["1", "gmqcarol", "trainA", "2"] and lines[3].endswith(f"  {why}")
    assert lines[3][: -len(why)].split()[-2:] == ["done", "-"]  # (no energy figure on these GPUs)
    lines = report(d, "--by", "user").stdout.splitlines()
    carol_line = next(line for line in lines if line.startswith("gmqcarol"))
    assert " 1 " in carol_line  # its preemption
    with sqlite3.connect(f"file:{d.tmp / 'history.sqlite'}?mode=ro", uri=True) as conn:
        hows = list(conn.execute("SELECT job, how, restart FROM job_runs ORDER BY start"))
        assert hows == [(a, "preempted", 0), (a, "done", 1), (b, "done", 0)]
        assert conn.execute("SELECT count(*) FROM runs WHERE process LIKE 'job:%'").fetchone()[0] == 0


def test_a_daemon_killed_with_a_job_running_records_the_run_once_and_ends_it_when_it_stopped(
    lab, daemon_factory
):
    d = daemon_factory(queue_body(lab, gpus="0"), {"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    a = lab.submit(lab.alice, *lab.job_cmd())
    wait_for(lambda: runs(lab, lab.alice, a), 20, "the job's first run")
    db = d.tmp / "history.sqlite"

    def row() -> list:
        if not db.exists():
            return []
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            return list(conn.execute("SELECT start, end, how FROM job_runs"))

    wait_for(lambda: (r := row()) and r[0][1] > r[0][0] + 1, 20, "the running row written twice")
    d.signal(signal.SIGKILL)
    d.proc.wait(10)
    (_start, last_end, _how) = row()[0]
    killed_at = time.time()
    wait_for(lambda: time.time() > killed_at + 2, 5, "a gap with no daemon")
    d.start()
    wait_for(lambda: len([e for e in runs(lab, lab.alice, a) if e["event"] == "start"]) == 2, 30, "run 2")
    finish(lab.alice, a)
    lab.wait_state(lab.alice, a, "done")
    wait_for(lambda: [h for _s, _e, h in row()] == ["requeued", "done"], 20, "both runs recorded")
    (_s1, e1, _h1), (s2, _e2, _h2) = sorted(row())
    assert e1 == last_end < killed_at  # the first run ends where the killed daemon's record did
    assert s2 > killed_at + 2


def test_without_a_queue_status_and_metrics_say_nothing_of_jobs(tmp_path, daemon_factory):
    port = free_port()
    body = "[gpu-all]\ngpus = ALL\n[process-w]\ncmd = sleep 600\ngpus = 0\nuser = root\n"
    body += f"[metrics]\nlisten = {port}\n"
    d = daemon_factory(body)
    d.wait_running("w")
    doc = json.loads(status(d, "--json").stdout)
    assert "queue" not in doc and all("job" not in g for g in doc["gpus"])
    assert "Queue:" not in status(d).stdout
    text = scrape(port)
    assert "gpu_mon_queue" not in text and "gpu_mon_job_" not in text


def test_a_version_1_history_is_migrated_forward_and_keeps_its_rows(tmp_path, daemon_factory):
    db = tmp_path / "old.sqlite"
    conn = sqlite3.connect(db)
    conn.execute(f"PRAGMA application_id={historydb.APPLICATION_ID}")
    conn.executescript(historydb._SCHEMA_V1 + "INSERT INTO schema_version VALUES (1);")
    now = time.time()
    conn.execute("INSERT INTO gpus VALUES ('GPU-old', 0, 'Old', ?)", (now,))
    conn.execute(
        "INSERT INTO intervals (uuid, state, start, end) VALUES ('GPU-old', 'idle', ?, ?)", (now - 60, now)
    )
    conn.execute(
        "INSERT INTO runs (process, label, gpus, start, end) VALUES ('w', 'w', 'GPU-old', ?, ?)",
        (now - 60, now),
    )
    conn.commit()
    conn.close()
    conf = tmp_path / "r.conf"
    conf.write_text(f"[history]\npath = {db}\n")
    r = subprocess.run(
        [*GPU_MON, "--config", str(conf), "report", "--since", "1h", "--json"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr  # an old file read as it is: no jobs
    assert json.loads(r.stdout)["jobs"] == [] and json.loads(r.stdout)["processes"][0]["name"] == "w"
    socket_path = tmp_path / "q" / "queue.sock"
    body = (
        f"[gpu-all]\ngpus = ALL\n[queue]\nsocket = {socket_path}\ndatabase = {tmp_path / 'q.sqlite'}\n"
        "launcher = direct\n"
        f"[history]\npath = {db}\n"
    )
    d = daemon_factory(body, {"start_delay_seconds": 0})
    wait_for(socket_path.exists, 20, "the queue's socket")
    client = tmp_path / "client.conf"
    client.write_text(f"[queue]\nsocket = {socket_path}\n")
    r = subprocess.run(
        [
            *GPU_MON,
            "--config",
            str(client),
            "submit",
            "--json",
            "--output",
            str(tmp_path / "job.log"),
            "--",
            "true",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr

    def done() -> list:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
            has = c.execute("SELECT 1 FROM sqlite_master WHERE name = 'job_runs'").fetchone()
            return list(c.execute("SELECT job, how FROM job_runs")) if has else []

    assert wait_for(done, 30, "the job's run in the history") == [(1, "done")]
    assert d.stop() == 0
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        assert c.execute("SELECT version FROM schema_version").fetchone()[0] == historydb.SCHEMA_VERSION == 4
        assert list(c.execute("SELECT process, start FROM runs")) == [("w", pytest.approx(now - 60))]
        assert c.execute("SELECT count(*) FROM intervals WHERE uuid = 'GPU-old'").fetchone()[0] == 1
    assert not list(tmp_path.glob("old.sqlite.bad-*"))  # migrated, never moved aside
