"""[slurm] in the daemon: each round, find the Slurm jobs among the GPUs' holders and ask Slurm to stop a
preemptible one that someone else now uses a GPU of (slurm/decide.py), once per job: `scontrol requeue`
(after `scancel --signal` and a grace, when `signal` is set) or `scancel`. gpu-mon never signals a
job's processes itself.

Before a requeue the job is told to avoid this node (its excluded nodes, while Slurm holds it for the
moment of the change), so that Slurm does not start it again on the GPU someone uses; after
avoid_node_seconds its own list comes back. Slurm itself would start a requeued batch job again only about
two minutes after it has ended (its EligibleTime: the end of the requeue plus ~121 s on 22.05); once the job
is back in the queue (PENDING, no longer COMPLETING) gpu-mon sets its StartTime to now, so that it runs at
once on another node. What gpu-mon owes a job (its release, its lift) is written down before the hold
(slurm/owed.py): a gpu-mon killed in between pays it when it starts again. Calls run in control.py's
threads: the round only hands them over, so a slow or dead slurmctld never delays a yield; a failed
action is tried again each round while the use lasts, and each time slurmctld cannot be reached is one
log line.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Callable, Counter, Dict, List, Mapping, Optional, Tuple

from gpu_mon.api.model import Holder, SlurmJob, Snapshot
from gpu_mon.api.text import sanitize
from gpu_mon.config import GpuSection, SlurmSection
from gpu_mon.policy import words
from gpu_mon.policy.decide import ignored
from gpu_mon.slurm import alloc as AL
from gpu_mon.slurm import control as C
from gpu_mon.slurm import owed as O
from gpu_mon.slurm.decide import Act, Use, decide, gpus_of_jobs
from gpu_mon.slurm.jobs import JobInfo, Preemptible, fields, parse_job
from gpu_mon.slurm.procs import JobMembers
from gpu_mon.slurm.view import Action, JobOnGpus, SlurmReport

log = logging.getLogger("gpu_mon")

FORGET_SECONDS = 60.0  # a job not seen on a GPU for this long is looked up again when it comes back
RETRY_SECONDS = 1.0  # a failed action is asked for again after this long (each round, at most this often)
# After the release, how often the job is looked at until it is back in the queue (its processes end:
# Slurm's KillWait at most), and for how long at most.
PEEK_SECONDS, PEEK_SLOW_SECONDS, PEEK_FAST_FOR, PEEK_FOR = 0.05, 1.0, 5.0, 300.0
# A job kept off this node that runs elsewhere when its time is up keeps the exclusion (Slurm changes the
# excluded nodes of pending jobs only): looked at again this often, lifted once it is pending.
LIFT_RETRY_SECONDS = 30.0
# Slurm's allocations (`scontrol show job -d -o`: every job of the cluster, one call to slurmctld, as a
# `squeue` would) are read every [slurm] allocation_seconds (0: never), and at once after each action
# gpu-mon asked Slurm for.
_ENDED = (
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
)


@dataclass
class _Acting:
    """What gpu-mon asked of Slurm for one job."""

    act: Act
    info: JobInfo
    node: str
    wake: float  # monotonic: the wake that saw the use
    by_open: bool
    stage: str  # signal (grace running), action (under way), retry (failed: again next round), done
    due: float = 0.0  # stage signal: when the action goes out
    signalled: bool = False
    failed: bool = False  # a call failed (said once)


class Slurm:
    """The daemon's Slurm hook: `round()` each round, `report()` for the outputs."""

    def __init__(
        self,
        rule: SlurmSection,
        poke: Callable[[], None],
        clock: Callable[[], float],
        wall: Callable[[], float],
        spawn: C.Spawn = C.popen,
        record: str = "",
    ) -> None:
        self.rule = rule
        self.clock, self.wall = clock, wall
        self.control = C.Control(poke, rule.timeout_seconds, clock, spawn)
        self.members = JobMembers()
        self.host = socket.gethostname().split(".")[0]
        self.jobs: Dict[int, JobInfo] = {}
        self.looking: Dict[int, float] = {}
        self.seen: Dict[int, float] = {}
        self.acting: Dict[int, _Acting] = {}
        self.lifts: Dict[int, float] = {}  # job -> when this node comes off its excluded nodes (owed)
        self.on_gpus: Dict[int, Tuple[str, ...]] = {}
        self.done: List[Action] = []
        self.counts: Counter[Tuple[str, str]] = collections.Counter()
        self.unreachable = False
        self.episodes = 0
        self.broken = False
        self.node_of: Dict[Tuple[int, str], str] = {}  # (job, GPU) -> SLURMD_NODENAME of its process there
        self.peeks: Dict[int, Tuple[float, float, float]] = {}  # job -> (next look, first look, give up)
        self.peeking: set = set()
        self.record = record  # owed.py's file ("": none kept)
        self.owed: Dict[int, O.Owed] = {}
        # Slurm's allocations: {UUID: (job, user)} as last read (kept while Slurm cannot be read: a job
        # that Slurm cannot see end stays on its GPUs); unknown until the first read has answered.
        self.allocated: Dict[str, Tuple[int, str]] = {}
        self.alloc_known = False
        self.alloc_next = 0.0
        self.alloc_asking = False
        self.alloc_said = False  # the one line for allocations that cannot be mapped
        self.gpu_ids: Dict[Tuple[int, ...], str] = {}  # device node's identity -> UUID
        self.devices: Tuple[Tuple[str, str], ...] = ()
        if record:
            self._recover()

    # ------------------------------------------------------------------ each round

    def round(
        self,
        snap: Snapshot,
        rules: Mapping[str, GpuSection],
        index_of: Mapping[str, int],
        wake: float,
        by_open: bool,
    ) -> None:
        """Read the calls' results, find the jobs on the GPUs, and ask Slurm to act where it must. An error
        here is a bug: logged once, and the daemon's round goes on."""
        try:
            self._round(snap, rules, index_of, wake, by_open)
        except Exception:
            if not self.broken:
                self.broken = True
                log.exception("slurm: internal error (please report it; shown once)")

    def _round(
        self,
        snap: Snapshot,
        rules: Mapping[str, GpuSection],
        index_of: Mapping[str, int],
        wake: float,
        by_open: bool,
    ) -> None:
        now = self.clock()
        self._devices(snap)
        self.take_results()
        uses = self._uses(snap, rules)
        self.on_gpus = {j: tuple(sorted(g)) for j, g in gpus_of_jobs(uses).items()}
        for job in {*self.on_gpus, *(j for j, _u in self.allocated.values())}:
            self.seen[job] = now
            if job not in self.jobs and job not in self.looking:
                self._lookup(job, now)
        settled = frozenset(j for j, a in self.acting.items() if a.stage != "retry" or now < a.due)
        preemptible = Preemptible(self.rule.preemptible_partitions, self.rule.preemptible_qos)
        acts = decide(uses, self.jobs, preemptible, settled)
        for act in acts:
            self._begin(act, index_of, wake, by_open, now)
        asked = {a.job for a in acts}
        for job in [
            j for j, a in self.acting.items() if a.stage == "retry" and now >= a.due and j not in asked
        ]:
            del self.acting[job]  # the use is over: nothing to ask again (a new one starts afresh)
        self.tick(now)
        self._forget(now)

    def tick(self, now: float) -> None:
        """Deadlines: a signal's grace is over (the action goes out), an avoided node may be used again."""
        for job, a in self.acting.items():
            if a.stage == "signal" and now >= a.due:
                self._action(job, a, now)
        for job, due in list(self.lifts.items()):
            if now >= due:
                del self.lifts[job]
                argv = (self.rule.scontrol, "show", "job", "-o", str(job))
                self.control.submit(C.Call(job, "lift-look", (argv,), now))
        if self.rule.allocation_seconds > 0 and now >= self.alloc_next and not self.alloc_asking:
            self.alloc_asking = True
            argv = (self.rule.scontrol, "show", "job", "-d", "-o")
            self.control.submit(C.Call(0, "allocations", (argv,), now))
        for job, (due, _first, _end) in list(self.peeks.items()):
            if now >= due and job not in self.peeking:
                self.peeking.add(job)
                argv = (self.rule.scontrol, "show", "job", "-o", str(job))
                self.control.submit(C.Call(job, "peek", (argv,), now))

    def wanted(self, now: float) -> bool:
        """Whether a round is due: a call has finished, or a deadline has come."""
        self.control.pump()  # (a call's next command starts at once)
        due = self.next_wake()
        return bool(self.control.results) or (due is not None and now >= due)

    def whose(self) -> str:
        """`partitions scavenger, QOS low` in words."""
        parts = []
        if self.rule.preemptible_partitions:
            parts.append(f"partitions {', '.join(self.rule.preemptible_partitions)}")
        if self.rule.preemptible_qos:
            parts.append(f"QOS {', '.join(self.rule.preemptible_qos)}")
        return " and ".join(parts)

    def next_wake(self) -> Optional[float]:
        """When `tick` has something to do."""
        due = [a.due for a in self.acting.values() if a.stage in ("signal", "retry")]
        due += list(self.lifts.values())
        due += [] if self.alloc_asking or self.rule.allocation_seconds == 0 else [self.alloc_next]
        due += [d for j, (d, _f, _e) in self.peeks.items() if j not in self.peeking]
        return min(due, default=None)

    def _uses(self, snap: Snapshot, rules: Mapping[str, GpuSection]) -> Tuple[Use, ...]:
        """Every process on a GPU that is not ours and not ignored, with its Slurm job."""
        merged: Dict[int, Tuple[Holder, frozenset]] = {}
        for h in (*snap.holders, *snap.nvml_procs):
            if h.ours:  # (ours on every GPU it holds; on one it was not given, its hold or context counts)
                continue
            gpus = frozenset(u for u in h.gpus if not h.ours_on(u) and not _ignored(h, rules.get(u)))
            if gpus:
                old = merged.get(h.pid)
                merged[h.pid] = (old[0] if old else h, gpus | (old[1] if old else frozenset()))
        uses = []
        self.node_of = {}
        for pid, (h, gpus) in sorted(merged.items()):
            member = self.members.of(pid, h.start_ticks)
            uses.append(Use(pid, h.user, h.name, gpus, member.job if member else None))
            if member is not None and member.node:
                self.node_of.update({(member.job, g): member.node for g in gpus})
        if len(self.members.cache) > 4 * len(merged) + 1000:
            self.members.keep_only((h.pid, h.start_ticks) for h, _g in merged.values())
        return tuple(uses)

    @property
    def node(self) -> str:
        """This node as Slurm names it, where no job's process says: [slurm] node_name, else the short
        host name."""
        return self.rule.node_name or self.host

    def _node(self, job: int, gpu: str) -> str:
        """This node as Slurm names it: node_name where set; else SLURMD_NODENAME in the job's processes on
        that GPU, or in any of them, else the short host name."""
        if self.rule.node_name:
            return self.rule.node_name
        if (job, gpu) in self.node_of:
            return self.node_of[(job, gpu)]
        for (_pid, _ticks), m in self.members.cache.items():
            if m is not None and m.job == job and m.node:
                return m.node
        return self.node

    def _lookup(self, job: int, now: float) -> None:
        self.looking[job] = now
        argv = (self.rule.scontrol, "show", "job", "-d", "-o", str(job))
        self.control.submit(C.Call(job, "lookup", (argv,), now))

    def _begin(self, act: Act, index_of: Mapping[str, int], wake: float, by_open: bool, now: float) -> None:
        info = self.jobs[act.job]
        old = self.acting.get(act.job)
        if old is not None:  # a retry (said when first asked for, and at the first failure); no new signal
            old.act = act
            self._action(act.job, old, now)
            return
        a = _Acting(act, info, self._node(act.job, act.gpu), wake, by_open, "action")
        self.acting[act.job] = a
        what = self.rule.action if self.rule.signal is None else "signal"
        log.info(
            "slurm: %s on %s, which job %d holds (%s, partition %s%s): %s",
            act.by.label,
            words.gpu(act.gpu, dict(index_of)),
            act.job,
            sanitize(info.user),
            sanitize(info.partition or "?"),
            f", QOS {sanitize(info.qos)}" if info.qos else "",
            {"signal": "signalling it", "requeue": "requeueing it", "cancel": "cancelling it"}[what],
        )
        if what == "signal":
            a.stage, a.due, a.signalled = "signal", now + self.rule.signal_grace_seconds, True
            argv = (self.rule.scancel, f"--signal={self.rule.signal}", "--full", str(act.job))
            self.control.submit(C.Call(act.job, "signal", (argv,), now))
        else:
            self._action(act.job, a, now)

    def _action(self, job: int, a: _Acting, now: float) -> None:
        a.stage = "action"
        s = self.rule
        if s.action == "cancel":
            argvs: Tuple[Tuple[str, ...], ...] = ((s.scancel, str(job)),)
        elif s.avoid_node_seconds > 0:
            # Held while its excluded nodes change: Slurm cannot start it again on this node meanwhile.
            exclude = ",".join(n for n in (a.info.exc_nodes, a.node) if n)
            self._owe(O.Owed(job, a.info.exc_nodes, a.node))  # (before the hold)
            argvs = ((s.scontrol, "requeuehold", str(job)),)
            after = (
                (s.scontrol, "update", f"JobId={job}", f"ExcNodeList={exclude}"),
                (s.scontrol, "release", str(job)),
            )
            self.control.submit(C.Call(job, s.action, argvs, now, after=after))
            return
        else:
            argvs = ((s.scontrol, "requeue", str(job)),)
        self.control.submit(C.Call(job, s.action, argvs, now))

    def _forget(self, now: float) -> None:
        for job in [j for j, t in self.seen.items() if now - t > FORGET_SECONDS]:
            del self.seen[job]
            self.jobs.pop(job, None)
        # A job acted on whose processes are gone may come back (requeued): it may be acted on again.
        for job in [j for j, a in self.acting.items() if a.stage == "done" and j not in self.on_gpus]:
            del self.acting[job]

    # ------------------------------------------------------------------ results

    def take_results(self) -> None:
        """What the calls did: job details, actions' results (logged, counted, kept for history)."""
        for r in self.control.take():
            self._reachable(r)
            if r.call.kind == "lookup":
                self._looked_up(r)
            elif r.call.kind == "allocations":
                self._allocations(r)
            elif r.call.kind in ("lift-look", "lift"):
                self._lifting(r)
            elif r.call.kind == "peek":
                self._peeked(r)
            elif r.call.kind in ("eligible", "release"):
                self._released(r)
            else:
                self._acted(r)

    def _reachable(self, r: C.Result) -> None:
        if r.result == C.UNREACHABLE and not self.unreachable:
            self.unreachable, self.episodes = True, self.episodes + 1
            log.warning("slurm: cannot reach Slurm (%s); trying again each round", r.error)
        elif r.result != C.UNREACHABLE and self.unreachable:
            self.unreachable = False
            log.info("slurm: Slurm answers again")

    def _looked_up(self, r: C.Result) -> None:
        self.looking.pop(r.call.job, None)
        info = parse_job(r.output) if r.result == C.OK else None
        if info is not None and info.job == r.call.job:
            self.jobs[info.job] = info
        elif r.result not in (C.UNREACHABLE, C.OK):
            log.debug("slurm: cannot describe job %d: %s", r.call.job, r.error)

    def _acted(self, r: C.Result) -> None:
        job, kind = r.call.job, r.call.kind
        a = self.acting.get(job)
        self.counts[(kind, r.result)] += 1
        if a is None:
            return
        issued = (r.issued - a.wake) * 1000 if r.issued else None
        self.done.append(
            Action(
                wall=self.wall(),
                job=job,
                user=a.info.user,
                partition=a.info.partition,
                gpu=a.act.gpu,
                by=a.act.by.label,
                action=kind,
                result=r.result,
                issued_ms=issued,
                seen_by="open" if a.by_open else "poll",
                error=r.error,
            )
        )
        took = f"issued {issued:.1f} ms after the {'open' if a.by_open else 'poll'}" if issued else ""
        if r.note:
            log.warning("slurm: job %d: %s", job, r.note)
        if r.result == C.OK:
            log.info("slurm: job %d: %s done (%s; %.0f ms)", job, kind, took, (r.done - r.issued) * 1000)
        elif r.result == C.GONE:
            log.info("slurm: job %d: %s: the job has ended (%s)", job, kind, r.error)
        elif r.result == C.FAILED and not a.failed:
            log.warning("slurm: job %d: %s failed: %s; trying again each round", job, kind, r.error)
        self.alloc_next = min(self.alloc_next, self.clock())  # (what Slurm does next is read at once)
        if kind == "signal":
            return  # the action follows when the grace is over (tick)
        if r.result in (C.OK, C.GONE):
            a.stage = "done"
            if r.result == C.OK and kind == "requeue" and self.rule.avoid_node_seconds > 0:
                self._requeued(job, a.info.exc_nodes, a.node, self.rule.avoid_node_seconds)
            else:
                self._paid(job)
        else:
            a.stage, a.due = "retry", self.clock() + RETRY_SECONDS  # again, if the use goes on
            a.failed = a.failed or r.result == C.FAILED

    # ------------------------------------------------------------------ allocations

    def allocations(self) -> Tuple[Tuple[SlurmJob, ...], str]:
        """(The jobs Slurm has allocated GPUs of this host to, why they are not known yet) for the
        snapshot; none where allocation_seconds = 0 (not read)."""
        if self.rule.allocation_seconds == 0:
            return (), ""
        if not self.alloc_known:
            return (), "no answer from scontrol yet"
        by_job: Dict[Tuple[int, str], List[str]] = {}
        for uuid, key in sorted(self.allocated.items()):
            by_job.setdefault(key, []).append(uuid)
        return tuple(SlurmJob(j, u, tuple(g)) for (j, u), g in sorted(by_job.items())), ""

    def _devices(self, snap: Snapshot) -> None:
        """Each GPU's device node by what names it (looked at again when the GPUs' nodes change)."""
        devices = tuple(sorted((g.device, g.uuid) for g in snap.reading.gpus if g.device and g.uuid))
        if devices and devices != self.devices:
            self.devices = devices
            self.gpu_ids = {}
            for path, uuid in devices:
                key = AL.identity(path)
                if key is not None:
                    self.gpu_ids[key] = uuid

    def _allocations(self, r: C.Result) -> None:
        """Slurm's answer: the GPUs of this host it allocated, by job. A failed read keeps the last answer
        (a job Slurm cannot be asked about stays on its GPUs); a first read that fails leaves the GPUs to
        what is observed (Slurm that cannot be reached starts no job here either), said once."""
        self.alloc_asking = False
        if self.rule.allocation_seconds == 0:
            return  # (turned off by a reload while it was read)
        self.alloc_next = self.clock() + self.rule.allocation_seconds
        if r.result != C.OK:
            if not self.alloc_known:
                self.alloc_known = True
                log.warning(
                    "slurm: cannot read Slurm's allocations (%s): GPUs count as Slurm's only when its jobs "
                    "use them, until it answers",
                    r.error,
                )
            return
        allocs = AL.parse_allocations(r.output)
        seen = (m.node for m in self.members.cache.values() if m is not None)
        here, guess = AL.this_node(self.rule.node_name, self.host, seen)
        conf = AL.read_gres_conf(AL.gres_conf_path(os.environ))
        self.allocated, problems = AL.mapped(allocs, conf, here, self.gpu_ids, guess=guess)
        self.alloc_known = True
        if problems and not self.alloc_said:
            self.alloc_said = True
            log.warning(
                "slurm: cannot tell which GPU Slurm allocated (%s%s): such GPUs count as Slurm's only when "
                "its jobs use them (said once)",
                sanitize(problems[0]),
                f"; {len(problems) - 1} more" if len(problems) > 1 else "",
            )

    # ------------------------------------------------------------------ outputs

    def report(self) -> SlurmReport:
        """The Slurm side of the round, for status, history and metrics (actions finished since the last)."""
        preemptible = Preemptible(self.rule.preemptible_partitions, self.rule.preemptible_qos)
        jobs = []
        allocated: Dict[int, List[str]] = {}
        users: Dict[int, str] = {}
        for uuid, (job, user) in sorted(self.allocated.items()):
            allocated.setdefault(job, []).append(uuid)
            users[job] = user
        on = {j: set(g) for j, g in self.on_gpus.items()}
        for job, uuids in allocated.items():
            on.setdefault(job, set()).update(uuids)
        for job, gpus_ in sorted(on.items()):
            gpus = tuple(sorted(gpus_))
            info = self.jobs.get(job)
            a = self.acting.get(job)
            jobs.append(
                JobOnGpus(
                    job=job,
                    user=info.user if info else users.get(job, "?"),
                    partition=info.partition if info else "",
                    qos=info.qos if info else "",
                    preemptible=preemptible(info) if info else None,
                    gpus=gpus,
                    doing=_doing(a, self.rule.action),
                    allocated=tuple(allocated.get(job, ())),
                )
            )
        done, self.done = tuple(self.done), []
        counts = tuple((k, r, n) for (k, r), n in sorted(self.counts.items()))
        return SlurmReport(tuple(jobs), done, counts, self.unreachable, self.episodes)

    def set_rule(self, rule: SlurmSection) -> None:
        """A reload changed [slurm]: the new rule from the next round on."""
        if rule.timeout_seconds != self.rule.timeout_seconds:
            self.control.timeout = rule.timeout_seconds
        old, self.rule = self.rule, rule
        if rule.allocation_seconds == 0:
            self.allocated, self.alloc_known = {}, False  # (read afresh if turned on again)
        elif rule.node_name != old.node_name or rule.allocation_seconds != old.allocation_seconds:
            # Read again at once (turned on: every GPU is busy until the first answer, as at a start).
            self.alloc_next, self.alloc_said = self.clock(), False

    def close(self) -> None:
        """gpu-mon stops (or [slurm] is removed): the jobs still kept off this node get it back now (no one
        would lift them later), each call waited for at most timeout_seconds; what cannot be given back
        stays owed, for the next start."""
        for job, o in sorted(self.owed.items()):
            if o.released and self._give_back(o):
                self.owed.pop(job, None)
        self.lifts.clear()
        self._save()
        self.control.close()

    def _give_back(self, o: O.Owed) -> bool:
        """This node off the job's excluded nodes, now; whether nothing is owed any more. A job still ending
        (COMPLETING: Slurm would not take the change) is waited for, up to timeout_seconds."""
        end = self.clock() + self.rule.timeout_seconds
        while True:
            argv = [self.rule.scontrol, "show", "job", "-o", str(o.job)]
            code, text = C.ask(argv, self.rule.timeout_seconds)
            state, exc = _state(text if code == 0 else "")
            if state != "COMPLETING" or self.clock() >= end:
                break
            time.sleep(PEEK_SECONDS)
        if (
            (code != 0 and C.classify(code, text) == C.GONE)
            or state in _ENDED
            or (code == 0 and _clear(exc, o))
        ):
            return True
        if state != "PENDING":  # (Slurm changes the excluded nodes of pending jobs only)
            why = f"cannot read it: {text}" if code else "running elsewhere" if state == "RUNNING" else state
            log.info("slurm: job %d: %s; it stays off %s until gpu-mon starts again", o.job, why, o.node)
            return False
        argv = [self.rule.scontrol, "update", f"JobId={o.job}", f"ExcNodeList={_without(exc, o)}"]
        code, text = C.ask(argv, self.rule.timeout_seconds)
        if code == 0 and o.job in self.peeks:  # (not yet made eligible: Slurm's begin time is minutes away)
            C.ask(
                [self.rule.scontrol, "update", f"JobId={o.job}", "StartTime=now"], self.rule.timeout_seconds
            )
        if code == 0:
            log.info("slurm: job %d may use this node again", o.job)
        elif C.classify(code, text) != C.GONE:
            log.warning("slurm: job %d: cannot lift its exclusion of this node: %s", o.job, text)
            return False
        return True

    # ------------------------------------------------------------------ after the requeue

    def _requeued(self, job: int, own: str, node: str, avoid: float) -> None:
        """Released: its lift is due in `avoid` seconds, and it is looked at until it may start again."""
        self.lifts[job] = self.clock() + avoid
        self._owe(O.Owed(job, own, node, True, self.wall() + avoid))
        now = self.clock()
        self.peeks[job] = (now, now, now + PEEK_FOR)

    def _lifting(self, r: C.Result) -> None:
        """A lift: the job looked at (pending: this node off its excluded nodes; running elsewhere: again
        later, since Slurm changes a pending job's only; ended: nothing owed), or the update's result."""
        job, now = r.call.job, self.clock()
        o = self.owed.get(job) or O.Owed(job)
        if r.result == C.GONE:
            self._paid(job)
            return
        if r.result != C.OK:
            if not (r.call.kind == "lift" and "no longer pending" in r.error.lower()):
                log.info(
                    "slurm: job %d: cannot lift the exclusion of %s: %s", job, o.node or self.node, r.error
                )
            self.lifts[job] = now + LIFT_RETRY_SECONDS
            return
        if r.call.kind == "lift":
            self._paid(job)
            return
        state, exc = _state(r.output)
        if state in _ENDED or _clear(exc, o):
            self._paid(job)
        elif state == "PENDING":
            argv = (self.rule.scontrol, "update", f"JobId={job}", f"ExcNodeList={_without(exc, o)}")
            self.control.submit(C.Call(job, "lift", (argv,), now))
        else:
            self.lifts[job] = now + (PEEK_SLOW_SECONDS if state == "COMPLETING" else LIFT_RETRY_SECONDS)

    def _peeked(self, r: C.Result) -> None:
        """Back in the queue (its processes ended): StartTime=now, so that it need not wait for the begin
        time Slurm gives a requeued job; still ending: looked at again soon; running or gone: nothing."""
        job = r.call.job
        self.peeking.discard(job)
        if job not in self.peeks:
            return
        _due, first, end = self.peeks[job]
        state = fields(r.output).get("JobState", "") if r.result == C.OK else ""
        now = self.clock()
        if state == "PENDING":
            del self.peeks[job]
            argv = (self.rule.scontrol, "update", f"JobId={job}", "StartTime=now")
            self.control.submit(C.Call(job, "eligible", (argv,), now))
        elif r.result in (C.OK, C.UNREACHABLE, C.FAILED) and state in ("", "COMPLETING") and now < end:
            pause = PEEK_SECONDS if now - first < PEEK_FAST_FOR else PEEK_SLOW_SECONDS
            self.peeks[job] = (now + pause, first, end)
        else:
            del self.peeks[job]

    def _released(self, r: C.Result) -> None:
        """The StartTime update (or a recovered job's release) came back."""
        if r.call.kind == "release" and r.result in (C.OK, C.GONE):
            o = self.owed.get(r.call.job)
            if o is not None and r.result == C.OK:
                self._owe(O.Owed(o.job, o.own, o.node, True, o.lift_at))
                now = self.clock()
                self.peeks[o.job] = (now, now, now + PEEK_FOR)
            elif o is not None:
                self._paid(r.call.job)
        elif r.result not in (C.OK, C.GONE):
            log.info("slurm: job %d: %s: %s", r.call.job, r.call.kind, r.error)

    # ------------------------------------------------------------------ what is owed

    def _owe(self, o: O.Owed) -> None:
        self.owed[o.job] = o
        self._save()

    def _paid(self, job: int) -> None:
        if self.owed.pop(job, None) is not None:
            self._save()

    def _save(self) -> None:
        if not self.record:
            return
        try:
            O.save(self.record, self.owed)
        except OSError as err:
            log.warning("slurm: cannot write %s: %s", self.record, err)

    def _recover(self) -> None:
        """Jobs an earlier gpu-mon held or kept off this node and stopped before it gave them back: held
        ones are released now, exclusions lifted when they were due (at once if that has passed)."""
        try:
            self.owed = O.load(self.record)
        except ValueError as err:
            log.warning("slurm: cannot read what an earlier gpu-mon owes Slurm: %s", err)
            return
        now, wall = self.clock(), self.wall()
        for job, o in sorted(self.owed.items()):
            lift_at = o.lift_at or wall + self.rule.avoid_node_seconds
            self.lifts[job] = now + max(0.0, lift_at - wall)
            self.peeks[job] = (now, now, now + PEEK_FOR)  # (pending: eligible at once)
            if not o.released:
                log.info(
                    "slurm: job %d was held by a gpu-mon that stopped before it released it: releasing it",
                    job,
                )
                self.owed[job] = O.Owed(job, o.own, o.node, False, lift_at)
                argv = (self.rule.scontrol, "release", str(job))
                self.control.submit(C.Call(job, "release", (argv,), now))
        self._save()


def _state(text: str) -> Tuple[str, str]:
    """(JobState, ExcNodeList) from `scontrol show job -o` ("" each when not there)."""
    f = fields(text)
    exc = f.get("ExcNodeList", "")
    return f.get("JobState", ""), "" if exc == "(null)" else exc


def _clear(exc: str, o: O.Owed) -> bool:
    """Whether nothing is left to give back: the node gpu-mon added is not among the excluded nodes (the
    update never happened), or the job's own list named it too."""
    return "[" not in exc and _without(exc, o) == exc


def _without(exc: str, o: O.Owed) -> str:
    """The excluded nodes less the one gpu-mon added (kept when the job's own list named it too); where
    Slurm shows them as a range (`gpu[01-03]`), the job's own list as it was."""
    if not o.node or o.node in o.own.split(","):
        return exc
    if "[" in exc:
        return o.own
    return ",".join(n for n in exc.split(",") if n and n != o.node)


def _doing(a: Optional[_Acting], action: str) -> str:
    if a is None:
        return ""
    return {
        "signal": "signalled",
        "action": action,
        "retry": f"{action} (retrying)",
        "done": f"{action} done",
    }[a.stage]


def _ignored(h: Holder, rules: Optional[GpuSection]) -> bool:
    """Monitors never count; a GPU's [gpu-*] ignore_programs and ignore_users where it has one."""
    return h.monitor or (rules is not None and ignored(h, rules))
