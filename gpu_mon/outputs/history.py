"""History: a round listener that records what each round saw into the SQLite file of [history].

The loop's side only turns a round into a few small operations (a GPU's state changed, a workload started
or ended, a preemption, an idle-holder episode, a sample every `sample_seconds`) and queues them: no I/O on
the loop, so a slow disk can never delay a yield. A writer thread applies them every FLUSH_SECONDS in one
transaction, moving the end of every open row forward: a daemon killed at any moment loses at most that
last batch, and the database stays consistent. A file that is damaged or not ours is moved aside with one
log line and a new one started; a full disk (or any write error) is logged once and history pauses for
RETRY_SECONDS; retention runs at start and once a day.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from typing import Dict, List, Optional, Tuple

from gpu_mon.api import historydb
from gpu_mon.config import HistorySection
from gpu_mon.policy import gpustate
from gpu_mon.policy.report import RoundReport
from gpu_mon.queue import jobs as J
from gpu_mon.queue.runner import PREFIX as JOB_PREFIX
from gpu_mon.queue.runs import JobRun

log = logging.getLogger("gpu_mon")
FLUSH_SECONDS = 5.0
RETRY_SECONDS = 300.0
RETENTION_EVERY_SECONDS = 86400.0
_SKIPS_SAID = 5  # lines about records skipped (then none: each would be the same bug)
_MAX_QUEUED = 100_000  # operations; beyond this (a writer stuck for hours) they are dropped, and said so


class History:
    """Round listener: queues what changed; the writer thread writes it."""

    def __init__(self, settings: HistorySection):
        self.settings = settings
        self.queue: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self.sent_states: Dict[str, Tuple[str, str, str]] = {}
        self.known_gpus: Dict[str, Tuple[Optional[int], Optional[str]]] = {}
        self.runs: Dict[str, dict] = {}  # workload key -> what was sent of its run
        self.next_sample = 0.0
        self.dropped = False
        self.writer = _Writer(settings, self.queue)
        # Started by the first round, not here: a daemon that then fails to take its lock (another one
        # runs) must not touch the history at all.
        self.thread: Optional[threading.Thread] = None

    def _start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self.writer.run, name="history", daemon=True)
            self.thread.start()

    def _put(self, op: tuple) -> None:
        if self.queue.qsize() > _MAX_QUEUED:
            if not self.dropped:
                self.dropped = True
                log.warning("history: the writer is behind by %d operations; dropping new ones", _MAX_QUEUED)
            return
        self.queue.put(op)

    def on_round(self, report: RoundReport) -> None:
        """Queue what changed in this round."""
        self._start()
        wall = report.wall
        self._gpus(report)
        self._states(report, wall)
        self._runs(report, wall)
        self._job_runs(report)
        for p in report.preemptions:
            self._put(("preemption", p.wall, p.uuid, p.workload, p.who, p.detected_by, p.term_ms, p.gone_ms))
        self._slurm(report)
        for h in report.idle_started:
            since = wall - h.idle_seconds(report.snapshot.now)
            self._put(("idle_start", (h.pid, h.uuid), h.uuid, h.pid, h.user, h.program, h.memory_mib, since))
        for h in report.idle_ended:
            self._put(("idle_end", (h.pid, h.uuid), wall))
        if wall >= self.next_sample:
            self.next_sample = wall + self.settings.sample_seconds
            rows = [
                (g.uuid, g.memory_used_mib, g.utilization_pct) for g in report.snapshot.reading.gpus if g.uuid
            ]
            self._put(("samples", wall, rows))

    def _gpus(self, report: RoundReport) -> None:
        for g in report.snapshot.reading.gpus:
            if g.uuid and self.known_gpus.get(g.uuid) != (g.index, g.name):
                self.known_gpus[g.uuid] = (g.index, g.name)
                self._put(("gpu", g.uuid, g.index, g.name, report.wall))

    def _states(self, report: RoundReport, wall: float) -> None:
        uuids = [g.uuid for g in report.snapshot.reading.gpus if g.uuid] or list(self.known_gpus)
        states = gpustate.round_states(report.decision, report.workloads, uuids)
        users = _users_by_gpu(report, {u: st for u, (st, _d) in states.items()})
        for uuid, (state, detail) in states.items():
            now = (state, detail, users.get(uuid, ""))
            if self.sent_states.get(uuid) != now:
                self.sent_states[uuid] = now
                self._put(("state", uuid, *now, wall))

    def _slurm(self, report: RoundReport) -> None:
        """[slurm]: a preemptible Slurm job that Slurm requeued or cancelled at gpu-mon's request is a
        preemption (its time: from the wake that saw the use to the call's start)."""
        for a in report.slurm.actions if report.slurm is not None else ():  # type: ignore[attr-defined]
            if a.result == "ok" and a.action != "signal" and a.issued_ms is not None:
                what = f"Slurm job {a.job} ({a.user}, {a.partition or '?'}): {a.action}"
                self._put(("preemption", a.wall, a.gpu, what, a.by, a.seen_by, a.issued_ms, None))

    def _job_runs(self, report: RoundReport) -> None:
        """[queue]: each run of a job as it starts and ends."""
        queue = report.queue
        if queue is None:
            return
        for run in queue.started:  # type: ignore[attr-defined]
            self._put(("job_start", _job_key(run), run))
        for run in queue.ended:  # type: ignore[attr-defined]
            self._put(("job_end", _job_key(run), run))

    def _runs(self, report: RoundReport, wall: float) -> None:
        # (a queued job's run is a workload of the supervisor too: it is recorded by _job_runs)
        live = {w["key"]: w for w in report.workloads if not w["key"].startswith(JOB_PREFIX)}
        sections = {p.name: p for p in report.config.processes}
        for key, w in live.items():
            if key not in self.runs or self.runs[key]["pid"] != w["pid"]:
                process = key.split("@", 1)[0]
                user = sections[process].user if process in sections else ""
                self.runs[key] = {"pid": w["pid"]}
                start = wall - max(0.0, report.snapshot.now - w["started_at"])
                self._put(("run_start", key, process, w["label"], ",".join(w["gpus"]), user, start))
            self.runs[key]["why"] = w.get("stop_reason", "")
        for ex in report.snapshot.exited:
            sent = self.runs.pop(ex.key, None)
            if sent is not None:
                how = f"stopped: {sent['why']}" if ex.stopped_by_us else f"exited with status {ex.returncode}"
                self._put(("run_end", ex.key, wall - max(0.0, report.snapshot.now - ex.ended_at), how))

    def on_event(self, event: str) -> None:
        """`stopped`: write what is queued and close (a few seconds at most)."""
        if event == "stopped" and self.thread is not None:
            self.queue.put(("close", time.time()))
            self.thread.join(timeout=FLUSH_SECONDS + 5)

    def deadline(self) -> Optional[float]:
        """No timer: the writer has its own."""
        return None


def _users_by_gpu(report: RoundReport, state_of: Dict[str, str]) -> Dict[str, str]:
    """Who is on each GPU: the foreign holders' and NVML processes' users when someone else uses it, our
    workload's user when it harvests."""
    out: Dict[str, set] = {}
    for h in (*report.snapshot.holders, *report.snapshot.nvml_procs):
        for uuid in h.gpus:
            if not h.ours_on(uuid) and state_of.get(uuid) == "foreign":
                out.setdefault(uuid, set()).add(h.user)
    for f in report.snapshot.open_floods:  # (whether or not a scan found them holding it this time)
        if state_of.get(f.uuid) == "foreign":
            out.setdefault(f.uuid, set()).update(h.user for h in f.by)
    sections = {p.name: p.user for p in report.config.processes}
    for w in report.workloads:
        for uuid in w["gpus"]:
            if state_of.get(uuid) == "harvesting":
                out.setdefault(uuid, set()).add(sections.get(w["key"].split("@", 1)[0], ""))
    for run in report.queue.running if report.queue is not None else ():  # type: ignore[attr-defined]
        for uuid in run.gpus:
            if state_of.get(uuid) == "harvesting":
                out.setdefault(uuid, set()).add(run.user)
    return {u: ",".join(sorted(x for x in users if x)) for u, users in out.items()}


class _Writer:
    """Owns the connection; applies queued operations in batches. Runs in its own thread."""

    def __init__(self, settings: HistorySection, ops: queue.SimpleQueue[tuple]):
        self.settings, self.ops = settings, ops
        self.conn = None
        self.retry_at = 0.0
        self.next_retention = 0.0
        self.failed_said = False
        self.skipped = 0
        tables = ("intervals", "runs", "idle_holders", "job_runs")
        self.open: Dict[str, Dict[object, int]] = {t: {} for t in tables}
        self.current: Dict[str, Dict[object, tuple]] = {t: {} for t in tables}

    def run(self) -> None:
        """Until a `close` operation: gather a batch, write it. Never ends otherwise: an unexpected error is
        said once (until a batch is written again) and history pauses as for a write error."""
        self._open(time.time())  # at once: the file exists (and a problem is said) from the start
        closing = False
        while not closing:
            batch = self._gather()
            closing = any(op[0] == "close" for op in batch)
            try:
                self._write([cleaned(op) for op in batch if op[0] != "close"])
            except Exception as err:  # a bug must not silently end every later record
                self._failed(time.time(), err)
        if self.conn is not None:
            self.conn.close()

    def _gather(self) -> List[tuple]:
        batch: List[tuple] = []
        deadline = time.monotonic() + FLUSH_SECONDS
        while True:
            try:
                op = self.ops.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return batch
            batch.append(op)
            if op[0] == "close":
                return batch

    def _write(self, batch: List[tuple]) -> None:
        now = time.time()
        opened = self.conn is not None or self._open(now)  # (reopens what was open before a pause)
        for op in batch:
            self._remember(op)
        if not opened:
            return
        try:
            self.conn.execute("BEGIN")
            for op in batch:
                self._apply(op)
            self._extend_open(now)
            self.conn.execute("COMMIT")
            self._retention(now)
            self.failed_said = False
        except historydb.Error as err:
            self._failed(now, err)

    def _apply(self, op: tuple) -> None:
        """One operation; one that cannot be stored (not sqlite's error: the database is fine) is skipped,
        with one line (the first few of them)."""
        try:
            getattr(self, f"_op_{op[0]}")(op)
        except historydb.Error:
            raise
        except Exception as err:
            self.skipped += 1
            if self.skipped <= _SKIPS_SAID:
                more = " (no more such lines)" if self.skipped == _SKIPS_SAID else ""
                log.warning("history: skipped a %s record that cannot be stored: %r%s", op[0], err, more)

    def _open(self, now: float) -> bool:
        if now < self.retry_at:
            return False
        path = self.settings.path
        try:
            self.conn = historydb.connect_rw(path)
        except historydb.Unsafe as err:
            return self._cannot_open(now, err)
        except historydb.NotOurs as err:
            aside = historydb.move_aside(path, now)
            log.warning(
                "history: %s is unusable (%s): moved aside to %s; starting a new one", path, err, aside
            )
            try:
                self.conn = historydb.connect_rw(path)
            except (historydb.Error, historydb.NotOurs, OSError) as again:
                return self._cannot_open(now, again)
        except (historydb.Error, OSError) as err:
            return self._cannot_open(now, err)
        log.info("history: recording to %s", path)
        self._reopen_current(now)
        return True

    def _cannot_open(self, now: float, err: Exception) -> bool:
        self.conn, self.retry_at = None, now + RETRY_SECONDS
        if not self.failed_said:
            self.failed_said = True
            log.warning(
                "history: cannot open %s (%s); trying again every %.0f s",
                self.settings.path,
                getattr(err, "strerror", None) or err,
                RETRY_SECONDS,
            )
        return False

    def _failed(self, now: float, err: Exception) -> None:
        if not self.failed_said:
            self.failed_said = True
            log.warning(
                "history: cannot write %s (%s); paused, trying again in %.0f s",
                self.settings.path,
                err,
                RETRY_SECONDS,
            )
        if self.conn is not None:
            with contextlib.suppress(historydb.Error):
                self.conn.execute("ROLLBACK")
            self.conn.close()
        self.conn, self.retry_at = None, now + RETRY_SECONDS
        for rows in self.open.values():
            rows.clear()

    def _retention(self, now: float) -> None:
        if now < self.next_retention:
            return
        self.next_retention = now + RETENTION_EVERY_SECONDS
        gone = historydb.retain(self.conn, now - self.settings.retention_days * 86400)
        if gone:
            log.info("history: removed %d rows older than %g days", gone, self.settings.retention_days)

    # What is open now, so that a reopened database (after a pause) starts those rows again.
    def _remember(self, op: tuple) -> None:
        kind = op[0]
        if kind == "state":
            self.current["intervals"][op[1]] = op
        elif kind == "run_start":
            self.current["runs"][op[1]] = op
        elif kind == "run_end":
            self.current["runs"].pop(op[1], None)
        elif kind == "idle_start":
            self.current["idle_holders"][op[1]] = op
        elif kind == "idle_end":
            self.current["idle_holders"].pop(op[1], None)
        elif kind == "job_start":
            self.current["job_runs"][op[1]] = op
        elif kind == "job_end":
            self.current["job_runs"].pop(op[1], None)

    def _reopen_current(self, now: float) -> None:
        try:
            self.conn.execute("BEGIN")
            openers = {
                "intervals": self._op_state,
                "runs": self._op_run_start,
                "idle_holders": self._op_idle_start,
            }
            for table, opener in openers.items():
                for op in list(self.current[table].values()):
                    opener((*op[:-1], now))
            for op in list(self.current["job_runs"].values()):
                self._op_job_start(op)  # (the same row: a run is its job and start)
            self.conn.execute("COMMIT")
        except historydb.Error as err:
            self._failed(now, err)

    def _extend_open(self, now: float) -> None:
        for table, rows in self.open.items():
            if rows:
                marks = ",".join("?" * len(rows))
                self.conn.execute(f"UPDATE {table} SET end = ? WHERE id IN ({marks})", (now, *rows.values()))

    def _close_row(self, table: str, key: object, end: float) -> None:
        row = self.open[table].pop(key, None)
        if row is not None:
            self.conn.execute(f"UPDATE {table} SET end = ? WHERE id = ?", (end, row))

    def _op_gpu(self, op: tuple) -> None:
        _, uuid, index, name, wall = op
        self.conn.execute(
            "INSERT OR REPLACE INTO gpus (uuid, idx, name, last_seen) VALUES (?, ?, ?, ?)",
            (uuid, index, name, wall),
        )

    def _op_state(self, op: tuple) -> None:
        _, uuid, state, detail, users, wall = op
        self._close_row("intervals", uuid, wall)
        cur = self.conn.execute(
            "INSERT INTO intervals (uuid, state, detail, users, start, end) VALUES (?, ?, ?, ?, ?, ?)",
            (uuid, state, detail, users, wall, wall),
        )
        self.open["intervals"][uuid] = cur.lastrowid

    def _op_run_start(self, op: tuple) -> None:
        _, key, process, label, gpus, user, start = op
        self._close_row("runs", key, start)
        cur = self.conn.execute(
            "INSERT INTO runs (process, label, gpus, user, start, end) VALUES (?, ?, ?, ?, ?, ?)",
            (process, label, gpus, user, start, start),
        )
        self.open["runs"][key] = cur.lastrowid

    def _op_run_end(self, op: tuple) -> None:
        _, key, end, how = op
        row = self.open["runs"].pop(key, None)
        if row is not None:
            self.conn.execute("UPDATE runs SET end = ?, how = ? WHERE id = ?", (end, how, row))

    def _op_preemption(self, op: tuple) -> None:
        self.conn.execute(
            "INSERT INTO preemptions (time, uuid, workload, who, detected_by, term_ms, gone_ms) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            op[1:],
        )

    def _op_idle_start(self, op: tuple) -> None:
        _, key, uuid, pid, user, program, memory, since = op
        cur = self.conn.execute(
            "INSERT INTO idle_holders (uuid, pid, user, program, memory_mib, start, end) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (uuid, pid, user, program, memory, since, since),
        )
        self.open["idle_holders"][key] = cur.lastrowid

    def _op_idle_end(self, op: tuple) -> None:
        self._close_row("idle_holders", op[1], op[2])

    def _op_samples(self, op: tuple) -> None:
        _, wall, rows = op
        historydb.insert_many(
            self.conn,
            "INSERT INTO samples (time, uuid, memory_used_mib, utilization_pct) VALUES (?, ?, ?, ?)",
            [(wall, *row) for row in rows],
        )

    def _renamed(self, key: tuple, run: JobRun) -> None:
        """An element's run an earlier gpu-mon recorded under the element's own number: named as now."""
        if run.array_id:
            self.conn.execute(
                "UPDATE OR IGNORE job_runs SET job = ? WHERE job = ? AND submitted = ? AND start = ?",
                (*key[:1], run.job, *key[1:]),
            )

    def _op_job_start(self, op: tuple) -> None:
        _, key, run = op
        self._renamed(key, run)
        self.conn.execute(
            "INSERT INTO job_runs (job, user, name, gpus, submitted, start, end, how, wait, restart) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, 'running', ?, ?) "
            "ON CONFLICT (job, submitted, start) DO UPDATE SET how = 'running'",
            (*_job_run(run), run.start, run.wait, run.restart),
        )
        row = self.conn.execute(
            "SELECT id FROM job_runs WHERE job = ? AND submitted = ? AND start = ?", key
        ).fetchone()
        self.open["job_runs"][key] = row[0]

    def _op_job_end(self, op: tuple) -> None:
        """The run's end (None: an earlier daemon's run, gone with it: its last recorded end stays)."""
        _, key, run = op
        self.open["job_runs"].pop(key, None)
        self._renamed(key, run)
        self.conn.execute(
            "INSERT INTO job_runs (job, user, name, gpus, submitted, start, end, how, wait, restart, "
            "preempted_by, energy_mj) VALUES (?, ?, ?, ?, ?, ?, COALESCE(?, ?), ?, ?, ?, ?, ?) "
            "ON CONFLICT (job, submitted, start) DO UPDATE SET end = COALESCE(?, end), how = excluded.how, "
            "preempted_by = excluded.preempted_by, energy_mj = excluded.energy_mj",
            (
                *_job_run(run),
                run.end,
                run.start,
                run.how,
                run.wait,
                run.restart,
                run.preempted_by,
                run.energy_mj,
                run.end,
            ),
        )


def storable(text: str) -> str:
    """Text SQLite can store (UTF-8): a name that is not UTF-8 (a file name's bytes, which Python holds as
    lone surrogates) keeps its bytes as `\\xff` escapes; any other lone surrogate as `\\ud800`."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def cleaned(value: object) -> object:
    """An operation with every text in it storable (tuples, lists and a JobRun's fields looked into)."""
    if isinstance(value, str):
        return storable(value)
    if isinstance(value, (tuple, list)):
        return type(value)(cleaned(v) for v in value)
    if isinstance(value, JobRun):
        fields = {f.name: cleaned(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **fields)
    return value


def _job_run(run: JobRun) -> tuple:
    """(job, user, name, gpus, submitted, start) of a run, as the job_runs table has them."""
    return (_job_key(run)[0], run.user, run.name, ",".join(run.gpus), run.submitted, run.start)


def _job_key(run: JobRun) -> tuple:
    """(job, submitted, start): a run's key in job_runs. Its job as people name it, as `jobs` does: a job's
    id (SQLite keeps `17` as the integer), an array's element `17_5` (text, in the same INTEGER column: a
    history before this kept the element's own number), so `report` names it as every listing does."""
    return (J.shown(run.job, run.array_id, run.array_index), run.submitted, run.start)
