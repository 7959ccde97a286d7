"""The users' queue as one of the daemon's tiers (engine/tiers.py): queue/runner.py's Queue at the points of
a round, and a queue that could not start tried again later (queue/retry.py)."""

from __future__ import annotations

import logging
from typing import Dict, Iterable, List, Optional, Set, Tuple

from gpu_mon.api.model import Snapshot
from gpu_mon.config import Config
from gpu_mon.engine.tiers import Moment, Tier, Wiring
from gpu_mon.policy.decisions import Decision
from gpu_mon.queue.retry import QueueRetry, next_try
from gpu_mon.queue.runner import PREFIX, Queue, queue_gpus

log = logging.getLogger("gpu_mon")


class QueueTier(Tier):
    """[queue]: its database and socket opened at the start; without them gpu-mon runs on, without the
    queue, and tries again later."""

    def __init__(self, wiring: Wiring):
        self.wiring = wiring
        self.config = wiring.config
        self.queue: Optional[Queue] = None
        self.retry: Optional[QueueRetry] = None
        self.hits: Set[str] = set()  # the GPUs of jobs the first decision of an open hits
        self.poll_now = False  # started after failed tries: its round at once

    def start(self, now: float) -> None:
        if self.config.queue is None:
            return
        w = self.wiring
        try:
            self.queue = Queue(self.config, w.supervisor, w.poke, w.wall, w.say)
            self.queue.start()
        except Exception as err:  # a database, socket or lock we cannot have: one line, and no queue yet
            self.queue = None
            self.retry = self.retry or QueueRetry()
            delay = self.retry.failed(str(err), now, w.wall())
            log.error("queue: cannot start the queue: %s; trying again in %.0f s", err, delay)
            return
        if self.retry is not None:
            log.info("queue: started (after %d failed tries)", self.retry.tries)
            self.retry, self.poll_now = None, True

    def later(self, now: float) -> bool:
        if self.retry is not None and self.retry.due(now):
            self.start(now)
        poll, self.poll_now = self.poll_now, False
        return poll

    def deadline(self) -> Optional[float]:
        wake = self.queue.wake_at() if self.queue is not None else None
        retry = next_try(self.retry)
        return min((t for t in (wake, retry) if t is not None), default=None)

    def wanted(self, now: float) -> bool:
        return self.queue is not None and self.queue.wanted(now)

    def patience(self, key: str) -> float:
        q = self.config.queue
        if q is None or self.queue is None or not key.startswith(PREFIX):
            return 0.0
        return q.brief_open_seconds

    def recheck(self, now: float) -> Set[str]:
        return self.queue.confirms_due(now) if self.queue is not None else set()

    def see(self, snap: Snapshot, quick: bool) -> Snapshot:
        return snap if quick or self.queue is None else self.queue.take_jobs(snap)

    def ask(self, snap: Snapshot, moment: Moment) -> None:
        if self.queue is not None:
            self.queue.seen_look(snap)

    def _gpus(self, moment: Moment) -> List[str]:
        assert self.queue is not None
        return queue_gpus(self.queue.q, moment.plan.rules, moment.plan.index_of)

    def hit(self, decision: Decision, moment: Moment) -> Set[str]:
        q = self.queue
        self.hits = q.hit(decision, self._gpus(moment), moment.now) if q is not None else set()
        return self.hits

    def yield_first(self, decision: Decision, moment: Moment) -> None:
        if self.hits and self.queue is not None:  # queued jobs yield exactly as workloads do
            self.queue.yield_first(decision, moment.plan.index_of, self._gpus(moment), moment.now)

    def place(self, decision: Decision, moment: Moment) -> Decision:
        if self.queue is None:
            return decision
        m = moment
        return self.queue.round(decision, m.plan.index_of, self._gpus(m), m.now, stopping=m.stopping)

    def report(self) -> Dict[str, object]:
        return {
            "queue": self.queue.report() if self.queue is not None else None,
            "queue_down": self.retry.report() if self.retry is not None else None,
        }

    def reconfigure(self, config: Config) -> None:
        self.config = config
        if self.queue is not None and config.queue is not None:
            self.queue.reconfigure(config)  # (its socket and database stay until a restart)

    def leave_running(self) -> int:
        return self.queue.leave_running() if self.queue is not None else 0

    def stop_all(self) -> None:
        if self.queue is None:
            return
        try:
            self.queue.requeue_running()  # its running jobs go back to the queue
        except Exception:  # (an internal error may be the queue's own: the jobs are stopped all the same)
            log.exception("queue: cannot mark the running jobs to be requeued")

    def owned(self, keys: Iterable[str]) -> Tuple[int, str]:
        return sum(1 for key in keys if key.startswith(PREFIX)), "queue job(s) to stop, back to the queue"

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close()
