"""Pure decisions: which GPUs are busy, and what to start and stop. No I/O and no clock here.

`resolve` turns the config's GPU references (NVML indices or UUIDs) into UUIDs against one look at the host;
`decide` takes the config, that plan, a snapshot of the host and the policy's memory of earlier rounds, and
returns the actions and the new memory. Everything that touches the host lives behind it (observe.py,
supervisor.py, daemon.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple

from gpu_mon.api.model import Exited, Gpu, Holder, Snapshot
from gpu_mon.api.text import sanitize
from gpu_mon.api.ttys import active
from gpu_mon.config import Config, GpuSection, GpuSelection, ProcessSection
from gpu_mon.engine.decisions import Backoff, Decision, Instance, PolicyState, Start, Stop, Verdict

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
        what = f"{section.line}: [gpu-{section.name}] gpus"
        for uuid in _resolve_refs(section.gpus, gpus, everything, what, problems):
            first = rules.setdefault(uuid, section)
            if first is not section:  # one by index, the other by UUID: only the host can tell
                problems.append(f"{what}: {uuid} is already named by [gpu-{first.name}]")
    watched = [u for u in everything if u in rules]
    instances: List[Instance] = []
    for proc in config.processes:
        what = f"{proc.line}: [process-{proc.name}] gpus"
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
            instances.extend(Instance(key=f"{proc.name}@{u}", process=proc.name, gpus=(u,)) for u in uuids)
        else:
            instances.append(Instance(key=proc.name, process=proc.name, gpus=tuple(uuids)))
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


def gpu_verdict(
    uuid: str, rules: GpuSection, snap: Snapshot, first_seen: Dict[tuple, float]
) -> Tuple[bool, List[str]]:
    """Busy or free, with reasons, for one GPU. Unsure means busy. Updates `first_seen` for holder grace."""
    reasons: List[str] = []
    if snap.reading.error:
        return True, [f"GPUs cannot be read: {snap.reading.error}"]
    gpu = snap.gpu(uuid)
    if gpu is None:
        return True, ["not found on this host (lost or removed?)"]
    blinding = [e for e in gpu.errors if e.split(":", 1)[0] in _BLINDING_FIELDS]
    if blinding:
        reasons.append("cannot be read: " + "; ".join(blinding))
    node_error = dict(snap.node_errors).get(uuid)
    if node_error:
        reasons.append(f"device node cannot be watched: {node_error}")
    hidden = [d for d in snap.denied if not ignored_name(d.name, d.user, rules)]
    if hidden:
        more = f" and {len(hidden) - 1} more" if len(hidden) > 1 else ""
        reasons.append(f"cannot see the open files of {sanitize(hidden[0].label)}{more}, which may hold it")
    nvml_pids = {p.pid for p in (gpu.processes or ())}
    grace = rules.holder_grace_seconds
    for h in snap.holders:
        if uuid not in h.gpus or h.ours or ignored(h, rules):
            continue
        key = (h.pid, h.start_ticks, uuid)
        first = first_seen.setdefault(key, snap.now)
        if (
            grace is not None
            and gpu.processes is not None
            and h.pid not in nvml_pids
            and snap.now - first >= grace
        ):
            continue  # holds the node without using the GPU (a monitor, a CUDA init on every GPU)
        node = h.nodes[0] if h.nodes else gpu.device or "its device node"
        reasons.append(f"{sanitize(h.user)} {sanitize(h.name)}[{h.pid}] holds {sanitize(node)}")
    ours_mib = 0
    by_pid = {h.pid: h for h in snap.nvml_procs}
    for p in gpu.processes or ():
        h = by_pid.get(p.pid)
        if h is not None and (h.ours or ignored(h, rules)):
            ours_mib += p.used_memory_mib or 0
            continue
        who = f"{sanitize(h.user)} {sanitize(h.name)}[{p.pid}]" if h else f"pid {p.pid} (not visible here)"
        used = f", {p.used_memory_mib} MiB" if p.used_memory_mib is not None else ""
        reasons.append(f"{who} has a {p.kind} context on it (NVML{used})")
    if gpu.memory_used_mib is not None:
        others = gpu.memory_used_mib - ours_mib
        if others > rules.busy_memory_mib:
            reasons.append(
                f"{others} MiB used by others (more than busy_memory_mib = {rules.busy_memory_mib})"
            )
    return bool(reasons), reasons


def _backoff_after(exit_: Exited, old: Backoff, config: Config) -> Tuple[Backoff, str]:
    d = config.defaults
    ran = max(0.0, exit_.ended_at - exit_.started_at)
    status = describe_exit(exit_.returncode)
    detail = f" ({exit_.detail})" if exit_.detail else ""
    if exit_.stopped_by_us:
        return dataclasses.replace(old, last_exit=f"stopped by gpu-mon ({status})"), ""
    failures = 0 if ran >= d.healthy_run_seconds else old.failures + 1
    delay = d.restart_delay_seconds * (2 ** max(0, failures - 1))
    delay = min(delay, d.restart_delay_max_seconds)
    new = Backoff(
        failures=failures,
        not_before=exit_.ended_at + delay,
        restarts=old.restarts + 1,
        last_exit=f"{status} after {ran:.1f} s{detail}",
    )
    note = f"{exit_.key} {status} after {ran:.1f} s{detail}; restarting in {delay:g} s"
    if failures >= 3:
        note += f" ({failures} quick failures in a row; check its command and log)"
    return new, note


def describe_exit(code: int) -> str:
    """`exited with status 1`, `was killed by signal 9`, `command not found`."""
    if code == 127:
        return "could not start (command not found, status 127)"
    if code == 126:
        return "could not start (permission denied or not executable, status 126)"
    if code > 128:
        return f"was killed by signal {code - 128}"
    return f"exited with status {code}"


def _pause_reason(config: Config, snap: Snapshot) -> Tuple[str, ...]:
    if not config.tty.enabled:
        return ()
    users = active(snap.ttys, config.tty.idle_seconds, config.tty.whitelist)
    return tuple(
        f"{sanitize(t.user)} at {t.device.replace('/dev/', '')} (active {t.idle_seconds:.0f} s ago)"
        for t in users
    )


def decide(config: Config, plan: Plan, snap: Snapshot, state: PolicyState) -> Decision:
    """What to start and stop now, and why."""
    now = snap.now
    first_seen: Dict[tuple, float] = dict(state.first_seen)
    verdicts: Dict[str, Verdict] = {}
    free_since = dict(state.free_since)
    for gpu in snap.reading.gpus:
        if gpu.uuid and gpu.uuid not in plan.rules:
            busy, reasons = gpu_verdict(gpu.uuid, _UNWATCHED_RULES, snap, first_seen)
            verdicts[gpu.uuid] = Verdict(gpu.uuid, busy, tuple(reasons))
    for uuid, rules in plan.rules.items():
        busy, reasons = gpu_verdict(uuid, rules, snap, first_seen)
        if busy:
            free_since.pop(uuid, None)
        else:
            free_since.setdefault(uuid, now)
        verdicts[uuid] = Verdict(uuid, busy, tuple(reasons), free_since.get(uuid))
    live = {(h.pid, h.start_ticks) for h in snap.holders}
    first_seen = {k: v for k, v in first_seen.items() if (k[0], k[1]) in live}

    notes: List[str] = []
    backoff = dict(state.backoff)
    for ex in snap.exited:
        backoff[ex.key], note = _backoff_after(ex, backoff.get(ex.key, Backoff()), config)
        if note:
            notes.append(note)

    paused_by = _pause_reason(config, snap)
    actions: List[object] = []
    running = {r.key: r for r in snap.running}
    planned = {i.key for i in plan.instances}
    claimed: Dict[str, str] = {}
    for inst in plan.instances:
        if inst.key in running:
            for uuid in inst.gpus:
                claimed.setdefault(uuid, inst.key)
    label = _labeller(plan)
    waits: Dict[str, str] = {}
    wakes: List[float] = []
    for inst in plan.instances:
        busy = [u for u in inst.gpus if verdicts[u].busy]
        r = running.get(inst.key)
        if r is not None:
            if r.stopping:
                waits[inst.key] = "stopping"
            elif paused_by:
                actions.append(Stop(inst.key, f"paused for terminal user {paused_by[0]}"))
            elif busy:
                why = "; ".join(f"{label(u)} busy: {verdicts[u].reasons[0]}" for u in busy)
                actions.append(Stop(inst.key, why, tuple(busy)))
            continue
        wait, wake = _why_not_start(inst, config, verdicts, busy, claimed, backoff, paused_by, now, label)
        if wake is not None:
            wakes.append(wake)
        if wait:
            waits[inst.key] = wait
            continue
        ready = ", ".join(label(u) for u in inst.gpus)
        actions.append(Start(inst, f"{ready} free for {now - min(free_since[u] for u in inst.gpus):.0f} s"))
        for uuid in inst.gpus:
            claimed[uuid] = inst.key
    for key, r in running.items():
        if key not in planned and not r.stopping:
            actions.append(Stop(key, "no longer in the config"))
    new_state = PolicyState(free_since=free_since, first_seen=first_seen, backoff=backoff)
    return Decision(
        actions=tuple(actions),
        state=new_state,
        verdicts=verdicts,
        paused_by=paused_by,
        next_wake=min(wakes) if wakes else None,
        notes=tuple(notes),
        waiting=waits,
    )


def _labeller(plan: Plan):
    def label(uuid: str) -> str:
        index = plan.index_of.get(uuid)
        return f"GPU {index} ({uuid})" if index is not None else uuid

    return label


def _why_not_start(
    inst: Instance,
    config: Config,
    verdicts: Dict[str, Verdict],
    busy: List[str],
    claimed: Dict[str, str],
    backoff: Dict[str, Backoff],
    paused_by: Tuple[str, ...],
    now: float,
    label,
) -> Tuple[str, Optional[float]]:
    """('' , None) when the instance may start now; else why not, and when to look again."""
    if paused_by:
        return f"paused: {paused_by[0]}", None
    if busy:
        return f"waiting: {label(busy[0])} busy: {verdicts[busy[0]].reasons[0]}", None
    taken = [u for u in inst.gpus if u in claimed and claimed[u] != inst.key]
    if taken:
        return f"waiting: {label(taken[0])} runs {claimed[taken[0]]}", None
    delay = config.defaults.start_delay_seconds
    since = [verdicts[u].free_since for u in inst.gpus]
    ready_at = max(now if s is None else s for s in since) + delay
    b = backoff.get(inst.key)
    if b is not None and b.not_before > ready_at:
        ready_at = b.not_before
        if ready_at > now:
            return f"restarting in {ready_at - now:.0f} s ({b.last_exit})", ready_at
    if ready_at > now:
        return f"waiting: start delay ({ready_at - now:.0f} s left)", ready_at
    return "", None


def processes_by_name(config: Config) -> Dict[str, ProcessSection]:
    """[process-*] sections by name."""
    return {p.name: p for p in config.processes}


def stops_confirmed(first: Iterable[object], second: Iterable[object]) -> Tuple[Stop, ...]:
    """Stops that a second, fresh look agrees with (look again before doing something destructive)."""
    again: Set[str] = {a.key for a in second if isinstance(a, Stop)}
    return tuple(a for a in first if isinstance(a, Stop) and a.key in again)
