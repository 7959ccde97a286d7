"""What `gpu-mon status` shows, as a JSON-able dict (also the daemon's state file) and as text."""

from __future__ import annotations

import time
from typing import Dict, Iterable, List, Optional, Set

from gpu_mon import __version__
from gpu_mon.api import logins
from gpu_mon.api.model import Gpu, Holder, Snapshot, gpu_label
from gpu_mon.api.text import sanitize, sanitize_lines
from gpu_mon.config import Config, GpuSection
from gpu_mon.policy import words
from gpu_mon.policy.decide import Plan, ignored
from gpu_mon.policy.decisions import Decision, Instance
from gpu_mon.policy.idleholders import IdleHolder
from gpu_mon.policy.report import RoundReport
from gpu_mon.queue import jobs as J
from gpu_mon.queue import words as queue_words
from gpu_mon.queue.runs import JobRun, QueueReport
from gpu_mon.slurm.view import SlurmReport


def _holder(h: Holder, uuid: Optional[str], ignored: bool, extra: Optional[dict] = None) -> dict:
    """A holder of GPU `uuid`: ours only where its workload was given that GPU (`elsewhere`: a process of
    a workload given other GPUs)."""
    ours = h.ours_on(uuid)
    out = {"pid": h.pid, "user": h.user, "name": h.name, "ours": ours, "ignored": ignored and not ours}
    if h.in_workload and not ours:
        out["elsewhere"] = True
    out.update(extra or {})
    return out


def from_report(report: RoundReport) -> dict:
    """The status document of a daemon's round."""
    doc = build(
        report.config,
        report.plan,  # type: ignore[arg-type]
        report.snapshot,
        report.decision,
        workloads=report.workloads,
        decisions=report.said,
        daemon=report.daemon,
        source=report.source,
        wall=report.wall,
        idle_holders=report.idle_holders,
        queue=report.queue,  # type: ignore[arg-type]
    )
    if report.queue_down is not None:
        doc = with_queue_down(doc, *report.queue_down)
    return doc if report.slurm is None else with_slurm(doc, report.slurm)  # type: ignore[arg-type]


def build(
    config: Optional[Config],
    plan: Plan,
    snap: Snapshot,
    decision: Decision,
    *,
    workloads: Iterable[dict] = (),
    decisions: Iterable[dict] = (),
    daemon: Optional[dict] = None,
    source: str = "",
    wall: Optional[float] = None,
    idle_holders: Iterable[IdleHolder] = (),
    queue: Optional[QueueReport] = None,
) -> dict:
    """The whole status document. Times are wall-clock seconds (rounded), so that a document that nothing
    changed in stays the same from round to round, and durations are computed when it is shown. With a
    queue: each GPU's `job` and the `queue` (jobs in each state, the runs going on)."""
    doc = _Document(plan, snap, decision, list(workloads), time.time() if wall is None else wall)
    out = {
        "version": 1,
        "gpu_mon": __version__,
        "source": source,
        "daemon": daemon,
        "config": config.path if config else None,
        "config_dropins": list(config.files[1:]) if config else [],
        "updated_wall": doc.wall,
        "error": snap.reading.error,
        "problems": list(plan.problems),
        "denied": [{"pid": d.pid, "user": d.user, "name": d.name} for d in snap.denied],
        "gpus": [doc.gpu(g) for g in snap.reading.gpus],
        "terminals": doc.terminals(config),
        "paused_by": [words.terminal(t) for t in decision.paused_by],
        "workloads": [doc.instance(i) for i in plan.instances],
        # Since when (wall clock), so that the document stays the same while nothing changes; `status` adds
        # idle_seconds when it shows them.
        "idle_holders": [
            {
                "pid": h.pid,
                "user": h.user,
                "program": h.program,
                "gpu": h.uuid,
                "memory_mib": h.memory_mib,
                "idle_since_wall": doc.since(h.since),
            }
            for h in idle_holders
        ],
        "decisions": list(decisions),
    }
    return out if queue is None else with_queue(out, queue)


def _job(run: JobRun) -> dict:
    return {
        "id": run.job,
        "user": run.user,
        "name": run.name,
        "state": run.state,
        "gpus": list(run.gpus),
        "started_wall": round(run.start),
        "restarts": run.restart,
        "array_id": run.array_id or None,
        "array_index": run.array_index if run.array_id else None,
    }


def with_queue(doc: dict, queue: QueueReport) -> dict:
    """The document with what the queue knows: each GPU's job (None when it runs none) and `queue`."""
    on: Dict[str, dict] = {}
    for run in queue.running:
        for uuid in run.gpus:
            on[uuid] = _job(run)
    for g in doc["gpus"]:
        g["job"] = on.get(g.get("uuid") or "")
    doc["queue"] = {"jobs": dict(queue.counts), "running": [_job(r) for r in queue.running]}
    if queue.drained is not None:
        doc["queue"]["drained"] = {"by": queue.drained[0], "at_wall": round(queue.drained[1])}
    return doc


def with_slurm(doc: dict, report: SlurmReport) -> dict:
    """The document with the Slurm jobs on each GPU (`slurm_jobs`) and `slurm` (calls and their results)."""
    on: Dict[str, List[dict]] = {}
    for j in report.jobs:
        entry = {
            "id": j.job,
            "user": j.user,
            "partition": j.partition,
            "qos": j.qos,
            "preemptible": j.preemptible,
            "doing": j.doing,
        }
        for uuid in j.gpus:
            on.setdefault(uuid, []).append(dict(entry, allocated=uuid in j.allocated))
    for g in doc["gpus"]:
        g["slurm_jobs"] = on.get(g.get("uuid") or "", [])
    doc["slurm"] = {
        "unreachable": report.unreachable,
        "unreachable_episodes": report.episodes,
        "calls": [{"action": a, "result": r, "count": n} for a, r, n in report.counts],
    }
    return doc


def slurm_job_words(job: dict) -> str:
    """`Slurm job 42 alice, partition scavenger, preemptible (requeue done)`."""
    kind = {True: "preemptible", False: "not preemptible", None: "not described by Slurm yet"}
    qos = f", QOS {sanitize(str(job['qos']))}" if job.get("qos") else ""
    doing = f" ({job['doing']})" if job.get("doing") else ""
    doing += ", allocated by Slurm" if job.get("allocated") else ""
    part = sanitize(str(job.get("partition") or "?"))
    user = sanitize(str(job.get("user")))
    return f"Slurm job {job['id']} {user}, partition {part}{qos}, {kind[job.get('preemptible')]}{doing}"


class _Document:
    """The parts of one status document."""

    def __init__(self, plan: Plan, snap: Snapshot, decision: Decision, workloads: List[dict], wall: float):
        self.plan, self.snap, self.decision, self.wall = plan, snap, decision, wall
        self.running = {w["key"]: w for w in workloads}
        self.by_gpu: Dict[str, str] = {
            u: w.get("label", k) for k, w in self.running.items() for u in w["gpus"]
        }

    def since(self, monotonic: float) -> int:
        """A monotonic time of this round as wall-clock seconds."""
        return round(self.wall - (self.snap.now - monotonic))

    def gpu(self, gpu: Gpu) -> dict:
        """One GPU: what it is, its verdict, who holds it."""
        uuid = gpu.uuid or ""
        rules = self.plan.rules.get(uuid)
        verdict = self.decision.verdicts.get(uuid)
        state = "busy" if verdict is None or verdict.busy else "free"
        if uuid in self.by_gpu:
            state = f"running {self.by_gpu[uuid]}"
        free = verdict.free_since if verdict else None
        return {
            "index": gpu.index,
            "uuid": gpu.uuid,
            "name": gpu.name,
            "device": gpu.device,
            "memory_used_mib": gpu.memory_used_mib,
            "memory_total_mib": gpu.memory_total_mib,
            "memory_reserved_mib": gpu.memory_reserved_mib,
            "utilization_pct": gpu.utilization_pct,
            "errors": list(gpu.errors),
            "watched": rules is not None,
            "section": f"gpu-{rules.name}" if rules else None,
            "state": state,
            "busy": verdict.busy if verdict else True,
            "reasons": [words.reason(r) for r in verdict.reasons] if verdict else ["not evaluated"],
            "free_since_wall": self.since(free) if free is not None else None,
            "holders": [
                _holder(h, uuid, bool(rules and ignored(h, rules)))
                for h in self.snap.holders
                if uuid in h.gpus
            ],
            "nvml_processes": self._nvml(gpu, rules),
        }

    def _nvml(self, gpu: Gpu, rules: Optional[GpuSection]) -> List[dict]:
        nvml = {h.pid: h for h in self.snap.nvml_procs if gpu.uuid in h.gpus}
        out = []
        for p in gpu.processes or ():
            extra = {
                "used_memory_mib": p.used_memory_mib,
                "kind": p.kind,
                "utilization_pct": p.utilization_pct,
            }
            h = nvml.get(p.pid)
            if h is not None:
                out.append(_holder(h, gpu.uuid, bool(rules and ignored(h, rules)), extra))
            else:
                out.append({"pid": p.pid, "user": "?", "name": "?", "ours": False, "ignored": False, **extra})
        return out

    def terminals(self, config: Optional[Config]) -> List[dict]:
        """Every terminal, and whether it pauses work."""
        hot = {(t.device, t.user) for t in self.decision.paused_by}
        return [
            {
                "device": t.device,
                "user": t.user,
                "uid": t.uid,
                "active_wall": round(self.wall - t.idle_seconds),
                "pauses_work": (t.device, t.user) in hot,
            }
            for t in self.snap.ttys
        ]

    def instance(self, inst: Instance) -> dict:
        """One planned workload: running, or why not."""
        w = self.running.get(inst.key)
        b = self.decision.state.backoff.get(inst.key)
        entry = {
            "key": inst.key,
            "process": inst.process,
            "label": inst.label(self.plan.index_of),
            "gpus": list(inst.gpus),
            "restarts": b.restarts if b else 0,
            "last_exit": words.last_exit(b.last) if b else "",
        }
        if w:
            entry.update(
                state="stopping" if w.get("stopping") else "running",
                pid=w.get("pid"),
                command_pid=w.get("command_pid"),
                started_wall=self.since(w["started_at"]),
                why=w.get("stop_reason", ""),
            )
            return entry
        wait = self.decision.waiting.get(inst.key)
        if wait is None:
            entry.update(state="starting", why="starting")
        else:
            entry.update(
                state=words.wait_state(wait), why=words.wait(wait, self.plan.index_of, self.snap.now)
            )
        return entry


def _who(h: dict) -> str:
    tag = " (ours)" if h.get("ours") else " (ignored)" if h.get("ignored") else ""
    tag = " (ours elsewhere)" if h.get("elsewhere") and not tag else tag
    mem = f" {h['used_memory_mib']} MiB" if h.get("used_memory_mib") is not None else ""
    util = f" {h['utilization_pct']}%" if h.get("utilization_pct") is not None else ""
    return f"{sanitize(str(h['user']))} {sanitize(str(h['name']))}[{h['pid']}]{mem}{util}{tag}"


def _where_looked(doc: dict) -> List[str]:
    """Where status looked for a daemon, and the daemons it saw elsewhere."""
    lines = []
    if doc.get("looked_for"):
        lines.append(f"  (looked for a daemon holding {doc['looked_for']}.lock)")
    for other in doc.get("other_daemons") or []:
        lines.append(
            f"  a gpu-mon daemon runs as pid {other['pid']} with --config {other['config']}: "
            f"gpu-mon --config {other['config']} status"
        )
    return lines


def render(doc: dict) -> str:
    """The status document as text for a terminal."""
    now = time.time()
    lines = [*_header(doc, now), ""]
    for g in doc.get("gpus", []):
        lines += _gpu_lines(g, now)
    if not doc.get("gpus"):
        lines.append("No GPUs found.")
    if (doc.get("slurm") or {}).get("unreachable"):
        lines += ["", "Slurm: cannot be reached (gpu-mon tries again each round)"]
    if doc.get("queue"):
        lines += ["", queue_line(doc["queue"], now)]
    lines += _idle_holder_lines(doc, now) + _terminal_lines(doc, now) + _workload_lines(doc, now)
    if doc.get("occupiers"):
        lines += ["", "Occupiers (gpu-mon occupy, every user's):"]
        lines += occupier_lines(doc["occupiers"], doc.get("gpus", []), now)
    if doc.get("decisions"):
        lines += ["", "Recent decisions:"]
        for entry in doc["decisions"][-10:]:
            lines.append(f"    {time.strftime('%H:%M:%S', time.localtime(entry['wall']))}  {entry['text']}")
    return sanitize_lines("\n".join(lines))


def logged_in_terminals(doc: dict, lines: Set[str]) -> dict:
    """The document with only the terminals someone is logged in on (and any that pause work);
    `terminals_not_shown` counts the others (consoles with nobody on them)."""
    terms = doc.get("terminals") or []
    keep = [t for t in terms if t.get("pauses_work") or logins.logged_in(t["device"], _owner(t), lines)]
    doc["terminals"], doc["terminals_not_shown"] = keep, len(terms) - len(keep)
    return doc


def _owner(terminal: dict) -> int:
    """The terminal's owner uid (a state file written before uids were recorded has only the name)."""
    uid = terminal.get("uid")
    if isinstance(uid, int):
        return uid
    return 0 if terminal.get("user") == "root" else -1


def no_countdowns(doc: dict) -> dict:
    """Without a daemon nothing counts: a free GPU is just free (not "free for 0 s"), and a workload whose
    GPUs are free is not running, with no start delay ticking."""
    for g in doc.get("gpus") or []:
        g["free_since_wall"] = None
    for w in doc.get("workloads") or []:
        if w.get("state") == "waiting" and w.get("why", "").startswith("waiting: start delay"):
            w["state"], w["why"] = "not running", "not running: no daemon (its GPUs are free now)"
    return doc


def _header(doc: dict, now: float) -> List[str]:
    d = doc.get("daemon")
    if d:
        up = words.duration(now - d["started_wall"]) if d.get("started_wall") else "?"
        lines = [
            f"gpu-mon {doc.get('gpu_mon')}: daemon running (pid {d['pid']}, up {up}); "
            f"config {doc.get('config')}; changed {words.duration(now - doc['updated_wall'])} ago"
        ]
        if d.get("containment"):
            lines.append(f"  containment: {d['containment']}")
    else:
        source = f" ({doc['source']})" if doc.get("source") else ""
        lines = [
            f"gpu-mon {doc.get('gpu_mon')}: no daemon: a single look at the host{source}; "
            f"config {doc.get('config')}"
        ]
        lines += _where_looked(doc)
    if doc.get("config_dropins"):
        lines.append(f"  config drop-ins: {', '.join(doc['config_dropins'])}")
    if doc.get("error"):
        lines.append(f"  GPUs cannot be read: {doc['error']}")
    lines += [f"  config problem: {doc.get('config')}:{p}" for p in doc.get("problems", [])]
    denied = doc.get("denied", [])
    lines += [f"  cannot see the open files of {d_['user']} {d_['name']}[{d_['pid']}]" for d_ in denied[:3]]
    if len(denied) > 3:
        lines.append(f"  ... and {len(denied) - 3} more processes (run as root to see them all)")
    return lines


def _gpu_lines(g: dict, now: float) -> List[str]:
    mem = (
        f"{g['memory_used_mib']}/{g['memory_total_mib']} MiB"
        if g["memory_total_mib"] is not None
        else "? MiB"
    )
    if g.get("memory_reserved_mib"):
        mem += f" (+{g['memory_reserved_mib']} reserved)"
    util = f"{g['utilization_pct']}%" if g["utilization_pct"] is not None else "?%"
    state = g["state"]
    if state == "free" and g.get("free_since_wall") is not None:
        state = f"free for {words.duration(now - g['free_since_wall'])}"
    elif state == "busy" and g["reasons"]:
        state = f"busy: {g['reasons'][0]}"
    elif g.get("job"):
        state = job_words(g["job"], now)  # (rather than `running job 17`)
    watched = f"[{g['section']}]" if g["watched"] else "(not watched)"
    lines = [f"{gpu_label(g['index'], g['uuid'])}  {g['name']}  {mem}  {util}  {watched}", f"    {state}"]
    lines += [f"    also: {reason}" for reason in g["reasons"][1:]]
    lines += [f"    {slurm_job_words(j)}" for j in g.get("slurm_jobs") or []]
    if g["holders"]:
        lines.append("    device holders: " + ", ".join(_who(h) for h in g["holders"]))
    if g["nvml_processes"]:
        lines.append("    NVML processes: " + ", ".join(_who(h) for h in g["nvml_processes"]))
    return lines


def job_words(job: dict, now: float) -> str:
    """`job 17 alice lr-3e-4 (running 1 h 2 min, restart 1)`."""
    up = words.duration(now - job["started_wall"]) if job.get("started_wall") is not None else "?"
    restart = f", restart {job['restarts']}" if job.get("restarts") else ""
    who = f"{sanitize(str(job['user']))} {sanitize(str(job['name']))}"
    named = J.shown(job["id"], job.get("array_id"), job.get("array_index"))
    return f"job {named} {who} ({job['state']} {up}{restart})"


def with_queue_down(doc: dict, why: str, next_try_wall: float) -> dict:
    """The document of a daemon whose [queue] could not start: why, and when it is tried again (no jobs:
    none runs)."""
    doc["queue"] = {"jobs": {}, "running": [], "not_running": why, "next_try_wall": round(next_try_wall)}
    return doc


def queue_line(queue: dict, now: Optional[float] = None) -> str:
    """`Queue: 3 running, 12 queued, 2 held (gpu-mon jobs lists them)`, and the drain's line when the
    admin drained the queue; `Queue: not running: WHY; next try in 20 s` when it could not start."""
    if queue.get("not_running"):
        wait = max(0, round((queue.get("next_try_wall") or 0) - (time.time() if now is None else now)))
        return f"Queue: not running: {sanitize(str(queue['not_running']))}; next try in {wait} s"
    n = queue.get("jobs") or {}
    shown = [s for s in ("running", "stopping", "queued", "held") if n.get(s) or s != "stopping"]
    parts = [f"{n.get(s, 0)} {s}" for s in shown]
    line = f"Queue: {', '.join(parts)} (gpu-mon jobs lists them)"
    drained = queue.get("drained")
    if not drained:
        return line
    return f"{line}\n{queue_words.drained(str(drained.get('by')), drained.get('at_wall') or 0)}"


def with_idle_seconds(doc: dict, now: float) -> dict:
    """The document with each idle holder's `idle_seconds` as of `now` (for `status --json`), and a queue
    that could not start's `next_try_seconds`."""
    for h in doc.get("idle_holders") or []:
        if h.get("idle_since_wall") is not None:
            h["idle_seconds"] = max(0, round(now - h["idle_since_wall"]))
    queue = doc.get("queue")
    if isinstance(queue, dict) and queue.get("not_running"):
        queue["next_try_seconds"] = max(0, round((queue.get("next_try_wall") or 0) - now))
    return doc


def _idle_holder_lines(doc: dict, now: float) -> List[str]:
    holders = doc.get("idle_holders") or []
    if not holders:
        return []
    lines = ["", "Idle holders (GPU memory held without using the GPU; reported, never signalled):"]
    for h in holders:
        idle = words.duration(now - h["idle_since_wall"]) if h.get("idle_since_wall") is not None else "?"
        lines.append(
            f"    {sanitize(str(h['user']))} {sanitize(str(h['program']))}[{h['pid']}] on {h['gpu']}: "
            f"{h['memory_mib']} MiB, idle {idle}"
        )
    return lines


def _terminal_lines(doc: dict, now: float) -> List[str]:
    terms = doc.get("terminals", [])
    recent = [t for t in terms if now - t["active_wall"] < 86400 or t["pauses_work"]]
    lines: List[str] = []
    if terms:
        stale = len(terms) - len(recent)
        if not recent:
            lines += ["", f"Terminals: {stale}, all idle for over a day"]
        else:
            lines += ["", "Terminals:" + (f" ({stale} more idle for over a day)" if stale else "")]
        for t in sorted(recent, key=lambda t: -t["active_wall"])[:20]:
            mark = "  <- pauses work" if t["pauses_work"] else ""
            lines.append(
                f"    {t['device']:<12} {t['user']:<12} idle {words.duration(now - t['active_wall'])}{mark}"
            )
    if doc.get("paused_by"):
        lines.append(f"All work paused for terminal users: {'; '.join(doc['paused_by'])}")
    return lines


def occupier_lines(found: List[dict], gpus: List[dict], now: float) -> List[str]:
    """One line per occupier: user, phase and since when, its GPUs, polite or firm, pid."""
    index = {g.get("uuid"): g.get("index") for g in gpus}
    lines = []
    for r in found:
        if r.get("unreadable"):  # (api/occupiers.py: its owner wrote into it what no occupier writes)
            who, why = sanitize(str(r.get("user"))), sanitize(str(r["unreadable"]))
            lines.append(f"    {who:<12} unreadable record ({why}), pid {r.get('pid')}")
            continue
        held = [f"GPU {index[u]}" if index.get(u) is not None else str(u) for u in r.get("gpus") or []]
        asked = [f"GPU {g}" if str(g).isdigit() else str(g) for g in r.get("gpus_asked") or []]
        where = ", ".join(asked or held) or "every GPU"
        since = r.get("since_wall")
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(since)) if since else "?"
        ago = words.duration(now - since) if since else "?"
        manner = "polite (--yield)" if r.get("polite") else "firm"
        user, phase = sanitize(str(r.get("user"))), sanitize(str(r.get("phase")))
        lines.append(
            f"    {user:<12} {phase:<9} since {when} ({ago}), {sanitize(where)}, {manner}, pid {r.get('pid')}"
        )
    return lines


def _workload_lines(doc: dict, now: float) -> List[str]:
    if not doc.get("workloads"):
        return []
    lines = ["", "Workloads:"]
    for w in doc["workloads"]:
        if w["state"] in ("running", "stopping"):
            # The log names a workload by its session id (the leader's pid): say both.
            cmd = f", command pid {w['command_pid']}" if w.get("command_pid") else ""
            what = f"{w['state']}  session {w.get('pid')}{cmd}, up {words.duration(now - w['started_wall'])}"
        else:
            what = w.get("why") or w["state"]
        extra = f"  restarts {w['restarts']}" if w["restarts"] else ""
        last = f"  last: {w['last_exit']}" if w.get("last_exit") else ""
        lines.append(f"    {w['label']:<16} {what}{extra}{last}")
    return lines
