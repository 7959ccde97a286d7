"""Jobs as `jobs` sends them, encoded once: a long queue's listing is mostly a join of bytes already made.

Each job's JSON is kept in three fixed pieces around the two that change without the job changing (its
waiting reason, from the last placement, and its GPUs' indices). A Job is a new object whenever it
changes, so `is` tells whether the pieces are still good. Strings are encoded as json.dumps does
(ensure_ascii), so the object reads back the same.

What is kept is bounded: a job whose JSON is over KEEP_ONE bytes (a long command: up to 64 KiB, each byte
escaped to as many as 6) is encoded again for each listing, never kept, and no more is kept once KEEP_ALL
bytes are.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Dict, Iterable, Optional, Tuple

from gpu_mon.queue import jobs as J
from gpu_mon.queue.jobs import Job

_string = json.encoder.encode_basestring_ascii  # a JSON string, quotes included
_ISO: Dict[int, str] = {}  # whole seconds -> local ISO time (jobs submitted in a burst share seconds)
KEEP_ONE = 16 * 1024  # bytes of one job's JSON kept between listings, at most
KEEP_ALL = 64 << 20  # bytes kept for every job together, at most


def iso(t: Optional[float]) -> Optional[str]:
    """Local time as `2026-11-24T13:07:49+0000`; None stays None."""
    if t is None:
        return None
    second = int(t // 1)
    text = _ISO.get(second)
    if text is None:
        if len(_ISO) > 100_000:
            _ISO.clear()
        text = _ISO[second] = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(second))
    return text


def run_seconds(j: Job) -> Optional[int]:
    """How long an ended job's last run lasted, in whole seconds (None: it is not ended, or never ran). A
    run that went back to the queue ended then (queued_at), not when the job was cancelled there later."""
    if j.state not in J.ENDED or j.started is None:
        return None
    back = j.queued_at if j.queued_at is not None and j.queued_at >= j.started else None
    end = back if back is not None else j.ended
    return None if end is None else int(max(0.0, end - j.started))


def elapsed(j: dict, now: float) -> Optional[float]:
    """The TIME of `jobs`' table: how long a running job has run, how long an ended one's last run
    lasted; None for one waiting (or that never ran)."""
    if j["state"] in J.LIVE and j.get("started"):
        return max(0.0, now - datetime.datetime.strptime(j["started"], "%Y-%m-%dT%H:%M:%S%z").timestamp())
    return j.get("run_seconds")


def _value(v: object) -> str:
    if v is None:
        return "null"
    return str(v) if type(v) is int else json.dumps(v)


def _time(t: Optional[float]) -> str:
    text = iso(t)
    return "null" if text is None else '"' + text + '"'


def _strings(items: Iterable[str]) -> str:
    return "[" + ",".join(map(_string, items)) + "]"


def _pieces(j: Job) -> Tuple[bytes, bytes, bytes]:
    head = (
        f'{{"id":{_value(j.id)},"user":{_string(j.user)},"name":{_string(j.name)},'
        f'"state":{_string(j.state)},"reason":'
    )
    gpus = f',"gpus":{_strings(j.gpus if j.state in J.LIVE else ())},"gpu_indices":'
    tail = (
        f',"gpus_wanted":{_value(j.gpus_wanted)},"priority":{_value(j.priority)},'
        f'"submitted":{_time(j.submitted)},"started":{_time(j.started)},"ended":{_time(j.ended)},'
        f'"restarts":{_value(j.restarts)},"exit_status":{_value(j.exit_status)},'
        f'"signal":{_value(j.signal or None)},"run_seconds":{_value(run_seconds(j))},'
        f'"preempted":{_time(j.preempted_at)},"preempted_reason":{_string(j.preempted_reason)},'
        f'"command":{_strings(j.command)},"array_id":{_value(j.array_id or None)},'
        f'"array_index":{_value(j.array_index if j.array_id else None)}}}'
    )
    return head.encode(), gpus.encode(), tail.encode()


class Listing:
    """Each job's encoded JSON, kept between listings (one thread uses it: the socket server's)."""

    def __init__(self) -> None:
        # job id -> (the job, its reason and indices when last encoded, its three pieces, the whole)
        self._kept: Dict[int, tuple] = {}
        self.kept_bytes = 0  # of the pieces and wholes kept

    def encoded(self, j: Job, reason: str, indices: tuple) -> bytes:
        """The job's JSON object, as bytes."""
        kept = self._kept.get(j.id)
        if kept is not None and kept[0] is j:
            if kept[1] == reason and kept[2] == indices:
                return kept[4]
            pieces = kept[3]
        else:
            pieces = _pieces(j)
        head, gpus, tail = pieces
        index_list = "[" + ",".join("null" if i is None else str(i) for i in indices) + "]"
        whole = b"".join((head, _string(reason).encode(), gpus, index_list.encode(), tail))
        self._keep(j, (j, reason, indices, pieces, whole))
        return whole

    def prepare(self, j: Job) -> None:
        """Make the job's fixed pieces now (a daemon that starts with a long queue: its first listing
        then only adds the reasons)."""
        kept = self._kept.get(j.id)
        if kept is None or kept[0] is not j:
            self._keep(j, (j, None, None, _pieces(j), b""))

    def _keep(self, j: Job, entry: tuple) -> None:
        """Keep the entry, within KEEP_ONE and KEEP_ALL (else forget what was kept of the job)."""
        old = self._kept.pop(j.id, None)
        if old is not None:
            self.kept_bytes -= _size(old)
        size = _size(entry)
        if size - len(entry[4]) <= KEEP_ONE and self.kept_bytes + size <= KEEP_ALL:
            self._kept[j.id] = entry
            self.kept_bytes += size

    def keep_only(self, ids: Iterable[int]) -> None:
        """Forget the jobs not in `ids` (pruned)."""
        wanted = set(ids)
        self._kept = {i: v for i, v in self._kept.items() if i in wanted}
        self.kept_bytes = sum(map(_size, self._kept.values()))

    def __len__(self) -> int:
        return len(self._kept)


def _size(entry: tuple) -> int:
    """Bytes of a kept entry's pieces and whole."""
    return sum(map(len, entry[3])) + len(entry[4])
