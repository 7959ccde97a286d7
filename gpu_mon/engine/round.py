"""One round: scan -> plan -> snapshot -> decide -> look again before stopping -> act -> publish.

The policy (gpu_mon/policy) decides on a snapshot; this module gathers the snapshot (the observer's holders,
the supervisor's workloads, each tier's jobs), looks again at the holders of every GPU a stop is for (a
second decision must call for the same stop), carries out what is confirmed (the workloads' stops first, then
each tier places its jobs, then the workloads' starts) and hands the whole picture to the listeners.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Callable, Deque, Dict, Optional, Sequence, Set, Tuple

from gpu_mon.api.model import Snapshot
from gpu_mon.api.observe import Observer
from gpu_mon.config import Config
from gpu_mon.engine.floods import Floods
from gpu_mon.engine.idleround import IdleRound
from gpu_mon.engine.loop import Loop
from gpu_mon.engine.openers import Openers
from gpu_mon.engine.opens import OpenWatch
from gpu_mon.engine.scanclock import ScanClock
from gpu_mon.engine.tiers import Moment, Tier
from gpu_mon.engine.workloads import stopping
from gpu_mon.engine.workloads.supervisor import StartError, Supervisor
from gpu_mon.engine.yields import Yields, urgent
from gpu_mon.policy import decide as policy
from gpu_mon.policy import gpustate, words
from gpu_mon.policy.decisions import Decision, PolicyState, Start, Stop
from gpu_mon.policy.report import RoundReport

log = logging.getLogger("gpu_mon")

_EMPTY_PLAN = policy.Plan(rules={}, instances=(), index_of={})


@dataclasses.dataclass
class Parts:
    """What a round works with, made once by the daemon."""

    observer: Observer
    supervisor: Supervisor
    opens: OpenWatch
    openers: Openers
    scans: ScanClock
    yields: Yields
    idle: IdleRound
    loop: Loop
    tiers: Sequence[Tier] = ()
    floods: Floods = dataclasses.field(default_factory=Floods)


class Round:
    """The rounds' state: the plan, the policy's state, the last decision and report, what was said."""

    def __init__(self, config: Config, parts: Parts, wall: Callable[[], float], source: str = ""):
        self.config = config
        self.p = parts
        self.wall = wall
        self.source = source
        self.state = PolicyState()
        self.plan: Optional[policy.Plan] = None
        self.reported_problems: Set[str] = set()
        self.said: Deque[dict] = collections.deque(maxlen=30)
        self.last_busy: Dict[str, bool] = {}
        self.decision: Optional[Decision] = None
        self.report: Optional[RoundReport] = None
        self.stopping = False
        self.daemon: dict = {}  # pid, start_ticks, started_wall, containment (for the report)

    def moment(self, now: float) -> Moment:
        y = self.p.yields
        return Moment(self.ensure_plan(), now, y.wake_at, y.by_open, self.stopping)

    def run(self, now: float, scan: Optional[str], pause: bool = False) -> None:
        """Scan (`pause`: a scan of /proc that gives way to an open, and goes on after it), decide, act,
        publish."""
        if scan is not None and not self._scan(scan, pause):
            return
        self._recheck(now)
        m = self.moment(now)
        snap = self.snapshot(now)
        decision = policy.decide(self.config, m.plan, snap, self.state)
        if any(isinstance(a, Stop) and a.gpus for a in decision.actions):
            decision, snap = self.look_again(m.plan, snap, decision, now)
        decision = self.p.yields.with_first(decision)
        for tier in self.p.tiers:
            tier.ask(snap, m)
        self.state = decision.state
        self._log_transitions(m.plan, decision)
        for event in decision.events:
            self.say(words.restarting(event), logging.WARNING if event.failing else logging.INFO)
        decision = self._act(decision, m)
        self.p.yields.first.clear()
        self.decision = decision
        self._publish(m.plan, snap, decision)

    def _scan(self, mode: str, pause: bool) -> bool:
        """Scan; False when the scan paused for an open (it is owed: the loop goes on with it after)."""
        obs, scans = self.p.observer, self.p.scans
        every = mode in ("full", "fds") and scans.every_next
        obs.scan(
            mode, self.p.supervisor.sessions(), pause=self.p.opens.pending if pause else None, every=every
        )
        if obs.scan_paused:
            log.debug("the %s scan gives way to an open, and goes on after it", mode)
            scans.owed = mode
            return False
        if every:
            scans.every_next = False
        return True

    def _recheck(self, now: float) -> None:
        """The holders of the GPUs a tier must know again now (a job's GPU opened a while ago: does its
        opener still hold it?), read again. One that cannot be read is then hidden, and the GPU busy."""
        gpus: Set[str] = set()
        for tier in self.p.tiers:
            gpus |= tier.recheck(now)
        if not gpus:
            return
        obs = self.p.observer
        pids = [h.pid for h in obs.holders if any(not h.ours_on(u) for u in h.gpus & gpus)]
        if pids:
            obs.scan("pids", self.p.supervisor.sessions(), pids)

    def patience(self) -> Dict[str, float]:
        """The GPUs where only jobs that wait out brief opens run (a tier's `patience`): how long opens
        there may go on before they count, the least of their jobs'. Every open of any other GPU where
        something of ours runs is looked at at once."""
        out: Dict[str, float] = {}
        eager: Set[str] = set()
        for key, w in self.p.supervisor.workloads.items():
            wait = max((t.patience(key) for t in self.p.tiers), default=0.0)
            for uuid in w.instance.gpus:
                if wait > 0:
                    out[uuid] = min(out.get(uuid, wait), wait)
                else:
                    eager.add(uuid)
        return {u: s for u, s in out.items() if u not in eager}

    def ensure_plan(self) -> policy.Plan:
        """The GPUs' rules as the config names them (resolved again while it has problems)."""
        reading = self.p.observer.reading
        if self.plan is not None and not self.plan.problems:
            return self.plan
        if reading.error:
            return self.plan or _EMPTY_PLAN
        plan = policy.resolve(self.config, reading.gpus)
        for problem in plan.problems:
            if problem not in self.reported_problems:
                self.reported_problems.add(problem)
                log.error("%s:%s", self.config.path, problem)
        self.plan = plan
        return plan

    def snapshot(self, now: float, quick: bool = False) -> Snapshot:
        """What the policy sees now. `quick` (a stop sent before the round): the last round's terminals,
        no exits or jobs taken (the round that follows takes them)."""
        tty, sup = self.config.tty, self.p.supervisor
        patterns = tty.devices if tty.enabled and not quick else None
        snap = self.p.observer.snapshot(now, sup.sessions(), patterns)
        snap = dataclasses.replace(
            snap,
            running=sup.running(),
            exited=() if quick else sup.take_exits(),
            unseen_opens=tuple(self.p.openers.unseen.values()),
            open_floods=self.p.floods.seen(self.patience()),
        )
        for tier in self.p.tiers:
            snap = tier.see(snap, quick)
        if quick:
            return dataclasses.replace(snap, ttys=self.report.snapshot.ttys if self.report else ())
        return snap

    def look_again(
        self,
        plan: policy.Plan,
        snap: Snapshot,
        decision: Decision,
        now: float,
        quick: bool = False,
        also: Set[str] = frozenset(),
    ) -> Tuple[Decision, Snapshot]:
        """Look again before doing something destructive: re-read the holders of the busy GPUs (those of the
        stops, and `also`: running jobs' GPUs); only the stops a second decision calls for too are kept."""
        stops = [a for a in decision.actions if isinstance(a, Stop)]
        busy = {u for s in stops for u in s.gpus} | set(also)
        pids = [h.pid for h in self.p.observer.holders if h.gpus & busy]
        if pids:
            self.p.observer.scan("pids", self.p.supervisor.sessions(), pids)
        again = dataclasses.replace(self.snapshot(now, quick), exited=snap.exited)
        second = policy.decide(self.config, plan, again, self.state)
        confirmed = {s.key for s in policy.stops_confirmed(decision.actions, second.actions)}
        for s in stops:
            if s.key not in confirmed:
                why = words.stop(s, plan.index_of)
                log.info("not stopping %s: a second look no longer finds the GPU busy (%s)", s.key, why)
        actions = tuple(a for a in second.actions if not isinstance(a, Stop) or a.key in confirmed)
        return dataclasses.replace(second, actions=actions), again

    def _act(self, decision: Decision, m: Moment) -> Decision:
        """The workloads' stops, then each tier's placement, then the workloads' starts. Returns the
        decision as acted (less the starts on GPUs the tiers' jobs hold or take)."""
        stops = tuple(a for a in decision.actions if isinstance(a, Stop))
        for stop in stops:
            self._stop(stop, m)
        rest = dataclasses.replace(decision, actions=tuple(a for a in decision.actions if a not in stops))
        for tier in self.p.tiers:
            rest = tier.place(rest, m)
        for action in rest.actions:
            if isinstance(action, Start) and not self.stopping:
                self._start(action, m)
        self._hurry(rest, m.now)
        return dataclasses.replace(rest, actions=(*stops, *rest.actions))

    def _stop(self, action: Stop, m: Moment) -> None:
        w = self.p.supervisor.workloads.get(action.key)
        first = self.p.yields.first.pop(action.key, None)
        why = words.stop(action, m.plan.index_of)
        if first is not None:  # (its signal went out before the round)
            self.say(f"{why}; stopping {first[1]}[{first[2]}]")
        elif w is not None:
            self.p.supervisor.stop(action.key, why, m.now, urgent=urgent(action))
            if urgent(action):
                self.p.yields.started(action, w.label)  # a preemption
            self.say(f"{why}; stopping {w.label}[{w.pid}]")

    def _hurry(self, decision: Decision, now: float) -> None:
        """A workload stopping with the full grace (a terminal user, a reload) whose GPU a foreign process
        has now opened: the rest of its stop gets the urgent grace."""
        for w in self.p.supervisor.workloads.values():
            if not w.stopping or w.urgent:
                continue
            for uuid in w.instance.gpus:
                v = decision.verdicts.get(uuid)
                if v is not None and v.busy and v.reasons and v.reasons[0].kind in gpustate.FOREIGN_REASONS:
                    self.p.supervisor.hurry(w)
                    break

    def _start(self, action: Start, m: Moment) -> None:
        inst = action.instance
        section = policy.processes_by_name(self.config)[inst.process]
        label = inst.label(m.plan.index_of)
        try:
            rule = stopping.rule_for(section, self.config.defaults)
            w = self.p.supervisor.start(inst, section, label, m.now, rule)
        except StartError as err:
            self.say(f"cannot start {label}: {err}", logging.ERROR)
            self.p.supervisor.failed_to_start(inst.key, m.now, str(err))
            return
        gpus = ", ".join(f"GPU {m.plan.index_of.get(u, '?')}" for u in inst.gpus)
        self.say(
            f"{words.start(action, m.plan.index_of)}; starting {label}[{w.pid}] on {gpus} as {section.user}: "
            f"{' '.join(section.cmd)}"
        )

    def _log_transitions(self, plan: policy.Plan, decision: Decision) -> None:
        stopping_for = {u for a in decision.actions if isinstance(a, Stop) for u in a.gpus}
        for uuid in plan.rules:
            v = decision.verdicts.get(uuid)
            if v is None or self.last_busy.get(uuid) == v.busy:
                continue
            label = words.gpu(uuid, plan.index_of)
            if v.busy and uuid not in stopping_for:  # (else the stop line says it, with what it stops)
                self.say(f"{label} busy: {'; '.join(words.reason(r) for r in v.reasons)}")
            elif not v.busy and uuid in self.last_busy:
                self.say(f"{label} free")
            self.last_busy[uuid] = v.busy
        was = bool(self.decision and self.decision.paused_by)  # the previous round's decision
        if decision.paused_by and not was:
            self.say(f"pausing all work: terminal user {words.terminal(decision.paused_by[0])}")
        elif was and not decision.paused_by:
            self.say("terminal users idle again: work may resume")

    def say(self, text: str, level: int = logging.INFO) -> None:
        """A decision's line: logged, and among status's recent decisions."""
        log.log(level, "%s", text)
        self.said.append({"wall": self.wall(), "text": text})

    def _publish(self, plan: policy.Plan, snap: Snapshot, decision: Decision) -> None:
        idle = self.p.idle.after(plan, snap)
        tiers: Dict[str, object] = {}
        for tier in self.p.tiers:
            tiers.update(tier.report())
        self.report = RoundReport(
            config=self.config,
            plan=plan,
            snapshot=snap,
            decision=decision,
            workloads=tuple(self.p.supervisor.views()),
            said=tuple(self.said),
            daemon=self.daemon,
            source=self.source,
            wall=self.wall(),
            preemptions=self.p.yields.done(snap),
            idle_holders=idle[0],
            idle_started=idle[1],
            idle_ended=idle[2],
            scans=self.p.observer.take_scan_times(),
            **tiers,  # type: ignore[arg-type]
        )
        self.p.loop.publish(self.report)
