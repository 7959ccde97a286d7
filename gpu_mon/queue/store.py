"""The queue's database: an embedded SQLite file (WAL, synchronous=FULL: a write is on disk when it returns)
and an in-memory copy of every job that reads use. Every change is committed before it is acknowledged.

One table, `jobs`: the columns reads would filter on (user, state, times) and the whole job as JSON; and
`queue_state`, the queue's own settings as key and JSON value (`drained`: who drained it, when). The
file carries its own application id and schema version; a damaged or foreign file is moved aside (one log
line) and a new one started. Thread-safe: the socket server and the daemon's loop both write.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from gpu_mon.api import historydb
from gpu_mon.queue import jobs as J
from gpu_mon.queue.jobs import Job

log = logging.getLogger("gpu_mon")

SCHEMA_VERSION = 1
APPLICATION_ID = 0x67706D71  # "gpmq": marks the file as gpu-mon's queue
_SCHEMA_V1 = """
CREATE TABLE schema_version (version INTEGER NOT NULL);
CREATE TABLE jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT, user TEXT NOT NULL, state TEXT NOT NULL,
    submitted REAL NOT NULL, ended REAL, data TEXT NOT NULL);
CREATE INDEX jobs_by_state ON jobs (state);
CREATE INDEX jobs_by_user_state ON jobs (user, state);
"""
# Added to schema 1 without a new version: an older gpu-mon ignores a table it does not know (a new version
# would make it move the whole queue aside), and this one makes the table where it is missing.
_QUEUE_STATE = "CREATE TABLE IF NOT EXISTS queue_state (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
_TUPLES = ("command", "after", "gpus", "after_arrays", "notify")


class NotOurs(Exception):
    """The file is not a usable gpu-mon queue; str() says how."""


@dataclass(frozen=True)
class Drained:
    """The queue is drained (`gpu-mon queue drain`): no job starts; by whom (a user name), when (wall)."""

    by: str
    at: float


class Refused(Exception):
    """A change the store will not make (a limit); str() is one line for the user."""


def _to_row(job: Job) -> str:
    data = dataclasses.asdict(job)
    data.pop("id")
    data["env"] = dict(job.env)
    return json.dumps(data, separators=(",", ":"))


def _from_row(job_id: int, text: str) -> Job:
    data = json.loads(text)
    for key in _TUPLES:
        data[key] = tuple(data.get(key) or ())
    data["env"] = tuple((str(k), str(v)) for k, v in (data.get("env") or {}).items())
    known = {f.name for f in dataclasses.fields(Job)}
    return Job(id=job_id, **{k: v for k, v in data.items() if k in known})


def _connect(path: str):
    """Open (creating, root's alone: it holds the jobs' environments) and check the file; NotOurs when it is
    damaged, foreign or newer."""
    try:
        conn = historydb.open_own(path, APPLICATION_ID, "queue", 0o600, "FULL")
    except historydb.NotOurs as err:
        raise NotOurs(str(err)) from None
    try:
        _migrate(conn)
    except (historydb.Error, NotOurs) as err:
        conn.close()
        raise NotOurs(str(err)) from None
    return conn


def _migrate(conn) -> None:
    has = conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='schema_version'").fetchone()
    row = conn.execute("SELECT version FROM schema_version").fetchone() if has else None
    current = int(row[0]) if row else 0
    if current > SCHEMA_VERSION:
        raise NotOurs(f"written by a newer gpu-mon (schema {current}; this one knows {SCHEMA_VERSION})")
    if current == 0:
        conn.executescript(f"BEGIN; {_SCHEMA_V1} INSERT INTO schema_version VALUES (1); COMMIT;")
    conn.execute(_QUEUE_STATE)


def _drained(conn) -> Optional[Drained]:
    """The drain an earlier daemon left, or None. A value that cannot be read still drains (by `?`): an
    admin asked for no starts, and starting jobs on a guess would not be what they asked."""
    row = conn.execute("SELECT value FROM queue_state WHERE key = 'drained'").fetchone()
    if row is None:
        return None
    try:
        data = json.loads(row[0])
        return Drained(str(data["by"]), float(data["at"]))
    except (ValueError, TypeError, KeyError):
        return Drained("?", 0.0)


class Store:
    """The queue's jobs, on disk and in memory."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.jobs: Dict[int, Job] = {}
        self.version = 0  # raised on every change (the daemon re-places jobs when it moves)
        # Kept as jobs change, so that a submit never counts through a long queue: unfinished jobs per
        # user, and queued jobs.
        self._unfinished: Dict[str, int] = {}
        self._queued = 0
        self.arrays: Dict[int, Dict[int, int]] = {}  # array id -> index -> the element's job id
        for job_id, text in conn.execute("SELECT id, data FROM jobs ORDER BY id"):
            job = self.jobs[job_id] = _from_row(job_id, text)
            self._tally(job, 1)
            if job.array_id:
                self.arrays.setdefault(job.array_id, {})[job.array_index] = job_id
        self.drained = _drained(conn)

    def _tally(self, job: Job, sign: int) -> None:
        if job.state not in J.ENDED:
            self._unfinished[job.user] = self._unfinished.get(job.user, 0) + sign
        if job.state == J.QUEUED:
            self._queued += sign

    @classmethod
    def open(cls, path: str, now: float) -> Store:
        """Open the database; a damaged or foreign file is moved aside with one log line."""
        try:
            return cls(_connect(path))
        except NotOurs as err:
            aside = historydb.move_aside(path, now)
            log.warning(
                "queue: %s is unusable (%s): moved aside to %s; starting an empty queue", path, err, aside
            )
            return cls(_connect(path))

    def close(self) -> None:
        """Close the database."""
        with self.lock:
            self.conn.close()

    # ------------------------------------------------------------------ reads (from memory)

    def all(self) -> List[Job]:
        """Every job, in submission order."""
        with self.lock:
            return list(self.jobs.values())

    def get(self, job_id: int) -> Optional[Job]:
        """One job, or None."""
        with self.lock:
            return self.jobs.get(job_id)

    def elements(self, array_id: int) -> List[Job]:
        """An array's elements, by index (empty: no such array)."""
        with self.lock:
            members = self.arrays.get(array_id, {})
            return [self.jobs[members[i]] for i in sorted(members)]

    def element(self, array_id: int, index: int) -> Optional[Job]:
        """One element of an array, or None."""
        with self.lock:
            job_id = self.arrays.get(array_id, {}).get(index)
            return self.jobs.get(job_id) if job_id is not None else None

    def unfinished(self, user: str) -> int:
        """How many of this user's jobs have not ended."""
        with self.lock:
            return self._unfinished.get(user, 0)

    # ------------------------------------------------------------------ writes (committed before they return)

    def drain(self, drained: Optional[Drained]) -> None:
        """Drain the queue (no job starts) or, with None, resume it; on disk before it returns."""
        with self.lock:
            if drained is None:
                self.conn.execute("DELETE FROM queue_state WHERE key = 'drained'")
            else:
                value = json.dumps({"by": drained.by, "at": drained.at})
                self.conn.execute("INSERT OR REPLACE INTO queue_state VALUES ('drained', ?)", (value,))
            self.drained = drained
            self.version += 1

    def submit(self, job: Job, max_unfinished: int) -> Tuple[Job, int]:
        """Add a job (its id is given here); return it and how many queued jobs are ahead of it.
        Refused when the user already has `max_unfinished` jobs that have not ended."""
        with self.lock:
            mine = self._unfinished.get(job.user, 0)
            if mine >= max_unfinished:
                raise Refused(f"{job.user} already has {mine} unfinished jobs (limit {max_unfinished})")
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                cur = self.conn.execute(
                    "INSERT INTO jobs (user, state, submitted, ended, data) VALUES (?, ?, ?, ?, ?)",
                    (job.user, job.state, job.submitted, job.ended, _to_row(job)),
                )
                self.conn.execute("COMMIT")
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            job = dataclasses.replace(job, id=int(cur.lastrowid))
            ahead = self._queued
            self.jobs[job.id] = job
            self._tally(job, 1)
            self.version += 1
            return job, ahead

    def submit_array(self, job: Job, indices: Sequence[int], max_unfinished: int) -> Tuple[Job, int]:
        """Add an array: one element (a job) per index, all in one transaction, with consecutive ids; the
        array's id is its first element's. Return the first element and how many queued jobs are ahead.
        Refused (nothing added) when the elements would take the user over `max_unfinished`."""
        with self.lock:
            mine = self._unfinished.get(job.user, 0)
            if mine + len(indices) > max_unfinished:
                raise Refused(
                    f"{job.user} has {mine} unfinished jobs; {len(indices)} more would pass the limit "
                    f"of {max_unfinished} ([queue] max_queued_per_user)"
                )
            first = self._next_id()
            base = dataclasses.replace(job, id=first, array_id=first, array_index=0)
            # One encoding of the whole job; each element's row is it with its own index (written last)
            data = json.loads(_to_row(base))
            data.pop("array_index")
            head = json.dumps(data, separators=(",", ":"))[:-1] + ',"array_index":'
            rows = [
                (first + k, job.user, job.state, job.submitted, job.ended, f"{head}{i}}}")
                for k, i in enumerate(indices)
            ]
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                self.conn.executemany(
                    "INSERT INTO jobs (id, user, state, submitted, ended, data) VALUES (?, ?, ?, ?, ?, ?)",
                    rows,
                )
                self.conn.execute("COMMIT")
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            ahead = self._queued
            members = self.arrays[first] = {}
            for k, i in enumerate(indices):
                self.jobs[first + k] = J.element(base, first + k, i)
                members[i] = first + k
            self._unfinished[job.user] = mine + (0 if job.state in J.ENDED else len(indices))
            if job.state == J.QUEUED:
                self._queued += len(indices)
            self.version += 1
            return self.jobs[first], ahead

    def _next_id(self) -> int:
        """The id the next insert would get (AUTOINCREMENT: never one used before, even if pruned)."""
        seq = self.conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'jobs'").fetchone()
        top = self.conn.execute("SELECT max(id) FROM jobs").fetchone()
        return max(int(seq[0]) if seq else 0, int(top[0] or 0) if top else 0) + 1

    def prune(self, before: float, batch: int = 500) -> int:
        """Remove the jobs that ended before `before` (wall time), but not one an unfinished job waits on
        (`--after`); how many. A few hundred a transaction: the lock is never held long (the daemon's
        round reads the store). Ids are never reused."""
        removed = 0
        while True:
            with self.lock:
                live = [j for j in self.jobs.values() if j.state not in J.ENDED]
                needed = {a for j in live for a in j.after}
                arrays = {a for j in live for a in j.after_arrays}  # (and its live elements keep an array)
                arrays.update(j.array_id for j in live if j.array_id)
                old = [
                    i
                    for i, j in self.jobs.items()
                    if j.state in J.ENDED
                    and j.ended is not None
                    and j.ended < before
                    and i not in needed
                    and j.array_id not in arrays
                ][:batch]
                if not old:
                    return removed
                self.conn.execute("BEGIN IMMEDIATE")
                try:
                    self.conn.executemany("DELETE FROM jobs WHERE id = ?", [(i,) for i in old])
                    self.conn.execute("COMMIT")
                except BaseException:
                    self.conn.execute("ROLLBACK")
                    raise
                for i in old:
                    gone = self.jobs.pop(i)
                    if gone.array_id:
                        members = self.arrays.get(gone.array_id, {})
                        members.pop(gone.array_index, None)
                        if not members:
                            self.arrays.pop(gone.array_id, None)
                self.version += 1
                removed += len(old)

    def change(self, job_id: int, edit: Callable[[Job], Optional[Job]]) -> Optional[Job]:
        """Apply `edit` to the job as it is now and write the result; None when there is no such job or
        `edit` changes nothing (returns None or the job itself). An exception from `edit` writes nothing."""
        return self.change_many([(job_id, edit)])[0]

    def change_many(self, edits: Iterable[Tuple[int, Callable[[Job], Optional[Job]]]]) -> List[Optional[Job]]:
        """Several `change`s in one transaction (each edit sees the job as it is now, so a change made by
        another thread in between is never overwritten with an old copy)."""
        with self.lock:
            out: List[Optional[Job]] = []
            for job_id, edit in edits:
                current = self.jobs.get(job_id)
                new = edit(current) if current is not None else None
                out.append(None if new is None or new is current else new)
            changed = [j for j in out if j is not None]
            if not changed:
                return out
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                self.conn.executemany(
                    "UPDATE jobs SET state = ?, ended = ?, data = ? WHERE id = ?",
                    [(j.state, j.ended, _to_row(j), j.id) for j in changed],
                )
                self.conn.execute("COMMIT")
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            for j in changed:
                self._tally(self.jobs[j.id], -1)
                self.jobs[j.id] = j
                self._tally(j, 1)
            self.version += 1
            return out
