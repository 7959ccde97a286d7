"""What each GPU was doing in a round, as history and metrics count it: one of five states. Pure.

harvesting: one of our workloads runs on it. paused: not harvesting because a terminal user paused all
work. foreign: someone else uses it (a holder, an NVML context, memory). unknown: it could not be read
(unsure counts as busy, and is counted apart). idle: none of these.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

from gpu_mon.policy.decisions import Busy, Decision, Verdict

STATES = ("harvesting", "foreign", "idle", "paused", "unknown")
# someone else uses it (not: unreadable)
FOREIGN_REASONS = (Busy.HOLDER, Busy.CONTEXT, Busy.MEMORY, Busy.UNSEEN, Busy.OPENS, Busy.SLURM_JOB)


def gpu_state(verdict: Optional[Verdict], running: Optional[str], paused: bool) -> Tuple[str, str]:
    """(state, detail): detail names the workload, or the foreign users and programs."""
    if running:
        return "harvesting", running
    if verdict is None:
        return "unknown", "not evaluated"
    foreign = [r for r in verdict.reasons if r.kind in FOREIGN_REASONS]
    if foreign:
        who = sorted({f"{r.who.user} {r.who.name}" for r in foreign if r.who is not None})
        return "foreign", ", ".join(who) or "memory used by others"
    if verdict.busy:
        return "unknown", verdict.reasons[0].kind if verdict.reasons else "unknown"
    return ("paused", "terminal user") if paused else ("idle", "")


def round_states(
    decision: Decision, workloads: Iterable[dict], uuids: Iterable[str]
) -> Dict[str, Tuple[str, str]]:
    """{uuid: (state, detail)} for these GPUs in one round."""
    running = {
        u: w.get("label", w.get("key", "")) for w in workloads if not w.get("stopping") for u in w["gpus"]
    }
    paused = bool(decision.paused_by)
    return {u: gpu_state(decision.verdicts.get(u), running.get(u), paused) for u in uuids}
