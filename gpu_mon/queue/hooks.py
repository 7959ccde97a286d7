"""Notifications: a job's hook (`submit --notify CMD`, else the user's executable ~/.config/gpu-mon/notify)
runs when the job ends or is preempted, as the job's user, in its directory, its output into the job's log.

`Notices` finds what to notify by comparing the store's jobs with what it saw last (every way a job ends
is found the same way: an exit, a cancel, a failed dependency, an earlier daemon's run found at start); an
array without --notify-each notifies once, when its last element ends; a job back in the queue (preempted,
or gpu-mon stopped) is `requeued`, never `preempted`, which is an end (--no-requeue). `Hooks` starts each
hook through its launcher and polls it (never waited for): 30 s, then it is killed with all it started. A
hook that fails is one line in the daemon's log and one in the job's.

Containment, as for jobs: nothing a hook started outlives it. Where jobs are our children, each hook runs
under a leader of its own (queue/hookleader.py, workloads/leader.py: a child subreaper that ends every
descendant, setsid'd ones too, when the hook's main process exits, SIGTERM then SIGKILL KILL_AFTER later,
and by itself when gpu-mon dies); where jobs are transient units, each hook is one (queue/outside.py:
systemd ends what is left in the unit when its main process exits, and after RuntimeMaxSec=).

gpu-mon leaves no hook running: when it stops, a hook has what is left of its 30 s but at most STOP_GRACE
(counted from the first round of the stop, so it overlaps the workloads' stops), then it gets SIGTERM and,
KILL_AFTER later, SIGKILL with all it started. Each hook also runs under coreutils' `timeout`, which ends its
group by itself a little after the daemon would have.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import pwd
import shlex
import shutil
import signal
import stat
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Deque, Dict, Iterable, List, Mapping, Optional, Protocol, Tuple

from gpu_mon.api.text import sanitize
from gpu_mon.queue import jobs as J
from gpu_mon.queue.jobs import Job

log = logging.getLogger("gpu_mon")

HOOK_SECONDS = 30.0
# A flood of notices (a 10 000-element --notify-each array cancelled at once) never becomes a flood of
# processes, nor a loop busy spawning them: hooks wait their turn, each user's in order.
MAX_RUNNING = 16  # hooks running at once on the machine
MAX_PER_USER = 4  # of them, one user's (another user's hook is not held up behind a flood)
MAX_STARTS = 2  # hooks started in one look (2-4 ms each: a look stays short, a yield is never held up)
TURN_SECONDS = 0.05  # how soon the loop looks again while hooks wait (so up to 40 hooks a second)
DEFAULT_HOOK_TTL = 5.0  # seconds a user's ~/.config/gpu-mon/notify (there or not) is believed
POLL_SECONDS = 0.2  # how often running hooks are looked at
STOP_GRACE = 2.0  # gpu-mon stops: what a running hook still has, at most (then SIGTERM to its group)
KILL_AFTER = 1.0  # then SIGKILL to the group
BACKSTOP_SECONDS = HOOK_SECONDS + 1.0  # `timeout` ends a hook by itself (its daemon was SIGKILLed)
BACKSTOP_KILL = 2  # and SIGKILLs its group this many seconds after its SIGTERM
DEFAULT_HOOK = ".config/gpu-mon/notify"  # under the user's home
LOOK_SECONDS = 2.0  # the look for a user's default hook, as the user, at most
REQUEUED = "requeued"  # a job back in the queue (preempted, or gpu-mon stopped); ended so: `preempted`
# As the user: the job's log for output (made 0600 when it is not there yet, as a job's; /dev/null when
# it cannot be opened: `command` keeps a failed redirection of `exec` from ending the shell, as it would a
# special builtin's), its directory, then the hook.
# $1 the log, $2 the directory, $3 the hook's command line, then what runs it (`timeout ... `, or nothing).
_WRAPPER = (
    '(umask 077; : >>"$1") 2>/dev/null; { command exec >>"$1"; } 2>/dev/null || exec >/dev/null; exec 2>&1; '
    'cd -- "$2" 2>/dev/null || cd / || exit 126; cmd=$3; shift 3; exec "$@" /bin/sh -c "$cmd"'
)


@dataclass(frozen=True)
class Notice:
    """Something to tell a job's user: the job (an array's notice: its last element to end), how it ended
    (done, failed, cancelled, timeout, preempted, requeued), its exit status, and an array's counts."""

    job: Job
    state: str
    exit: Optional[int]
    counts: str = ""  # an array's: `done=198 failed=2`
    summary: str = ""  # an array's, in words: `198 done, 2 failed` (done first, then the most)


def _event(before: Optional[Job], job: Job) -> Optional[str]:
    """How the job ended or went back to the queue since it was seen as `before` (None: unended, never
    restarted)."""
    if job.state in J.ENDED and (before is None or before.state not in J.ENDED):
        return job.state
    if job.state == J.QUEUED and job.restarts > (before.restarts if before is not None else 0):
        return REQUEUED  # (back in the queue: `preempted` is a job that ended so, under --no-requeue)
    return None


class Notices:
    """What to notify, found by comparing the jobs with those seen last (pure; one pass over the jobs)."""

    def __init__(self) -> None:
        # The jobs seen last that had ended or restarted (a job not there had neither, or is new: a queue
        # of 50 000 waiting jobs is remembered in no space)
        self.seen: Dict[int, Job] = {}
        self.version = -1

    def changes(self, jobs: Iterable[Job], version: int) -> List[Notice]:
        """The notices since the last call (none the first time: what was before is not news)."""
        if version == self.version:
            return []
        first = self.version < 0
        self.version = version
        out: List[Notice] = []
        ended: Dict[int, Job] = {}  # array -> its element that ended in this pass (the last one wins)
        unfinished: Dict[int, int] = collections.defaultdict(int)
        counts: Dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        failure: Dict[int, Job] = {}  # array -> its first element that did not end done
        seen: Dict[int, Job] = {}
        for j in jobs:
            if j.state in J.ENDED or j.restarts:
                seen[j.id] = j
            if j.array_id:
                if j.state in J.ENDED:
                    counts[j.array_id][j.state] += 1
                    if j.state != J.DONE and j.array_id not in failure:
                        failure[j.array_id] = j
                else:
                    unfinished[j.array_id] += 1
            # (a job new since the last pass that has ended already, submitted and cancelled between two
            # passes, say, is news too: only the first pass, what was there before gpu-mon, is not)
            event = None if first else _event(self.seen.get(j.id), j)
            if event is None:
                continue
            if j.array_id and not j.notify_each:
                if event in J.ENDED:
                    ended[j.array_id] = j
                continue
            out.append(Notice(j, event, j.exit_status))
        self.seen = seen
        for array_id, last in ended.items():
            if unfinished[array_id]:
                continue
            bad = failure.get(array_id)
            state = bad.state if bad is not None else J.DONE
            exit_status = bad.exit_status if bad is not None else 0
            text = " ".join(f"{s}={n}" for s, n in sorted(counts[array_id].items()))
            out.append(Notice(last, state, exit_status, text, array_summary(counts[array_id])))
        return out


def array_summary(counts: Mapping[str, int]) -> str:
    """How an array's elements ended, in words: `18 done, 2 cancelled` (done first, then the most)."""
    order = sorted(counts.items(), key=lambda kv: (kv[0] != J.DONE, -kv[1], kv[0]))
    return ", ".join(f"{n} {state}" for state, n in order if n)


def environment(n: Notice) -> Dict[str, str]:
    """The hook's environment: the job's own, and what happened to it."""
    j = n.job
    env = dict(j.env)
    env.update(
        GPU_MON_JOB_ID=str(j.id),
        GPU_MON_JOB_REF=J.ref(j),  # (as every listing names it: `17`, an element `17_5`)
        GPU_MON_JOB_NAME=j.name,
        GPU_MON_JOB_STATE=n.state,
        GPU_MON_JOB_EXIT="" if n.exit is None else str(n.exit),
        GPU_MON_JOB_REASON=j.reason,  # (why it ended as it did: `cannot open /x/3.log: ...`)
    )
    if j.array_id:
        env.update(GPU_MON_ARRAY_ID=str(j.array_id), GPU_MON_ARRAY_INDEX=str(j.array_index))
        if n.counts:
            env["GPU_MON_ARRAY_COUNTS"] = n.counts
        if n.summary:
            env["GPU_MON_ARRAY_SUMMARY"] = n.summary
    return env


def default_hook(uid: int, groups_of: Callable[[int, int], Tuple[int, ...]]) -> str:
    """The user's executable ~/.config/gpu-mon/notify as a command line, else "". Looked for as the user
    (`looks_usable`): root's look would tell a path only root may reach from one that is not there."""
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return ""
    path = os.path.join(pw.pw_dir, DEFAULT_HOOK)
    return "exec " + shlex.quote(path) if looks_usable(path, pw, groups_of) else ""


def looks_usable(path: str, pw: pwd.struct_passwd, groups_of: Callable[[int, int], Tuple[int, ...]]) -> bool:
    """Whether `path` is a regular file the user may execute, as the user sees it: root looks through a
    child with the user's ids and groups (a hook is there or not alike whether it is missing or only root
    could see it); not root, itself (it is the user, or cannot run another user's hook anyway)."""
    if os.geteuid() != 0 or pw.pw_uid == 0:
        try:
            st = os.stat(path)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and bool(st.st_mode & 0o111)
    try:
        done = subprocess.run(
            ["/bin/sh", "-c", '[ -f "$1" ] && [ -x "$1" ]', "gpu-mon-hook-look", path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
            env={"PATH": os.defpath},
            user=pw.pw_uid,
            group=pw.pw_gid,
            extra_groups=list(groups_of(pw.pw_uid, pw.pw_gid)),
            timeout=LOOK_SECONDS,
        )
    except (OSError, subprocess.SubprocessError):
        return False  # (a hung home directory: no hook this time)
    return done.returncode == 0


def wrapper_argv(output: str, cwd: str, cmd: str, seconds: float = BACKSTOP_SECONDS) -> List[str]:
    """The hook's argv: the wrapper, then CMD under `timeout` (its group ends after `seconds` even when
    gpu-mon is gone; without coreutils' timeout, only gpu-mon's own limit)."""
    found = shutil.which("timeout", path=os.defpath)
    limit = [found, "-k", str(BACKSTOP_KILL), f"{seconds:g}"] if found else []
    return ["/bin/sh", "-c", _WRAPPER, "gpu-mon-notify", output, cwd, cmd, *limit]


def _exited(pid: int) -> bool:
    """Whether our child `pid` has exited, without reaping it (while unreaped, its group is still its)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _killpg(pid: int, sig: int) -> None:
    """Signal the group of our unreaped child `pid` (its own session: start_new_session)."""
    with contextlib.suppress(OSError):
        os.killpg(pid, sig)


class Reach(Protocol):
    """What ends every process a hook started, wherever it went: its leader's descendants (the direct
    launcher, queue/hookleader.py) or its transient unit's group (queue/outside.py)."""

    def signal(self, sig: int) -> bool: ...

    def kill(self) -> bool: ...


# How a hook is started, contained (queue/hookleader.py, or queue/outside.py where jobs are transient
# units): from the job, the wrapper's argv, its environment and its time limit, the process started (what
# the loop polls: it exits once nothing of the hook is left) and what reaches all of the hook. OSError when
# it cannot be started.
Launch = Callable[[Job, List[str], Dict[str, str], float], Tuple[subprocess.Popen, Reach]]


@dataclass
class _Running:
    popen: subprocess.Popen
    job: Job
    deadline: float
    unit: Optional[Reach] = None  # what reaches every process of the hook (None: our child's group only)
    killed: bool = False  # its deadline passed: killed (again at each look until nothing is left)

    def signal(self, sig: int) -> None:
        """`sig` to the hook's group (ours, unreaped: still its), and to every process it started."""
        _killpg(self.popen.pid, sig)
        if self.unit is not None:
            self.unit.signal(sig)

    def kill(self) -> bool:
        """SIGKILL to every process the hook started, then to its group (the leader with it, once nothing
        is left that would be orphaned); False when some may be left (to be tried again)."""
        gone = self.unit.kill() if self.unit is not None else True
        if gone:
            _killpg(self.popen.pid, signal.SIGKILL)
        return gone


def _late(runs: List[_Running], deadline_of: Callable[[_Running], float]) -> List[_Running]:
    """Wait until each hook has exited or its deadline (monotonic) passed; those that had not exited."""
    pending, late = list(runs), []
    while pending:
        now = time.monotonic()
        still = []
        for r in pending:
            if not _exited(r.popen.pid):
                (late if now >= deadline_of(r) else still).append(r)
        pending = still
        if pending:
            time.sleep(0.02)
    return late


def _kill_all(r: _Running, budget: float = KILL_AFTER) -> None:
    """Kill every process of the hook, trying again for up to `budget` seconds, its leader last."""
    until = time.monotonic() + budget
    while not r.kill() and time.monotonic() < until:
        time.sleep(0.02)
    _killpg(r.popen.pid, signal.SIGKILL)


class Hooks:
    """The hooks running now: started without waiting, looked at each round, killed after HOOK_SECONDS."""

    def __init__(
        self,
        output_of: Callable[[Job], str],
        groups_of: Callable[[int, int], Tuple[int, ...]],
        note: Callable[[Job, str], bool],
        keep: Dict[int, subprocess.Popen],
        launch: Optional[Launch] = None,
    ) -> None:
        self.output_of, self.groups_of, self.note = output_of, groups_of, note
        self.launch = launch  # (None: each hook is a child of ours, as its user)
        self.keep = keep  # the supervisor's helpers: a child it must not reap for us
        self.running: List[_Running] = []
        self.waiting: Dict[int, Deque[Tuple[Notice, str]]] = {}  # uid -> its notices with a hook, in order
        self.defaults: Dict[int, Tuple[float, str]] = {}  # uid -> (when, its default hook) (_default_hook)
        self.stop_by: Optional[float] = None  # gpu-mon stops: no hook runs past this (monotonic)

    def add(self, n: Notice, now: float) -> None:
        """The job's hook, if it has one, waits its turn (never run as root for another user's job)."""
        if self.stop_by is not None:
            return
        cmd = n.job.notify[0] if n.job.notify else self._default_hook(n.job.uid, now)
        if not cmd:
            return
        if os.geteuid() != 0 and n.job.uid != os.geteuid():
            log.info("queue: job %s: its hook is not run: gpu-mon is not root", J.ref(n.job))
            return
        self.waiting.setdefault(n.job.uid, collections.deque()).append((n, cmd))

    def _default_hook(self, uid: int, now: float) -> str:
        """default_hook(uid), looked up once in DEFAULT_HOOK_TTL (a thousand jobs ending together: one
        lookup of the user, however slow the directory service)."""
        found = self.defaults.get(uid)
        if found is None or now - found[0] > DEFAULT_HOOK_TTL:
            if len(self.defaults) > 1000:
                self.defaults = {}
            found = self.defaults[uid] = (now, default_hook(uid, self.groups_of))
        return found[1]

    def _start_waiting(self, now: float) -> None:
        """Start waiting hooks, a user at a time in turn: at most MAX_STARTS now, MAX_RUNNING in all,
        MAX_PER_USER of one user's."""
        started = 0
        busy = collections.Counter(r.job.uid for r in self.running)
        progressed = True
        while progressed:
            progressed = False
            for uid in list(self.waiting):
                if started >= MAX_STARTS or len(self.running) >= MAX_RUNNING:
                    return
                if busy[uid] >= MAX_PER_USER:
                    continue
                n, cmd = self.waiting[uid].popleft()
                rest = self.waiting.pop(uid)
                if rest:
                    self.waiting[uid] = rest  # (to the back of the line: the next user's turn)
                started += 1
                progressed = True
                if self._start(n, cmd, now):
                    busy[uid] += 1

    def _start(self, n: Notice, cmd: str, now: float) -> bool:
        """Run the job's hook `cmd`; whether it started."""
        j = n.job
        argv, env, unit = wrapper_argv(self.output_of(j), j.cwd or "/", cmd), environment(n), None
        try:
            if self.launch is not None:  # (OSError too: its environment cannot be written)
                popen, unit = self.launch(j, argv, env, BACKSTOP_SECONDS + BACKSTOP_KILL + 1)
            else:
                popen = self._child(j, argv, env)
        except (OSError, ValueError) as err:  # (ValueError: a NUL or lone surrogate an older gpu-mon let in)
            self._failed(j, f"cannot run its hook: {getattr(err, 'strerror', None) or err}")
            return False
        self.keep[popen.pid] = popen
        self.running.append(_Running(popen, j, now + HOOK_SECONDS, unit))
        log.info("queue: job %s %s: running its hook[%d]", J.ref(j), n.state, popen.pid)
        return True

    def _child(self, j: Job, argv: List[str], env: Dict[str, str]) -> subprocess.Popen:
        """The hook as a plain child of ours, as its user, in a group of its own (without a launcher)."""
        ids = {}
        if os.geteuid() == 0:
            ids = {"user": j.uid, "group": j.gid, "extra_groups": list(self.groups_of(j.uid, j.gid))}
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
            env=env,
            start_new_session=True,  # (its own group: killed whole after HOOK_SECONDS)
            **ids,  # type: ignore[arg-type]
        )

    def poll(self, now: float) -> None:
        """Reap the hooks that ended (a failure: one line each), kill those past their time, start those
        whose turn came."""
        self._reap(now)
        if self.stop_by is None:
            self._start_waiting(now)

    def _reap(self, now: float) -> None:
        still: List[_Running] = []
        for r in self.running:
            code = r.popen.poll()
            if code is None and now >= r.deadline:
                if not r.kill():  # (ours, not yet reaped: the group is still its)
                    r.deadline, r.killed = now + POLL_SECONDS, True  # (some left: again at the next look)
                    still.append(r)
                    continue
                r.popen.wait()
                self._failed(r.job, f"its hook took over {HOOK_SECONDS:g} s: killed")
            elif code is None:
                still.append(r)
                continue
            elif r.killed:
                self._failed(r.job, f"its hook took over {HOOK_SECONDS:g} s: killed")
            elif code != 0:
                self._failed(r.job, f"its hook exited with status {code}")
            self.keep.pop(r.popen.pid, None)
        self.running = still

    def stopping(self, now: float) -> None:
        """gpu-mon stops (`now`: monotonic, as every `now` here): no new hook; those running have at most
        STOP_GRACE more (the first call counts)."""
        if self.stop_by is None:
            self.stop_by = now + STOP_GRACE
            left = sum(len(q) for q in self.waiting.values())
            if left:
                log.warning("queue: gpu-mon stops: %d hook(s) waiting to run are not run", left)
            self.waiting = {}
        for r in self.running:
            r.deadline = min(r.deadline, self.stop_by)

    def close(self) -> None:
        """gpu-mon stops now: wait for the running hooks until their deadlines, then SIGTERM their groups,
        KILL_AFTER later (or once their leaders exited) SIGKILL to every group; every one reaped. Blocks at
        most STOP_GRACE + KILL_AFTER."""
        self.stopping(time.monotonic())
        late = _late(self.running, lambda r: r.deadline)
        for r in late:
            r.signal(signal.SIGTERM)
            r.signal(signal.SIGCONT)  # (a stopped hook hears it)
        term_at = time.monotonic()
        _late(late, lambda r: term_at + KILL_AFTER)
        for r in self.running:
            _kill_all(r)  # (what is left of each hook: a child that outlived it)
            code = r.popen.wait()  # (reaped only now: until then each group was still its leader's)
            if r in late:
                self._failed(r.job, "its hook was still running when gpu-mon stopped: killed")
            elif code != 0:
                self._failed(r.job, f"its hook exited with status {code}")
            self.keep.pop(r.popen.pid, None)
        self.running = []

    def next_poll(self, now: float) -> Optional[float]:
        """When the hooks should be looked at again (None: none runs or waits)."""
        if self.waiting:
            return now + TURN_SECONDS
        return now + POLL_SECONDS if self.running else None

    def _failed(self, job: Job, what: str) -> None:
        log.warning("queue: job %s: %s", J.ref(job), sanitize(what))
        self.note(job, f"gpu-mon: job {J.ref(job)}: {what}")
