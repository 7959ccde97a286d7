"""Slurm's preemptible jobs as one of the daemon's tiers (engine/tiers.py): slurm/preempt.py's hook, made,
changed or closed as [slurm] comes and goes with reloads."""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict, Optional

from gpu_mon.api.model import Snapshot
from gpu_mon.config import Config
from gpu_mon.engine.tiers import Moment, Tier, Wiring
from gpu_mon.slurm.owed import path_for as owed_path
from gpu_mon.slurm.preempt import Slurm

log = logging.getLogger("gpu_mon")


class SlurmTier(Tier):
    """[slurm]: jobs of the named partitions yield to anyone else's use of their GPUs."""

    def __init__(self, wiring: Wiring):
        self.wiring = wiring
        self.slurm: Optional[Slurm] = None

    def start(self, now: float) -> None:
        self.reconfigure(self.wiring.config)

    def deadline(self) -> Optional[float]:
        return self.slurm.next_wake() if self.slurm is not None else None

    def wanted(self, now: float) -> bool:
        return self.slurm is not None and self.slurm.wanted(now)

    def see(self, snap: Snapshot, quick: bool) -> Snapshot:
        if self.slurm is None:
            return snap
        jobs, unknown = self.slurm.allocations()  # GPUs Slurm has allocated: its jobs', opened or not
        return dataclasses.replace(snap, slurm_jobs=jobs, slurm_unknown=unknown)

    def ask(self, snap: Snapshot, moment: Moment) -> None:
        if self.slurm is not None:  # (before our own stops: asking Slurm only hands a call to a thread)
            plan = moment.plan
            self.slurm.round(snap, plan.rules, plan.index_of, moment.wake_at, moment.by_open)

    def report(self) -> Dict[str, object]:
        return {"slurm": self.slurm.report() if self.slurm is not None else None}

    def reconfigure(self, config: Config) -> None:
        rule, w = config.slurm, self.wiring
        if rule is None and self.slurm is not None:
            self.slurm.close()
            self.slurm = None
        elif rule is not None and self.slurm is None:
            record = owed_path(config.defaults.state_file)
            self.slurm = Slurm(rule, w.poke, w.clock, w.wall, w.supervisor.spawn_helper, record)
            log.info("slurm: jobs of %s yield to anyone else's use of their GPUs", self.slurm.whose())
        elif rule is not None and self.slurm is not None:
            self.slurm.set_rule(rule)

    def close(self) -> None:
        if self.slurm is not None:
            self.slurm.close()
