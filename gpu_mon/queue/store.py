"""The queue's database: an embedded SQLite file (WAL, synchronous=FULL: a write is on disk when it returns)
and an in-memory copy of every job that reads use. Every change is committed before it is acknowledged
(but see below: a full disk).

Tables: `jobs`, the columns reads would filter on (user, state, times) and the job as JSON; `arrays`, an
array as submitted, once (its elements' rows hold their array's id and index until they change: rows.py);
`queue_state`, the queue's own settings as key and JSON value (`drained`: who drained it, when); and
`runs` (schema 3), each run of a job as runrecords.py writes it when it starts and ends, read only by
`show`. In
memory too an element as submitted is its id (jobs.array_class) and its array's index -> id is the array's
indices (arrays.Members): five held 10 000-element arrays take 10 MB of the daemon's memory, not 110.
The file carries its own application id and schema version; a damaged or foreign file is moved aside (one
log line) and a new one started.
Thread-safe: the socket server and the daemon's loop both write.

What one user may keep is bounded (`Limits`): jobs, finished ones included, and the bytes of their rows; a
submit over either removes that user's oldest finished jobs first, and is refused when that is not enough.
A write that fails (a full disk) refuses a submit, but a change of a job's state is kept in memory and
written with the next write that works (`flush`): the daemon goes on with what it knows.

A job's start (`durable=False`) is committed without waiting for the disk (synchronous=NORMAL: in the
WAL, which outlives gpu-mon's crash but not the machine's): it is on the start's path, where one fsync
took 280 ms on a VM's shared disk, and a start lost with the machine changes nothing (its processes are
gone too: the job runs again, as a requeued one would). The next durable commit (an end, a submit) puts
it on disk first, so a job's end is never on disk without its start.

The write-ahead log is truncated after a durable commit that leaves it over historydb.WAL_BYTES (a prune,
a cancel of many big jobs; never on a start's path), so what one user makes root store stays near their cap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, MutableMapping, Optional, Sequence, Set, Tuple, Type

from gpu_mon.api import historydb
from gpu_mon.queue import arrays, rows
from gpu_mon.queue import jobs as J
from gpu_mon.queue.arrays import Members
from gpu_mon.queue.jobs import Job

log = logging.getLogger("gpu_mon")

SCHEMA_VERSION = 3
APPLICATION_ID = 0x67706D71  # "gpmq": marks the file as gpu-mon's queue
_SCHEMA_V1 = """
CREATE TABLE schema_version (version INTEGER NOT NULL);
CREATE TABLE jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT, user TEXT NOT NULL, state TEXT NOT NULL,
    submitted REAL NOT NULL, ended REAL, data TEXT NOT NULL);
"""
# Indexes that schema 1 made and nothing reads (every read is from memory): each row written paid for
# them (5 ms of a 10 000-element array's submit). Dropped where found; no new version: an older gpu-mon
# reads the same tables without them.
_UNREAD_INDEXES = ("jobs_by_state", "jobs_by_user_state")
# Added to schema 1 without a new version: an older gpu-mon ignores a table it does not know (a new version
# would make it move the whole queue aside), and this one makes the table where it is missing.
_QUEUE_STATE = "CREATE TABLE IF NOT EXISTS queue_state (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
# 2: an array's shared part once (an older gpu-mon would read its elements without a command: it moves the
# file aside instead, as it does any newer one)
_SCHEMA_V2 = "CREATE TABLE arrays (id INTEGER PRIMARY KEY, data TEXT NOT NULL);"
# 3: each run of a job, written when it starts and when it ends (runrecords.py): its GPUs, how it ended,
# NVML's energy counters at its start and end. Keyed by the job and the run's start (wall), removed with
# the job. Nothing keeps them in memory: `show` reads one job's rows.
_SCHEMA_V3 = """CREATE TABLE runs (
    job INTEGER NOT NULL, start REAL NOT NULL, end REAL, how TEXT NOT NULL, data TEXT NOT NULL,
    PRIMARY KEY (job, start));"""
# SQLite's page cache, KiB (its default: 2000): reads are from memory (the file is read whole once, at
# start), so the cache only holds the pages a write changes; 2 MB of the daemon's memory for nothing.
CACHE_KIB = 200


SYNCHRONOUS = "FULL"  # every write on disk before it returns (but a start's: _transaction)


class NotOurs(Exception):
    """The file is not a usable gpu-mon queue; str() says how."""


@dataclass(frozen=True)
class Drained:
    """The queue is drained (`gpu-mon queue drain`): no job starts; by whom (a user name), when (wall)."""

    by: str
    at: float


# An array's elements as submitted, indices `start + k * step` for k below `count`: their rows are
# rows.element_row's (the test of arrays checks that they read back as that makes them)
_ELEMENTS = """INSERT INTO jobs (id, user, state, submitted, ended, data)
WITH RECURSIVE k(k) AS (SELECT 0 UNION ALL SELECT k + 1 FROM k WHERE k + 1 < :count)
SELECT :first + k, :user, :state, :submitted, NULL,
    '{"array_id":' || :first || ',"array_index":' || (:start + k * :step) || '}' FROM k"""


def _as_submitted(job: Job) -> int:
    """The bytes of an element's row as submitted (rows.element_row); -1 for a job not in an array."""
    return len(rows.element_row(job.array_id, job.array_index)) if job.array_id else -1


class Refused(Exception):
    """A change the store will not make (a limit); str() is one line for the user."""


def _connect(path: str):
    """Open (creating, root's alone: it holds the jobs' environments) and check the file; NotOurs when it is
    damaged, foreign or newer."""
    try:
        conn = historydb.open_own(path, APPLICATION_ID, "queue", 0o600, SYNCHRONOUS)
    except historydb.NotOurs as err:
        raise NotOurs(str(err)) from None
    try:
        _migrate(conn)
        conn.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
    except historydb.OperationalError:  # (a full disk, a lock: the file is not damaged for it)
        conn.close()
        raise
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
        conn.executescript(
            f"BEGIN; {_SCHEMA_V1} {_SCHEMA_V2} {_SCHEMA_V3} INSERT INTO schema_version VALUES (3); COMMIT;"
        )
    elif current < SCHEMA_VERSION:
        steps = {2: _SCHEMA_V2, 3: _SCHEMA_V3}
        for target in range(current + 1, SCHEMA_VERSION + 1):
            bump = f"UPDATE schema_version SET version = {target}"
            conn.executescript(f"BEGIN; {steps[target]} {bump}; COMMIT;")
    conn.execute(_QUEUE_STATE)
    for index in _UNREAD_INDEXES:
        conn.execute(f"DROP INDEX IF EXISTS {index}")


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


MIB = 1024 * 1024
RETRY_SECONDS = 1.0  # between two tries of the changes a failed write left in memory (flush)


@dataclass(frozen=True)
class Limits:
    """What one user may have in the store (0: no limit): unfinished jobs; jobs kept, finished ones
    included; and the bytes of their rows (an array's shared part counted once)."""

    unfinished: int
    kept: int = 0
    stored_bytes: int = 0


def _full(err: BaseException) -> bool:
    """The write failed for want of space."""
    if isinstance(err, OSError):
        return err.errno == errno.ENOSPC
    code = getattr(err, "sqlite_errorcode", None)
    return code == 13 or "disk is full" in str(err)  # SQLITE_FULL


class Store:
    """The queue's jobs, on disk and in memory."""

    def __init__(self, conn, path: str = "") -> None:
        self.conn, self.path = conn, path
        self.lock = threading.Lock()
        self.jobs: Dict[int, Job] = {}
        self.version = 0  # raised on every change (the daemon re-places jobs when it moves)
        self._not_durable = False  # the connection was left at synchronous=NORMAL (_transaction)
        # Kept as jobs change, so that a submit never counts through a long queue: unfinished jobs per
        # user, queued jobs, each user's jobs and their rows' bytes.
        self._unfinished: Dict[str, int] = {}
        self._queued = 0
        self._kept: Dict[str, int] = {}
        self._bytes: Dict[str, int] = {}
        self._size: Dict[int, int] = {}  # job id -> its row's bytes (not an element's as submitted: _size_of)
        self._array_size: Dict[int, int] = {}  # array id -> its shared row's bytes (arrays stored so)
        # array id -> index -> the element's job id (arrays.Members: nothing kept per element)
        self.arrays: Dict[int, MutableMapping[int, int]] = {}
        self.unwritten: Dict[int, str] = {}  # job id -> its row, changed in memory but not on disk yet
        self.failing: Optional[str] = None  # why writes fail now (None: they work)
        self._retry_at = 0.0
        self._load()
        self.drained = _drained(conn)

    def _load(self) -> None:
        classes: Dict[int, Type[Job]] = {}
        for array_id, text in self.conn.execute("SELECT id, data FROM arrays"):
            classes[array_id] = rows.array_class(text)
            self._array_size[array_id] = len(text)
        kept_whole: List[Members] = []  # (their elements removed since: once every row is read)
        one_by_one: Dict[int, Dict[int, int]] = {}  # the arrays that keep no indices (an older gpu-mon's)
        for job_id, text in self.conn.execute("SELECT id, data FROM jobs ORDER BY id"):
            job = self.jobs[job_id] = rows.from_row(job_id, text, classes)
            self._tally(job, 1)
            self._weigh(job, len(text), 1)
            if not job.array_id:
                continue
            if job.array_id not in self.arrays and job.array_id not in one_by_one:
                self._bytes[job.user] += self._array_size.get(job.array_id, 0)
                order = J.indices_of(classes[job.array_id]) if job.array_id in classes else None
                if order is None:
                    one_by_one[job.array_id] = {}
                else:
                    kept_whole.append(Members(job.array_id, order))
                    self.arrays[job.array_id] = kept_whole[-1]
            if job.array_id in one_by_one:
                one_by_one[job.array_id][job.array_index] = job_id
        for members in kept_whole:
            ids = range(members.first, members.first + len(members.order))
            members.gone.update(i for i, j in zip(members.order, ids) if j not in self.jobs)
        self.arrays.update(one_by_one)

    def _tally(self, job: Job, sign: int) -> None:
        if job.state not in J.ENDED:
            self._unfinished[job.user] = self._unfinished.get(job.user, 0) + sign
        if job.state == J.QUEUED:
            self._queued += sign

    def _weigh(self, job: Job, size: int, sign: int) -> None:
        """Count a job (sign 1) or no longer (-1) among its user's kept jobs and bytes."""
        self._kept[job.user] = self._kept.get(job.user, 0) + sign
        self._bytes[job.user] = self._bytes.get(job.user, 0) + sign * size
        if sign > 0 and size != _as_submitted(job):
            self._size[job.id] = size
        else:
            self._size.pop(job.id, None)

    def _size_of(self, job: Job) -> int:
        """The bytes of a job's row (an element's as submitted is not kept: its length is known)."""
        size = self._size.get(job.id)
        return _as_submitted(job) if size is None else size

    @classmethod
    def open(cls, path: str, now: float) -> Store:
        """Open the database; a damaged or foreign file is moved aside with one log line."""
        try:
            return cls(_connect(path), path)
        except NotOurs as err:
            aside = historydb.move_aside(path, now)
            log.warning(
                "queue: %s is unusable (%s): moved aside to %s; starting an empty queue", path, err, aside
            )
            return cls(_connect(path), path)

    def close(self) -> None:
        """Close the database (what could not be written is tried once more)."""
        with self.lock:
            self._flush()
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

    def kept(self, user: str) -> Tuple[int, int]:
        """How many of this user's jobs the store keeps, and their rows' bytes."""
        with self.lock:
            return self._kept.get(user, 0), self._bytes.get(user, 0)

    # ------------------------------------------------------------------ writes (committed before they return)

    def _transaction(self, work: Callable[[], object], durable: bool = True) -> object:
        """`work` in one transaction: committed (on disk when `durable`), or rolled back and raised."""
        if durable:
            if self._not_durable:  # (a reset that failed: never a durable write that is not)
                self.conn.execute(f"PRAGMA synchronous={SYNCHRONOUS}")
                self._not_durable = False
            out = self._committed(work)
            self._trim()
            return out
        self._not_durable = True
        self.conn.execute("PRAGMA synchronous=NORMAL")
        try:
            return self._committed(work)
        finally:  # (outside any transaction here: _committed rolled back what failed)
            with contextlib.suppress(historydb.Error):
                self.conn.execute(f"PRAGMA synchronous={SYNCHRONOUS}")
                self._not_durable = False

    def _trim(self) -> None:
        """Truncate a WAL that one transaction made big (see the module's text); a failure changes nothing
        that was committed, and the next durable commit tries again."""
        with contextlib.suppress(historydb.Error):
            historydb.trim_wal(self.conn, self.path)

    def _committed(self, work: Callable[[], object]) -> object:
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            out = work()
            self.conn.execute("COMMIT")
        except BaseException:
            if self.conn.in_transaction:
                with contextlib.suppress(historydb.Error):  # (sqlite rolls back itself on some errors)
                    self.conn.execute("ROLLBACK")
            raise
        return out

    def _cannot_store(self, err: BaseException) -> Refused:
        where = os.path.dirname(self.path) or "."
        if _full(err):
            return Refused(f"cannot store the job: no space left on the device of {where}: nothing queued")
        return Refused(f"cannot store the job in {self.path}: {err}: nothing queued")

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

    def submit(self, job: Job, max_unfinished: int, limits: Optional[Limits] = None) -> Tuple[Job, int]:
        """Add a job (its id is given here); return it and how many queued jobs are ahead of it.
        Refused when the user already has `max_unfinished` jobs that have not ended, when it would pass
        `limits` once that user's oldest finished jobs are removed, or when it cannot be written."""
        limits = limits or Limits(max_unfinished)
        with self.lock:
            mine = self._unfinished.get(job.user, 0)
            if mine >= max_unfinished:
                raise Refused(f"{job.user} already has {mine} unfinished jobs (limit {max_unfinished})")
            text = rows.to_row(job)
            self._make_room(job.user, 1, len(text), limits)

            def insert() -> int:
                cur = self.conn.execute(
                    "INSERT INTO jobs (user, state, submitted, ended, data) VALUES (?, ?, ?, ?, ?)",
                    (job.user, job.state, job.submitted, job.ended, text),
                )
                return int(cur.lastrowid)

            try:
                job = dataclasses.replace(job, id=self._transaction(insert))
            except (historydb.Error, OSError) as err:
                raise self._cannot_store(err) from None
            ahead = self._queued
            self.jobs[job.id] = job
            self._tally(job, 1)
            self._weigh(job, len(text), 1)
            self.version += 1
            return job, ahead

    def submit_array(
        self, job: Job, indices: Sequence[int], max_unfinished: int, limits: Optional[Limits] = None
    ) -> Tuple[Job, int]:
        """Add an array: one element (a job) per index, all in one transaction, with consecutive ids; the
        array's id is its first element's; what the elements have alike is stored once. Return the first
        element and how many queued jobs are ahead. Refused (nothing added) when the elements would take
        the user over `max_unfinished` or `limits` (as `submit`), or cannot be written."""
        limits = limits or Limits(max_unfinished)
        with self.lock:
            mine = self._unfinished.get(job.user, 0)
            if mine + len(indices) > max_unfinished:
                raise Refused(
                    f"{job.user} has {mine} unfinished jobs; {len(indices)} more would pass the limit "
                    f"of {max_unfinished} ([queue] max_queued_per_user)"
                )
            first = self._next_id()
            base = dataclasses.replace(job, id=first, array_id=first, array_index=0)
            order = arrays.as_range(indices) or tuple(indices)
            shared = rows.array_row(base, order)
            size = rows.element_rows_bytes(first, order)
            self._make_room(job.user, len(order), len(shared) + size, limits)
            try:
                self._transaction(lambda: self._insert_array(base, shared, order))
            except (historydb.Error, OSError) as err:
                raise self._cannot_store(err) from None
            ahead = self._queued
            cls = J.array_class(J.values_of(base), order)
            self.jobs.update((i, J.element(cls, i)) for i in range(first, first + len(order)))
            self.arrays[first] = Members(first, order)
            self._array_size[first] = len(shared)
            self._kept[job.user] = self._kept.get(job.user, 0) + len(order)
            self._bytes[job.user] = self._bytes.get(job.user, 0) + len(shared) + size
            self._unfinished[job.user] = mine + (0 if job.state in J.ENDED else len(order))
            if job.state == J.QUEUED:
                self._queued += len(order)
            self.version += 1
            return self.jobs[first], ahead

    def _insert_array(self, base: Job, shared: str, indices: Sequence[int]) -> None:
        """The array's row and its elements' (rows.element_row), ids from the array's on. Indices evenly
        spaced (a spec of one item: `0-9999`, `0-99:5`) in one statement, the rows made by SQLite (10 000
        rows bound one by one from Python: 30-60 ms; so: 10-15 ms)."""
        self.conn.execute("INSERT INTO arrays (id, data) VALUES (?, ?)", (base.id, shared))
        values = {"first": base.id, "user": base.user, "state": base.state, "submitted": base.submitted}
        span = indices if isinstance(indices, range) else None
        if span is not None:
            step = {"count": len(span), "start": span.start, "step": span.step}
            self.conn.execute(_ELEMENTS, {**values, **step})
            return
        row = rows.element_row
        each = [{**values, "id": base.id + k, "data": row(base.id, i)} for k, i in enumerate(indices)]
        self.conn.executemany(
            "INSERT INTO jobs (id, user, state, submitted, ended, data) "
            "VALUES (:id, :user, :state, :submitted, NULL, :data)",
            each,
        )

    def _next_id(self) -> int:
        """The id the next insert would get (AUTOINCREMENT: never one used before, even if pruned)."""
        seq = self.conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'jobs'").fetchone()
        top = self.conn.execute("SELECT max(id) FROM jobs").fetchone()
        return max(int(seq[0]) if seq else 0, int(top[0] or 0) if top else 0) + 1

    # ------------------------------------------------------------------ what a user keeps

    def _make_room(self, user: str, jobs: int, size: int, limits: Limits) -> None:
        """Make room for `jobs` more jobs of `size` bytes of this user's: within the limits, or with that
        user's oldest finished jobs removed; Refused (nothing removed) when that is not enough."""
        kept, stored = self._kept.get(user, 0), self._bytes.get(user, 0)
        over_jobs = kept + jobs - limits.kept if limits.kept else 0
        over_bytes = stored + size - limits.stored_bytes if limits.stored_bytes else 0
        if over_jobs <= 0 and over_bytes <= 0:
            return
        victims, freed_jobs, freed_bytes = self._oldest_finished(user, over_jobs, over_bytes)
        if freed_jobs < over_jobs:
            unfinished = self._unfinished.get(user, 0)
            raise Refused(
                f"{user} has {kept} jobs kept ({unfinished} unfinished); {jobs} more would pass the limit "
                f"of {limits.kept} ([queue] max_kept_per_user)"
            )
        if freed_bytes < over_bytes:
            raise Refused(
                f"{user}'s jobs would keep {(stored - freed_bytes + size) / MIB:.1f} MiB in the queue's "
                f"database, over the limit of {limits.stored_bytes / MIB:g} MiB "
                "([queue] max_stored_mib_per_user)"
            )
        try:
            self._delete(victims)
        except (historydb.Error, OSError) as err:
            raise self._cannot_store(err) from None
        log.info("queue: %d finished job(s) of %s removed to keep its limits", len(victims), user)

    def _oldest_finished(self, user: str, jobs: int, size: int) -> Tuple[List[int], int, int]:
        """This user's finished jobs that may go, oldest end first, until `jobs` and `size` bytes are
        freed (or none is left): their ids, how many jobs and bytes that frees."""
        needed, arrays = self._needed()
        mine = [
            j
            for j in self.jobs.values()
            if j.user == user and j.state in J.ENDED and j.id not in needed and j.array_id not in arrays
        ]
        mine.sort(key=lambda j: (j.ended or 0.0, j.id))
        left = {a: len(m) for a, m in self.arrays.items()}
        victims: List[int] = []
        freed = 0
        for j in mine:
            if len(victims) >= jobs and freed >= size:
                break
            victims.append(j.id)
            freed += self._size_of(j)
            if j.array_id:
                left[j.array_id] -= 1
                freed += self._array_size.get(j.array_id, 0) if left[j.array_id] == 0 else 0
        return victims, len(victims), freed

    def _needed(self) -> Tuple[Set[int], Set[int]]:
        """What unfinished jobs still need kept: the jobs they wait on (`--after`); the arrays they wait on,
        and those they belong to."""
        live = [j for j in self.jobs.values() if j.state not in J.ENDED]
        needed = {a for j in live for a in (*j.after, *j.after_any, *j.after_notok)}
        arrays = {a for j in live for a in (*j.after_arrays, *j.after_any_arrays, *j.after_notok_arrays)}
        arrays.update(j.array_id for j in live if j.array_id)
        return needed, arrays

    def _delete(self, ids: List[int]) -> None:
        """Remove these jobs (and the shared part of an array whose last element goes), on disk first."""
        gone_arrays: List[int] = []
        left = {}
        for i in ids:
            a = self.jobs[i].array_id
            if a:
                left[a] = left.get(a, len(self.arrays.get(a, {}))) - 1
        gone_arrays = [a for a, n in left.items() if n <= 0 and a in self._array_size]

        def work() -> None:
            self.conn.executemany("DELETE FROM jobs WHERE id = ?", [(i,) for i in ids])
            self.conn.executemany("DELETE FROM runs WHERE job = ?", [(i,) for i in ids])
            self.conn.executemany("DELETE FROM arrays WHERE id = ?", [(a,) for a in gone_arrays])

        self._transaction(work)
        for i in ids:
            gone = self.jobs.pop(i)
            self._tally(gone, -1)
            self._weigh(gone, self._size_of(gone), -1)
            self.unwritten.pop(i, None)
            if gone.array_id:
                members = self.arrays.get(gone.array_id, {})
                members.pop(gone.array_index, None)
                if not members:
                    self.arrays.pop(gone.array_id, None)
                    size = self._array_size.pop(gone.array_id, 0)
                    self._bytes[gone.user] = self._bytes.get(gone.user, 0) - size
        self.version += 1

    def prune(self, before: float, batch: int = 500) -> int:
        """Remove the jobs that ended before `before` (wall time), but not one an unfinished job waits on
        (`--after`); how many. A few hundred a transaction: the lock is never held long (the daemon's
        round reads the store). Ids are never reused."""
        removed = 0
        while True:
            with self.lock:
                old = self._prunable(before, batch)
                if not old:
                    return removed
                self._delete(old)
                removed += len(old)

    def _prunable(self, before: float, batch: int) -> List[int]:
        """The next jobs prune removes in one transaction: at most `batch`, and rows of about
        historydb.WAL_BYTES at most (Debian's SQLite zeroes what it deletes: each byte goes through the
        WAL)."""
        needed, arrays = self._needed()
        out: List[int] = []
        size = 0
        for i, j in self.jobs.items():
            if len(out) >= batch or size >= historydb.WAL_BYTES:
                break
            old = j.state in J.ENDED and j.ended is not None and j.ended < before
            if old and i not in needed and j.array_id not in arrays:
                out.append(i)
                size += self._size_of(j)
        return out

    def change(
        self, job_id: int, edit: Callable[[Job], Optional[Job]], durable: bool = True
    ) -> Optional[Job]:
        """Apply `edit` to the job as it is now and write the result; None when there is no such job or
        `edit` changes nothing (returns None or the job itself). An exception from `edit` writes nothing.
        `durable=False`: a start's, not waiting for the disk (see the module's text)."""
        return self.change_many([(job_id, edit)], durable)[0]

    def change_many(
        self, edits: Iterable[Tuple[int, Callable[[Job], Optional[Job]]]], durable: bool = True
    ) -> List[Optional[Job]]:
        """Several `change`s in one transaction (each edit sees the job as it is now, so a change made by
        another thread in between is never overwritten with an old copy). A write that fails (a full
        disk) does not undo them: they are kept in memory and written with the next write that works."""
        with self.lock:
            out: List[Optional[Job]] = []
            for job_id, edit in edits:
                current = self.jobs.get(job_id)
                new = edit(current) if current is not None else None
                out.append(None if new is None or new is current else new)
            changed = [j for j in out if j is not None]
            if not changed:
                return out
            texts = [rows.to_row(j, j.array_id in self._array_size) for j in changed]
            for j, text in zip(changed, texts):
                old = self.jobs[j.id]
                self._tally(old, -1)
                self._weigh(old, self._size_of(old), -1)
                self.jobs[j.id] = j
                self._tally(j, 1)
                self._weigh(j, len(text), 1)
                self.unwritten[j.id] = text
            self._flush(durable)
            self.version += 1
            return out

    # ------------------------------------------------------------------ runs (runrecords.py)

    def record_runs(self, rows: Sequence[Tuple[int, float, Optional[float], str, str]]) -> None:
        """Write runs' records, (job, start, end, how, data JSON), each replacing the one of the same run;
        not waiting for the disk (a start's: see the module's text). historydb.Error or OSError when it
        cannot be written (the caller keeps them for the next try)."""
        with self.lock:
            self._transaction(
                lambda: self.conn.executemany(
                    "INSERT OR REPLACE INTO runs (job, start, end, how, data) VALUES (?, ?, ?, ?, ?)", rows
                ),
                durable=False,
            )

    def runs_of(self, job_id: int) -> List[Tuple[float, Optional[float], str, str]]:
        """One job's runs as recorded, (start, end, how, data JSON), by start (read from the file: a
        `show`'s, never a round's)."""
        with self.lock:
            return list(
                self.conn.execute(
                    "SELECT start, end, how, data FROM runs WHERE job = ? ORDER BY start", (job_id,)
                )
            )

    def flush(self, now: float) -> None:
        """Write the changes a failed write left in memory (at most every RETRY_SECONDS while it fails)."""
        with self.lock:
            if self.unwritten and now >= self._retry_at:
                self._retry_at = now + RETRY_SECONDS
                self._flush()

    def _flush(self, durable: bool = True) -> bool:
        """Write every change not on disk yet; whether that worked (one log line when writes start to
        fail, one when they work again)."""
        if not self.unwritten:
            return True
        pending = [(self.jobs[i], text) for i, text in self.unwritten.items()]
        try:
            self._transaction(
                lambda: self.conn.executemany(
                    "UPDATE jobs SET state = ?, ended = ?, data = ? WHERE id = ?",
                    [(j.state, j.ended, text, j.id) for j, text in pending],
                ),
                durable,
            )
        except (historydb.Error, OSError) as err:
            if self.failing is None:
                self.failing = str(err)
                log.error(
                    "queue: cannot write to %s (%s): jobs' changes are kept in memory and written once it "
                    "works again; submits are refused meanwhile",
                    self.path,
                    err,
                )
            return False
        if self.failing is not None:
            log.warning("queue: %s is written again (%d job change(s) that waited)", self.path, len(pending))
            self.failing = None
        self.unwritten.clear()
        return True
