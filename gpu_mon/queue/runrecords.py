"""Each run of a job, as the queue's database keeps it (the store's `runs` table, schema 3): written when a
run starts and when it ends (runs.py finds both, whatever made them: a start, an exit, a preemption, a
cancel, an earlier daemon's run found at start), never in between, so a long queue costs a round nothing.

A record (the table's `data`, JSON; `show --json` gives it as it is, with `energy_mj` added):

    {"job": 17, "ref": "17_5", "restart": 0, "gpus": ["GPU-..."], "start": 1767200000.0,
     "end": 1767200042.5, "how": "done", "preempted_by": "",
     "energy": {"GPU-...": {"start_mj": 9000000, "end_mj": 9420000, "sampled_mj": 418000.0}}}

`end` is null while it runs, and for an earlier daemon's run that ended unseen (then `end_mj` is null
too: what the GPU used after is not this run's). `start_mj`/`end_mj`: NVML's energy counter at its start
and end (null: no counter on that GPU); `sampled_mj`: the GPU's power integrated over the rounds it ran
(null: no power figure), used where there is no counter (energy.py). A gpu-mon that stops while a run goes
on (a job in a unit of its own outlives it) writes what it sampled so far; the next one reads the record
back and goes on from it, so a restart loses nothing the counters hold.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from gpu_mon.api import historydb
from gpu_mon.api.model import Gpu
from gpu_mon.queue import energy
from gpu_mon.queue import jobs as J
from gpu_mon.queue.runs import JobRun
from gpu_mon.queue.store import Store

log = logging.getLogger("gpu_mon")

Key = Tuple[int, float]  # (job id, the run's start, wall)


def _key(run: JobRun) -> Key:
    return (run.job, run.start)


def _record(run: JobRun, counters: Dict[str, Optional[int]]) -> dict:
    return {
        "job": run.job,
        "ref": J.shown(run.job, run.array_id, run.array_index),
        "restart": run.restart,
        "gpus": list(run.gpus),
        "start": run.start,
        "end": None,
        "how": J.RUNNING,
        "preempted_by": "",
        "energy": {u: {"start_mj": counters.get(u), "end_mj": None, "sampled_mj": None} for u in run.gpus},
    }


def with_energy(record: dict) -> dict:
    """The record with its total energy (`energy_mj`: over its GPUs, null when any is unknown), and each
    GPU's (`used_mj`, `reset`: the counter went down, a driver reload)."""
    per_gpu = {}
    for uuid, figures in record.get("energy", {}).items():
        got, reset = energy.energy_of(figures)
        per_gpu[uuid] = {**figures, "used_mj": got, "reset": reset}
    return {**record, "energy": per_gpu, "energy_mj": energy.total(record.get("energy", {}))}


def so_far(record: dict, gpus: Iterable[Gpu]) -> dict:
    """A running run's record as if it ended now: its GPUs' counters in this look as its end."""
    now = energy.counters(gpus, record["energy"])
    per_gpu = {u: {**f, "end_mj": now.get(u)} for u, f in record["energy"].items()}
    return {**record, "energy": per_gpu}


class RunRecords:
    """The runs going on (their records, in memory) and the writes of those that started or ended."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.live: Dict[Key, dict] = {}
        self.meter = energy.Meter()
        self.pending: Dict[Key, dict] = {}  # records to write (kept when a write fails: tried again)
        self.failing = False

    def sample(self, gpus: Sequence[Gpu], now: float) -> None:
        """A look's power figures, integrated into the running runs' GPUs (cost: the running runs)."""
        got = self.meter.sample(gpus, now)
        if not got:
            return
        for record in self.live.values():
            for uuid, figures in record["energy"].items():
                if uuid in got:
                    figures["sampled_mj"] = round((figures["sampled_mj"] or 0.0) + got[uuid], 1)

    def seen(self, run: JobRun, gpus: Optional[Sequence[Gpu]]) -> JobRun:
        """A run that started or ended (runs.Runs' hook), with the GPUs as last seen (None: not yet looked
        at); the run, with its energy once it ended."""
        if run.how == J.RUNNING:
            self._started(run, gpus)
            return run
        record = self._ended(run, gpus)
        return dataclasses.replace(run, energy_mj=energy.total(record["energy"]))

    def _started(self, run: JobRun, gpus: Optional[Sequence[Gpu]]) -> None:
        key = _key(run)
        before = self._stored(run) if run.earlier else None
        if before is not None:  # (an earlier daemon's run, going on: its counters at its start kept)
            self.live[key] = before
            return
        self.live[key] = _record(run, energy.counters(gpus or (), run.gpus))
        self.pending[key] = self.live[key]

    def _ended(self, run: JobRun, gpus: Optional[Sequence[Gpu]]) -> dict:
        key = _key(run)
        record = self.live.pop(key, None) or self._stored(run) or _record(run, {})
        # (no look yet: an earlier daemon's run that ended with it, unseen; when, and at what count, is
        # not known)
        counters = energy.counters(gpus, run.gpus) if gpus is not None else {}
        for uuid, figures in record["energy"].items():
            figures["end_mj"] = counters.get(uuid)
        end = run.end if gpus is not None or not run.earlier else None
        record.update(end=end, how=run.how, preempted_by=run.preempted_by)
        self.pending[key] = record
        return record

    def _stored(self, run: JobRun) -> Optional[dict]:
        """The record an earlier daemon wrote of this run (None: none, or unreadable)."""
        try:
            rows = self.store.runs_of(run.job)
        except historydb.Error:
            return None
        for start, _end, _how, data in rows:
            if start == run.start:
                try:
                    record = json.loads(data)
                except ValueError:
                    return None
                return record if isinstance(record, dict) and isinstance(record.get("energy"), dict) else None
        return None

    def write(self, everything_live: bool = False) -> None:
        """Write the records that changed (`everything_live`: the running ones too, with what they have
        sampled so far: gpu-mon stops); one log line when writes start to fail, one when they work again."""
        if everything_live:
            self.pending.update(self.live)
        if not self.pending:
            return
        rows = [
            (job, start, r["end"], r["how"], json.dumps(r, separators=(",", ":")))
            for (job, start), r in self.pending.items()
        ]
        try:
            self.store.record_runs(rows)
        except (historydb.Error, OSError) as err:
            if not self.failing:
                log.error("queue: cannot record %d run(s) of jobs: %s (tried again later)", len(rows), err)
            self.failing = True
            return
        if self.failing:
            log.warning("queue: the runs of jobs are recorded again")
        self.failing = False
        self.pending.clear()

    def of_job(self, job_id: int) -> List[dict]:
        """The records of the job's runs going on now (copies)."""
        return [json.loads(json.dumps(r)) for (j, _s), r in list(self.live.items()) if j == job_id]
