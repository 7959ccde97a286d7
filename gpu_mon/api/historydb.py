"""The history database (embedded SQLite): its schema, migrations, and the reads `gpu-mon report` makes.
The only module that imports sqlite3. Times are wall-clock seconds (epoch).

Rows that are still open (a GPU's current state, a running workload, an idle-holder episode) are written
with `end` = the time of the last write and moved forward at every write, so a daemon killed at any moment
leaves a consistent database that ends at its last write.
"""

from __future__ import annotations

import os
import sqlite3
import stat
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

SCHEMA_VERSION = 4
APPLICATION_ID = 0x67706D6E  # "gpmn": marks the file as gpu-mon's history
_SCHEMA_V1 = """
CREATE TABLE schema_version (version INTEGER NOT NULL);
CREATE TABLE gpus (uuid TEXT PRIMARY KEY, idx INTEGER, name TEXT, last_seen REAL);
CREATE TABLE intervals (
    id INTEGER PRIMARY KEY, uuid TEXT NOT NULL, state TEXT NOT NULL, detail TEXT NOT NULL DEFAULT '',
    users TEXT NOT NULL DEFAULT '', start REAL NOT NULL, end REAL NOT NULL);
CREATE INDEX intervals_by_end ON intervals (end);
CREATE TABLE runs (
    id INTEGER PRIMARY KEY, process TEXT NOT NULL, label TEXT NOT NULL, gpus TEXT NOT NULL,
    user TEXT NOT NULL DEFAULT '', start REAL NOT NULL, end REAL NOT NULL,
    how TEXT NOT NULL DEFAULT 'running');
CREATE INDEX runs_by_end ON runs (end);
CREATE TABLE preemptions (
    id INTEGER PRIMARY KEY, time REAL NOT NULL, uuid TEXT NOT NULL, workload TEXT NOT NULL, who TEXT NOT NULL,
    detected_by TEXT NOT NULL, term_ms REAL NOT NULL, gone_ms REAL);
CREATE INDEX preemptions_by_time ON preemptions (time);
CREATE TABLE idle_holders (
    id INTEGER PRIMARY KEY, uuid TEXT NOT NULL, pid INTEGER NOT NULL, user TEXT NOT NULL,
    program TEXT NOT NULL, memory_mib INTEGER NOT NULL, start REAL NOT NULL, end REAL NOT NULL);
CREATE INDEX idle_holders_by_end ON idle_holders (end);
CREATE TABLE samples (
    time REAL NOT NULL, uuid TEXT NOT NULL, memory_used_mib INTEGER, utilization_pct INTEGER);
CREATE INDEX samples_by_time ON samples (time);
"""
# version -> the statements that bring a database from version-1 to it (v1 is created whole).
MIGRATIONS: Dict[int, str] = {
    # 2: each run of a queued job ([queue]): its job, user, GPUs, start, end, how it ended, the wait before it
    2: """
CREATE TABLE job_runs (
    id INTEGER PRIMARY KEY, job INTEGER NOT NULL, user TEXT NOT NULL, name TEXT NOT NULL DEFAULT '',
    gpus TEXT NOT NULL, submitted REAL NOT NULL, start REAL NOT NULL, end REAL NOT NULL,
    how TEXT NOT NULL DEFAULT 'running', wait REAL NOT NULL DEFAULT 0, restart INTEGER NOT NULL DEFAULT 0);
CREATE UNIQUE INDEX job_runs_by_run ON job_runs (job, submitted, start);
CREATE INDEX job_runs_by_end ON job_runs (end);
""",
    # 3: who preempted each preempted run (the reason `jobs` and the job's log give)
    3: "ALTER TABLE job_runs ADD COLUMN preempted_by TEXT NOT NULL DEFAULT '';",
    # 4: the energy each run's GPUs used, millijoules (NULL: not known; queue/energy.py says how it is had)
    4: "ALTER TABLE job_runs ADD COLUMN energy_mj REAL;",
}
Error = sqlite3.Error
OperationalError = sqlite3.OperationalError  # (a full disk, a lock: not a damaged file)
BUSY_MS = 5000  # how long a statement waits for a lock another connection holds
# The most a write-ahead log keeps on disk between writes. SQLite only ever reuses its WAL file, never
# shrinks it: one transaction that changes much (a prune of big rows, which Debian's SQLite zeroes:
# SECURE_DELETE) left a 71 MB WAL beside a queue at its 64 MiB cap, for good (issue 46). Its auto-checkpoint
# runs at 1000 pages (4 MiB) too, so this is what a WAL reaches anyway.
WAL_BYTES = 4 << 20


class NotOurs(Exception):
    """The file is not a gpu-mon history database (or is damaged); str() says how."""


class Unsafe(OSError):
    """The path is a symlink, a device, a FIFO or the like: never opened, changed or moved aside."""


def _regular_or_absent(path: str) -> bool:
    """True when the path is a regular file, False when nothing is there; Unsafe otherwise (a symlink
    planted there, /dev/null by mistake: chmod or rename of that as root would break the machine)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        raise Unsafe(f"{path}: not a regular file (a symlink, device or FIFO is never used)")
    return True


def open_own(path: str, application_id: int, what: str, mode: int, synchronous: str) -> sqlite3.Connection:
    """Open (creating it, `mode`, and its directory) one of gpu-mon's own databases, marked by its
    application id: WAL, `synchronous`, a busy timeout, autocommit (the caller writes BEGIN and COMMIT),
    usable from any thread (the caller serializes). NotOurs when the file exists but is damaged or another
    application's; Unsafe when it is not a regular file."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    fresh = not _regular_or_absent(path) or os.path.getsize(path) == 0
    conn = sqlite3.connect(path, timeout=BUSY_MS / 1000, isolation_level=None, check_same_thread=False)
    try:
        if fresh:
            os.chmod(path, mode)
            conn.execute(f"PRAGMA application_id={application_id}")
        else:
            _check(conn, application_id, what)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.execute(f"PRAGMA journal_size_limit={WAL_BYTES}")  # (a WAL started again is cut to this)
    except (sqlite3.DatabaseError, NotOurs) as err:
        conn.close()
        raise NotOurs(str(err)) from None
    return conn


def trim_wal(conn: sqlite3.Connection, path: str) -> bool:
    """Checkpoint the database at `path` and truncate its WAL when that has grown past WAL_BYTES; whether it
    did. Outside a transaction only. Never waits on a reader (it is tried again at the next call)."""
    try:
        size = os.stat(path + "-wal").st_size
    except OSError:
        return False
    if size <= WAL_BYTES:
        return False
    conn.execute("PRAGMA busy_timeout=0")
    try:
        busy = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
    finally:
        conn.execute(f"PRAGMA busy_timeout={BUSY_MS}")
    return not busy


def connect_rw(path: str) -> sqlite3.Connection:
    """Open (creating it and its directory) for the daemon's writer: WAL, synchronous=NORMAL, a busy
    timeout. NotOurs when the file exists but is damaged, someone else's or newer; Unsafe when it is not a
    regular file."""
    conn = open_own(path, APPLICATION_ID, "history", 0o644, "NORMAL")
    try:
        migrate(conn)
    except (sqlite3.DatabaseError, NotOurs) as err:
        conn.close()
        raise NotOurs(str(err)) from None
    return conn


def _check(conn: sqlite3.Connection, application_id: int, what: str) -> None:
    app = conn.execute("PRAGMA application_id").fetchone()[0]
    if app != application_id:
        raise NotOurs(f"not a gpu-mon {what} database (another application's SQLite file)")
    ok = conn.execute("PRAGMA quick_check").fetchone()[0]
    if ok != "ok":
        raise NotOurs(f"damaged ({ok})")


def version(conn: sqlite3.Connection) -> int:
    """The schema version of this database (0: empty)."""
    has = conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='schema_version'").fetchone()
    if not has:
        return 0
    row = conn.execute("SELECT version FROM schema_version").fetchone()
    return int(row[0]) if row else 0


def migrate(conn: sqlite3.Connection) -> None:
    """Bring the schema to SCHEMA_VERSION, one version per transaction."""
    current = version(conn)
    if current > SCHEMA_VERSION:
        raise NotOurs(f"written by a newer gpu-mon (schema {current}; this one knows {SCHEMA_VERSION})")
    if current == 0:
        conn.executescript(f"BEGIN; {_SCHEMA_V1} INSERT INTO schema_version VALUES (1); COMMIT;")
        current = 1
    for target in range(current + 1, SCHEMA_VERSION + 1):
        conn.executescript(
            f"BEGIN; {MIGRATIONS[target]} UPDATE schema_version SET version = {target}; COMMIT;"
        )


def connect_ro(path: str) -> sqlite3.Connection:
    """Open read-only (works while the daemon writes); NotOurs when it is not a usable history."""
    if not _regular_or_absent(path):  # (a FIFO would hang the open)
        raise FileNotFoundError(path)
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    try:
        if conn.execute("PRAGMA application_id").fetchone()[0] != APPLICATION_ID:
            raise NotOurs("not a gpu-mon history database")
        if version(conn) > SCHEMA_VERSION:
            raise NotOurs(f"written by a newer gpu-mon (schema {version(conn)})")
    except sqlite3.DatabaseError as err:
        conn.close()
        raise NotOurs(str(err)) from None
    except NotOurs:
        conn.close()
        raise
    return conn


def move_aside(path: str, when: float) -> str:
    """Rename a damaged or foreign file (and its -wal/-shm) out of the way; return the new name."""
    import time as _time

    stamp = _time.strftime("%Y%m%d-%H%M%S", _time.localtime(when))
    aside = f"{path}.bad-{stamp}"
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.replace(path + suffix, aside + suffix)
    return aside


def retain(conn: sqlite3.Connection, cutoff: float) -> int:
    """Delete what ended before `cutoff`; return how many rows went."""
    gone = 0
    for table, column in (
        ("intervals", "end"),
        ("runs", "end"),
        ("idle_holders", "end"),
        ("preemptions", "time"),
        ("samples", "time"),
        ("job_runs", "end"),
    ):
        gone += conn.execute(f"DELETE FROM {table} WHERE {column} < ?", (cutoff,)).rowcount
    return gone


# ----------------------------------------------------------------------------------------------- reads


@dataclass(frozen=True)
class Span:
    """A stretch of time with what it was (an interval, a run, an idle-holder episode)."""

    key: str  # GPU uuid, process name or user
    kind: str  # state, label or program
    detail: str
    start: float
    end: float

    def within(self, since: float, until: float) -> float:
        """Seconds of it inside [since, until)."""
        return max(0.0, min(self.end, until) - max(self.start, since))


def gpus(conn: sqlite3.Connection) -> List[Tuple[str, Optional[int], Optional[str]]]:
    """(uuid, index, name) of every GPU the history knows, by index."""
    return list(conn.execute("SELECT uuid, idx, name FROM gpus ORDER BY idx, uuid"))


def intervals(conn: sqlite3.Connection, since: float, until: float) -> List[Span]:
    """GPU states overlapping [since, until): key = uuid, kind = state, detail = users."""
    rows = conn.execute(
        "SELECT uuid, state, users, start, end FROM intervals WHERE end > ? AND start < ?", (since, until)
    )
    return [Span(*row) for row in rows]


def runs(
    conn: sqlite3.Connection, since: float, until: float
) -> List[Tuple[str, str, int, str, float, float]]:
    """(process, label, number of GPUs, user, start, end) of runs overlapping the period."""
    rows = conn.execute(
        "SELECT process, label, gpus, user, start, end FROM runs WHERE end > ? AND start < ?", (since, until)
    )
    return [(p, label, len([g for g in gs.split(",") if g]), u, s, e) for p, label, gs, u, s, e in rows]


def preemptions(conn: sqlite3.Connection, since: float, until: float) -> List[Tuple[float, str, float]]:
    """(time, uuid, open-to-SIGTERM ms) in the period."""
    q = "SELECT time, uuid, term_ms FROM preemptions WHERE time >= ? AND time < ? ORDER BY time"
    return list(conn.execute(q, (since, until)))


def idle_episodes(conn: sqlite3.Connection, since: float, until: float) -> List[Span]:
    """Idle-holder episodes overlapping the period: key = user, kind = program, detail = uuid."""
    rows = conn.execute(
        "SELECT user, program, uuid, start, end FROM idle_holders WHERE end > ? AND start < ?", (since, until)
    )
    return [Span(*row) for row in rows]


@dataclass(frozen=True)
class JobRunRow:
    """One run of a queued job as the history has it (`how` is `running` while it runs)."""

    job: Union[int, str]  # as people name it: 17; an array's element "17_5" (before: its own number)
    user: str
    name: str
    gpus: int  # how many
    submitted: float
    start: float
    end: float
    how: str
    wait: float
    restart: int
    preempted_by: str = ""  # a preempted run: why, naming who ("" in a history before schema 3)
    energy_mj: Optional[float] = None  # its GPUs' energy, millijoules (None: not known, or before schema 4)


def job_runs(conn: sqlite3.Connection, since: float, until: float) -> List[JobRunRow]:
    """Runs of queued jobs overlapping the period, or starting in it, by start (none in a history
    written before jobs were recorded)."""
    has = conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='job_runs'").fetchone()
    if not has:
        return []
    # (read-only, a history an older gpu-mon wrote is read as it is: schema 2 has no preempted_by)
    columns = {row[1] for row in conn.execute("PRAGMA table_info(job_runs)")}
    by = "preempted_by" if "preempted_by" in columns else "''"
    mj = "energy_mj" if "energy_mj" in columns else "NULL"
    rows = conn.execute(
        f"SELECT job, user, name, gpus, submitted, start, end, how, wait, restart, {by}, {mj} FROM job_runs "
        "WHERE (end > ? OR start >= ?) AND start < ? ORDER BY start, id",
        (since, since, until),
    )
    return [
        JobRunRow(job, user, name, len([g for g in gs.split(",") if g]), *rest)
        for job, user, name, gs, *rest in rows
    ]


def extent(conn: sqlite3.Connection) -> Optional[Tuple[float, float]]:
    """(first start, last end) of all intervals, or None when there is no history yet."""
    row = conn.execute("SELECT MIN(start), MAX(end) FROM intervals").fetchone()
    return None if row is None or row[0] is None else (float(row[0]), float(row[1]))


def insert_many(conn: sqlite3.Connection, sql: str, rows: Iterable[Sequence[object]]) -> None:
    """executemany, for the writer."""
    conn.executemany(sql, list(rows))
