"""Jobs as `jobs` sends them, encoded once: a long queue's listing is mostly a join of bytes already made.

What a listing holds of each job is small whatever the job (issue 46: one user's five 1000-element arrays
of a 60 KB argument made every user's `jobs --all --json` 296 MB): an array's elements carry no command,
the listing gives each array's once (`shared`, under "arrays"); a command whose JSON is over LIST_COMMAND
bytes is listed cut (its first arguments, the last one cut short; "command_cut": true), and a reason over
LIST_REASON characters (one that names a long path: a job that could not open its output) ends in "...",
unless the request names its jobs (`whole`).

Each job's JSON is kept in three fixed pieces around the two that change without the job changing (its
waiting reason, from the last placement, and its GPUs' indices with its estimated start). A Job is a new
object whenever it changes, so `is` tells whether the pieces are still good. Strings are encoded as
json.dumps does (ensure_ascii), so the object reads back the same.

What is kept is bounded: a job whose JSON is over KEEP_ONE bytes (a long reason: a path of 4096 bytes, each
escaped to as many as 6) is encoded again for each listing, never kept, and no more is kept once KEEP_ALL
bytes are; a whole command (a listing that names its jobs) is never kept.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Dict, Iterable, List, Optional, Tuple

from gpu_mon.queue import jobs as J
from gpu_mon.queue.jobs import Job

_string = json.encoder.encode_basestring_ascii  # a JSON string, quotes included
_ISO: Dict[int, str] = {}  # whole seconds -> local ISO time (jobs submitted in a burst share seconds)
KEEP_ONE = 16 * 1024  # bytes of one job's JSON kept between listings, at most
KEEP_ALL = 64 << 20  # bytes kept for every job together, at most
LIST_COMMAND = 4096  # bytes of a command's JSON in a listing that does not name its jobs, at most
LIST_REASON = 300  # characters of a reason in such a listing, at most


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


def ran_in_all(j: Job) -> Optional[int]:
    """Its run time over every run that ended, in whole seconds (None: none ended). An older gpu-mon kept
    only GPU-seconds: those over the GPUs it wants, then."""
    ran = j.ran_seconds or j.gpu_seconds / max(1, j.gpus_wanted)
    return int(ran) if ran or j.restarts or (j.state in J.ENDED and j.started is not None) else None


def elapsed(j: dict, now: float) -> Optional[float]:
    """The TIME of `jobs`' table: a job's run time over all its runs (a running one's so far); None for
    one that never ran (a listing from an older gpu-mon: the current or last run's only)."""
    before = j.get("ran_seconds")
    if j["state"] in J.LIVE and j.get("started"):
        started = datetime.datetime.strptime(j["started"], "%Y-%m-%dT%H:%M:%S%z").timestamp()
        return max(0.0, now - started) + (before or 0)
    return before if before is not None else j.get("run_seconds")


def _value(v: object) -> str:
    if v is None:
        return "null"
    return str(v) if type(v) is int else json.dumps(v)


def _time(t: Optional[float]) -> str:
    text = iso(t)
    return "null" if text is None else '"' + text + '"'


def _strings(items: Iterable[str]) -> str:
    return "[" + ",".join(map(_string, items)) + "]"


def command_json(command: Iterable[str], whole: bool = False) -> Tuple[str, bool]:
    """A command's JSON list and whether it is cut: whole, or (over LIST_COMMAND bytes, not `whole`) its
    first arguments that fit in LIST_COMMAND bytes, the last of them cut short."""
    text = _strings(command)
    if whole or len(text) <= LIST_COMMAND:
        return text, False
    parts: List[str] = []
    room = LIST_COMMAND - 2  # (the brackets)
    for arg in command:
        room -= 1 if parts else 0  # (the comma before it)
        encoded = _string(arg)
        if len(encoded) > room:
            if room >= 3:  # (its quotes and a character at least)
                parts.append(_string(arg[: _fitting(arg, room)]))
            break
        parts.append(encoded)
        room -= len(encoded)
    return "[" + ",".join(parts) + "]", True


def _fitting(arg: str, room: int) -> int:
    """The most characters of `arg` whose JSON string fits in `room` bytes."""
    low, high = 0, min(len(arg), room)
    while low < high:
        mid = (low + high + 1) // 2
        if len(_string(arg[:mid])) <= room:
            low = mid
        else:
            high = mid - 1
    return low


def listed_reason(text: str, whole: bool = False) -> str:
    """A reason as a listing gives it: over LIST_REASON characters, cut to them with "..." (not `whole`)."""
    return text if whole or len(text) <= LIST_REASON else text[: LIST_REASON - 3] + "..."


def _command_field(command: Iterable[str], whole: bool) -> str:
    text, cut = command_json(command, whole)
    return f',"command":{text},"command_cut":{"true" if cut else "false"}'


def shared(j: Job, whole: bool = False) -> bytes:
    """What the elements of j's array share and a listing gives once, under "arrays": `{"command": [...],
    "command_cut": false}`."""
    return ("{" + _command_field(j.command, whole)[1:] + "}").encode()


def _pieces(j: Job, whole: bool = False) -> Tuple[bytes, bytes, bytes]:
    head = (
        f'{{"id":{_value(j.id)},"user":{_string(j.user)},"name":{_string(j.name)},'
        f'"state":{_string(j.state)},"reason":'
    )
    gpus = f',"gpus":{_strings(j.gpus if j.state in J.LIVE else ())},"gpu_indices":'
    command = "" if j.array_id else _command_field(j.command, whole)  # (an element's: its array's, once)
    preempted = _string(listed_reason(j.preempted_reason, whole))
    tail = (
        f',"gpus_wanted":{_value(j.gpus_wanted)},"priority":{_value(j.priority)},'
        f'"submitted":{_time(j.submitted)},"started":{_time(j.started)},"ended":{_time(j.ended)},'
        f'"restarts":{_value(j.restarts)},"exit_status":{_value(j.exit_status)},'
        f'"signal":{_value(j.signal or None)},"run_seconds":{_value(run_seconds(j))},'
        f'"ran_seconds":{_value(ran_in_all(j))},'
        f'"preempted":{_time(j.preempted_at)},"preempted_reason":{preempted}'
        f'{command},"array_id":{_value(j.array_id or None)},'
        f'"array_index":{_value(j.array_index if j.array_id else None)}}}'
    )
    return head.encode(), gpus.encode(), tail.encode()


def _may_be_cut(j: Job) -> bool:
    """Whether j's fixed pieces may be cut in a listing (False: never; True: its command's JSON may be
    over LIST_COMMAND bytes, each character at most 12 of them, or its preemption's reason is long)."""
    long_command = not j.array_id and sum(len(a) + 3 for a in j.command) * 12 > LIST_COMMAND
    return long_command or len(j.preempted_reason) > LIST_REASON


class Listing:
    """Each job's encoded JSON, kept between listings (one thread uses it: the socket server's)."""

    def __init__(self) -> None:
        # job id -> (the job, its reason and (indices, estimated start) when last encoded, its three
        # pieces, the whole)
        self._kept: Dict[int, tuple] = {}
        self.kept_bytes = 0  # of the pieces and wholes kept, and of the arrays' shared values
        self._arrays: Dict[int, bytes] = {}  # array id -> what its elements share (at most LIST_COMMAND + 40)

    def encoded(
        self, j: Job, reason: str, indices: tuple, whole: bool = False, start: Optional[float] = None
    ) -> bytes:
        """The job's JSON object, as bytes; `whole`: its command whole (made afresh when it may be cut);
        `start`: its estimated start (a queued job's, from the last placement)."""
        if whole and _may_be_cut(j):
            head, gpus, tail = _pieces(j, whole=True)
            return b"".join((head, _string(reason).encode(), gpus, _indices(indices, start), tail))
        kept = self._kept.get(j.id)
        changing = (indices, start)
        if kept is not None and kept[0] is j:
            if kept[1] == reason and kept[2] == changing:
                return kept[4]
            pieces = kept[3]
        else:
            pieces = _pieces(j)
        head, gpus, tail = pieces
        made = b"".join((head, _string(reason).encode(), gpus, _indices(indices, start), tail))
        self._keep(j, (j, reason, changing, pieces, made))
        return made

    def shared(self, j: Job, whole: bool = False) -> bytes:
        """What j's array's elements share, as `shared` makes it (kept per array: an array's command never
        changes, and a cut one is small)."""
        if whole:
            return shared(j, whole=True)
        made = self._arrays.get(j.array_id)
        if made is None:
            made = shared(j)
            if self.kept_bytes + len(made) <= KEEP_ALL:
                self._arrays[j.array_id] = made
                self.kept_bytes += len(made)
        return made

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

    def keep_only(self, ids: Iterable[int], arrays: Iterable[int] = ()) -> None:
        """Forget the jobs not in `ids` and the arrays not in `arrays` (pruned)."""
        wanted, wanted_arrays = set(ids), set(arrays)
        self._kept = {i: v for i, v in self._kept.items() if i in wanted}
        self._arrays = {i: v for i, v in self._arrays.items() if i in wanted_arrays}
        self.kept_bytes = sum(map(_size, self._kept.values())) + sum(map(len, self._arrays.values()))

    def __len__(self) -> int:
        return len(self._kept)


def _indices(indices: tuple, start: Optional[float]) -> bytes:
    """The GPUs' indices, then the estimated start (the two pieces that change without the job)."""
    shown = ",".join("null" if i is None else str(i) for i in indices)
    return f'[{shown}],"estimated_start":{_time(start)}'.encode()


def _size(entry: tuple) -> int:
    """Bytes of a kept entry's pieces and whole."""
    return sum(map(len, entry[3])) + len(entry[4])
