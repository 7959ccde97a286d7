"""[history], idle holders and `gpu-mon report`: a real daemon on simulated GPUs, a real SQLite file."""

from __future__ import annotations

import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import GPU_MON, foreign_opener_cmd, pid_alive, wait_for, workload_cmd

from gpu_mon.api import historydb
from gpu_mon.config import HistorySection
from gpu_mon.outputs import history


def body(tmp_path: Path, extra_gpu: str = "", history_extra: str = "") -> str:
    return (
        f"[gpu-all]\ngpus = ALL\n{extra_gpu}\n"
        f"[process-w]\ncmd = {workload_cmd(tmp_path)}\ngpus = 0\nuser = root\n\n"
        f"[history]\npath = {tmp_path / 'h.sqlite'}\nsample_seconds = 1\n{history_extra}"
    )


def report(conf: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*GPU_MON, "--config", str(conf), "report", *args], capture_output=True, text=True)


def rows(path: Path, sql: str) -> list:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as c:
        return list(c.execute(sql))


def open_gpu(path: str) -> subprocess.Popen:
    p = subprocess.Popen(foreign_opener_cmd(path), stdout=subprocess.PIPE, start_new_session=True)
    assert p.stdout is not None and p.stdout.readline().strip() == b"open"
    return p


def test_preemptions_and_state_durations_are_recorded(tmp_path, sim, daemon_factory):
    d = daemon_factory(body(tmp_path))
    d.wait_running("w")
    for n in (1, 2):
        opener = open_gpu(sim.device(0))
        d.wait_log(r"w\[\d+\] stopped in", count=n)
        opener.kill()
        opener.wait()
        d.wait_running("w", timeout=20)
        wait_for(lambda n=n: d.log().count("starting w[") > n, what="restarted")
    db = tmp_path / "h.sqlite"
    wait_for(lambda: db.exists() and rows(db, "SELECT count(*) FROM intervals")[0][0], what="a first batch")
    r = report(d.config_path, "--json", "--since", "1h")  # while the daemon writes
    assert r.returncode == 0, r.stderr
    assert d.stop() == 0
    pre = rows(db, "SELECT uuid, detected_by, term_ms, gone_ms FROM preemptions")
    assert len(pre) == 2 and all(u == sim.uuid(0) for u, *_ in pre)
    assert all(0 < term <= gone < 5000 for _u, _by, term, gone in pre), pre
    assert rows(db, "PRAGMA integrity_check") == [("ok",)]
    doc = json.loads(report(d.config_path, "--json", "--since", "1h").stdout)
    assert set(doc) >= {"since", "until", "gpus", "processes", "users"}
    g0 = next(g for g in doc["gpus"] if g["uuid"] == sim.uuid(0))
    keys = ["harvested_seconds", "foreign_seconds", "idle_seconds", "paused_seconds", "unknown_seconds"]
    assert set(g0) >= {"uuid", "index", "name", "preemptions", "yield_ms_p50", "yield_ms_p99", *keys}
    assert g0["preemptions"] == 2 and g0["yield_ms_p50"] is not None
    # (each foreign stretch lasts from the open to the opener's close: a few ms, said to 0.1 s)
    foreign = rows(db, "SELECT \"end\" - start FROM intervals WHERE state = 'foreign'")
    assert len(foreign) == 2 and all(s > 0 for (s,) in foreign)
    assert g0["harvested_seconds"] > 0 and g0["foreign_seconds"] == round(sum(s for (s,) in foreign), 1)
    assert abs(sum(g0[k] for k in keys) - 3600) <= 1.0  # the five states cover the hour
    assert doc["processes"][0]["name"] == "w" and doc["processes"][0]["runs"] == 3
    text = report(d.config_path, "--since", "1h").stdout
    assert "harvested" in text and sim.uuid(0) in text


def test_kill_9_keeps_the_database_consistent_and_the_next_daemon_appends(tmp_path, sim, daemon_factory):
    d = daemon_factory(body(tmp_path))
    d.wait_running("w")
    db = tmp_path / "h.sqlite"
    wait_for(
        lambda: db.exists() and rows(db, "SELECT count(*) FROM intervals")[0][0] >= 2, what="first batch"
    )
    d.signal(signal.SIGKILL)
    d.proc.wait()
    assert rows(db, "PRAGMA integrity_check") == [("ok",)]
    before = rows(db, "SELECT count(*), max(end) FROM intervals")[0]
    d2 = daemon_factory(body(tmp_path))
    d2.wait_log("history: recording to")
    wait_for(lambda: rows(db, "SELECT count(*) FROM intervals")[0][0] > before[0], what="new rows")
    assert (
        rows(db, "SELECT min(start) FROM intervals WHERE id > (SELECT max(id) - 1 FROM intervals)")[0][0]
        >= before[1]
    )
    assert d2.stop() == 0
    assert rows(db, "PRAGMA integrity_check") == [("ok",)]


def test_retention_deletes_old_rows_only(tmp_path, sim, daemon_factory):
    db = tmp_path / "h.sqlite"
    conn = historydb.connect_rw(str(db))
    old, recent = time.time() - 10 * 86400, time.time() - 3600
    for start in (old, recent):
        conn.execute(
            "INSERT INTO intervals (uuid, state, start, end) VALUES (?, 'idle', ?, ?)",
            (sim.uuid(1), start, start + 60),
        )
        conn.execute("INSERT INTO samples VALUES (?, ?, 0, 0)", (start, sim.uuid(1)))
    conn.close()
    d = daemon_factory(body(tmp_path, history_extra="retention_days = 2\n"))
    d.wait_log(r"history: removed 2 rows older than 2 days")
    assert rows(db, f"SELECT count(*) FROM intervals WHERE start = {recent}") == [(1,)]
    assert rows(db, f"SELECT count(*) FROM intervals WHERE start < {recent - 86400}") == [(0,)]


@pytest.mark.parametrize("junk", ["garbage", "foreign"])
def test_an_unusable_database_is_moved_aside(tmp_path, sim, daemon_factory, junk):
    db = tmp_path / "h.sqlite"
    if junk == "garbage":
        db.write_bytes(b"SQLite format 3\x00" + os.urandom(5000))
    else:
        with sqlite3.connect(db) as c:
            c.execute("CREATE TABLE notes (x)")
    d = daemon_factory(body(tmp_path))
    d.wait_log(r"history: .*h\.sqlite is unusable .*: moved aside to .*h\.sqlite\.bad-")
    d.wait_log("history: recording to")
    d.wait_running("w")  # the daemon goes on as ever
    assert list(tmp_path.glob("h.sqlite.bad-*"))
    wait_for(lambda: rows(db, "SELECT count(*) FROM intervals")[0][0] > 0, what="the new history")


def test_idle_holder_appears_disappears_and_is_never_signalled(tmp_path, sim, daemon_factory):
    holder = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        gpu = "idle_holder_seconds = 1\nidle_holder_memory_mib = 1000\n"
        d = daemon_factory(body(tmp_path, extra_gpu=gpu))
        d.wait_running("w")

        def idle() -> list:
            r = subprocess.run(
                [*GPU_MON, "--config", str(d.config_path), "status", "--json"], capture_output=True
            )
            return json.loads(r.stdout).get("idle_holders", [])

        def as_listed(util: int, mem: int = 4000) -> None:
            procs = [{"pid": holder.pid, "used_memory_mib": mem, "utilization_pct": util}]
            sim.set(1, processes=procs, memory_used_mib=mem)

        as_listed(0)
        found = wait_for(idle, what="an idle holder")
        assert found[0]["pid"] == holder.pid and found[0]["gpu"] == sim.uuid(1)
        assert (
            found[0]["memory_mib"] == 4000
            and found[0]["idle_seconds"] >= 1
            and found[0]["program"] == "sleep"
        )
        d.wait_log(rf"idle holder on GPU 1 .*sleep\[{holder.pid}\] holds 4000 MiB")
        as_listed(40)  # it computes
        wait_for(lambda: not idle(), what="no idle holder while it computes")
        d.wait_log(rf"idle holder on GPU 1 .* no more: .*sleep\[{holder.pid}\]")
        as_listed(0)
        wait_for(idle, what="idle again")
        as_listed(0, mem=100)  # it freed its memory
        wait_for(lambda: not idle(), what="no idle holder after it freed memory")
        assert pid_alive(holder.pid)  # reported, never signalled
        assert d.stop() == 0
        assert rows(tmp_path / "h.sqlite", "SELECT count(*), min(user) FROM idle_holders")[0][0] == 2
    finally:
        holder.kill()
        holder.wait()


def test_report_without_history(tmp_path):
    from conftest import write_config

    conf = write_config(tmp_path / "c.conf", f"[history]\npath = {tmp_path / 'none.sqlite'}\n")
    r = report(conf)
    assert r.returncode == 1 and "no history yet" in r.stderr and "Traceback" not in r.stderr
    historydb.connect_rw(str(tmp_path / "none.sqlite")).close()
    r = report(conf)
    assert r.returncode == 1 and "no history yet in" in r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--since", "yesterday"], "--since 'yesterday': use 7d"),
        (["--since", "1d", "--until", "2d"], "--until must be after --since"),
        (["--by", "cat"], "invalid choice: 'cat'"),
        (["--plot", "x.jpg"], "must end in .png or .svg"),
    ],
)
def test_report_bad_usage(tmp_path, args, message):
    conf = synthetic(tmp_path, days=1, gpus=1)
    r = report(conf, *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def synthetic(tmp_path: Path, days: float, gpus: int) -> Path:
    """A history of `days` days for `gpus` GPUs, made with bench/history_synth.py's generator."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from conftest import write_config
    from history_synth import make

    make(str(tmp_path / "s.sqlite"), days=days, gpus=gpus)
    return write_config(tmp_path / "c.conf", f"[history]\npath = {tmp_path / 's.sqlite'}\n")


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG\r\n\x1a\n"), (".svg", b"<?xml")])
def test_plot_writes_a_real_image(tmp_path, suffix, magic):
    conf = synthetic(tmp_path, days=3, gpus=4)
    out = tmp_path / f"r{suffix}"
    r = report(conf, "--since", "3d", "--plot", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes().startswith(magic) and out.stat().st_size > 10_000


def test_plot_without_matplotlib_names_the_extra(tmp_path):
    conf = synthetic(tmp_path, days=1, gpus=1)
    code = "import sys; sys.modules['matplotlib'] = None; from gpu_mon.cli import main; "
    code += "sys.exit(main(sys.argv[1:]))"
    args = ["--config", str(conf), "report", "--plot", str(tmp_path / "x.png")]
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    assert r.returncode == 1 and "pip install 'gpu-mon[plot]'" in r.stderr


def test_report_by_day_process_user(tmp_path):
    conf = synthetic(tmp_path, days=2, gpus=2)
    for by, head in (("day", "day"), ("process", "process"), ("user", "user"), ("gpu", "GPU")):
        r = report(conf, "--since", "2d", "--by", by)
        assert r.returncode == 0 and r.stdout.splitlines()[2].startswith(head), r.stdout


def test_migration_to_the_next_version(tmp_path, monkeypatch):
    db = str(tmp_path / "h.sqlite")
    conn = historydb.connect_rw(db)
    conn.execute("INSERT INTO runs (process, label, gpus, start, end) VALUES ('w', 'w', 'GPU-a', 1, 2)")
    conn.close()
    now = historydb.SCHEMA_VERSION
    monkeypatch.setattr(historydb, "SCHEMA_VERSION", now + 1)
    monkeypatch.setitem(
        historydb.MIGRATIONS, now + 1, "ALTER TABLE runs ADD COLUMN note TEXT NOT NULL DEFAULT '';"
    )
    conn = historydb.connect_rw(db)
    assert historydb.version(conn) == now + 1
    assert list(conn.execute("SELECT process, note FROM runs")) == [("w", "")]
    conn.close()
    monkeypatch.setattr(historydb, "SCHEMA_VERSION", now)  # an older gpu-mon meets the newer file
    with pytest.raises(historydb.NotOurs, match="newer gpu-mon"):
        historydb.connect_rw(db)


def test_a_full_disk_is_logged_once_and_pauses_history(tmp_path, caplog):
    import queue

    ops: queue.SimpleQueue[tuple] = queue.SimpleQueue()
    w = history._Writer(HistorySection(path=str(tmp_path / "h.sqlite")), ops)
    assert w._open(time.time())
    w.conn.execute("PRAGMA max_page_count = 30")  # the file may not grow any more: SQLITE_FULL
    rows_ = [("GPU-a", 1, 1)] * 2000
    with caplog.at_level(logging.WARNING, logger="gpu_mon"):
        for _ in range(3):
            w._write([("samples", time.time(), rows_)])
    said = [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(said) == 1 and "full" in said[0] and "paused" in said[0]
    assert w.conn is None and w.retry_at > time.time() + 60


@pytest.mark.parametrize("kind", ["symlink", "fifo", "devnull"])
def test_a_history_path_that_is_not_a_regular_file_is_never_touched(tmp_path, sim, daemon_factory, kind):
    db = tmp_path / "h.sqlite"
    target = tmp_path / "precious"
    target.write_text("keep me")
    os.chmod(target, 0o600)
    if kind == "symlink":
        db.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(db)
    else:
        db.symlink_to("/dev/null")
    mode_null = os.stat("/dev/null").st_mode
    d = daemon_factory(body(tmp_path))
    d.wait_log(r"history: cannot open .*h\.sqlite .*not a regular file")
    d.wait_running("w")  # the daemon goes on without history
    assert os.path.lexists(db) and not list(tmp_path.glob("h.sqlite.bad-*"))
    assert target.read_text() == "keep me" and os.stat(target).st_mode & 0o777 == 0o600
    assert os.stat("/dev/null").st_mode == mode_null
    r = report(d.config_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr


def test_an_elements_runs_are_named_as_jobs_names_it_and_an_earlier_daemons_row_is_renamed(tmp_path):
    """job_runs.job: 17 for a job, `17_5` for an array's element (the number of its own an earlier gpu-mon
    recorded is renamed when the run goes on or ends, not left open beside it)."""
    import dataclasses
    import queue

    from gpu_mon.api import summary
    from gpu_mon.queue.runs import JobRun

    ops: queue.SimpleQueue[tuple] = queue.SimpleQueue()
    w = history._Writer(HistorySection(path=str(tmp_path / "h.sqlite")), ops)
    assert w._open(time.time())
    t = time.time() - 60
    plain = JobRun(job=17, user="ann", name="a", gpus=("GPU-a",), submitted=t, start=t + 1, wait=1, restart=0)
    element = dataclasses.replace(plain, job=20, array_id=18, array_index=2, name="sweep")
    old = dataclasses.replace(element, job=21, array_index=3, start=t + 2)
    w.conn.execute(  # (as an earlier gpu-mon wrote an element's run: its own number)
        "INSERT INTO job_runs (job, user, name, gpus, submitted, start, end, how, wait, restart) "
        "VALUES (21, 'ann', 'sweep', 'GPU-a', ?, ?, ?, 'running', 0, 0)",
        (t, t + 2, t + 3),
    )
    for run in (plain, element, old):
        w._write([("job_start", history._job_key(run), run)])
    ended = [dataclasses.replace(r, end=t + 10, how="done") for r in (plain, element, old)]
    w._write([("job_end", history._job_key(r), r) for r in ended])
    rows = w.conn.execute("SELECT job, how FROM job_runs ORDER BY job").fetchall()
    assert len(rows) == 3 and set(rows) == {(17, "done"), ("18_2", "done"), ("18_3", "done")}
    found = summary.job_rows(historydb.job_runs(w.conn, t - 1, t + 100), t - 1, t + 100)
    assert [r["job"] for r in found] == [17, "18_2", "18_3"]
