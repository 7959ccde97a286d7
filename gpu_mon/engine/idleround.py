"""Each round's idle holders (policy/idleholders.py decides who is one): a log line when an episode begins
or ends, and [gpu-*] idle_holder_command started for each that begins (engine/idlecommand.py)."""

from __future__ import annotations

import logging
from typing import Tuple

from gpu_mon.api.model import Snapshot
from gpu_mon.engine.idlecommand import IdleCommands
from gpu_mon.policy import idleholders, words
from gpu_mon.policy.decide import Plan
from gpu_mon.policy.idleholders import IdleHolder

log = logging.getLogger("gpu_mon")

Episodes = Tuple[Tuple[IdleHolder, ...], Tuple[IdleHolder, ...], Tuple[IdleHolder, ...]]


class IdleRound:
    """The idle-holder episodes, round after round."""

    def __init__(self, commands: IdleCommands):
        self.commands = commands
        self.track = idleholders.IdleTrack({}, {})

    def after(self, plan: Plan, snap: Snapshot) -> Episodes:
        """(current, begun, ended) episodes after this round, each that began or ended said once."""
        self.track, started, ended = idleholders.track(plan.rules, snap, self.track)
        for h in started:
            self._began(h, plan, snap.now)
        for h in ended:
            log.info(
                "idle holder on %s no more: %s %s[%d] (idle for %s)",
                words.gpu(h.uuid, plan.index_of),
                h.user,
                h.program,
                h.pid,
                words.duration(h.idle_seconds(snap.now)),
            )
        return tuple(self.track.current.values()), tuple(started), tuple(ended)

    def _began(self, h: IdleHolder, plan: Plan, now: float) -> None:
        rules = plan.rules.get(h.uuid)
        log.info(
            "idle holder on %s: %s %s[%d] holds %d MiB at <= %g%% for %s",
            words.gpu(h.uuid, plan.index_of),
            h.user,
            h.program,
            h.pid,
            h.memory_mib,
            rules.idle_holder_utilization_pct if rules is not None else 1.0,
            words.duration(h.idle_seconds(now)),
        )
        if rules is not None and rules.idle_holder_command:
            label = f"{h.user} {h.program}[{h.pid}] on {words.gpu(h.uuid, plan.index_of)}"
            self.commands.start(rules.idle_holder_command, h, now, label)
