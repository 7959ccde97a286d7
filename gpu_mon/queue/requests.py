"""What the queue socket's requests do: submit, jobs, cancel, hold, release, logs-path, queue (drain).

The user is whoever the kernel says is on the other end (`Peer`, from SO_PEERCRED), never what the
request says: a selection (`cancel --all`) is resolved here, among the jobs that user may change. Every
refusal is one line for that client (`{"ok": false, "error": ..., "code": 1|2}`:
1 not allowed or over a limit, 2 bad usage).
"""

from __future__ import annotations

import dataclasses
import grp
import json
import logging
import os
import pwd
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple, Union

from gpu_mon.api.text import sanitize
from gpu_mon.config import QueueSection
from gpu_mon.queue import afterspec, arrays, fields, share, show, submitcheck, timelimits, update
from gpu_mon.queue import jobs as J
from gpu_mon.queue.described import View, describe, estimate, reason_key, reason_of
from gpu_mon.queue.fields import MAX_NAME, Bad
from gpu_mon.queue.grouped import grouped
from gpu_mon.queue.jobs import Job
from gpu_mon.queue.listing import Listing, listed_reason
from gpu_mon.queue.placement import never_fits, never_met
from gpu_mon.queue.protocol import DEFAULT_OUTPUT, PAGE_BYTES, Encoded, Pages
from gpu_mon.queue.runs import how_it_ended
from gpu_mon.queue.store import MIB, Drained, Limits, Refused, Store
from gpu_mon.queue.words import never_met as waiting_words_never_met
from gpu_mon.queue.words import refusal

log = logging.getLogger("gpu_mon")

Entry = Union[Job, Tuple[int, str]]  # a job of a listing, or an array's elements in one state (collapsed)


@dataclass(frozen=True)
class Peer:
    """Who is on the other end of a connection, as the kernel says."""

    pid: int
    uid: int
    gid: int


def default_output(home: str, job_ref: Union[int, str]) -> str:
    """Where a job's output goes without --output (ID.log; an array's element: ARRAY_INDEX.log)."""
    return os.path.join(home, DEFAULT_OUTPUT, f"{job_ref}.log")


class Requests:
    """Answers one request at a time (the server calls it from its own thread)."""

    def __init__(
        self,
        store: Store,
        queue: QueueSection,
        view: Callable[[], View],
        changed: Callable[[], None],
        checks_here: bool = True,
        submitted: Optional[Callable[[], None]] = None,
    ):
        self.store, self.queue, self.view, self.changed = store, queue, view, changed
        # A submit only adds a job to place (a placement soon, not a round at once): `changed` without one
        self.submitted = submitted or changed
        # Whether a job sees the files the daemon sees (its own children): then a submit is checked here
        # too; a job in a unit of its own sees the user's (the daemon's sandbox hides homes and /tmp),
        # where the client, the user, has checked it.
        self.checks_here = checks_here
        self.listing = Listing()  # each job's JSON as `jobs` last sent it
        self.live: Optional[show.Live] = None  # the daemon's last look and runs going on (`show`)

    def prepare(self) -> None:
        """Encode what `jobs` will send of every job now (the server does, before it listens)."""
        for j in self.store.all():
            self.listing.prepare(j)

    def check_submit(self, peer: Peer, req: dict) -> Optional[dict]:
        """The slow part of a submit, for a thread of its own (the server's never waits on it): the job
        checked as its user (submitcheck.py: a user's file system may hang). None: answer it with
        `answer(peer, req, checked=True)`; else the refusal."""
        try:
            user = _user(peer.uid)
            self._allowed(user)
            job = self._job_from(peer, user, req)
            if self.checks_here:
                can_start(job, user)
        except Bad as err:
            return {"ok": False, "error": str(err), "code": err.code}
        return None

    def answer(self, peer: Peer, req: dict, checked: bool = False) -> Union[dict, Encoded, Pages]:
        """The answer to one request (never raises for bad input); `checked`: a submit that passed
        check_submit."""
        op = req.get("op")
        handler = {
            "submit": partial(self._submit, checked=checked),
            "jobs": self._jobs,
            "cancel": self._cancel,
            "hold": self._hold,
            "release": self._release,
            "logs-path": self._logs_path,
            "ids": self._ids,
            "queue": self._queue,
            "show": self._show,
            "update": self._update,
            "share": self._share,
        }.get(op if isinstance(op, str) else "")
        if handler is None:
            return {"ok": False, "error": f"unknown request {sanitize(str(op))[:40]!r}", "code": 2}
        try:
            user = _user(peer.uid)
            out = handler(peer, user, req)
            return out if isinstance(out, (Encoded, Pages)) else {"ok": True, **out}
        except Bad as err:
            return {"ok": False, "error": str(err), "code": err.code}

    # ------------------------------------------------------------------ submit

    def _submit(self, peer: Peer, user: pwd.struct_passwd, req: dict, checked: bool = False) -> dict:
        self._allowed(user)
        spec = self._array(req)
        job = self._job_from(peer, user, req)
        if not checked and self.checks_here:
            can_start(job, user)
        q, limits = self.queue, kept_limits(self.queue)
        try:
            if spec is not None:
                job = dataclasses.replace(job, array_limit=spec.limit)
                job, ahead = self.store.submit_array(job, spec.indices, q.max_queued_per_user, limits)
            else:
                job, ahead = self.store.submit(job, q.max_queued_per_user, limits)
        except Refused as err:
            raise Bad(str(err), 1) from None
        self.submitted()
        if spec is not None:  # (its elements are encoded when a listing first shows them one by one)
            count = len(spec.indices)
            return {"id": job.id, "array_id": job.id, "elements": count, "state": job.state, "ahead": ahead}
        self.listing.prepare(job)  # (after the answer is decided: the next `jobs` only adds its reason)
        return {"id": job.id, "state": job.state, "ahead": ahead}

    def _array(self, req: dict) -> Optional[arrays.ArraySpec]:
        """The --array SPEC parsed (None without one); Bad (one line) for a spec that is refused."""
        spec = req.get("array")
        if spec is None:
            return None
        try:
            return arrays.parse(spec, self.queue.max_array_size)
        except arrays.SpecError as err:
            raise Bad(f"--array: {err}") from None

    def _allowed(self, user: pwd.struct_passwd) -> None:
        q = self.queue
        if user.pw_uid == 0 or (not q.users and not q.groups) or user.pw_name in q.users:
            return
        if q.groups:
            mine = {g.gr_name for g in _groups_of(user)}
            if mine & set(q.groups):
                return
        raise Bad(f"{user.pw_name} may not submit jobs here ([queue] users and groups)", 1)

    def _job_from(self, peer: Peer, user: pwd.struct_passwd, req: dict) -> Job:
        q = self.queue
        command = fields.command(req.get("command"))
        env = fields.environment(req.get("env"))
        name = fields.label(req, "name", "name", MAX_NAME)
        cwd = fields.text(req, "cwd", "the submit directory", fields.MAX_PATH)
        if not os.path.isabs(cwd):
            raise Bad("the submit directory must be an absolute path")
        gpus = fields.whole(req, "gpus", "--gpus", 1, 1, fields.MAX_GPUS)
        self._could_start(gpus)
        grace = _seconds(req, "grace", q.grace_seconds, "--grace")
        if grace > q.max_grace_seconds:
            raise Bad(f"--grace {grace:g} is over the limit of {q.max_grace_seconds:g} s", 1)
        after = self._after(req.get("after") or [])
        output = fields.text(req, "output", "--output", fields.MAX_PATH)
        if output and not os.path.isabs(output):
            raise Bad("--output must be an absolute path")
        limit = self._time_limit(req)
        top = fields.MAX_PRIORITY
        job = Job(
            id=0,
            user=user.pw_name,
            uid=user.pw_uid,
            gid=user.pw_gid,
            command=command,
            cwd=cwd,
            env=env,
            output=output,
            submitted=time.time(),
            name=name,
            gpus_wanted=gpus,
            priority=fields.whole(req, "priority", "--priority", 0, -top, top),
            **after,
            notify=self._notify(req),
            notify_each=fields.flag(req, "notify_each", False),
            stop_signal=fields.stop_signal(req.get("stop_signal", "SIGTERM")),
            stop_main_only=fields.flag(req, "stop_main_only", False),
            grace=grace,
            time_limit=limit,
            requeue=fields.flag(req, "requeue", True),
            state=J.HELD if fields.flag(req, "hold", False) else J.QUEUED,
        )
        if J.depends(job):
            self._never_met(job)
        return job

    def _after(self, refs: object) -> Dict[str, Tuple[int, ...]]:
        """--after's jobs and whole arrays by kind (afterspec.py: `17`: every element of array 17; `17_5`:
        one element), as Job's fields (J.DEPENDENCIES); Bad for a job that does not exist."""
        if not isinstance(refs, list) or len(refs) > afterspec.MAX_REFS:
            raise Bad(f"--after takes job ids (at most {afterspec.MAX_REFS})")
        out: Dict[str, List[int]] = {name: [] for name in J.DEPENDENCIES}
        for item in refs:
            try:
                kind, ref = afterspec.split(item)
                job_id, index = _ref(ref)
            except (Bad, ValueError) as err:
                raise Bad(f"--after: {err}".replace("--after: --after: ", "--after: ")) from None
            field = "after" if kind == afterspec.AFTEROK else f"after_{kind[5:]}"
            if index is None and job_id in self.store.arrays:
                out[f"{field}_arrays"].append(job_id)
                continue
            job = self.store.get(job_id) if index is None else self.store.element(job_id, index)
            if job is None:
                raise Bad(f"--after {_ref_text(ref)}: no such job")
            out[field].append(job.id)
        return {name: tuple(dict.fromkeys(ids)) for name, ids in out.items()}

    def _never_met(self, job: Job) -> None:
        """Bad (one line) when one of its dependencies can never be met as the jobs are now (an afterok on
        a job that failed or was cancelled, an afternotok on one done): sbatch refuses such a job too."""
        arrays = (*job.after_arrays, *job.after_any_arrays, *job.after_notok_arrays)
        elements = [e for a in dict.fromkeys(arrays) for e in self.store.elements(a)]
        named = (self.store.get(i) for i in (*job.after, *job.after_any, *job.after_notok))
        never = never_met(job, {j.id: j for j in named if j is not None}, elements)
        if never is not None:
            why = waiting_words_never_met(never, self._named)
            raise Bad(f"--after {why.replace(' (', ' can never be met (', 1)}", 1)

    def _named(self, job_id: int) -> str:
        job = self.store.get(job_id)
        return J.ref(job) if job is not None else str(job_id)

    def _time_limit(self, req: dict) -> Optional[float]:
        """--time-limit (seconds), within [queue] max_time_limit; [queue] default_time_limit without one."""
        limit = req.get("time_limit")
        if limit is None:
            return self.queue.default_time_limit
        limit = _seconds(req, "time_limit", 0.0, "--time-limit")
        if limit <= 0:
            raise Bad("--time-limit must be more than 0")
        return timelimits.within_max(limit, self.queue)

    def _notify(self, req: dict) -> Tuple[str, ...]:
        """--notify CMD (run by /bin/sh as the user), or none."""
        text = fields.text(req, "notify", "--notify", fields.MAX_NOTIFY)
        return (text,) if text else ()

    def _could_start(self, gpus: int) -> None:
        """Refuse a job that could never start under the queue's GPUs and limits as they are now (one that
        a reload left so keeps waiting, with its reason)."""
        known = self.view().gpus
        never = never_fits(gpus, known if known is not None else gpus, self.queue)
        if never is not None:
            raise Bad(refusal(never, gpus), 1)

    # ------------------------------------------------------------------ jobs

    def _jobs(self, peer: Peer, user: pwd.struct_passwd, req: dict) -> Pages:
        """`{"ok": true, "jobs": [...], "more": N, "drained": ...}`: with `limit`, at most that many queued
        or held jobs are listed (every running one is) and `more` counts the rest. In pages (PAGE_BYTES),
        each made when the client is ready for it: the jobs are picked when the first is made."""
        fields.optional_text(req.get("user"), "--user", 256)
        fields.optional_text(req.get("name"), "--name", 1000)
        want_state = req.get("state")
        if want_state is not None and want_state not in J.STATES:
            raise Bad(f"--state {sanitize(str(want_state))[:20]!r} is not a job state")
        ids, limit = req.get("ids") or [], req.get("limit")
        if not isinstance(ids, list) or len(ids) > 10000:
            raise Bad("ids must be job ids")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
            raise Bad("limit must be a whole number")
        if ids:
            _few_ranges(ids)
            for ref in ids:  # (a bad one refused now, in one line)
                self._range(ref) if arrays.is_range(ref) else _ref(ref)
        return Pages(self._pages(req, ids, limit))

    def _pages(self, req: dict, ids: list, limit: Optional[int]) -> Iterator[bytes]:
        """The answer's pages: `{"ok":true,"more":N,"drained":...,"jobs":[...],"arrays":{...}}`, each but
        the last with `"continued":true`; an array's shared values ("arrays", by its id) come once, in the
        page of its first element listed."""
        view, now, whole = self.view(), time.time(), bool(ids)
        entries, groups = self._entries(req, ids)
        shown, more = _limited(entries, groups, limit)
        if len(self.listing) > 2 * len(self.store.jobs) + 1000:  # (jobs pruned since)
            self.listing.keep_only(self.store.jobs, self.store.arrays)
        head = b'"more":%d,"drained":%s,' % (more, _drained_json(self.store.drained).encode())
        parts: List[bytes] = []
        shared: List[bytes] = []
        seen: Set[int] = set()
        size = 0
        for e in shown:
            if size >= PAGE_BYTES:
                yield _page(head, parts, shared, True)
                parts, shared, size, head = [], [], 0, b""
            first = e if isinstance(e, Job) else groups[e][0]
            if first.array_id and first.array_id not in seen:
                seen.add(first.array_id)
                shared.append(b'"%d":%s' % (first.array_id, self.listing.shared(first, whole)))
                size += len(shared[-1]) + 1
            parts.append(self._entry(e, groups, view, now, whole))
            size += len(parts[-1]) + 1
        yield _page(head, parts, shared, False)

    def _entries(self, req: dict, ids: list) -> Tuple[List[Entry], Dict[Tuple[int, str], List[Job]]]:
        """The jobs the request lists, in order: a job, or (collapse) an array's elements in one state."""
        want_user, want_state, want_name = req.get("user"), req.get("state"), req.get("name")
        every = bool(req.get("all")) or bool(ids) or want_state in J.ENDED
        if ids:
            found = {j.id: j for ref in ids for j in self._found(ref)}
            candidates: List[Job] = sorted(found.values(), key=lambda j: j.id)
        else:
            candidates = self.store.all()
        collapse = bool(req.get("collapse"))
        entries: List[Entry] = []
        groups: Dict[Tuple[int, str], List[Job]] = {}
        for j in candidates:
            if (want_user and j.user != want_user) or (want_state and j.state != want_state):
                continue
            if want_name is not None and j.name != want_name:
                continue
            if not every and j.state in J.ENDED:
                continue
            if collapse and j.array_id:
                key = (j.array_id, j.state)
                group = groups.get(key)
                if group is None:
                    groups[key] = [j]
                    entries.append(key)
                else:
                    group.append(j)
                continue
            entries.append(j)
        return entries, groups

    def _entry(
        self, e: Entry, groups: Dict[Tuple[int, str], List[Job]], view: View, now: float, whole: bool
    ) -> bytes:
        """One entry's JSON: a job's, or a collapsed group's (what its elements share, else totals and
        ranges: grouped.py; with `elements` and `count`)."""
        members = [e] if isinstance(e, Job) else groups[e]
        if len(members) == 1:  # (one element is named as itself: `17_5`, not `17_[5] (1)`)
            return self._encoded(members[0], view, now, whole)
        encoded = self._encoded(members[0], view, now, whole)
        indices = arrays.ranges(m.array_index for m in members)
        group = grouped(json.loads(encoded), members, view.index_of, lambda j: reason_key(j, view))
        encoded = json.dumps(group, separators=(",", ":")).encode()
        return encoded[:-1] + b',"elements":"%s","count":%d}' % (indices.encode(), len(members))

    def _ids(self, peer: Peer, user: pwd.struct_passwd, req: dict) -> Encoded:
        """`{"ok": true, "ids": [...]}`: the asking user's own jobs (root's too: only its own), in these
        `states` (default: every state), for shell completion."""
        states = req.get("states")
        wanted = set(J.STATES if states is None else states if isinstance(states, list) else ())
        if not wanted or not all(isinstance(s, str) for s in wanted):
            raise Bad("states must be a list of job states")
        return Encoded(b'{"ok":true,"ids":[%s]}' % b",".join(_named_ids(self.store.all(), peer.uid, wanted)))

    def _encoded(self, j: Job, view: View, now: float, whole: bool) -> bytes:
        reason = listed_reason(reason_of(j, view, now), whole)
        indices = tuple(view.index_of.get(u) for u in j.gpus) if j.state in J.LIVE else ()
        return self.listing.encoded(j, reason, indices, whole, estimate(j, view))

    # ------------------------------------------------------------------ cancel, hold, release, logs

    def _found(self, ref: object) -> List[Job]:
        """The jobs a reference names: `17` (a job, or every element of array 17), `17_5` (one element),
        `17_[0-3,8]` (those elements of array 17 that are there: Slurm's scancel's ranges)."""
        if arrays.is_range(ref):
            return self._in_range(*self._range(ref))
        job_id, index = _ref(ref)
        if index is None and job_id in self.store.arrays:
            return self.store.elements(job_id)
        job = self.store.get(job_id) if index is None else self.store.element(job_id, index)
        return [job] if job is not None else []

    def _range(self, ref: object) -> Tuple[int, Sequence[int]]:
        """A range's array and indices, bounded by [queue] max_array_size (an enormous one is refused
        before anything is made for it); Bad (one line, exit 2) when it is malformed."""
        try:
            return arrays.parse_range(str(ref), self.queue.max_array_size)
        except arrays.SpecError as err:
            raise Bad(str(err)) from None

    def _in_range(self, array_id: int, indices: Sequence[int]) -> List[Job]:
        """The elements of the array that the indices name, by index (whichever is shorter is walked)."""
        members = self.store.arrays.get(array_id, {})
        if len(indices) <= len(members):
            found = (self.store.element(array_id, i) for i in indices)
            return [j for j in found if j is not None]
        wanted = indices if isinstance(indices, range) else frozenset(indices)
        return [j for j in self.store.elements(array_id) if j.array_index in wanted]

    def _targets(self, peer: Peer, ref: object) -> List[Job]:
        """The jobs a reference names, when the asking user may change them (theirs; root: any)."""
        found = self._found(ref)
        if not found:
            raise Bad(f"job {_ref_text(ref)}: no such job", 1)
        if peer.uid != 0 and found[0].uid != peer.uid:
            raise Bad(f"job {_ref_text(ref)} is {found[0].user}'s, not yours", 1)
        return found

    def _mine(self, peer: Peer, user: pwd.struct_passwd, ref: object) -> Job:
        found = self._targets(peer, ref)
        if len(found) > 1 and arrays.is_range(ref):
            raise Bad(f"job {_ref_text(ref)} names {len(found)} elements: name one ({J.ref(found[0])}, ...)")
        if len(found) > 1:
            name = _ref_text(ref)
            raise Bad(f"job {name} is an array of {len(found)} elements: name one ({name}_INDEX)")
        return found[0]

    def _each(self, peer: Peer, user: pwd.struct_passwd, req: dict, change: Callable[[Job], Job]) -> dict:
        if req.get("select") is not None:
            return self._selected(peer, user, req, change)
        ids = req.get("ids")
        if not isinstance(ids, list) or not ids or len(ids) > 10000:
            raise Bad("no job ids given")
        _few_ranges(ids)
        results: List[dict] = []
        for ref in ids:
            try:
                found = self._targets(peer, ref)
                one = _names_one(ref, found)
                results.append(self._one(ref, found[0], change) if one else self._apply(ref, found, change))
            except Bad as err:
                results.append({"id": ref, "ok": False, "error": str(err), "code": err.code})
        self.changed()
        return {"results": results}

    def _one(self, ref: object, job: Job, change: Callable[[Job], Job]) -> dict:
        new = self.store.change(job.id, change)
        state = new.state if new is not None else self.store.jobs[job.id].state
        return {"id": ref, "ok": True, "state": state}

    def _apply(self, ref: object, found: List[Job], change: Callable[[Job], Job]) -> dict:
        """A change to every element of an array, in one transaction; the elements it does not apply to
        (a cancel of those already ended) are left as they are."""

        def quiet(job: Job) -> Optional[Job]:
            try:
                return change(job)
            except Bad:
                return None

        changed = [j for j in self.store.change_many((j.id, quiet) for j in found) if j is not None]
        if not changed:
            states = ", ".join(sorted({j.state for j in found}))
            raise Bad(f"array {_ref_text(ref)}: nothing to change (its {len(found)} elements: {states})", 1)
        states = sorted({j.state for j in changed})
        return {"id": ref, "ok": True, "state": ", ".join(states), "count": len(changed), "of": len(found)}

    def _selected(self, peer: Peer, user: pwd.struct_passwd, req: dict, change: Callable[[Job], Job]) -> dict:
        """`cancel --name NAME`, `--state STATE`, `--all` (root: `--user USER`): every job of one user that
        the selection names and the change applies to, in one transaction; how many."""
        op, sel = str(req.get("op")), req["select"]
        if not isinstance(sel, dict):
            raise Bad("select must be an object")
        name, state = sel.get("name"), sel.get("state")
        name = fields.optional_text(name, "--name", 1000)
        if state is not None and state not in J.STATES:
            raise Bad(f"--state {sanitize(str(state))[:20]!r} is not a job state")
        if name is None and state is None and sel.get("all") is not True:
            raise Bad(f"{op}: name jobs: IDs, or --name, --state or --all")
        whose, owned = self._owner(peer, user, sel.get("user"), op)

        def matches(j: Job) -> bool:
            return owned(j) and (name is None or j.name == name) and (state is None or j.state == state)

        def edit(job: Job) -> Optional[Job]:  # (again in the transaction: a job may have changed since)
            if not matches(job):
                return None
            try:
                return change(job)
            except Bad:
                return None

        found = [j for j in self.store.all() if matches(j)]
        changed = [j for j in self.store.change_many((j.id, edit) for j in found) if j is not None]
        flags = [f"--name {sanitize(name)[:MAX_NAME]!r}"] if name is not None else []
        flags += [f"--state {state}"] if state is not None else []
        what = " ".join(flags) or "--all"
        if not found:
            raise Bad(f"{op}: no job of {whose} matches {what}", 1)
        if not changed:
            states = ", ".join(sorted({j.state for j in found}))
            n = len(found)
            raise Bad(
                f"{op}: {n} job{'s' if n != 1 else ''} of {whose} match {what} ({states}): none to {op}", 1
            )
        self.changed()
        stopping = sum(1 for j in changed if j.state == J.STOPPING)
        return {"count": len(changed), "stopping": stopping, "matched": len(found)}

    def _owner(
        self, peer: Peer, user: pwd.struct_passwd, who: object, op: str
    ) -> Tuple[str, Callable[[Job], bool]]:
        """Whose jobs a selection is among, in words, and the test: the asker's own; root's `--user NAME`,
        that user's; root's `--user '*'`, everyone's (only ever asked for by name: a root without
        `--user` selects only its own jobs)."""
        if who is None or who == user.pw_name:
            return "yours", lambda j: j.uid == peer.uid
        if not isinstance(who, str) or not who or len(who) > 256:
            raise Bad("--user must be a user name")
        if not _admin(peer):
            raise Bad(f"{op}: only root may select another user's jobs (--user {sanitize(who)[:40]})", 1)
        if who == "*":
            return "any user", lambda j: True
        return f"{sanitize(who)[:40]}'s", lambda j: j.user == who

    def _queue(self, peer: Peer, user: pwd.struct_passwd, req: dict) -> dict:
        """`gpu-mon queue drain` (no job starts; running ones go on) and `resume`: root's (or the daemon's
        own user's); kept in the database, so a restarted daemon stays drained."""
        action = req.get("action")
        if action not in ("drain", "resume"):
            raise Bad(f"queue: {sanitize(str(action))[:20]!r} is not drain or resume")
        if not _admin(peer):
            raise Bad(f"queue {action}: only root may drain or resume the queue", 1)
        before = self.store.drained
        if action == "drain" and before is None:
            self.store.drain(Drained(user.pw_name, time.time()))
            log.info("queue: drained by %s: no job starts until `gpu-mon queue resume`", user.pw_name)
        elif action == "resume" and before is not None:
            self.store.drain(None)
            log.info("queue: resumed by %s: jobs start again", user.pw_name)
        else:
            return {"changed": False, "drained": _drained_dict(before)}
        self.changed()
        return {"changed": True, "drained": _drained_dict(self.store.drained)}

    def _cancel(self, peer: Peer, user: pwd.struct_passwd, req: dict) -> dict:
        who = user.pw_name

        def cancel(job: Job) -> Job:
            if job.state in (J.QUEUED, J.HELD):
                return J.cancelled(job, time.time(), cancelled_reason(job, who))
            if job.state == J.RUNNING:
                return J.stopping(job, J.STOP_CANCEL, by=who)
            if job.state == J.STOPPING and job.reason != J.STOP_CANCEL:
                return dataclasses.replace(job, reason=J.STOP_CANCEL, stopped_by=who)
            if job.state == J.STOPPING:
                return job
            raise Bad(f"job {J.ref(job)} has already ended ({job.state})", 1)

        return self._each(peer, user, req, cancel)

    def _hold(self, peer: Peer, user: pwd.struct_passwd, req: dict) -> dict:
        def hold(job: Job) -> Job:
            if job.state == J.HELD:
                return job
            if job.state != J.QUEUED:
                raise Bad(f"job {J.ref(job)} is {job.state}: only a queued job can be held", 1)
            return J.held(job)

        return self._each(peer, user, req, hold)

    def _release(self, peer: Peer, user: pwd.struct_passwd, req: dict) -> dict:
        def release(job: Job) -> Job:
            if job.state != J.HELD:
                raise Bad(f"job {J.ref(job)} is {job.state}, not held", 1)
            return J.released(job)

        return self._each(peer, user, req, release)

    def _show(self, peer: Peer, user: pwd.struct_passwd, req: dict) -> dict:
        """`gpu-mon show ID`: every job the id names (show.py), anyone's."""
        ref = req.get("id")
        found = self._found(ref)
        if not found:
            raise Bad(f"job {_ref_text(ref)}: no such job", 1)
        view, now = self.view(), time.time()
        described = partial(describe, view=view, now=now, whole=True)
        return show.shown(found, peer.uid, described, output_of, self.store.runs_of, self.live)

    def _update(self, peer: Peer, user: pwd.struct_passwd, req: dict) -> dict:
        """`gpu-mon update`: the change update.py reads, checked as a submit checks it, made to each job
        named that the asker may change (an array named whole: its queued and held elements)."""
        ids = req.get("ids")
        if not isinstance(ids, list) or not ids or len(ids) > 10000:
            raise Bad("update: no job ids given")
        _few_ranges(ids)
        change = update.asked(req, self.queue, self._after, self._could_start)
        results: List[dict] = []
        for ref in ids:
            try:
                found = self._targets(peer, ref)
                whole = not _names_one(ref, found)  # (an array, or a range of its elements)
                self._may_update(peer, found if whole else found[:1], change)
                edit = partial(update.changed, change=change, waiting_only=whole)
                results.append(self._apply(ref, found, edit) if whole else self._one(ref, found[0], edit))
            except Bad as err:
                results.append({"id": ref, "ok": False, "error": str(err), "code": err.code})
        self.changed()
        return {"results": results}

    def _may_update(self, peer: Peer, found: List[Job], change: update.Change) -> None:
        """Bad when the change may not be made to these jobs: a plain user raising a priority; an --after
        that can never be met, or that would wait for the job itself."""
        waiting = [j for j in found if j.state in (J.QUEUED, J.HELD)]
        update.allowed(waiting or found, change, _admin(peer))
        if change.after is None or not waiting:
            return
        self._never_met(dataclasses.replace(waiting[0], **change.after))
        for j in waiting if len(waiting) < 1000 else waiting[:1] + waiting[-1:]:
            looped = update.cycle(j, change.after, self.store.get, self.store.elements)
            if looped is not None:
                through = self._named(looped)
                raise Bad(f"--after: job {J.ref(j)} would wait for itself (through job {through})", 1)

    def _share(self, peer: Peer, user: pwd.struct_passwd, req: dict) -> dict:
        """`gpu-mon share`: share.py's table (a plain user: only their own line under share_public = no)."""
        everyone = _admin(peer) or self.queue.share_public
        return share.table(self.store.all(), self.queue, time.time(), None if everyone else user.pw_name)

    def _logs_path(self, peer: Peer, user: pwd.struct_passwd, req: dict) -> dict:
        job = self._mine(peer, user, req.get("id"))
        return {
            "path": output_of(job),
            "state": job.state,
            "reason": job.reason,
            "ran": job.started is not None,  # (one cancelled before it ran has no output: never had)
            "uid": job.uid,  # (whose: logs reads it as its owner)
            "gid": job.gid,
        }


def kept_limits(q: QueueSection) -> Limits:
    """What one user may have in the store: max_queued_per_user unfinished jobs; max_kept_per_user jobs in
    all (never fewer than the unfinished ones allowed); max_stored_mib_per_user of their rows."""
    kept = max(q.max_kept_per_user, q.max_queued_per_user) if q.max_kept_per_user else 0
    return Limits(q.max_queued_per_user, kept, q.max_stored_mib_per_user * MIB)


def _limited(
    entries: List[Entry], groups: Dict[Tuple[int, str], List[Job]], limit: Optional[int]
) -> Tuple[List[Entry], int]:
    """The entries listed under `limit` (queued or held ones, at most that many) and how many are not."""
    if limit is None:
        return entries, 0
    shown: List[Entry] = []
    waiting = more = 0
    for e in entries:
        first = e if isinstance(e, Job) else groups[e][0]
        if first.state in (J.QUEUED, J.HELD):
            waiting += 1
            if waiting > limit:
                more += 1
                continue
        shown.append(e)
    return shown, more


def _admin(peer: Peer) -> bool:
    """Root, or the user the daemon runs as."""
    return peer.uid in (0, os.geteuid())


def _drained_dict(drained: Optional[Drained]) -> Optional[dict]:
    return None if drained is None else {"by": drained.by, "at_wall": round(drained.at)}


def _page(head: bytes, jobs: List[bytes], shared: List[bytes], continued: bool) -> bytes:
    """One page of a `jobs` answer (`shared`: the arrays first listed in it, as `"ID":{...}`)."""
    arrays = b',"arrays":{%s}' % b",".join(shared) if shared else b""
    more = b',"continued":true' if continued else b""
    return b'{"ok":true,%s"jobs":[%s]%s%s}' % (head, b",".join(jobs), arrays, more)


def _drained_json(drained: Optional[Drained]) -> str:
    """The `drained` of a `jobs` answer: null, or who drained the queue and when."""
    return json.dumps(_drained_dict(drained), separators=(",", ":"))


def can_start(job: Job, user: pwd.struct_passwd) -> None:
    """Bad (one line) when what is known now says the job cannot start: checked as its user
    (submitcheck.py). A job with no command (a request that skipped the client) is refused by the door."""
    home = None if job.output else (user.pw_dir, os.path.join(user.pw_dir, DEFAULT_OUTPUT))
    path = job.env_dict.get("PATH")
    groups = groups_of(job.uid, job.gid)
    submitcheck.check(job.uid, job.gid, groups, job.cwd, job.command, path, job.output, home)


def output_of(job: Job) -> str:
    """Where the job's output goes."""
    if job.output:
        return arrays.expand_output(job.output, job.id, job.array_id, job.array_index)
    try:
        home = pwd.getpwuid(job.uid).pw_dir
    except KeyError:
        home = "/nonexistent"
    return default_output(home, J.ref(job))


def cancelled_reason(job: Job, who: str) -> str:
    """`cancelled by alice`; for a job back in the queue after a run, how that run ended, in the word
    `report --by job` gives it (`cancelled by root while queued (last run preempted)`)."""
    if job.started is None:
        return f"cancelled by {who}"
    return f"cancelled by {who} while {job.state} (last run {how_it_ended(job)})"


def _ref(ref: object) -> Tuple[int, Optional[int]]:
    """A job reference from a request: 17 or "17" (a job or a whole array), "17_5" (an element)."""
    if isinstance(ref, int) and not isinstance(ref, bool):
        return ref, None
    if isinstance(ref, str) and len(ref) < 40:
        try:
            return arrays.parse_ref(ref)
        except ValueError:
            pass
    raise Bad(f"{sanitize(str(ref))[:40]!r} is not a job id")


def _names_one(ref: object, found: List[Job]) -> bool:
    """Whether `ref` names one job (an element, or a job that is no array), not an array or a range of
    its elements (`found`: the jobs it names)."""
    return not arrays.is_range(ref) and (_ref(ref)[1] is not None or found[0].array_id != _ref(ref)[0])


def _ref_text(ref: object) -> str:
    if arrays.is_range(ref):  # (one already parsed: only its shape, in a line's length)
        return sanitize(str(ref))[:80]
    job_id, index = _ref(ref)
    return str(job_id) if index is None else f"{job_id}_{index}"


MAX_RANGES = 100  # ranges (`17_[0-3,8]`) in one request: each may name up to [queue] max_array_size


def _few_ranges(ids: list) -> None:
    """Bad when a request names more ranges than MAX_RANGES (what they cost the daemon is bounded)."""
    if sum(1 for ref in ids if arrays.is_range(ref)) > MAX_RANGES:
        raise Bad(f"at most {MAX_RANGES} ranges of elements (17_[0-3,8]) in one request")


def _user(uid: int) -> pwd.struct_passwd:
    try:
        return pwd.getpwuid(uid)
    except KeyError:
        raise Bad(f"uid {uid} has no user name on this host", 1) from None


def _groups_of(user: pwd.struct_passwd) -> List[grp.struct_group]:
    out = []
    for gid in os.getgrouplist(user.pw_name, user.pw_gid):
        try:
            out.append(grp.getgrgid(gid))
        except KeyError:
            continue
    return out


def groups_of(uid: int, gid: int) -> Tuple[int, ...]:
    """The user's supplementary groups (as a login gives them)."""
    try:
        return tuple(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))
    except KeyError:
        return (gid,)


def _seconds(req: dict, key: str, default: float, what: str) -> float:
    value = req.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 366 * 86400:
        raise Bad(f"{what} must be a number of seconds (at most a year)")
    return float(value)


def _named_ids(jobs: Iterable[Job], uid: int, wanted: Set[str]) -> List[bytes]:
    """As users name them, JSON strings: `"17"`; an array's elements `"22_0"`, ... and the array once, `"22"`
    (before its first element listed)."""
    ids: List[bytes] = []
    arrays: Set[int] = set()
    for j in jobs:
        if j.uid != uid or j.state not in wanted:
            continue
        if j.array_id and j.array_id not in arrays:
            arrays.add(j.array_id)
            ids.append(b'"%d"' % j.array_id)
        ids.append(b'"%s"' % J.ref(j).encode())
    return ids
