"""Shared test harness: simulated GPUs, real daemons, real workloads, and waiting on conditions.

Only the GPU is simulated (a JSON file plus regular files standing in for /dev/nvidiaN). Processes, signals,
sessions, files and sockets are real. Nothing here sleeps and hopes: `wait_for` polls a condition until a
deadline and fails with what it was waiting for.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
# A developer's own settings must not steer the suite: every test names its config and simulated host.
for _name in ("GPU_MON_CONFIG", "GPU_MON_SIM"):
    os.environ.pop(_name, None)
GPU_MON = [sys.executable, "-m", "gpu_mon"]
WORKLOAD = Path(__file__).resolve().parent / "workload.py"
# Workloads may run as `nobody`, who cannot read the venv's interpreter under /root: use the system one.
WORKLOAD_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
UUIDS = [f"GPU-{i:08x}-1111-2222-3333-{i:012x}" for i in range(8)]
# Fails a module, and the run, that changes the machine's own gpu-mon files (/etc/gpu_mon.conf, ...).
pytest_plugins = ["machine_guard"]
PR_SET_PDEATHSIG = 1  # prctl(2); looked up here, not in a forked child (no dlopen between fork and exec)
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl


# Signals that stop a run (a CI timeout, `timeout`, `systemctl stop`; a closed terminal) as Ctrl-C does.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _stop_as_ctrl_c(signum: int, frame: object) -> None:
    """Turn the first stop signal into a KeyboardInterrupt: pytest then tears the fixtures down (a test
    daemon stops its workloads, test users and directories go) and exits 2. Later ones do nothing, so they
    cannot cut that teardown short (SIGKILL still can: the test daemons die with the run, Daemon.start)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda *_: None)
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def pytest_configure(config: pytest.Config) -> None:
    """Without this, SIGTERM or SIGHUP ends the run at once and leaves its daemons and workloads running.
    A signal the run was started with ignored (nohup) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, _stop_as_ctrl_c)


def _dies_with_the_run(parent: int) -> None:
    """In a test daemon, before its exec: SIGTERM when the thread that started it ends (pytest SIGKILLed),
    so that it stops its workloads as for an admin's stop instead of running on. The product never asks this:
    only the tests' launch does. `parent`: the run's pid."""
    if _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if os.getppid() != parent:  # the run died before the prctl
        os.kill(os.getpid(), signal.SIGTERM)


def dies_with_the_run() -> Optional[Callable[[], None]]:
    """preexec_fn for a `gpu-mon run` a test starts itself: SIGTERM when the run is SIGKILLed (see
    _dies_with_the_run). None off pytest's main thread: a thread that ends sooner would be its parent."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return functools.partial(_dies_with_the_run, os.getpid())


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Tests marked `gpu` need a real NVIDIA GPU: skipped (only they) where NVML finds none."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    from gpu_mon.api.nvml import NvmlBackend

    reading = NvmlBackend().read()
    if reading.gpus and not reading.error:
        return
    skip = pytest.mark.skip(reason=f"needs an NVIDIA GPU ({reading.error or 'no GPU found'})")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


# Sleeps until told, then swaps a descriptor of the node in place of one it had (its count stays the same).
SWAP_IN_PLACE = """
import os, sys
fd = os.open(sys.argv[2], os.O_RDONLY)
print("ready", flush=True)
sys.stdin.readline()
node = os.open(sys.argv[1], os.O_RDONLY)
os.dup2(node, fd)
os.close(node)
print("swapped", flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="session", autouse=True)
def own_caches(tmp_path_factory):
    """matplotlib's config and font cache (the plots' tests) in a directory of the run's, not the tester's
    home: the suite leaves the machine as it found it."""
    saved = os.environ.get("MPLCONFIGDIR")
    os.environ["MPLCONFIGDIR"] = str(tmp_path_factory.mktemp("matplotlib"))
    yield
    if saved is None:
        os.environ.pop("MPLCONFIGDIR", None)
    else:
        os.environ["MPLCONFIGDIR"] = saved


@pytest.fixture
def procs():
    """A list a test appends the processes it starts to; each is killed and reaped afterwards."""
    made: list = []
    yield made
    for p in made:
        p.kill()
        p.wait()


def wait_for(
    condition: Callable[[], object], timeout: float = 20.0, what: str = "condition", interval: float = 0.02
) -> object:
    """Poll `condition` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


@pytest.fixture
def alarm():
    """Fail (instead of hanging the suite) if the test blocks for 5 seconds."""

    def hung(signum: int, frame: object) -> None:
        raise TimeoutError("blocked: the call hung")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(5)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def pid_alive(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def need_fd_counts(incremental: bool) -> None:
    """Fail, in one line (a missing kernel feature is not a skip), where the holder scan cannot be
    incremental: Linux before 6.2 has no open-fd count in stat of /proc/PID/fd."""
    if not incremental:
        release = os.uname().release
        pytest.fail(
            f"needs Linux >= 6.2 (open-fd counts in stat of /proc/PID/fd); this is {release}", pytrace=False
        )


def has_open(pid: int, path: str) -> bool:
    """Whether the process has `path` open (a descriptor in /proc/PID/fd names it)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") == path:
                return True
    return False


def sleeping(pid: int) -> bool:
    """Whether the process's main thread sleeps (state S in /proc/PID/stat: blocked in a read, a wait or a
    sleep, and so not running on until something wakes it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"S"
    except (OSError, IndexError):
        return False


def marked(marker: str) -> List[int]:
    """Live (not zombie) processes whose command line carries the marker."""
    out = []
    needle = marker.encode()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if needle not in f.read():
                    continue
            with open(f"/proc/{name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
        except OSError:
            continue
        out.append(int(name))
    return out


def kill_marked(marker: str) -> None:
    """SIGKILL every process carrying the marker, until none is left (a test's last resort after a failure).

    One pass is not enough for a fork chain: it has a new pid before the kill lands. So stop, kill, repeat.
    """
    deadline = time.monotonic() + 10
    empty = 0
    while time.monotonic() < deadline:
        pids = marked(marker)
        # A look at /proc can miss a process that lives a millisecond: done after five empty looks in a row.
        empty = 0 if pids else empty + 1
        if empty >= 5:
            return
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        time.sleep(0.01)
    raise AssertionError(f"processes marked {marker} survived 10 s of SIGKILL: {marked(marker)}")


def idle_terminal(tmp_path: Path, name: str = "3") -> Path:
    """A stand-in terminal of nobody's, idle for an hour, in TMP/pts/ (touch it to make nobody active);
    `tty_section` makes the [tty] section that watches it."""
    term = tmp_path / "pts" / name
    term.parent.mkdir(exist_ok=True)
    term.touch()
    os.chown(term, 65534, 65534)
    old = time.time() - 3600
    os.utime(term, (old, old))
    return term


def tty_section(term: Path) -> str:
    """[tty] watching the directory of an idle_terminal(), 60 s to become idle again."""
    return f"\n[tty]\nenabled = yes\nidle_seconds = 60\ndevices = {term.parent}/*\n"


def foreign_opener_cmd(path: str) -> List[str]:
    """A process that is not ours opening a GPU node, saying `open`, and keeping it (like a CUDA program)."""
    code = "import sys, time; f = open(sys.argv[1]); print('open', flush=True); time.sleep(600)"
    return [WORKLOAD_PYTHON, "-c", code, path]


@contextlib.contextmanager
def foreign_open(path: str) -> Iterator[subprocess.Popen]:
    """foreign_opener_cmd's process, once it has said `open`; killed and reaped afterwards."""
    opener = subprocess.Popen(foreign_opener_cmd(path), stdout=subprocess.PIPE, text=True)
    try:
        assert opener.stdout is not None and opener.stdout.readline() == "open\n"
        yield opener
    finally:
        opener.kill()
        opener.wait()


def run_script(
    script: Path, *args: str, cwd: Path, hide: Sequence[str] = (), timeout: float = 120
) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` from `cwd` with the checkout on PYTHONPATH; each module in `hide` is "not
    installed" (a stand-in in cwd/shadow, ahead on the path, whose import fails)."""
    path = [str(ROOT)]
    if hide:
        shadow = cwd / "shadow"
        shadow.mkdir(exist_ok=True)
        for name in hide:
            (shadow / f"{name}.py").write_text(f"raise ImportError('{name} is not installed here')\n")
        path.insert(0, str(shadow))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    argv = [sys.executable, str(script), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


class SimHost:
    """A simulated host: the JSON file the daemon re-reads each look, and the device stand-in files."""

    def __init__(self, directory: Path, count: int = 2):
        self.dir = directory
        self.path = directory / "sim.json"
        self.gpus: List[Dict[str, object]] = [
            {
                "uuid": UUIDS[i],
                "name": f"Sim GPU {i}",
                "memory_total_mib": 81559,
                "memory_used_mib": 0,
                "utilization_pct": 0,
                "device": f"dev/nvidia{i}",
            }
            for i in range(count)
        ]
        (directory / "dev").mkdir(exist_ok=True)
        for i in range(count):
            Path(self.device(i)).touch()
        self.write()

    def device(self, index: int) -> str:
        """Path of GPU `index`'s stand-in device file."""
        return str(self.dir / "dev" / f"nvidia{index}")

    def uuid(self, index: int) -> str:
        """UUID of GPU `index`."""
        return str(self.gpus[index]["uuid"])

    def write(self) -> None:
        """Replace the file atomically, so the daemon never reads half of it."""
        tmp = self.dir / "sim.json.tmp"
        tmp.write_text(json.dumps({"gpus": self.gpus}))
        os.replace(tmp, self.path)

    def set(self, index: int, **fields: object) -> None:
        """Change fields of one GPU (None removes the key)."""
        for key, value in fields.items():
            if value is None:
                self.gpus[index].pop(key, None)
            else:
                self.gpus[index][key] = value
        self.write()


@pytest.fixture
def sim(tmp_path: Path) -> SimHost:
    """Two simulated GPUs."""
    return SimHost(tmp_path, 2)


def write_config(path: Path, text: str) -> Path:
    """Write a config file the way root wants it (0600)."""
    path.write_text(text)
    os.chmod(path, 0o600)
    return path


class Daemon:
    """A real `gpu-mon run` on a simulated host, with its log in a file."""

    def __init__(
        self,
        tmp_path: Path,
        sim: SimHost,
        body: str,
        defaults: Optional[Dict[str, object]] = None,
        env: Optional[Dict[str, str]] = None,
        args: Tuple[str, ...] = (),
        cwd: Optional[str] = None,
    ):
        self.tmp = tmp_path
        self.args = args
        self.cwd = cwd or str(tmp_path)
        self.sim = sim
        self.state_path = tmp_path / "state.json"
        self.config_path = tmp_path / "gpu_mon.conf"
        self.log_path = tmp_path / "daemon.log"
        self.defaults = {
            "interval_seconds": 0.2,
            "start_delay_seconds": 0.5,
            "stop_timeout_seconds": 2,
            "restart_delay_seconds": 0.5,
            "state_file": str(self.state_path),
        }
        self.defaults.update(defaults or {})
        self.body = body
        self.write_config(body)
        self.env = dict(os.environ)
        self.env.pop("NOTIFY_SOCKET", None)
        self.env.pop("JOURNAL_STREAM", None)
        self.env.update(env or {})
        self.proc: Optional[subprocess.Popen] = None
        self.seen_pids: set = set()

    def write_config(self, body: str, defaults: Optional[Dict[str, object]] = None) -> None:
        """(Re)write the config file."""
        values = dict(self.defaults)
        values.update(defaults or {})
        head = "[defaults]\n" + "".join(f"{k} = {v}\n" for k, v in values.items())
        if "[history]" not in body:  # never the machine's /var/lib/gpu_mon
            body += f"\n[history]\npath = {self.tmp / 'history.sqlite'}\n"
        write_config(self.config_path, head + body)

    def start(self) -> Daemon:
        """Start `gpu-mon run` in its own session."""
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - the daemon writes it until cleanup()
        # The thread that starts it is its parent for PR_SET_PDEATHSIG: only pytest's main thread lives as
        # long as the run.
        self.proc = subprocess.Popen(
            [*GPU_MON, "--config", str(self.config_path), "--sim", str(self.sim.path), "run", *self.args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,
            preexec_fn=dies_with_the_run(),
        )
        return self

    def log(self) -> str:
        """Everything the daemon logged so far."""
        return self.log_path.read_text(errors="replace")

    def wait_log(self, pattern: str, timeout: float = 20.0, count: int = 1) -> List[str]:
        """Wait until `pattern` (a regex) matches `count` log lines; return the matching lines."""
        rx = re.compile(pattern)

        def found() -> List[str]:
            lines = [line for line in self.log().splitlines() if rx.search(line)]
            return lines if len(lines) >= count else []

        try:
            return wait_for(found, timeout, f"log line /{pattern}/ x{count}")  # type: ignore[return-value]
        except AssertionError:
            raise AssertionError(f"timed out waiting for /{pattern}/ x{count}; log:\n{self.log()}") from None

    def state(self) -> Dict[str, object]:
        """The daemon's state file (empty dict while it has none)."""
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {}

    def workload(self, label: str) -> Dict[str, object]:
        """The state file's entry for one workload (by label, e.g. `miner@0`)."""
        for w in self.state().get("workloads", []):  # type: ignore[union-attr]
            if w["label"] == label:
                return w
        return {}

    def wait_running(self, label: str, timeout: float = 20.0) -> int:
        """Wait until a workload runs and has reported its command's pid; return that pid."""

        def running() -> int:
            w = self.workload(label)
            if w.get("state") == "running" and w.get("command_pid"):
                return int(w["command_pid"])  # type: ignore[arg-type]
            return 0

        pid = int(wait_for(running, timeout, f"{label} running"))  # type: ignore[arg-type]
        self.seen_pids.add(pid)
        return pid

    def descendants(self) -> List[int]:
        """Live descendants of the daemon."""
        if self.proc is None:
            return []
        try:
            return [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def signal(self, sig: int) -> None:
        """Send a signal to the daemon."""
        assert self.proc is not None
        self.proc.send_signal(sig)

    def status_line(self, timeout: float = 20.0) -> float:
        """Ask for SIGUSR1's status line and wait for it; return when (monotonic) it was seen. The loop logs
        it as a wake takes its signals, before that wake's rounds (so only after the daemon is up: until
        it catches SIGUSR1, the signal kills it)."""
        before = len(re.findall(r" INFO status: ", self.log()))
        self.signal(signal.SIGUSR1)
        self.wait_log(r" INFO status: ", timeout, count=before + 1)
        return time.monotonic()

    def wake_passed(self, timeout: float = 20.0) -> None:
        """Wait until the wake of the daemon's loop that takes a signal sent now, and every wake before it,
        has done all its rounds (e.g. the poll owed after a reload): a second status line, asked for once
        the first is seen, comes from a later wake than the first."""
        self.status_line(timeout)
        self.status_line(timeout)

    def poll_passed(self, interval: Optional[float] = None, timeout: float = 20.0) -> None:
        """Wait until a poll that began after this call has done its round (it read every process started
        before the call). Such a poll is due `interval` (the config's interval_seconds) after the call at
        the latest. The wake after the one that logs a status line asked for past that time begins past
        it, so it polls if no such poll ran before; a third status line says that wake is done."""
        period = float(self.defaults["interval_seconds"] if interval is None else interval)  # type: ignore[arg-type]
        time.sleep(period)  # a wait for the daemon's own deadline (a poll is due by then), not for a result
        for _ in range(3):
            self.status_line(timeout)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait for exit; return the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def cleanup(self) -> None:
        """Leave nothing behind, whatever the test did: a live daemon is stopped the way an admin would
        (it stops its workloads, every process of them); what is left after that is killed."""
        victims = set(self.descendants()) | self.seen_pids
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in victims:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if hasattr(self, "_log"):
            self._log.close()


@pytest.fixture
def daemon_factory(tmp_path: Path, sim: SimHost):
    """daemon_factory(body, defaults=None, env=None) -> a started Daemon, cleaned up after the test."""
    made: List[Daemon] = []

    def make(
        body: str,
        defaults: Optional[Dict[str, object]] = None,
        env: Optional[Dict[str, str]] = None,
        start: bool = True,
        args: Tuple[str, ...] = (),
        cwd: Optional[str] = None,
    ) -> Daemon:
        d = Daemon(tmp_path, sim, body, defaults, env, args, cwd)
        made.append(d)
        return d.start() if start else d

    yield make
    for d in made:
        d.cleanup()


@pytest.fixture
def public_dir():
    """A world-writable directory outside /root and pytest's 0700 tree, for workloads run as `nobody`."""
    path = Path(tempfile.mkdtemp(prefix="gpu-mon-test-", dir="/tmp"))
    os.chmod(path, 0o777)
    shutil.copy(WORKLOAD, path / "workload.py")
    os.chmod(path / "workload.py", 0o644)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def occupy_paths(tmp_path_factory: pytest.TempPathFactory):
    """`gpu-mon occupy` registers every occupier in a host-wide directory and reads the admin's limits from
    /etc/gpu_mon.conf; for root (the tests) both move into the session's temporary directory (no file
    there: no limits)."""
    base = tmp_path_factory.mktemp("occupy-host")
    saved = {k: os.environ.get(k) for k in ("GPU_MON_OCCUPIERS_DIR", "GPU_MON_SYSTEM_CONFIG")}
    os.environ.update(
        GPU_MON_OCCUPIERS_DIR=str(base / "occupiers"), GPU_MON_SYSTEM_CONFIG=str(base / "gpu_mon.conf")
    )
    yield base
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def occupy_paths_of_the_copy(package: Path, public_dir: Path) -> None:
    """A plain user cannot move those two paths (the environment is honoured only for root): in a copy of
    the package run by `nobody`, point them into `public_dir` (gpu_mon.conf there: the limits)."""
    for module, name, value in (
        ("api/occupiers.py", "REGISTRY", public_dir / "occupiers"),
        ("commands/occupy_limits.py", "SYSTEM_CONFIG", public_dir / "gpu_mon.conf"),
    ):
        path = package / module
        text, count = re.subn(rf"^{name} = .*$", f"{name} = {str(value)!r}", path.read_text(), flags=re.M)
        assert count == 1, f"{module}: no {name} to point into the test's directory"
        path.write_text(text)


def nobody_host(public_dir: Path) -> Tuple[SimHost, Path]:
    """A simulated host and a copy of the package, both readable by `nobody` (a checkout under /root is
    not): (the host, the directory to put on PYTHONPATH)."""
    sim = SimHost(public_dir, 2)
    code_dir = public_dir / "code"
    shutil.copytree(ROOT / "gpu_mon", code_dir / "gpu_mon", ignore=shutil.ignore_patterns("__pycache__"))
    occupy_paths_of_the_copy(code_dir / "gpu_mon", public_dir)
    (public_dir / "occupiers").mkdir()  # the registry, root's, as the package's tmpfiles.d entry makes it
    for path in (
        public_dir / "dev",
        sim.path,
        *(public_dir / "dev").iterdir(),
        code_dir,
        *code_dir.rglob("*"),
    ):
        os.chmod(path, 0o755)
    os.chmod(public_dir / "occupiers", 0o1777)
    return sim, code_dir


def run_as_nobody(
    argv: List[str], env: Dict[str, str], cwd: str = "/", timeout: Optional[float] = 60
) -> subprocess.CompletedProcess:
    """Run argv as `nobody` (uid and gid 65534, no supplementary groups) with exactly env; output captured."""
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        user=65534,
        group=65534,
        extra_groups=[],
        cwd=cwd,
        env=env,
        timeout=timeout,
    )


@contextlib.contextmanager
def names_held(names: Sequence[str], deadline: float = 600.0) -> Iterator[None]:
    """Hold these user and group names for this test run alone while the block runs: two runs of the suite
    at once on one machine (two checkouts) would otherwise make and remove each other's users. Each name
    is an abstract Unix socket bound by the holder (no file is left; the kernel frees it when the holder
    dies); a name another run holds is waited for, up to `deadline` seconds."""
    held: List[socket.socket] = []
    try:
        for name in sorted(set(names)):
            held.append(_hold_name(name, deadline))
        yield
    finally:
        for s in held:
            s.close()


def _hold_name(name: str, deadline: float) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    end = time.monotonic() + deadline
    while True:
        try:
            s.bind(f"\0gpu-mon-test-name-{name}")
            return s
        except OSError:
            if time.monotonic() > end:
                s.close()
                held = f"another test run has held the user name {name} for {deadline:.0f} s"
                raise AssertionError(held) from None
            time.sleep(0.2)


@contextlib.contextmanager
def made_user(name: str, groups: Tuple[str, ...] = ()) -> Iterator[pwd.struct_passwd]:
    """A user made for the test (its own primary group, no home, no login), also in `groups` (made for
    it too); user and groups removed afterwards. Leftovers of the same names (a killed run) go first."""

    def remove() -> None:
        subprocess.run(["userdel", name], capture_output=True)
        for group in groups:
            subprocess.run(["groupdel", group], capture_output=True)

    def make(argv: List[str]) -> None:
        r = subprocess.run(argv, capture_output=True, text=True)
        assert r.returncode == 0, f"{' '.join(argv)}: {r.stderr.strip()}"

    with names_held((name, *groups)):
        remove()
        try:
            for group in groups:
                make(["groupadd", group])
            shell = ["-s", "/usr/sbin/nologin", "-d", "/nonexistent"]
            make(["useradd", "-M", "-U", *shell, *(["-G", ",".join(groups)] if groups else []), name])
            yield pwd.getpwnam(name)
        finally:
            remove()


def read_reports(path: Path) -> List[Dict[str, object]]:
    """JSON lines written by tests/workload.py."""
    try:
        text = path.read_text()
    except OSError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def workload_cmd(directory: Path, *args: str) -> str:
    """A `cmd =` value running tests/workload.py (copied into `directory`) with these arguments."""
    script = directory / "workload.py"
    if not script.exists():
        shutil.copy(WORKLOAD, script)
    quoted = " ".join(f"'{a}'" for a in args)
    return f"{WORKLOAD_PYTHON} {script} {quoted}"
