"""Which processes hold which GPU's device node, as `fuser` finds them: the descriptors of every fd table
(a thread created without CLONE_FILES has its own, seen only in /proc/PID/task/TID/fd) and memory maps of
the node, which outlive a closed descriptor.

A character device matches by `st_rdev`, so a process holding the node under another path (a container's own
/dev, made with mknod) is found too, and that node is reported so it can be watched; the simulator's regular
files match by (st_dev, st_ino), so hard links are found. /dev/nvidiactl and /dev/nvidia-uvm are not GPU
nodes and attribute nothing.

A held node counts by what is held, not by the path that exists now: when a GPU's node is replaced (a
simulated device file renamed and made anew, a node recreated with another inode), the old node's keys are
kept for that GPU (`retired`) while anything may still hold them, and dropped only after every process's
memory maps have been read at least once without a match.

A full scan stats every fd of every table of every process (50-95 ms for 1000 processes with 10 fds each
on a 2-core VM), except where the process has not run since it was last read: a single-threaded process
whose main thread's run time and count of times scheduled in (/proc/PID/schedstat) are unchanged cannot
have changed its table or maps (~18 ms then, for 1000 mostly idle processes). A scan can pause for the
caller (an open to serve first) and go on later.

The incremental scan (`changed`) re-reads only processes whose signature changed: since Linux 6.2
`stat(/proc/PID/fd).st_size` is the open-fd count, and its inode and ctime tell a reused pid from
the process that had it before; the tables of threads known to have their own are part of the signature.
What keeps the signature (a descriptor replaced in place by close-and-open or dup2, one received from
another process, a new thread with a table of its own) is left to the caller: it runs a full scan when an
open event is not explained by the incremental scan, and whenever a holder lets go of a GPU
(`ScanResult.released`: its descriptor may have been handed on). Counting threads in every poll as well
doubled a poll's cost (one more stat per process) for a case an open event already covers.

After an open, `changed(enough=...)` reads the likeliest openers first (the processes that changed or
appeared most recently, then new ones, then the others, the newest first by the order the kernel handed out
their pids) and stops at the first holder the caller accepts, so that a stop can go out before the rest is
read; the next `changed` reads the rest. Between two
signature passes, `fresh` notices new and gone processes and compares the signatures of holders and young
processes only (a pass over every signature costs a `stat` per process).
"""

from __future__ import annotations

import os
import platform
import stat
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Set, Tuple

from gpu_mon.api import procfs
from gpu_mon.api.logger import logger
from gpu_mon.api.model import Denied, Gpu, Holder

log = logger(__name__)

DevKey = Tuple[int, ...]  # (S_IFCHR, rdev) or (S_IFREG, st_dev, st_ino)
_DENIED = "denied"
# Monitors that hold every GPU's node without using it. They count as idle only when the process runs a
# root-owned executable of that name: any user can name a process `nvidia-smi`.
BUILTIN_MONITORS = ("nvidia-smi", "nvidia-persistenced", "nv-hostengine", "dcgm-exporter")
_KCMP_FILES = 2
_MAX_NODES = 256  # other namespaces' GPU nodes remembered (a hostile user could make many)
_MAPS_ROUNDS = 30  # every process's maps are read at least once every this many maps scans
_MAX_RETIRED = 64  # replaced nodes remembered per scanner (the oldest goes first)
_YOUNG_SECONDS = 60.0  # a process first seen this recently has its signature compared by every `fresh`
_RECENT = 64  # processes remembered as the latest that changed or appeared (an open's first suspects)
_PAUSE_EVERY = 32  # processes read between two questions whether a scan should pause (~0.2 ms at most)
_KCMP_SYSCALL = {"x86_64": 312, "aarch64": 272, "riscv64": 272, "ppc64le": 354, "s390x": 343}.get(
    platform.machine()
)


def device_key(st: os.stat_result) -> Optional[DevKey]:
    """How an open file is matched against GPU nodes: char devices by rdev, regular files by inode."""
    kind = stat.S_IFMT(st.st_mode)
    if kind == stat.S_IFCHR:
        return (stat.S_IFCHR, st.st_rdev)
    if kind == stat.S_IFREG:
        return (stat.S_IFREG, st.st_dev, st.st_ino)
    return None


@dataclass(frozen=True)
class Targets:
    """The GPU nodes to look for: by match key, and by the node's own inode (for memory maps)."""

    keys: Dict[DevKey, str] = field(default_factory=dict)
    inodes: Dict[Tuple[int, int], str] = field(default_factory=dict)  # (st_dev, st_ino) -> uuid


@dataclass
class _Retired:
    """Keys of GPU nodes that were replaced by another node, each with its GPU and the maps scan when it was
    replaced; kept while a process may still hold them."""

    keys: Dict[DevKey, Tuple[str, int]] = field(default_factory=dict)
    inodes: Dict[Tuple[int, int], Tuple[str, int]] = field(default_factory=dict)

    def note(self, old: Targets, new: Targets, turn: int) -> None:
        """Remember the old targets' keys that `new` no longer has, for GPUs that are still there."""
        live = set(new.keys.values())
        _keep(self.keys, old.keys, new.keys, live, turn)
        _keep(self.inodes, old.inodes, new.inodes, live, turn)

    def merged(self, given: Targets) -> Targets:
        """The targets to match: the given ones, and the replaced nodes of the GPUs among them (one that is
        unreadable for a while keeps its replaced nodes for when it is back)."""
        live = set(given.keys.values())
        keys = {**{k: u for k, (u, _t) in self.keys.items() if u in live}, **given.keys}
        inodes = {**{k: u for k, (u, _t) in self.inodes.items() if u in live}, **given.inodes}
        return Targets(keys, inodes)

    def prune(self, matched: Set[object], turn: int) -> bool:
        """Forget replaced nodes that nothing matched, once every process's maps were read since they were
        replaced; True if any was forgotten."""
        before = len(self.keys) + len(self.inodes)
        for table in (self.keys, self.inodes):
            for key, (_uuid, since) in list(table.items()):
                if key not in matched and turn - since >= _MAPS_ROUNDS:
                    del table[key]
        return len(self.keys) + len(self.inodes) != before


def _keep(table: Dict, old: Dict, new: Dict, live: Set[str], turn: int) -> None:
    for key, uuid in old.items():
        if key not in new and uuid in live:
            table.setdefault(key, (uuid, turn))
    for key in [k for k in table if k in new]:
        del table[key]  # a current node again
    while len(table) > _MAX_RETIRED:
        del table[next(iter(table))]


def device_targets(gpus: Iterable[Gpu]) -> Tuple[Targets, Dict[str, str]]:
    """Map each GPU's device node to its UUID; also return {uuid: error} for nodes that cannot be used."""
    keys: Dict[DevKey, str] = {}
    inodes: Dict[Tuple[int, int], str] = {}
    problems: Dict[str, str] = {}
    for gpu in gpus:
        if not gpu.uuid:
            continue
        if not gpu.device:
            problems[gpu.uuid] = "device node unknown"
            continue
        try:
            st = os.stat(gpu.device)
        except OSError as err:
            problems[gpu.uuid] = f"{gpu.device}: {err.strerror or err}"
            continue
        key = device_key(st)
        if key is None:
            problems[gpu.uuid] = f"{gpu.device}: not a character device or regular file"
            continue
        keys[key] = gpu.uuid
        inodes[(st.st_dev, st.st_ino)] = gpu.uuid
    return Targets(keys, inodes), problems


def fd_count_supported(proc: str = procfs.PROC) -> bool:
    """Whether stat(/proc/PID/fd).st_size is the number of open fds (Linux >= 6.2)."""
    try:
        before = os.stat(f"{proc}/self/fd").st_size
        fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        try:
            after = os.stat(f"{proc}/self/fd").st_size
        finally:
            os.close(fd)
    except OSError:
        return False
    return before > 0 and after == before + 1


def _shares_fd_table(pid: int, tid: int) -> Optional[bool]:
    """kcmp(KCMP_FILES): whether a thread uses its process's fd table; None when the kernel cannot tell."""
    if _KCMP_SYSCALL is None:
        return None
    import ctypes  # only here: most processes have one thread, and most scans never get this far

    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.syscall(_KCMP_SYSCALL, pid, tid, _KCMP_FILES, 0, 0)
    return None if result < 0 else result == 0


@dataclass
class _Entry:
    # (fd inode, fd ctime, fd count, fd counts of private tables): the inode and its ctime
    # belong to this process's proc entry, so a pid reused by a new process between two scans never matches.
    signature: Optional[Tuple[int, ...]]
    gpus: object  # frozenset of UUIDs, or _DENIED
    private: Tuple[int, ...] = ()  # threads with an fd table of their own
    mapped: FrozenSet[str] = frozenset()  # GPUs held only through a memory map
    nodes: FrozenSet[Tuple[str, str]] = frozenset()  # (uuid, path the process opened)
    # A single-threaded process's (ns run, times scheduled in) taken before its table was read: while they
    # stay the same it has not run, so its table and maps cannot have changed (see HolderScanner.full).
    ran: Optional[Tuple[int, int]] = None
    ran_maps: Optional[Tuple[int, int]] = None  # the same, as of the last look at its maps (a maps scan's)


@dataclass
class ScanResult:
    """Raw result of a scan: pid -> GPUs it holds, unreadable processes, pids that were read."""

    held: Dict[int, FrozenSet[str]] = field(default_factory=dict)
    denied: List[int] = field(default_factory=list)
    rescanned: Set[int] = field(default_factory=set)  # pids whose fds were read in this scan
    full: bool = False
    released: bool = False  # a holder let go of a GPU (or exited): a full scan should follow
    complete: bool = True  # False: a search stopped at what it looked for (the next `changed` reads the rest)
    paused: bool = False  # a scan stopped because `pause` said so (call it again to go on)
    nodes: Dict[int, FrozenSet[Tuple[str, str]]] = field(default_factory=dict)  # pid -> (uuid, path)


@dataclass
class _FullScan:
    """A full scan under way: the processes listed when it began and how far it got."""

    pids: List[str]
    maps: bool
    every: bool
    at: int = 0
    next_check: int = 0
    paused: bool = False  # it paused at least once (processes may have come and gone meanwhile)
    result: ScanResult = field(default_factory=ScanResult)


class _Reader:
    """Reads one process's fd tables and maps against the targets."""

    def __init__(
        self,
        proc: str,
        targets: Targets,
        extra_nodes: Dict[Tuple[int, int], Tuple[str, str]],
        matched: Optional[Set[object]] = None,
    ):
        self.proc, self.targets, self.extra_nodes = proc, targets, extra_nodes
        self.matched: Set[object] = set() if matched is None else matched  # keys and inodes that matched

    def table(self, fd_dir: str, pid: str, found: Set[str], nodes: Set[Tuple[str, str]]) -> bool:
        """Add the GPUs one fd table holds; False if we may not read it."""
        try:
            names = os.listdir(fd_dir)
        except PermissionError:
            return False
        except OSError:
            return True  # gone (a thread or process exiting): holds nothing
        keys = self.targets.keys
        for name in names:
            try:
                st = os.stat(f"{fd_dir}/{name}")
            except PermissionError:
                return False
            except OSError:
                continue  # closed since the listing, or the process exited
            kind = stat.S_IFMT(st.st_mode)
            if kind == stat.S_IFCHR:
                uuid = keys.get((stat.S_IFCHR, st.st_rdev))
            elif kind == stat.S_IFREG:
                uuid = keys.get((stat.S_IFREG, st.st_dev, st.st_ino))
            else:
                continue
            if uuid:
                found.add(uuid)
                self.matched.add(device_key(st))
                self._note_node(pid, f"{fd_dir}/{name}", st, uuid, nodes)
        return True

    def _note_node(
        self, pid: str, link: str, st: os.stat_result, uuid: str, nodes: Set[Tuple[str, str]]
    ) -> None:
        try:
            path = os.readlink(link)
        except OSError:
            return
        nodes.add((uuid, path))
        key = (st.st_dev, st.st_ino)
        if stat.S_ISCHR(st.st_mode) and key not in self.targets.inodes and key not in self.extra_nodes:
            # Another node for the same device: a container's own /dev/nvidiaN. Seen through its root.
            if len(self.extra_nodes) >= _MAX_NODES:
                del self.extra_nodes[next(iter(self.extra_nodes))]  # the oldest goes
            self.extra_nodes[key] = (uuid, f"{self.proc}/{pid}/root{path}")

    def private_tables(self, pid: str) -> Optional[Tuple[int, ...]]:
        """Threads of `pid` that have an fd table of their own; None if unreadable."""
        try:
            tids = [int(t) for t in os.listdir(f"{self.proc}/{pid}/task") if t != pid]
        except OSError:
            return ()
        out = []
        for tid in tids:
            shared = _shares_fd_table(int(pid), tid) if self.proc == procfs.PROC else None
            if not shared:
                out.append(tid)
        return tuple(out)

    def maps(self, pid: str) -> Set[str]:
        """GPUs whose node this process has mapped into memory."""
        try:
            with open(f"{self.proc}/{pid}/maps", "rb") as f:
                data = f.read()
        except OSError:
            return set()
        found: Set[str] = set()
        inodes = self.targets.inodes
        for line in data.split(b"\n"):
            parts = line.split(None, 5)
            if len(parts) < 6 or parts[4] == b"0":
                continue
            major, _, minor = parts[3].partition(b":")
            try:
                key = (os.makedev(int(major, 16), int(minor, 16)), int(parts[4]))
            except ValueError:
                continue
            uuid = inodes.get(key)
            if uuid is not None:
                self.matched.add(key)
            elif parts[5].startswith(b"/dev/"):  # a node we do not know: a container's?
                uuid = self._mapped_device(pid, parts[0])
            if uuid:
                found.add(uuid)
        return found

    def _mapped_device(self, pid: str, span: bytes) -> Optional[str]:
        """A mapping of some other node (a container's): stat it through map_files to see its device."""
        try:
            st = os.stat(f"{self.proc}/{pid}/map_files/{span.decode()}")
        except (OSError, UnicodeDecodeError):
            return None
        return self.targets.keys.get((stat.S_IFCHR, st.st_rdev)) if stat.S_ISCHR(st.st_mode) else None


class HolderScanner:
    """Scans /proc for GPU holders; remembers the last result so that `changed` can be incremental."""

    def __init__(self, proc: str = procfs.PROC, skip_pids: Iterable[int] = ()):
        self.proc = proc
        self.skip = {str(p) for p in skip_pids}
        self.incremental = proc == procfs.PROC and fd_count_supported(proc)
        self._cache: Dict[str, _Entry] = {}
        self._notable: Set[str] = set()  # pids in the cache that hold a GPU or cannot be read
        self._given = Targets()  # the current nodes
        self._targets = Targets()  # those and the replaced ones still held (see _Retired)
        self._retired = _Retired()
        self._matched: Set[object] = set()  # keys that matched in the current full scan
        self._maps_scans = 0
        # Nodes of other mount namespaces seen holding a GPU: (st_dev, st_ino) -> (uuid, path to watch).
        self.extra_nodes: Dict[Tuple[int, int], Tuple[str, str]] = {}
        self._vm_seen: Dict[str, int] = {}  # pid -> mapped pages when its maps were last read
        self._maps_turn = 0
        self._scanned = False  # a complete scan has run (the processes it found first are not young)
        self._last_pid: Optional[int] = None  # the kernel's last pid at the last listing of /proc ...
        self._pids: Set[str] = set()  # ... and the pids it listed
        # That last pid counts the pids of our own pid namespace: is /proc that of our namespace?
        self._own_proc = _proc_self(proc) == os.getpid()
        self._young: Dict[str, float] = {}  # pid -> when a scan first saw it, for _YOUNG_SECONDS
        self._carry: Optional[ScanResult] = None  # what searches that stopped early read since
        self._recent: Dict[str, None] = {}  # the latest processes read as new or changed, the latest last
        # A full scan skips a process that has not run since it was read (see `full`), where the kernel
        # counts how often each process is scheduled in.
        self._idle_skip = self.incremental and _schedstat_counts(proc)
        self._running: Optional[_FullScan] = None  # a full scan that paused (see `full`)

    def _signature(self, pid: str, private: Tuple[int, ...] = ()) -> Optional[Tuple[int, ...]]:
        try:
            st = os.stat(f"{self.proc}/{pid}/fd")
            if not private:  # nearly every process: this runs for each of them on every poll
                return (st.st_ino, st.st_ctime_ns, st.st_size)
            tables = tuple(os.stat(f"{self.proc}/{pid}/task/{t}/fd").st_size for t in private)
        except OSError:
            return None
        return (st.st_ino, st.st_ctime_ns, st.st_size, *tables)

    def _read(
        self, pid: str, maps: bool, old: Optional[_Entry], maps_looked: bool = False
    ) -> Optional[_Entry]:
        """Read one process; None if it vanished. Its signature is taken before its table is read: a file
        opened while we read shows as a change at the next look (after, it would hide that open)."""
        before = self._signature(pid) if self.incremental else None
        ran = procfs.read_ran(pid, self.proc) if self._idle_skip else None
        reader = _Reader(self.proc, self._targets, self.extra_nodes, self._matched)
        found: Set[str] = set()
        nodes: Set[Tuple[str, str]] = set()
        readable = reader.table(f"{self.proc}/{pid}/fd", pid, found, nodes)
        private: Tuple[int, ...] = ()
        if readable and self._threads(pid) > 1:
            ran = None  # (schedstat counts the main thread only)
            private = reader.private_tables(pid) or ()
            for tid in private:
                readable = readable and reader.table(f"{self.proc}/{pid}/task/{tid}/fd", pid, found, nodes)
        if not readable:
            return self._denied_or_gone(pid)
        mapped: Set[str] = set()
        lost = old is not None and old.gpus != _DENIED and not set(old.gpus) <= found  # type: ignore[arg-type]
        if maps or lost or (old is not None and old.mapped):
            mapped = reader.maps(pid) - found
        signature = before
        if private and before is not None:
            tables = self._signature(pid, private)
            signature = (*before, *tables[3:]) if tables is not None else None
        # Its maps are as a maps scan saw them when this scan looked at them (`maps_looked`: read, or their
        # size unchanged), or when the last one did if it has not run since.
        ran_maps = ran if maps_looked else old.ran_maps if old is not None and old.ran_maps == ran else None
        held = frozenset(found | mapped)
        return _Entry(signature, held, private, frozenset(mapped), frozenset(nodes), ran, ran_maps)

    def _threads(self, pid: str) -> int:
        try:
            return os.stat(f"{self.proc}/{pid}/task").st_nlink - 2
        except OSError:
            return 1

    def _denied_or_gone(self, pid: str) -> Optional[_Entry]:
        """A process that is exiting also refuses access to its fds: that one is gone, not hidden."""
        st = procfs.read_stat(int(pid), self.proc)
        if st is None or st.state in ("Z", "X") or st.kernel_thread:
            return None  # (a kernel thread, like kthreadd, refuses non-root too, and holds no files)
        # Its signature (readable to anyone) tells when it opens or closes a file: only then is it read again.
        return _Entry(self._signature(pid) if self.incremental else None, _DENIED)

    def set_targets(self, targets: Targets) -> None:
        """Use these device nodes (and, for the same GPUs, the nodes they replaced while those may still be
        held); a change forgets the cache (the next scan reads everything)."""
        if targets == self._given:
            return
        self._retired.note(self._given, targets, self._maps_scans)
        self._given = targets
        self._targets = self._retired.merged(targets)
        self._cache.clear()
        self._notable.clear()
        self._running = None

    def full(
        self,
        pids: Optional[Iterable[str]] = None,
        maps: bool = False,
        every: bool = False,
        pause: Optional[Callable[[], bool]] = None,
    ) -> ScanResult:
        """Read the fds of every process (or of `pids` only, merged into the last result). With `maps`, also
        the memory maps of each process whose mapped size changed since we last read them, and of a 30th of
        the others in turn (reading every map costs ~350 ms at 1000 processes: too long a stall).

        A process that holds nothing, has one thread, keeps its signature and has not run since it was last
        read (its main thread's run time and count of times scheduled in, /proc/PID/schedstat, are what
        they were) cannot have changed its table or its maps: it is not read again, unless `every`. (Only
        a process that shares its fd table with another, made with CLONE_FILES but not as a thread, has
        its table changed by someone else; that one is read when the other lets go, by an `every` scan.)

        With `pause`, asked every few processes, the scan stops when it answers True and returns what it
        has (`paused`; the holders as far as it got, the rest as last read); the next call with a `pause`
        goes on from there. A call without one starts over and finishes."""
        if pids is not None:
            return self._some(pids)
        run = self._running
        if run is None or pause is None or (maps and not run.maps) or (every and not run.every):
            run = self._start_full(maps, every)
        self._running = run
        if self._full_pids(run, pause):
            return self._paused(run.result)
        self._running = None
        return self._finish_full(run)

    def _start_full(self, maps: bool, every: bool) -> _FullScan:
        if self._running is not None:  # (a paused one starts over: what it found goes into the new one)
            self._carry = _merged(self._carry, self._running.result)
        self._last_pid = None  # (the next light look lists /proc again)
        if maps:
            self._maps_turn = (self._maps_turn + 1) % _MAPS_ROUNDS
            self._maps_scans += 1
        self._matched.clear()
        listed = [p for p in procfs.list_pids(self.proc) if p not in self.skip]
        return _FullScan(listed, maps, every or not self._idle_skip)

    def _full_pids(self, run: _FullScan, pause: Optional[Callable[[], bool]]) -> bool:
        """Read the scan's processes from where it stands; True when `pause` stopped it."""
        cache, result = self._cache, run.result
        while run.at < len(run.pids):
            if pause is not None and run.at >= run.next_check:
                run.next_check = run.at + _PAUSE_EVERY  # (a scan resumed reads that many before it pauses)
                if pause():
                    run.paused = True
                    return True
            pid = run.pids[run.at]
            run.at += 1
            old = cache.get(pid)
            if not run.every and self._unchanged(pid, old, run.maps):
                continue
            due = run.maps and self._maps_due(pid)
            self._update(pid, self._read(pid, due, old, run.maps), old, result)
        return False

    def _unchanged(self, pid: str, old: Optional[_Entry], maps: bool) -> bool:
        """Whether a process that holds nothing has not run since it was read (nor changed its table), and,
        for a maps scan, since a maps scan last looked at its maps."""
        if old is None or old.gpus or old.signature is None:
            return False
        since = old.ran_maps if maps else old.ran
        if since is None or procfs.read_ran(pid, self.proc) != since:
            return False
        return self._signature(pid) == old.signature

    def _finish_full(self, run: _FullScan) -> ScanResult:
        result = run.result
        listed = set(run.pids)
        for pid in [p for p in self._cache if p not in listed]:
            if not run.paused or not os.path.isdir(f"{self.proc}/{pid}"):  # (one met while it paused stays)
                self._cache.pop(pid, None)
                self._notable.discard(pid)
        if run.maps:
            live = self._cache.keys()
            self._vm_seen = {p: v for p, v in self._vm_seen.items() if p in live}
            if self._retired.prune(self._matched, self._maps_scans):
                self._targets = self._retired.merged(self._given)  # nothing held them: no entry changes
        result.full = True
        self._scanned = True
        self._take_carry(result)
        return self._result(result)

    def _some(self, pids: Iterable[str]) -> ScanResult:
        """Read exactly these processes, merged into the last result."""
        result = ScanResult()
        for pid in pids:
            if pid not in self.skip:
                old = self._cache.get(pid)
                self._update(pid, self._read(pid, False, old), old, result)
        return self._result(result)

    def _paused(self, done: ScanResult) -> ScanResult:
        """What a paused scan has read so far (the holders: as far as it got, the rest as last read)."""
        return self._result(
            ScanResult(rescanned=set(done.rescanned), released=done.released, complete=False, paused=True)
        )

    def full_paused(self) -> bool:
        """Whether a full scan paused and has not finished since (a `full` with a `pause` goes on)."""
        return self._running is not None

    def _maps_due(self, pid: str) -> bool:
        """Whether this process's maps should be read in this maps scan (and note its size if so)."""
        pages = _vm_pages(f"{self.proc}/{pid}/statm")
        due = pages is None or self._vm_seen.get(pid) != pages or hash(pid) % _MAPS_ROUNDS == self._maps_turn
        if due and pages is not None:
            self._vm_seen[pid] = pages
        return due

    def _update(self, pid: str, entry: Optional[_Entry], old: Optional[_Entry], result: ScanResult) -> None:
        result.rescanned.add(int(pid))
        if _released(old, entry):
            result.released = True
        if entry is None:
            self._cache.pop(pid, None)
        else:
            self._cache[pid] = entry
        if entry is not None and entry.gpus:
            self._notable.add(pid)
        else:
            self._notable.discard(pid)
        if entry is not None and self._scanned:
            self._note(pid, entry, old)

    def _note(self, pid: str, entry: _Entry, old: Optional[_Entry]) -> None:
        """A new process is young for a while; one read as new or changed is among the recent ones."""
        if old is None:
            self._young.setdefault(pid, time.monotonic())
        if old is None or old.signature != entry.signature:
            self._recent.pop(pid, None)
            self._recent[pid] = None
            if len(self._recent) > _RECENT:
                del self._recent[next(iter(self._recent))]

    def changed(
        self,
        enough: Optional[Callable[[int, FrozenSet[str]], bool]] = None,
        pause: Optional[Callable[[], bool]] = None,
        first: Iterable[int] = (),
    ) -> ScanResult:
        """Read only the processes that are new or whose signature changed (full if counts are unknown).

        With `enough`, the likeliest openers are read first (the latest processes that changed or
        appeared, before /proc is even listed; then new processes; then the others, the newest first) and
        the scan stops after the first process that holds a GPU and that `enough` accepts: `complete` is
        False, and processes that exited are noticed by the next `changed`, which reads the rest and
        reports what both read (`rescanned`, `released`). With `pause` (asked every few processes), it
        stops likewise when that answers True, with `paused` set. `first`: processes the kernel said opened
        a node (fanotify), read before all others, changed or not."""
        if not self.incremental or not self._cache:
            return self.full(pause=pause)
        result = ScanResult()
        openers = [str(p) for p in first if str(p) not in self.skip] if enough is not None else []
        if openers and self._search(openers, enough, result, force=True):
            return self._stopped(result)
        recent = [p for p in reversed(self._recent) if p in self._cache] if enough is not None else []
        if self._search(recent, enough, result):
            return self._stopped(result)
        live = self._live()
        if self._search(self._likeliest(live, set(recent)) if enough else live, enough, result, pause):
            return self._stopped(result)
        self._gone(live, result)
        self._take_carry(result)
        return self._result(result)

    def _search(
        self,
        pids: Iterable[str],
        enough: Optional[Callable[[int, FrozenSet[str]], bool]],
        result: ScanResult,
        pause: Optional[Callable[[], bool]] = None,
        force: bool = False,
    ) -> bool:
        """Read those of these processes that are new or changed (with `force`, each); True at the first
        that `enough` accepts, or when `pause` (asked every _PAUSE_EVERY processes) answers True
        (`result.paused` then)."""
        cache, fd_stat, proc = self._cache, os.stat, self.proc
        for n, pid in enumerate(pids):
            if pause is not None and n % _PAUSE_EVERY == _PAUSE_EVERY - 1 and pause():
                result.paused = True
                return True
            entry = cache.get(pid)
            if force:
                pass
            elif entry is not None and not entry.mapped and not entry.private:  # nearly all: _same, inlined
                try:
                    st = fd_stat(f"{proc}/{pid}/fd")
                except OSError:
                    pass
                else:
                    if entry.signature == (st.st_ino, st.st_ctime_ns, st.st_size):
                        continue
            elif self._same(pid, entry):
                continue
            new = self._read(pid, False, entry)
            self._update(pid, new, entry, result)
            if enough is not None and _holds(new) and enough(int(pid), new.gpus):  # type: ignore[union-attr]
                return True
        return False

    def _stopped(self, result: ScanResult) -> ScanResult:
        result.complete = False
        self._carry = _merged(self._carry, result)
        return self._result(result)

    def fresh(self) -> ScanResult:
        """A light look for the polls between two signature passes: new processes are read and gone ones
        noticed, but of the others only holders and young processes (first seen within _YOUNG_SECONDS)
        have their signature compared; the rest wait for the next `changed` or `full`."""
        if not self.incremental or not self._cache:
            return self.full()
        result = ScanResult()
        live = self._live(reuse=True)
        since = time.monotonic() - _YOUNG_SECONDS
        self._young = {p: t for p, t in self._young.items() if t > since and p in live}
        holding = {p for p in self._notable if self._cache[p].gpus != _DENIED}
        for pid in live.difference(self._cache.keys()) | holding | self._young.keys():
            entry = self._cache.get(pid)
            if not self._same(pid, entry):
                self._update(pid, self._read(pid, False, entry), entry, result)
        self._gone(live, result)
        return self._result(result)

    def _live(self, reuse: bool = False) -> Set[str]:
        """The pids in /proc; with `reuse`, those of the last listing when the kernel has handed out no pid
        since (no process or thread started: one that exited is noticed by reading it, or later)."""
        last = procfs.last_pid(self.proc)
        if reuse and self._own_proc and last is not None and last == self._last_pid:
            return self._pids
        self._last_pid, self._pids = last, set(procfs.list_pids(self.proc)).difference(self.skip)
        return self._pids

    def _same(self, pid: str, entry: Optional[_Entry]) -> bool:
        """Whether a known process's signature is what it was (one with only a memory map is read again)."""
        if entry is None or entry.mapped:
            return False
        signature = self._signature(pid, entry.private)
        return signature is not None and entry.signature == signature

    def _gone(self, live: Set[str], result: ScanResult) -> None:
        """Forget the processes that exited (a holder among them is released)."""
        for pid in self._cache.keys() - live:
            self._update(pid, None, self._cache[pid], result)
        self._scanned = True

    def _likeliest(self, live: Set[str], done: Set[str]) -> List[str]:
        """Where an opener most likely is, after the recent ones (`done`): processes new since the last
        scan, then the others, each in the order the kernel handed out their pids, the newest first."""
        last = procfs.last_pid(self.proc)
        cache = self._cache
        new = procfs.newest_first(map(int, (p for p in live if p not in cache)), last)
        known = procfs.newest_first(map(int, (p for p in live if p in cache and p not in done)), last)
        return [*map(str, new), *map(str, known)]

    def _take_carry(self, result: ScanResult) -> None:
        """A complete scan reports what the searches that stopped before it read."""
        if self._carry is not None:
            result.rescanned |= self._carry.rescanned
            result.released = result.released or self._carry.released
            self._carry = None

    def only(self, pids: Iterable[int]) -> ScanResult:
        """Read the fds of exactly these processes, forgetting every other (a process tree's scan: its cost
        is the tree's size, not /proc's)."""
        keep = {str(p) for p in pids} - self.skip
        self._cache = {p: e for p, e in self._cache.items() if p in keep}
        self._notable &= keep
        self._running = None
        return self.full(pids=sorted(keep))

    def forget(self, pids: Iterable[int]) -> None:
        """Drop cached results (e.g. a holder whose start time changed: the pid was reused)."""
        for pid in pids:
            self._cache.pop(str(pid), None)
            self._notable.discard(str(pid))

    def _result(self, result: ScanResult) -> ScanResult:
        for pid in sorted(self._notable, key=int):
            entry = self._cache[pid]
            if entry.gpus == _DENIED:
                result.denied.append(int(pid))
            elif entry.gpus:
                result.held[int(pid)] = entry.gpus  # type: ignore[assignment]
                result.nodes[int(pid)] = entry.nodes
        return result


def _schedstat_counts(proc: str) -> bool:
    """Whether this kernel counts how often each process is scheduled in (ours has been, at least once)."""
    if proc != procfs.PROC:
        return False
    ran = procfs.read_ran(os.getpid(), proc)
    return ran is not None and ran[1] > 0


def _proc_self(proc: str) -> Optional[int]:
    """The pid /proc/self names (ours, when that /proc is our pid namespace's), or None."""
    try:
        return int(os.readlink(f"{proc}/self"))
    except (OSError, ValueError):
        return None


def _holds(entry: Optional[_Entry]) -> bool:
    """Whether a read process holds a GPU (not: it could not be read)."""
    return entry is not None and entry.gpus != _DENIED and bool(entry.gpus)


def _merged(old: Optional[ScanResult], new: ScanResult) -> ScanResult:
    """What two searches read."""
    if old is None:
        return ScanResult(rescanned=set(new.rescanned), released=new.released)
    return ScanResult(rescanned=old.rescanned | new.rescanned, released=old.released or new.released)


def _vm_pages(path: str) -> Optional[int]:
    """The first field of /proc/PID/statm: pages mapped (any new mapping changes it)."""
    try:
        with open(path, "rb") as f:
            return int(f.read(32).split(b" ", 1)[0])
    except (OSError, ValueError):
        return None


def _released(old: Optional[_Entry], new: Optional[_Entry]) -> bool:
    """Whether a process held a GPU before and does not hold all of those now."""
    if old is None or not old.gpus or old.gpus == _DENIED:
        return False
    return new is None or new.gpus == _DENIED or not set(old.gpus) <= set(new.gpus)  # type: ignore[arg-type]


def builtin_monitor(pid: int, proc: str = procfs.PROC) -> bool:
    """Whether the process runs a root-owned, root-only-writable executable named like a built-in monitor."""
    try:
        exe = os.readlink(f"{proc}/{pid}/exe")
        st = os.stat(f"{proc}/{pid}/exe")
    except OSError:
        return False
    name = os.path.basename(exe.removesuffix(" (deleted)"))
    return name in BUILTIN_MONITORS and st.st_uid == 0 and not st.st_mode & 0o022


def describe(
    pid: int, gpus: FrozenSet[str], proc: str = procfs.PROC, nodes: Iterable[str] = ()
) -> Optional[Holder]:
    """Name, user, session and start time of a holder; None if it has gone."""
    st = procfs.read_stat(pid, proc)
    if st is None:
        return None
    argv0 = procfs.read_argv0(pid, proc)
    uid = procfs.read_uid(pid, proc)
    named = st.comm in BUILTIN_MONITORS or argv0 in BUILTIN_MONITORS
    return Holder(
        pid=pid,
        start_ticks=st.start_ticks,
        name=procfs.display_name(st.comm, argv0),
        argv0=argv0,
        uid=uid,
        user=procfs.user_name(uid),
        sid=st.sid,
        gpus=frozenset(gpus),
        nodes=tuple(sorted(set(nodes))),
        monitor=named and builtin_monitor(pid, proc),
    )


def describe_denied(pids: Iterable[int], proc: str = procfs.PROC) -> Tuple[Denied, ...]:
    """Denied records for processes whose fds could not be read."""
    out = []
    for pid in sorted(pids):
        st = procfs.read_stat(pid, proc)
        if st is None:
            continue
        uid = procfs.read_uid(pid, proc)
        name = procfs.display_name(st.comm, procfs.read_argv0(pid, proc))
        out.append(Denied(pid=pid, user=procfs.user_name(uid), name=name))
    return tuple(out)
