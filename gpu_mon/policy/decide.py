"""Pure decisions: which GPUs are busy, and what to start and stop. No I/O and no clock here.

`resolve` turns the config's GPU references (NVML indices or UUIDs) into UUIDs against one look at the host;
`decide` takes the config, that plan, a snapshot of the host and the policy's memory of earlier rounds, and
returns the actions and the new memory. Everything that touches the host lives behind it (observe.py,
supervisor.py, daemon.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Set, Tuple

from gpu_mon.api import ttys
from gpu_mon.api.model import Exited, Gpu, Holder, Running, Snapshot
from gpu_mon.config import Config, GpuSection, GpuSelection, ProcessSection, line_of
from gpu_mon.policy.decisions import (
    Backoff,
    Busy,
    Decision,
    Instance,
    PolicyState,
    Reason,
    Restarting,
    Start,
    Stop,
    TerminalUse,
    Verdict,
    Wait,
    Who,
)

# Fields whose failure leaves us unsure whether the GPU is in use (utilization and name are only shown).
_BLINDING_FIELDS = (
    "gpu",
    "handle",
    "uuid",
    "minor number",
    "memory",
    "compute processes",
    "graphics processes",
)
_UNWATCHED_RULES = GpuSection(name="", gpus=GpuSelection(all=True))


@dataclass(frozen=True)
class Plan:
    """The config with GPU references resolved to UUIDs."""

    rules: Dict[str, GpuSection]  # watched UUID -> the [gpu-*] section that names it
    instances: Tuple[Instance, ...]
    index_of: Dict[str, int]  # UUID -> NVML index at resolution time
    problems: Tuple[str, ...] = ()  # `LINE: [section] gpus: ...`: references that name no GPU on this host


def _resolve_refs(
    selection: GpuSelection, gpus: Tuple[Gpu, ...], universe: List[str], what: str, problems: List[str]
) -> List[str]:
    if selection.all:
        return list(universe)
    out: List[str] = []
    by_uuid = {g.uuid.lower(): g.uuid for g in gpus if g.uuid}  # NVML spells UUIDs in lower case
    for ref in selection.refs:
        if isinstance(ref, int):
            if ref >= len(gpus):
                problems.append(f"{what}: no GPU with index {ref} (this host has {len(gpus)})")
                continue
            uuid = gpus[ref].uuid
            if not uuid:
                problems.append(f"{what}: GPU {ref}: its UUID cannot be read")
                continue
        else:
            uuid = by_uuid.get(str(ref).lower(), "")
            if not uuid:
                problems.append(f"{what}: no GPU with UUID {ref} on this host")
                continue
        if uuid not in out:
            out.append(uuid)
    return out


def resolve(config: Config, gpus: Tuple[Gpu, ...]) -> Plan:
    """Resolve every [gpu-*] and [process-*] GPU reference against this list of GPUs."""
    problems: List[str] = []
    everything = [g.uuid for g in gpus if g.uuid]
    rules: Dict[str, GpuSection] = {}
    for section in config.gpu_sections:
        what = f"{line_of(section, 'gpus')}: [gpu-{section.name}] gpus"
        for uuid in _resolve_refs(section.gpus, gpus, everything, what, problems):
            first = rules.setdefault(uuid, section)
            if first is not section:  # one by index, the other by UUID: only the host can tell
                problems.append(f"{what}: {uuid} is already named by [gpu-{first.name}]")
    watched = [u for u in everything if u in rules]
    instances: List[Instance] = []
    for proc in config.processes:
        what = f"{line_of(proc, 'gpus')}: [process-{proc.name}] gpus"
        uuids = _resolve_refs(proc.gpus, gpus, watched, what, problems)
        unwatched = [u for u in uuids if u not in rules]
        for uuid in unwatched:
            problems.append(f"{what}: {uuid} is not named by any [gpu-*] section, so it is never used")
        uuids = [u for u in uuids if u in rules]
        if not uuids:
            if not unwatched:
                problems.append(f"{what}: names no watched GPU; [process-{proc.name}] will never start")
            continue
        if proc.per_gpu:
            group = tuple(uuids) if proc.together else ()
            instances.extend(
                Instance(key=f"{proc.name}@{u}", process=proc.name, gpus=(u,), group=group) for u in uuids
            )
        else:
            instances.append(Instance(key=proc.name, process=proc.name, gpus=tuple(uuids)))
    if config.sentinel is not None:  # its GPUs need not be watched, only there
        _resolve_refs(
            config.sentinel.gpus,
            gpus,
            everything,
            f"{line_of(config.sentinel, 'gpus')}: [sentinel] gpus",
            problems,
        )
    index_of = {g.uuid: g.index for g in gpus if g.uuid}
    return Plan(rules=rules, instances=tuple(instances), index_of=index_of, problems=tuple(problems))


def ignored(holder: Holder, rules: GpuSection) -> bool:
    """Whether a holder does not make the GPU busy: a built-in monitor, an ignored program or user."""
    return (
        holder.monitor
        or ignored_name(holder.name, holder.user, rules)
        or ignored_name(holder.argv0, holder.user, rules)
    )


def ignored_name(name: str, user: str, rules: GpuSection) -> bool:
    """Whether this program name or user is ignored by a [gpu-*] section."""
    return name in rules.ignore_programs or user in rules.ignore_users


def _who(h: Holder) -> Who:
    return Who(user=h.user, name=h.name, pid=h.pid)


def blinding_errors(gpu: Gpu) -> List[str]:
    """The read errors of a GPU that leave us unsure whether it is in use (it then counts as busy)."""
    return [e for e in gpu.errors if e.split(":", 1)[0] in _BLINDING_FIELDS]


def _unsure(uuid: str, snap: Snapshot, rules: GpuSection) -> List[Reason]:
    """Reasons we cannot tell whether the GPU is in use: it then counts as busy."""
    gpu = snap.gpu(uuid)
    assert gpu is not None
    reasons: List[Reason] = []
    blinding = blinding_errors(gpu)
    if blinding:
        reasons.append(Reason(Busy.UNREADABLE, detail="; ".join(blinding)))
    node_error = dict(snap.node_errors).get(uuid)
    if node_error:
        reasons.append(Reason(Busy.NODE, detail=node_error))
    hidden = [d for d in snap.denied if rules.unreadable_is_busy and not ignored_name(d.name, d.user, rules)]
    if hidden:
        first = hidden[0]
        reasons.append(Reason(Busy.HIDDEN, who=Who(first.user, first.name, first.pid), count=len(hidden)))
    return reasons


def _holder_reasons(
    uuid: str, rules: GpuSection, snap: Snapshot, first_seen: Mapping[tuple, float]
) -> List[Reason]:
    """Foreign processes holding the GPU's node (after holder_grace_seconds, only those NVML shows)."""
    gpu = snap.gpu(uuid)
    assert gpu is not None
    nvml_pids = {p.pid for p in (gpu.processes or ())}
    grace = rules.holder_grace_seconds
    reasons = []
    for h in snap.holders:
        if uuid not in h.gpus or h.ours_on(uuid) or ignored(h, rules):
            continue
        first = first_seen.get((h.pid, h.start_ticks, uuid), snap.now)
        idle_holder = gpu.processes is not None and h.pid not in nvml_pids
        if grace is not None and idle_holder and snap.now - first >= grace:
            continue  # holds the node without using the GPU (a monitor, a CUDA init on every GPU)
        reasons.append(Reason(Busy.HOLDER, who=_who(h), path=h.nodes[0] if h.nodes else gpu.device or ""))
    return reasons


def held_since(
    uuid: str, rules: GpuSection, snap: Snapshot, first_seen: Mapping[tuple, float], reasons: List[Reason]
) -> Optional[float]:
    """When a GPU busy only because processes hold its node (each reason a Busy.HOLDER) has been held
    since: the first time the longest of those holders was seen there. None when any other reason makes
    it busy (a context, memory, a process that cannot be read: those count at once) or it is free."""
    if not reasons or any(r.kind != Busy.HOLDER for r in reasons):
        return None
    pids = {r.who.pid for r in reasons if r.who is not None}
    seen = [
        first_seen.get((h.pid, h.start_ticks, uuid), snap.now)
        for h in snap.holders
        if h.pid in pids and uuid in h.gpus and not h.ours_on(uuid) and not ignored(h, rules)
    ]
    return min(seen) if seen else None


def _nvml_reasons(uuid: str, rules: GpuSection, snap: Snapshot) -> List[Reason]:
    """Foreign NVML contexts on the GPU, and memory used by others beyond busy_memory_mib."""
    gpu = snap.gpu(uuid)
    assert gpu is not None
    reasons = []
    ours_mib = 0
    by_pid = {h.pid: h for h in snap.nvml_procs if uuid in h.gpus}
    for p in gpu.processes or ():
        h = by_pid.get(p.pid)
        if h is not None and (h.ours_on(uuid) or ignored(h, rules)):
            ours_mib += p.used_memory_mib or 0
            continue
        who = _who(h) if h else None
        reasons.append(Reason(Busy.CONTEXT, who=who, pid=p.pid, context=p.kind, mib=p.used_memory_mib))
    if gpu.memory_used_mib is not None:
        others = gpu.memory_used_mib - ours_mib
        if others > rules.busy_memory_mib:
            reasons.append(Reason(Busy.MEMORY, mib=others, limit_mib=rules.busy_memory_mib))
    return reasons


def _unseen_reasons(uuid: str, rules: GpuSection, snap: Snapshot, seconds: float) -> List[Reason]:
    """An open of the node within `seconds` that only a process whose files we cannot read may have made
    (where those do not count as busy anyway: a plain user's `occupy`)."""
    if rules.unreadable_is_busy:
        return []  # every such process already makes the GPU busy (Busy.HIDDEN)
    for o in snap.unseen_opens:
        if o.uuid != uuid or snap.now - o.at >= seconds:
            continue
        by = [d for d in o.by if not ignored_name(d.name, d.user, rules)]
        if by:
            return [Reason(Busy.UNSEEN, who=Who(by[0].user, by[0].name, by[0].pid), count=len(by))]
    return []


def _flood_reasons(uuid: str, rules: GpuSection, snap: Snapshot) -> List[Reason]:
    """Its node opened again and again by a process its [gpu-*] section does not ignore and that does not
    hold it now (a holder is said as one: a CUDA program opens its nodes a few times as it starts). An
    opener that nobody saw makes it busy only as the scans find it: gpu-mon's own opens are among those."""
    holding = {h.pid for h in snap.holders if uuid in h.gpus}
    for f in snap.open_floods:
        by = [h for h in f.by if not ignored(h, rules) and h.pid not in holding] if f.uuid == uuid else []
        if by:
            return [Reason(Busy.OPENS, who=_who(by[0]), count=len(by))]
    return []


def _queue_reasons(uuid: str, snap: Snapshot) -> List[Reason]:
    """A queue job runs on the GPU, or the queue's jobs cannot be known (`gpu-mon occupy` only: the
    daemon's own snapshots have neither)."""
    if snap.queue_unknown:
        return [Reason(Busy.QUEUE_UNKNOWN, detail=snap.queue_unknown)]
    return [
        Reason(Busy.QUEUE_JOB, who=Who(j.user, j.name, 0), job=j.job)
        for j in snap.queue_jobs
        if uuid in j.gpus
    ]


def _slurm_reasons(uuid: str, snap: Snapshot) -> List[Reason]:
    """[slurm]: Slurm has allocated the GPU to a job, or its allocations are not known yet."""
    if snap.slurm_unknown:
        return [Reason(Busy.SLURM_UNKNOWN, detail=snap.slurm_unknown)]
    return [
        Reason(Busy.SLURM_JOB, who=Who(j.user, f"Slurm job {j.job}", 0), job=j.job)
        for j in snap.slurm_jobs
        if uuid in j.gpus
    ]


def gpu_verdict(
    uuid: str,
    rules: GpuSection,
    snap: Snapshot,
    first_seen: Mapping[tuple, float],
    unseen_seconds: float = 0.0,
) -> Tuple[bool, List[Reason]]:
    """Busy or free, with reasons, for one GPU. Unsure means busy. An unseen open counts for
    `unseen_seconds` after it."""
    if snap.reading.error:
        return True, [Reason(Busy.BACKEND, detail=snap.reading.error)]
    if snap.gpu(uuid) is None:
        return True, [Reason(Busy.MISSING)]
    reasons = _unsure(uuid, snap, rules)
    reasons += _queue_reasons(uuid, snap)
    reasons += _holder_reasons(uuid, rules, snap, first_seen)
    reasons += _unseen_reasons(uuid, rules, snap, unseen_seconds)
    reasons += _flood_reasons(uuid, rules, snap)
    reasons += _nvml_reasons(uuid, rules, snap)
    reasons += _slurm_reasons(uuid, snap)  # (after what is observed: the log names the process first)
    return bool(reasons), reasons


def _backoff_after(exit_: Exited, old: Backoff, config: Config) -> Tuple[Backoff, Optional[Restarting]]:
    d = config.defaults
    if exit_.stopped_by_us:
        return dataclasses.replace(old, last=exit_), None
    ran = max(0.0, exit_.ended_at - exit_.started_at)
    failures = 0 if ran >= d.healthy_run_seconds else old.failures + 1
    delay = min(d.restart_delay_seconds * (2 ** max(0, failures - 1)), d.restart_delay_max_seconds)
    new = Backoff(failures=failures, not_before=exit_.ended_at + delay, restarts=old.restarts + 1, last=exit_)
    return new, Restarting(exited=exit_, delay=delay, failures=failures)


def terminal_users(config: Config, snap: Snapshot) -> Tuple[TerminalUse, ...]:
    """Terminals touched within [tty] idle_seconds by users who are not on the whitelist."""
    tty = config.tty
    if not tty.enabled:
        return ()
    return tuple(
        TerminalUse(user=t.user, device=t.device, idle_seconds=t.idle_seconds)
        for t in ttys.active(snap.ttys, tty.idle_seconds, tty.whitelist)
    )


def _first_seen(snap: Snapshot, old: Mapping[tuple, float]) -> Dict[tuple, float]:
    """When each (holder, GPU) pair was first seen: kept for live pairs, now for new ones."""
    return {
        (h.pid, h.start_ticks, uuid): old.get((h.pid, h.start_ticks, uuid), snap.now)
        for h in snap.holders
        for uuid in h.gpus
    }


def unseen_seconds(config: Config) -> float:
    """How long an unseen open keeps a GPU busy: the start delay, and at least until the next poll (the
    opener may hold the node for long, and NVML shows it only once it makes a context)."""
    d = config.defaults
    return max(d.start_delay_seconds, d.interval_seconds)


def _verdicts(
    plan: Plan,
    snap: Snapshot,
    first_seen: Mapping[tuple, float],
    free_since: Dict[str, float],
    unseen_for: float = 0.0,
) -> Dict[str, Verdict]:
    """A verdict for every GPU (watched ones remember since when they are free: `free_since` is updated)."""
    verdicts: Dict[str, Verdict] = {}
    for gpu in snap.reading.gpus:
        if gpu.uuid and gpu.uuid not in plan.rules:
            busy, reasons = gpu_verdict(gpu.uuid, _UNWATCHED_RULES, snap, first_seen)
            verdicts[gpu.uuid] = Verdict(gpu.uuid, busy, tuple(reasons))
    for uuid, rules in plan.rules.items():
        busy, reasons = gpu_verdict(uuid, rules, snap, first_seen, unseen_for)
        if busy:
            free_since.pop(uuid, None)
        else:
            free_since.setdefault(uuid, snap.now)
        held = held_since(uuid, rules, snap, first_seen, reasons)
        verdicts[uuid] = Verdict(uuid, busy, tuple(reasons), free_since.get(uuid), held)
    return verdicts


def decide(config: Config, plan: Plan, snap: Snapshot, state: PolicyState) -> Decision:
    """What to start and stop now, and why. Pure: the inputs are not changed."""
    first_seen = _first_seen(snap, state.first_seen)
    free_since = dict(state.free_since)
    verdicts = _verdicts(plan, snap, first_seen, free_since, unseen_seconds(config))
    backoff = dict(state.backoff)
    events = []
    for ex in snap.exited:
        backoff[ex.key], event = _backoff_after(ex, backoff.get(ex.key, Backoff()), config)
        if event is not None:
            events.append(event)
    paused_by = terminal_users(config, snap)
    round_ = _Round(config, verdicts, free_since, backoff, paused_by, snap)
    actions = round_.plan_instances(plan)
    planned = {i.key for i in plan.instances}
    actions += [Stop(r.key, "removed") for r in snap.running if r.key not in planned and not r.stopping]
    return Decision(
        actions=tuple(actions),
        state=PolicyState(free_since=free_since, first_seen=first_seen, backoff=backoff),
        verdicts=verdicts,
        paused_by=paused_by,
        next_wake=min(round_.wakes) if round_.wakes else None,
        events=tuple(events),
        waiting=round_.waits,
    )


class _Round:
    """What to do with each planned instance in one decision."""

    def __init__(
        self,
        config: Config,
        verdicts: Dict[str, Verdict],
        free_since: Dict[str, float],
        backoff: Dict[str, Backoff],
        paused_by: Tuple[TerminalUse, ...],
        snap: Snapshot,
    ):
        self.config, self.verdicts, self.free_since = config, verdicts, free_since
        self.backoff, self.paused_by, self.now = backoff, paused_by, snap.now
        self.running = {r.key: r for r in snap.running}
        self.waits: Dict[str, Wait] = {}
        self.wakes: List[float] = []
        self.claimed: Dict[str, str] = {}
        self.sections = processes_by_name(config)

    def plan_instances(self, plan: Plan) -> List[object]:
        """Stops for running instances that must yield, starts for waiting ones that may run."""
        for inst in plan.instances:
            if inst.key in self.running:
                for uuid in inst.gpus:
                    self.claimed.setdefault(uuid, inst.key)
        actions: List[object] = []
        for inst in plan.instances:
            busy = [u for u in inst.needs if self.verdicts[u].busy]
            r = self.running.get(inst.key)
            action = self._running(inst, r, busy) if r is not None else self._waiting(inst, busy)
            if action is not None:
                actions.append(action)
        return actions

    def _running(self, inst: Instance, r: Running, busy: List[str]) -> Optional[Stop]:
        if r.stopping:
            self.waits[inst.key] = Wait("stopping")
            return None
        if self.paused_by:
            return Stop(inst.key, "terminal", terminal=self.paused_by[0])
        if busy and not self.holds(inst):
            return Stop(inst.key, "gpu_busy", busy=tuple((u, self.verdicts[u].reasons[0]) for u in busy))
        return None

    def holds(self, inst: Instance) -> bool:
        """Whether its section never yields a busy GPU (`gpu-mon occupy` without --yield)."""
        section = self.sections.get(inst.process)
        return bool(section and section.hold)

    def _waiting(self, inst: Instance, busy: List[str]) -> Optional[Start]:
        wait = self._why_not_start(inst, busy)
        if wait is not None:
            self.waits[inst.key] = wait
            if wait.until is not None:
                self.wakes.append(wait.until)
            return None
        for uuid in inst.gpus:
            self.claimed[uuid] = inst.key
        return Start(inst, self.now - min(self.free_since[u] for u in inst.gpus))

    def _why_not_start(self, inst: Instance, busy: List[str]) -> Optional[Wait]:
        """None when the instance may start now."""
        if self.paused_by:
            return Wait("paused", terminal=self.paused_by[0])
        if busy:
            return Wait("busy", gpu=busy[0], reason=self.verdicts[busy[0]].reasons[0])
        taken = [u for u in inst.gpus if u in self.claimed and self.claimed[u] != inst.key]
        if taken:
            return Wait("taken", gpu=taken[0], by=self.claimed[taken[0]])
        since = [self.verdicts[u].free_since for u in inst.needs]
        ready_at = max(self.now if s is None else s for s in since) + self.config.defaults.start_delay_seconds
        b = self.backoff.get(inst.key)
        if b is not None and b.not_before > ready_at and b.not_before > self.now:
            return Wait("backoff", until=b.not_before, last=b.last)
        if ready_at > self.now:
            return Wait("start_delay", until=ready_at)
        return None


def processes_by_name(config: Config) -> Dict[str, ProcessSection]:
    """[process-*] sections by name."""
    return {p.name: p for p in config.processes}


def stops_confirmed(first: Iterable[object], second: Iterable[object]) -> Tuple[Stop, ...]:
    """Stops that a second, fresh look agrees with (look again before doing something destructive)."""
    again: Set[str] = {a.key for a in second if isinstance(a, Stop)}
    return tuple(a for a in first if isinstance(a, Stop) and a.key in again)
