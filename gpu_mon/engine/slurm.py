"""[slurm] in the daemon: each round, find the Slurm jobs among the GPUs' holders and ask Slurm to stop a
preemptible one that someone else now uses a GPU of (slurm/decide.py), once per job: `scontrol requeue`
(after `scancel --signal` and a grace, when `signal` is set) or `scancel`. gpu-mon never signals a
job's processes itself.

Before a requeue the job is told to avoid this node (its excluded nodes, while Slurm holds it for the
moment of the change), so that Slurm does not start it again on the GPU someone uses; after
avoid_node_seconds its own list comes back. Calls run in control.py's threads: the round only hands
them over, so a slow or dead slurmctld never delays a yield; a failed action is tried again each round
while the use lasts, and each time slurmctld cannot be reached is one log line.
"""

from __future__ import annotations

import collections
import logging
import socket
from dataclasses import dataclass
from typing import Callable, Counter, Dict, List, Mapping, Optional, Tuple

from gpu_mon.api.model import Holder, Snapshot
from gpu_mon.api.text import sanitize
from gpu_mon.config import GpuSection, SlurmSection
from gpu_mon.engine import words
from gpu_mon.engine.policy import ignored
from gpu_mon.slurm import control as C
from gpu_mon.slurm.decide import Act, Use, decide, gpus_of_jobs
from gpu_mon.slurm.jobs import JobInfo, Preemptible, parse_job
from gpu_mon.slurm.procs import JobMembers
from gpu_mon.slurm.view import Action, JobOnGpus, SlurmReport

log = logging.getLogger("gpu_mon")

FORGET_SECONDS = 60.0  # a job not seen on a GPU for this long is looked up again when it comes back
RETRY_SECONDS = 1.0  # a failed action is asked for again after this long (each round, at most this often)


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
    ) -> None:
        self.rule = rule
        self.clock, self.wall = clock, wall
        self.control = C.Control(poke, rule.timeout_seconds, clock, spawn)
        self.members = JobMembers()
        self.node = socket.gethostname().split(".")[0]
        self.jobs: Dict[int, JobInfo] = {}
        self.looking: Dict[int, float] = {}
        self.seen: Dict[int, float] = {}
        self.acting: Dict[int, _Acting] = {}
        self.lifts: Dict[int, Tuple[float, str]] = {}  # job -> (when, its own ExcNodeList)
        self.on_gpus: Dict[int, Tuple[str, ...]] = {}
        self.done: List[Action] = []
        self.counts: Counter[Tuple[str, str]] = collections.Counter()
        self.unreachable = False
        self.episodes = 0
        self.broken = False

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
        self.take_results()
        uses = self._uses(snap, rules)
        self.on_gpus = {j: tuple(sorted(g)) for j, g in gpus_of_jobs(uses).items()}
        for job in self.on_gpus:
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
        for job, (due, own) in list(self.lifts.items()):
            if now >= due:
                del self.lifts[job]
                argv = (self.rule.scontrol, "update", f"JobId={job}", f"ExcNodeList={own}")
                self.control.submit(C.Call(job, "lift", (argv,), now))

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
        due += [d for d, _own in self.lifts.values()]
        return min(due, default=None)

    def _uses(self, snap: Snapshot, rules: Mapping[str, GpuSection]) -> Tuple[Use, ...]:
        """Every process on a GPU that is not ours and not ignored, with its Slurm job."""
        merged: Dict[int, Tuple[Holder, frozenset]] = {}
        for h in (*snap.holders, *snap.nvml_procs):
            if h.ours:
                continue
            gpus = frozenset(u for u in h.gpus if not _ignored(h, rules.get(u)))
            if gpus:
                old = merged.get(h.pid)
                merged[h.pid] = (old[0] if old else h, gpus | (old[1] if old else frozenset()))
        uses = []
        for pid, (h, gpus) in sorted(merged.items()):
            member = self.members.of(pid, h.start_ticks)
            uses.append(Use(pid, h.user, h.name, gpus, member.job if member else None))
        if len(self.members.cache) > 4 * len(merged) + 1000:
            self.members.keep_only((h.pid, h.start_ticks) for h, _g in merged.values())
        return tuple(uses)

    def _node(self, job: int) -> str:
        """This node as Slurm names it: SLURMD_NODENAME in the job's processes, else the short host name."""
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
        a = _Acting(act, info, self._node(act.job), wake, by_open, "action")
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
            elif r.call.kind == "lift":
                if r.result not in (C.OK, C.GONE):
                    log.info(
                        "slurm: job %d: cannot lift the exclusion of %s: %s", r.call.job, self.node, r.error
                    )
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
        if kind == "signal":
            return  # the action follows when the grace is over (tick)
        if r.result in (C.OK, C.GONE):
            a.stage = "done"
            if r.result == C.OK and kind == "requeue" and self.rule.avoid_node_seconds > 0:
                self.lifts[job] = (self.clock() + self.rule.avoid_node_seconds, a.info.exc_nodes)
        else:
            a.stage, a.due = "retry", self.clock() + RETRY_SECONDS  # again, if the use goes on
            a.failed = a.failed or r.result == C.FAILED

    # ------------------------------------------------------------------ outputs

    def report(self) -> SlurmReport:
        """The Slurm side of the round, for status, history and metrics (actions finished since the last)."""
        preemptible = Preemptible(self.rule.preemptible_partitions, self.rule.preemptible_qos)
        jobs = []
        for job, gpus in sorted(self.on_gpus.items()):
            info = self.jobs.get(job)
            a = self.acting.get(job)
            jobs.append(
                JobOnGpus(
                    job=job,
                    user=info.user if info else "?",
                    partition=info.partition if info else "",
                    qos=info.qos if info else "",
                    preemptible=preemptible(info) if info else None,
                    gpus=gpus,
                    doing=_doing(a, self.rule.action),
                )
            )
        done, self.done = tuple(self.done), []
        counts = tuple((k, r, n) for (k, r), n in sorted(self.counts.items()))
        return SlurmReport(tuple(jobs), done, counts, self.unreachable, self.episodes)

    def set_rule(self, rule: SlurmSection) -> None:
        """A reload changed [slurm]: the new rule from the next round on."""
        if rule.timeout_seconds != self.rule.timeout_seconds:
            self.control.timeout = rule.timeout_seconds
        self.rule = rule

    def close(self) -> None:
        """gpu-mon stops (or [slurm] is removed): the jobs still kept off this node get their own excluded
        nodes back now (no one would lift them later), each call waited for at most timeout_seconds."""
        for job, (_due, own) in sorted(self.lifts.items()):
            argv = [self.rule.scontrol, "update", f"JobId={job}", f"ExcNodeList={own}"]
            code, text = C.ask(argv, self.rule.timeout_seconds)
            if code == 0:
                log.info("slurm: job %d may use this node again", job)
            elif C.classify(code, text) != C.GONE:
                log.warning("slurm: job %d: cannot lift its exclusion of this node: %s", job, text)
        self.lifts.clear()
        self.control.close()


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
