"""One look at the host: GPUs from the backend, holders from /proc, terminal users. The thin adapter in
front of the pure policy: it touches the host, the policy only sees the Snapshot it returns."""

from __future__ import annotations

import collections
import dataclasses
import os
import time
import types
from typing import Callable, Collection, Deque, Dict, Iterable, Mapping, Optional, Protocol, Set, Tuple

from gpu_mon.api import holders, procfs
from gpu_mon.api import ttys as sessions
from gpu_mon.api.logger import logger
from gpu_mon.api.model import GpuReading, Holder, Snapshot, TtyUser

log = logger(__name__)
# What the daemon tells a scan about its workloads: the session id of each (its leader's pid), and each
# process of a transient unit that runs one, -> the UUIDs of the GPUs that workload was given.
Given = Mapping[int, Collection[str]]
_OURS_MEMORY_SECONDS = 30.0
_MAX_EXTRA_NODES = 64
_MAX_NOT_DESCENDANTS = 4096
_NO_WORKLOADS: Given = types.MappingProxyType({})
_EVERY_GPU: frozenset = frozenset(["(every GPU)"])  # what gpu_mon itself is given (compared by identity)


class Backend(Protocol):
    """NvmlBackend or SimBackend."""

    def read(self, process_utilization: bool = True) -> GpuReading: ...

    def close(self) -> None: ...


class Observer:
    """Takes looks at the host. Remembers the last GPU reading and the holder scan between looks."""

    def __init__(
        self,
        backend: Backend,
        proc: str = procfs.PROC,
        own_pid: Optional[int] = None,
        wall: Callable[[], float] = time.time,
    ):
        self.backend = backend
        self.proc = proc
        self.own_pid = os.getpid() if own_pid is None else own_pid
        self.scanner = holders.HolderScanner(proc, skip_pids=(self.own_pid,))
        self.wall = wall
        self.reading = GpuReading(gpus=(), error="not read yet")
        # (uuid, pid) -> utilization_pct of the last look that asked for per-process samples
        self.sampled: Dict[Tuple[str, int], int] = {}
        self.node_errors: Dict[str, str] = {}
        self.holders: Tuple[Holder, ...] = ()
        self.last_rescanned: Set[int] = set()  # pids whose descriptors the last scan read
        self.scan_complete = True  # False after a search that stopped at what it looked for (see scan)
        self.scan_paused = False  # the last scan paused for its caller (see scan)
        self.rescan_wanted = False  # a holder let go of a GPU since the last full scan
        # (mode, seconds) of each holder scan since take_scan_times (the latest 256: nobody may take them)
        self.scan_times: Deque[Tuple[str, float]] = collections.deque(maxlen=256)
        self.denied_pids: Tuple[int, ...] = ()
        # Log each process whose files cannot be read (off where a caller says once what it cannot see)
        self.warn_denied = True
        self.after_scan: Optional[Callable[[], None]] = None  # called at the end of every scan
        self._denied_logged: Set[int] = set()
        self._starts: Dict[int, int] = {}
        self._ancestors: Set[int] = set()
        # (pid, uuid) -> when it was last seen as ours on that GPU (monotonic)
        self._ours_seen: Dict[Tuple[int, str], float] = {}
        # (pid, start) of processes found not to be in one of our workloads (not its leader's descendant,
        # nor in its session or unit): that never changes (a process is only ever reparented to one of its
        # ancestors, and a new workload cannot be the ancestor of an older process), so their ancestry is
        # walked once.
        self._not_descendants: Set[Tuple[int, int]] = set()

    def take_scan_times(self) -> Tuple[Tuple[str, float], ...]:
        """(mode, seconds) of the holder scans since the last call."""
        out = tuple(self.scan_times)
        self.scan_times.clear()
        return out

    def read_gpus(self, process_utilization: bool = True) -> GpuReading:
        """Read the backend and point the holder scan at the current device nodes. Without
        `process_utilization` the backend does not ask for per-process samples: a process keeps the
        utilization the last look that asked found for it on that GPU, and one it did not find there is
        unknown (None), never 0."""
        reading = self.backend.read(process_utilization=process_utilization)
        if process_utilization:
            self.sampled = sampled_utilization(reading)
        else:
            reading = with_sampled(reading, self.sampled)
        self.reading = reading
        targets, self.node_errors = holders.device_targets(self.reading.gpus)
        self.scanner.set_targets(targets)
        return self.reading

    def watch_targets(self) -> Dict[str, str]:
        """{path: uuid} of every node to watch for opens: each readable GPU's device node, and the nodes of
        other mount namespaces (containers) that a scan has seen holding one (at most _MAX_EXTRA_NODES)."""
        out = {
            g.device: g.uuid
            for g in self.reading.gpus
            if g.device and g.uuid and g.uuid not in self.node_errors
        }
        for uuid, path in list(self.scanner.extra_nodes.values())[:_MAX_EXTRA_NODES]:
            out.setdefault(path, uuid)
        return out

    def device_paths(self) -> Tuple[str, ...]:
        """Nodes to watch for opens (see watch_targets), sorted."""
        return tuple(sorted(self.watch_targets()))

    def forget_node(self, path: str) -> None:
        """A container's node went away (its watch ended): stop watching it."""
        for key, (_uuid, watched) in list(self.scanner.extra_nodes.items()):
            if watched == path:
                del self.scanner.extra_nodes[key]

    def scan(
        self,
        mode: str,
        given: Given = _NO_WORKLOADS,
        pids: Iterable[int] = (),
        enough: Optional[Callable[[Holder], bool]] = None,
        pause: Optional[Callable[[], bool]] = None,
        every: bool = False,
        first: Iterable[int] = (),
    ) -> None:
        """Scan holders: mode 'full' (with memory maps), 'fds' (full, descriptors only), 'changed'
        (incremental), 'first' (incremental, the likeliest openers first, stopping at the first holder that
        `enough` accepts: `scan_complete` is then False, and a 'changed' scan reads the rest), 'new' (new
        processes, holders and young ones: HolderScanner.fresh) or 'pids' (just those).

        A full scan reads again only the processes that ran since it last read them, unless `every`.
        'full', 'fds', 'changed' and 'first' ask `pause` every few processes and stop when it answers True:
        `scan_paused` is then set, the holders are those found so far and the rest as last read, and the
        same call with a `pause` goes on (a full scan from where it stopped, `changed` from the start).
        'first' reads the processes in `first` (the openers the kernel named) before all others.

        `given`: our workloads' sessions and units' processes -> the GPUs each was given (see _classify)."""
        began = time.perf_counter()
        ours = given
        if mode in ("full", "fds"):
            result = self.scanner.full(maps=mode == "full", every=every, pause=pause)
        elif mode == "pids":
            result = self.scanner.full(pids=[str(p) for p in pids])
        elif mode == "new":
            result = self.scanner.fresh()
        elif mode == "first" and enough is not None:
            result = self.scanner.changed(enough=self._accepts(enough, ours), pause=pause, first=first)
        else:
            result = self.scanner.changed(pause=pause)
        self.scan_times.append((mode, time.perf_counter() - began))
        self._take(result, ours)

    def _take(self, result: holders.ScanResult, ours: Given) -> None:
        """What a scan found becomes the holders (a reused pid read again next time), and the processes
        that cannot be read are said once each."""
        self.scan_complete = result.complete
        self.scan_paused = result.paused
        self.last_rescanned = result.rescanned
        self.rescan_wanted = (self.rescan_wanted or result.released) and not result.full
        found = []
        reused = []
        for pid, gpus in sorted(result.held.items()):
            h = holders.describe(pid, gpus, self.proc, (path for _u, path in result.nodes.get(pid, ())))
            if h is None:
                continue
            if pid not in result.rescanned and self._starts.get(pid, h.start_ticks) != h.start_ticks:
                reused.append(pid)  # the pid now names another process: read it again next time
                continue
            found.append(self._classify(h, ours))
        if reused:
            self.scanner.forget(reused)
        self._starts = {h.pid: h.start_ticks for h in found}
        self.holders = tuple(found)
        if result.full or not self._ancestors:
            self._ancestors = set(procfs.ancestors(self.own_pid, self.proc))
        # Our own ancestors (systemd, the admin's shell, a container's init) supervise gpu-mon; they are not
        # GPU users, and some (a sandbox's init with more capabilities than ours) even root cannot inspect.
        self._say_denied(tuple(p for p in result.denied if p not in self._ancestors))
        if self.after_scan is not None and result.complete:
            self.after_scan()

    def _say_denied(self, denied: Tuple[int, ...]) -> None:
        self.denied_pids = denied
        new_denied = set(denied) - self._denied_logged
        if new_denied and self.warn_denied:
            log.warning(
                "cannot read the open files of %d process(es) (e.g. pid %d): GPUs count as busy while they "
                "run, unless a [gpu-*] section ignores them (ignore_programs, ignore_users)%s",
                len(new_denied),
                min(new_denied),
                "" if os.geteuid() == 0 else "; run gpu-mon as root to see every process",
            )
            self._denied_logged |= new_denied

    def full_paused(self) -> bool:
        """Whether a full scan paused and has not finished since."""
        return self.scanner.full_paused()

    def _accepts(self, enough: Callable[[Holder], bool], ours: Given) -> Callable[[int, frozenset], bool]:
        """`enough` for the scanner: a holder described and told apart as ours or not."""

        def accepts(pid: int, gpus: frozenset) -> bool:
            h = holders.describe(pid, gpus, self.proc)
            return h is not None and enough(self._classify(h, ours))

        return accepts

    def workload_gpus(self, pid: int, sid: int, ours: Given) -> Optional[Collection[str]]:
        """The GPUs given to the workload this process is in (its leader's session or descendants, or its
        unit), or None when it is in none. gpu_mon itself is given every GPU. A descendant of gpu_mon that
        is in no workload (a hook's setsid'd child, reparented to the daemon, a child subreaper) is not
        ours: the walk up stops at the daemon."""
        if pid == self.own_pid:
            return _EVERY_GPU
        given = ours.get(pid)
        if given is None:
            given = ours.get(sid)
        if given is not None:
            return given
        for a in procfs.ancestors(pid, self.proc):
            if a == self.own_pid:
                return None  # (every leader is our child: a walk that reaches us passed none)
            given = ours.get(a)
            if given is not None:
                return given
        return None

    def _classify(self, h: Holder, ours: Given) -> Holder:
        """The holder, ours on the GPUs its workload was given (cost: dict look-ups, and the walk up the
        process tree of a process not seen before)."""
        key = (h.pid, h.start_ticks)
        if key in self._not_descendants and h.sid not in ours and h.pid not in ours:
            return h  # (a new workload cannot be the ancestor of a process older than itself)
        given = self.workload_gpus(h.pid, h.sid, ours)
        if given is None:
            if h.start_ticks:
                if len(self._not_descendants) >= _MAX_NOT_DESCENDANTS:
                    self._not_descendants.clear()
                self._not_descendants.add(key)
            return h
        mine = h.gpus if given is _EVERY_GPU else h.gpus.intersection(given)
        now = time.monotonic()
        for uuid in mine:
            self._ours_seen[(h.pid, uuid)] = now
        # (on GPUs it was not given, a workload's process is not ours: its use there is someone else's)
        ours = len(mine) == len(h.gpus)
        return dataclasses.replace(h, ours=ours, ours_gpus=frozenset(mine), in_workload=True)

    def nvml_processes(self, ours: Given) -> Tuple[Holder, ...]:
        """Owners of the processes NVML lists (pid namespaces aside, these are host pids)."""
        out = []
        now = time.monotonic()
        self._ours_seen = {p: t for p, t in self._ours_seen.items() if now - t < _OURS_MEMORY_SECONDS}
        for gpu in self.reading.gpus:
            gpus = frozenset([gpu.uuid] if gpu.uuid else [])
            for p in gpu.processes or ():
                h = holders.describe(p.pid, gpus, self.proc)
                if h is not None:
                    out.append(self._classify(h, ours))
                elif (p.pid, gpu.uuid) in self._ours_seen:
                    # NVML goes on listing a process for about a second after it exited (seen on an H100,
                    # driver 580) while the driver tears its context down: one of ours stays ours.
                    out.append(
                        Holder(
                            pid=p.pid,
                            start_ticks=0,
                            name="(exited)",
                            argv0="",
                            uid=None,
                            user="?",
                            sid=0,
                            gpus=gpus,
                            ours=True,
                        )
                    )
        return tuple(out)

    def ttys(self, patterns: Iterable[str]) -> Tuple[TtyUser, ...]:
        """Terminal users now."""
        return sessions.scan_ttys(patterns, self.wall())

    def snapshot(self, now: float, ours: Given, tty_patterns: Optional[Iterable[str]]) -> Snapshot:
        """The Snapshot of what was last read and scanned (the supervisor's parts are added by the daemon);
        `ours` as scan's `given`."""
        return Snapshot(
            now=now,
            reading=self.reading,
            holders=self.holders,
            denied=holders.describe_denied(self.denied_pids, self.proc),
            ttys=self.ttys(tty_patterns) if tty_patterns is not None else (),
            nvml_procs=self.nvml_processes(ours),
            node_errors=tuple(sorted(self.node_errors.items())),
        )


def sampled_utilization(reading: GpuReading) -> Dict[Tuple[str, int], int]:
    """{(uuid, pid): utilization_pct} of every process whose utilization the reading knows."""
    return {
        (g.uuid, p.pid): p.utilization_pct
        for g in reading.gpus
        if g.uuid
        for p in g.processes or ()
        if p.utilization_pct is not None
    }


def with_sampled(reading: GpuReading, sampled: Dict[Tuple[str, int], int]) -> GpuReading:
    """The reading with each listed process's utilization as `sampled` last knew it (else None)."""
    gpus = []
    for g in reading.gpus:
        if g.processes:
            procs = tuple(
                dataclasses.replace(p, utilization_pct=sampled.get((g.uuid or "", p.pid)))
                for p in g.processes
            )
            g = dataclasses.replace(g, processes=procs)
        gpus.append(g)
    return dataclasses.replace(reading, gpus=tuple(gpus))


def unexplained(before: GpuReading, after: GpuReading, known: Iterable[Holder]) -> bool:
    """Whether a new GPU reading shows use that the holders found so far may not explain: a process NVML
    lists that is not a known holder of that GPU, or memory used that changed (or became unreadable)."""
    held = {(u, h.pid) for h in known for u in h.gpus}
    used = {g.uuid: g.memory_used_mib for g in before.gpus}
    for gpu in after.gpus:
        if gpu.uuid not in used or gpu.memory_used_mib is None or gpu.memory_used_mib != used[gpu.uuid]:
            return True
        if gpu.processes is None or any((gpu.uuid, p.pid) not in held for p in gpu.processes):
            return True
    return False


def look(backend: Backend, tty_patterns: Optional[Iterable[str]] = None, proc: str = procfs.PROC) -> Snapshot:
    """One complete look at the host (GPUs, every holder, terminals), as a plain user may take it."""
    observer = Observer(backend, proc=proc)
    observer.read_gpus()
    observer.scan("full")
    return observer.snapshot(time.monotonic(), _NO_WORKLOADS, tty_patterns)
