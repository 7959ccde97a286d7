"""The yield path: someone opened a GPU's node -> find who -> stop what runs there -> what is owed after.

1. An open (inotify IN_OPEN on the GPU's node; fanotify names the opener's pid as root) wakes the loop.
2. The opener is searched for with an incremental scan that reads the likeliest openers first (those the
   kernel named, then processes that changed or appeared, the newest first) and stops at the first holder of
   that GPU that is not ours and that its [gpu-*] section does not ignore.
3. The urgent stops that holder calls for are decided on what the search has read, confirmed by a look again
   at the GPU's holders (as in every round), and sent at once: workloads are signalled, each tier's jobs on
   that GPU yield (engine/tiers.py). The daemon then leaves the CPU for up to STEP_ASIDE_SECONDS, so that
   the signalled workload runs before the rest of /proc is read.
4. What is owed afterwards: the rest of the scan, then a round that logs the stops with the whole picture
   (engine/yields.py); a full scan soon to confirm the opener (the process found may be a child that
   inherited the descriptor); an open no scan explained is looked at again after short delays
   (engine/opens.py RETRY_DELAYS), then by a rate-limited full scan; the preemption is recorded with its
   latencies when its workload is gone.
Only step 2 and the look again of step 3 keep a new open waiting: every other scan here (a look again, the
full scan of an open no incremental scan explained, the round after an episode of opens) gives way to a new
open and goes on after it. A look again read every process and kept the loop from the next open for as long
(25 ms with 1000 processes, 110 ms with 5000, up to six looks in the second after an open whose holder let
go, as a probe's does): that was the yield's tail that doubled after 55696b6 (issue 50).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from typing import Callable, Iterable, Optional, Set, Tuple

from gpu_mon.api import holders
from gpu_mon.api.model import Holder
from gpu_mon.engine.opens import OpenRetry, retry_for
from gpu_mon.engine.round import Round
from gpu_mon.engine.yields import urgent
from gpu_mon.policy import decide as policy
from gpu_mon.policy import words
from gpu_mon.policy.decisions import Stop

log = logging.getLogger("gpu_mon")

# After a foreign open's stop signal goes out, the daemon leaves the CPU this long (or until another open)
# before it reads the rest of /proc: on a 2-core machine the signalled workload otherwise waited up to ~9 ms
# for a core behind that read (p99 of the signal to its handler 5.4 ms; 3.5 ms with the pause).
STEP_ASIDE_SECONDS = 0.005
_SUMMED_LOOKS = 3  # an episode of opens again and again that ends in a line: looked at this often
_NAMED = 4  # the openers of a GPU opened again and again that are kept (the first is named in its reason)


class YieldPath:
    """Opens of GPU nodes, from the event to the round that follows."""

    def __init__(self, round_: Round):
        self.round = round_
        self.p = round_.p
        self.retry: Optional[OpenRetry] = None  # an open no scan explained yet: looked at again soon

    def deadline(self) -> Optional[float]:
        if self.p.opens.opened:  # (nodes watched again at once: engine/floods.py, `guard`)
            return 0.0
        times = (self.retry.at if self.retry is not None else None, self.p.floods.deadline())
        return min((t for t in times if t is not None), default=None)

    def on_wake(self, now: float) -> bool:
        """The opens reported since the last wake, or an open due to be looked at again. True: a round ran."""
        opened = self.p.opens.take()
        ran = bool(opened) or (self.retry is not None and now >= self.retry.at)
        if opened:
            self.on_open(opened, now)
        elif ran:
            self.look_again(now)
        return self._floods_due(now) or ran  # (after the opens: one just read goes on an episode)

    def on_open(self, opened: Set[str], now: float) -> None:
        """A GPU node was opened: find the opener with an incremental scan, else a (rate-limited) full one.

        The open is never dropped: when the full scan has to wait for its rate limit it is deferred, and a
        poll that comes in the same wake does not replace it (a poll's incremental scan misses a process
        that swapped a descriptor in place, as a CUDA program's imports can: this was a CI flake). An open
        the incremental scan does explain is confirmed by a full scan within 0.5 s all the same: the
        process that explained it may be a child that inherited the descriptor from the real opener.
        """
        obs, scans = self.p.observer, self.p.scans
        pending, self.retry = self.retry, None  # (an earlier open's look again: kept, after this one)
        self.p.yields.by_open = True
        uuids = {obs.watch_targets().get(path) for path in opened}
        before = self.p.openers.before()
        named = self.p.opens.openers()
        if self._flooded(uuids, now):  # (nothing of ours there: no stop to send, no opener to chase)
            self._look_at_flood(uuids, named, before, now)
            self.retry = pending
            return
        explained = self._explained("first", uuids, named)
        if not obs.scan_complete:  # a foreign holder of an opened GPU: it is yielded to first
            self.yield_first(now)
            if self.p.yields.first:  # (its handler runs now, even where other processes hold every core)
                self.p.opens.wait(STEP_ASIDE_SECONDS)
            explained = self._explained("changed", uuids, polite=bool(self.p.yields.first)) | explained
        for uuid in self.p.openers.note(uuids, before, now):  # a process we cannot read opened it: at once
            log.debug("open of %s by a process whose files cannot be read", uuid)
        self.retry = None if explained else retry_for(uuids, named, now)
        if explained:
            self.round.run(now, scan=None)
            if not self._still_held(explained, uuids):
                self.retry = retry_for(uuids, named, now)
            # Explained by *a* new holder, which may only have inherited the descriptor (a fork) while the
            # opener swapped one in place and went unseen: confirm with a full scan soon.
            scans.defer_full(now)
        elif scans.event_full_now(now):
            # Every process's every fd table; if even that does not explain it, memory maps too (a process
            # that opened, mapped and closed the node between two looks).
            found = self._explained("fds", uuids)
            if found:
                self.retry = None
            self.round.run(now, scan=None if found else "full", pause=True)
        else:
            self.round.run(now, scan=None)
            scans.defer_full(now)
        self.retry = pending if self.retry is None else self.retry.joined(pending)

    # ------------------------------------------------------------------ opens again and again (floods.py)

    def _guarded(self, uuid: str) -> bool:
        """Something of ours that yields at an open is on this GPU (a workload, a queue job that does not
        wait out brief opens, a Slurm job): each open of its node is looked at at once. Before the first
        round, every GPU is."""
        if any(uuid in w.instance.gpus for w in self.p.supervisor.workloads.values()):
            return uuid not in self.round.patience()
        report = self.round.report
        if report is None:
            return True
        snap = report.snapshot
        return any(uuid in j.gpus for j in (*snap.slurm_jobs, *snap.queue_jobs))

    def _flooded(self, uuids: Set[Optional[str]], now: float) -> bool:
        """Note these opens of the GPUs with nothing of ours on them; whether every one of them is a GPU
        opened again and again (its node is let go until the next look)."""
        quiet = {u for u in uuids if u is not None and not self._guarded(u)}
        flooded = self.p.floods.opened(quiet, now)
        return bool(uuids) and uuids <= flooded

    def _look_at_flood(
        self, uuids: Set[Optional[str]], named: Tuple[int, ...], before: tuple, now: float
    ) -> None:
        """An open of GPUs opened again and again: who (the openers the kernel named first), then a round;
        their nodes let go again."""
        self._explained("first", uuids, named)
        for uuid in self.p.openers.note(uuids, before, now):  # (a plain user's daemon: no names)
            log.debug("open of %s by a process whose files cannot be read", uuid)
        obs = self.p.observer
        for uuid in uuids:
            assert uuid is not None
            pids = [p for p in named if p != obs.own_pid]
            pids += [h.pid for h in obs.holders if uuid in h.gpus and not h.ours_on(uuid)]
            found = (holders.describe(p, frozenset((uuid,)), obs.proc) for p in dict.fromkeys(pids))
            self.p.floods.named(uuid, tuple(itertools.islice((h for h in found if h is not None), _NAMED)))
        self._hold()
        self.round.run(now, scan=None)

    def _floods_due(self, now: float) -> bool:
        """Nodes let go long enough are watched again; an episode with no open since ends, in one line, and
        a round with a scan says what the GPU is now. True: a round ran."""
        listen, ended = self.p.floods.due(now)
        if listen or ended:
            self._hold()
        index_of = self.round.plan.index_of if self.round.plan is not None else {}
        for e in ended:  # (not a short one: a CUDA program opens its nodes a few times as it starts)
            if e.looks >= _SUMMED_LOOKS:
                self.round.say(words.brief_opens(words.gpu(e.uuid, index_of), e.seconds, e.by, e.looks))
        if ended:
            self.round.run(now, scan="changed", pause=True)
        return bool(ended)

    def guard(self) -> None:
        """After a wake's rounds: a GPU let go that something of ours is on now is watched again at once,
        and looked at as if opened (it may have been, while let go)."""
        floods = self.p.floods
        gone = floods.drop([u for u in floods.episodes if self._guarded(u)])
        if gone:
            self._hold()
            self.p.opens.opened.update(p for p, u in self.p.observer.watch_targets().items() if u in gone)

    def _hold(self) -> None:
        """The nodes of the GPUs let go now are not watched; the others are."""
        held = self.p.floods.held()
        self.p.opens.hold(p for p, u in self.p.observer.watch_targets().items() if u in held)

    # ------------------------------------------------------------------ opens no scan explained

    def look_again(self, now: float) -> None:
        """An open no scan explained, looked at again: its openers and the processes that changed."""
        retry, self.retry = self.retry, None
        assert retry is not None
        explained = self._explained("first", set(retry.uuids), retry.openers, pause=self.p.opens.pending)
        if not explained and self.p.observer.scan_paused:  # a new open: it first, this look right after
            self.retry = dataclasses.replace(retry, at=now)
            return
        if explained:
            log.debug("an open of %d GPU(s) explained on look %d", len(retry.uuids), retry.step + 2)
            self.round.run(now, scan=None)
        if not explained or not self._still_held(explained, set(retry.uuids)):
            self.retry = retry.later(now)

    def _still_held(self, explainers: Set[int], uuids: Set[Optional[str]]) -> bool:
        """Whether a process that explained an open still holds that GPU after the round. One that let go by
        the round's look again (it opened and closed the node) leaves the open looked at again, as one no
        scan explained: a descriptor it is handed later (SCM_RIGHTS, pidfd_getfd) makes no event of its
        own, and was found only by the next poll (a CI flake, polls 30 s apart)."""
        return any(h.pid in explainers and h.gpus & uuids for h in self.p.observer.holders)

    def _explained(
        self,
        scan: str,
        uuids: Set[Optional[str]],
        openers: Iterable[int] = (),
        polite: bool = False,
        pause: Optional[Callable[[], bool]] = None,
    ) -> Set[int]:
        """Scan; the processes that scan read that now hold one of these GPUs (none: not explained). A
        'first' scan reads the `openers` the kernel named first and stops at the first holder of one of them
        that is not ours and that its [gpu-*] section does not ignore."""
        obs = self.p.observer
        enough = self._foreign_holder(uuids) if scan == "first" else None
        mode = scan if enough else "changed"
        if polite:  # (a workload just signalled may be waiting for a core)
            pause = _let_others_run
        obs.scan(mode, self.p.supervisor.sessions(), enough=enough, first=openers, pause=pause)
        rescanned = obs.last_rescanned
        return {h.pid for h in obs.holders if h.pid in rescanned and h.gpus & uuids}

    def _foreign_holder(self, uuids: Set[Optional[str]]) -> Optional[Callable[[Holder], bool]]:
        """Whether a holder makes one of these GPUs busy by the policy's rule for holders (one more holder
        changes the log line, not the decision); None while the plan has problems."""
        plan = self.round.plan
        if plan is None or plan.problems:
            return None
        rules = {u: plan.rules[u] for u in uuids if u in plan.rules}
        # (our workload's process on a GPU it was not given is someone else's use of that GPU)
        return lambda h: any(
            u in rules and not h.ours_on(u) and not policy.ignored(h, rules[u]) for u in h.gpus
        )

    def yield_first(self, now: float) -> None:
        """The urgent stops a foreign open calls for, sent on what the search has read (confirmed by the look
        again, as in every round); the round after the rest of the scan logs them with the whole picture."""
        r = self.round
        m = r.moment(now)
        snap = r.snapshot(now, quick=True)
        for tier in self.p.tiers:  # (a preemptible Slurm job on that GPU: Slurm is asked first, too)
            tier.ask(snap, m)
        decision = policy.decide(r.config, m.plan, snap, r.state)
        stops = tuple(a for a in decision.actions if isinstance(a, Stop) and urgent(a))
        hit: Set[str] = set()
        for tier in self.p.tiers:
            hit |= tier.hit(decision, m)
        if not stops and not hit:
            return
        decision = dataclasses.replace(decision, actions=stops)
        decision, _snap = r.look_again(m.plan, snap, decision, now, quick=True, also=hit)
        for tier in self.p.tiers:  # their jobs yield exactly as workloads do
            tier.yield_first(decision, m)
        for stop in decision.actions:
            self._send(stop, m.plan.index_of, now)

    def _send(self, stop: object, index_of: dict, now: float) -> None:
        sup = self.p.supervisor
        w = sup.workloads.get(stop.key) if isinstance(stop, Stop) and urgent(stop) else None
        if w is None or w.stopping:
            return
        assert isinstance(stop, Stop)
        why = words.stop(stop, index_of)
        sup.stop(stop.key, why, now, urgent=True)
        self.p.yields.sent_first(stop, w.label, w.pid)
        log.debug("stopping %s before reading the rest of /proc: %s", w.label, why)


def _let_others_run() -> bool:
    """A scan's `pause` that never pauses, but lets the processes waiting for this core run first."""
    os.sched_yield()
    return False
