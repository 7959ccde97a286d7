"""`gpu-mon occupy on|off|status` (seed 004) on simulated GPUs, with real processes, as root and as nobody.

The occupier is the daemon on an in-memory config; CMD mode with a stand-in command is used here (the
stressor needs a GPU; the daemon runs it the same way).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional

import pytest
from conftest import (
    GPU_MON,
    SimHost,
    foreign_opener_cmd,
    kill_marked,
    marked,
    nobody_host,
    pid_alive,
    run_as_nobody,
    wait_for,
)

FAST = ["--wait-minutes", "0.02", "--refresh-minutes", "0.002"]  # 1.2 s of free GPUs, a look every 0.12 s


class Occupy:
    """`gpu-mon occupy` for one user's state directory and one simulated host."""

    def __init__(self, sim: SimHost, state_home: Path):
        self.sim, self.state_home = sim, state_home
        self.env = {k: v for k, v in os.environ.items() if k not in ("GPU_MON_SIM", "XDG_STATE_HOME")}
        self.env.update(GPU_MON_SIM=str(sim.path), XDG_STATE_HOME=str(state_home))
        self.dir = state_home / "gpu-mon" / "occupy"

    def __call__(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*GPU_MON, "occupy", *args], capture_output=True, text=True, env=self.env, timeout=timeout
        )

    def popen(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [*GPU_MON, "occupy", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env,
        )

    def status(self) -> Dict[str, object]:
        r = self("status", "--json")
        return json.loads(r.stdout)

    def wait_state(self, state: str, timeout: float = 30) -> Dict[str, object]:
        return wait_for(lambda: (s := self.status())["state"] == state and s, timeout, f"state {state}")  # type: ignore[return-value]

    def log(self) -> str:
        try:
            return (self.dir / "occupy.log").read_text(errors="replace")
        except OSError:
            return ""

    def pid(self) -> int:
        return int(json.loads((self.dir / "occupier.json").read_text())["pid"])


@pytest.fixture
def occ(sim, tmp_path):
    o = Occupy(sim, tmp_path / "state")
    markers: List[str] = []
    o.markers = markers  # type: ignore[attr-defined]
    yield o
    o("off", "--timeout", "10")
    for m in markers:
        kill_marked(m)


def stand_in(occ: Occupy, out: Path) -> List[str]:
    """A CMD that records its GPUs and holds them (with a child that left its session), marked for cleanup."""
    m = f"gmo-{uuid.uuid4().hex}"
    occ.markers.append(m)  # type: ignore[attr-defined]
    code = (
        "import os, sys, time\n"
        f"open({str(out)!r}, 'a').write(os.environ.get('CUDA_VISIBLE_DEVICES', '') + '\\n')\n"
        "if os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\n"
        "time.sleep(600)\n"
    )
    return ["--", sys.executable, "-c", code, m]


def test_waits_while_memory_is_above_the_threshold_and_a_blip_restarts_the_timer(occ, sim, tmp_path):
    sim.set(1, memory_used_mib=2000)  # someone else's 2 GB on GPU 1 (threshold: 1 GiB)
    out = tmp_path / "gpus"
    r = occ("on", *FAST, *stand_in(occ, out))
    assert r.returncode == 0, r.stderr
    assert "started (pid" in r.stdout and "occupy.log" in r.stdout
    s = occ.wait_state("waiting")
    wait_for(lambda: any("2000 MiB" in b for b in occ.status()["blocked_by"]), what="blocked by memory")
    sim.set(1, memory_used_mib=0)
    wait_for(lambda: any("start delay" in b for b in occ.status()["blocked_by"]), what="the wait running")
    sim.set(1, memory_used_mib=1500)  # a blip: the timer starts over
    wait_for(lambda: any("1500 MiB" in b for b in occ.status()["blocked_by"]), what="blocked again")
    freed = time.time()
    sim.set(1, memory_used_mib=0)
    s = occ.wait_state("occupying")
    assert s["mode"] == "hold" and s["gpus"] == [sim.uuid(0), sim.uuid(1)]
    started = re.search(
        r"(\d\d:\d\d:\d\d\.\d+) gpu-mon\[\d+\] INFO .* free for \d+ s; starting occupy", occ.log()
    )
    assert started, occ.log()
    day = time.strftime("%Y-%m-%d", time.localtime(freed))
    at = time.mktime(time.strptime(f"{day} {started.group(1)[:8]}", "%Y-%m-%d %H:%M:%S"))
    assert at + 1 >= freed + 1.2  # (log times are cut to the second) the whole wait after the blip
    wait_for(lambda: out.exists() and out.read_text(), what="CMD ran")
    assert out.read_text().split() == [f"{sim.uuid(0)},{sim.uuid(1)}"]


def test_cmd_gets_exactly_the_gpus_asked_for(occ, sim, tmp_path):
    out = tmp_path / "gpus"
    assert occ("on", "--gpus", "1", *FAST, *stand_in(occ, out)).returncode == 0
    wait_for(lambda: out.exists() and out.read_text(), what="CMD ran")
    assert out.read_text().split() == [sim.uuid(1)]
    assert occ.status()["gpus"] == [sim.uuid(1)]


@pytest.mark.parametrize("when", ["waiting", "occupying"])
def test_off_leaves_nothing(occ, sim, tmp_path, when):
    if when == "waiting":
        sim.set(0, memory_used_mib=5000)
    out = tmp_path / "gpus"
    assert occ("on", *FAST, *stand_in(occ, out)).returncode == 0
    occ.wait_state(when)
    marker = occ.markers[0]  # type: ignore[attr-defined]
    if when == "occupying":
        wait_for(lambda: len(marked(marker)) >= 2, what="CMD and its escaped child")
    pid = occ.pid()
    r = occ("off")
    assert r.returncode == 0 and f"stopped (pid {pid})" in r.stdout
    assert not pid_alive(pid) and marked(marker) == []
    s = occ("status")
    assert s.returncode == 3 and s.stdout.startswith("gpu-mon occupy: stopped")
    assert not (occ.dir / "occupier.json").exists()


def test_a_stale_record_is_never_signalled(occ, tmp_path):
    occ.dir.mkdir(parents=True, mode=0o700)
    bystander = subprocess.Popen(["sleep", "600"])
    try:
        st = Path(f"/proc/{bystander.pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
        # The pid of an unrelated process, with its own start time even: it does not hold the lock.
        for start in (int(st[19]), 12345):
            (occ.dir / "occupier.json").write_text(json.dumps({"pid": bystander.pid, "start_ticks": start}))
            r = occ("off")
            assert r.returncode == 0 and "stale record" in r.stdout and "nothing signalled" in r.stdout
            assert bystander.poll() is None and not (occ.dir / "occupier.json").exists()
        assert occ("status").returncode == 3
    finally:
        bystander.kill()
        bystander.wait()


def test_two_racing_on_exactly_one_runs(occ, sim, tmp_path):
    out = tmp_path / "gpus"
    cmd = stand_in(occ, out)
    first, second = occ.popen("on", *FAST, *cmd), occ.popen("on", *FAST, *cmd)
    codes = sorted(p.wait(60) for p in (first, second))
    assert codes == [0, 1]
    loser = first if first.returncode == 1 else second
    assert "already running" in loser.stderr.read()  # type: ignore[union-attr]
    occ.wait_state("occupying")
    serving = [p for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if _is_serve(p, occ)]
    assert serving == [occ.pid()]


def _is_serve(pid: int, occ: Occupy) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return b"serve" in argv and b"occupy" in argv and str(occ.state_home).encode() in env


def test_yield_releases_on_a_foreign_open_and_takes_the_gpus_back(occ, sim, tmp_path):
    out = tmp_path / "gpus"
    assert occ("on", "--yield", *FAST, *stand_in(occ, out)).returncode == 0
    s = occ.wait_state("occupying")
    assert s["mode"] == "yield"
    marker = occ.markers[0]  # type: ignore[attr-defined]
    wait_for(lambda: len(marked(marker)) >= 2, what="CMD and its escaped child")
    foreign = subprocess.Popen(
        foreign_opener_cmd(sim.device(1)), stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert foreign.stdout is not None and foreign.stdout.readline().strip() == b"open"
        wait_for(lambda: marked(marker) == [], timeout=10, what="every process of CMD gone")
        stopped = re.compile(r"occupy\[\d+\] stopped in (\d+) ms \(SIGTERM\)")
        m = wait_for(lambda: stopped.search(occ.log()), what="the stop line")  # logged once it is reaped
        assert int(m.group(1)) < 2000, occ.log()  # type: ignore[union-attr]
        assert occ.wait_state("yielded")["state"] == "yielded"
    finally:
        foreign.kill()
        foreign.wait()
    occ.wait_state("occupying")
    wait_for(lambda: out.read_text().count("\n") == 2, what="CMD started again")  # taken back after the wait


def test_hold_mode_keeps_the_gpus_when_someone_else_opens_one(occ, sim, tmp_path):
    out = tmp_path / "gpus"
    assert occ("on", *FAST, *stand_in(occ, out)).returncode == 0
    occ.wait_state("occupying")
    foreign = subprocess.Popen(
        foreign_opener_cmd(sim.device(0)), stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert foreign.stdout is not None and foreign.stdout.readline().strip() == b"open"
        wait_for(lambda: "busy" in occ.log(), what="the daemon noticing the foreign opener")
        assert occ.status()["state"] == "occupying" and "stopping occupy" not in occ.log()
    finally:
        foreign.kill()
        foreign.wait()


def test_status_json_and_exit_codes(occ, sim, tmp_path):
    r = occ("status", "--json")
    assert r.returncode == 3 and json.loads(r.stdout)["state"] == "stopped"
    sim.set(0, memory_used_mib=9000)
    assert occ("on", *FAST, *stand_in(occ, tmp_path / "gpus")).returncode == 0
    s = occ.wait_state("waiting")
    assert {"state", "pid", "gpus", "mode", "since"} <= set(s)
    assert s["pid"] == occ.pid() and s["since"] and s["gpus"] == [sim.uuid(0), sim.uuid(1)]
    assert occ("status").returncode == 0


@pytest.mark.parametrize(
    "options, message",
    [
        (["--gpus", "x"], "'x' is not a GPU index or UUID"),
        (["--gpus", "7"], "no GPU 7"),
        (["--memory", "-5"], "--memory"),
        (["--wait-minutes", "-1"], "--wait-minutes must be 0 or more"),
        (["--refresh_minutes", "0"], "--refresh-minutes must be greater than 0"),
        (["--compute-min", "0"], "use --no-compute"),
    ],
)
def test_bad_options_exit_2(occ, options, message):
    r = occ("on", *options)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and occ("status").returncode == 3


def test_works_as_a_plain_user(public_dir):
    """nobody, with the package readable by it and the system interpreter: on, status, off."""
    sim, code_dir = nobody_host(public_dir)
    home = public_dir / "home"
    home.mkdir()
    os.chown(home, 65534, 65534)
    out = public_dir / "gpus"
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(code_dir),
        "HOME": str(home),
        "GPU_MON_SIM": str(sim.path),
    }

    def run(*args: str) -> subprocess.CompletedProcess:
        return run_as_nobody(["/usr/bin/python3", "-m", "gpu_mon", "occupy", *args], env, cwd=str(home))

    code = f"import os, time; open({str(out)!r}, 'w').write(str(os.getuid())); time.sleep(600)"
    try:
        r = run("on", *FAST, "--", "/usr/bin/python3", "-c", code)
        assert r.returncode == 0, r.stderr
        assert (home / ".local" / "state" / "gpu-mon" / "occupy").stat().st_mode & 0o777 == 0o700
        wait_for(lambda: out.exists() and out.read_text() == "65534", what="CMD running as nobody")
        assert json.loads(run("status", "--json").stdout)["state"] == "occupying"
    finally:
        r = run("off")
    assert r.returncode == 0 and "stopped" in r.stdout
    assert run("status").returncode == 3


@pytest.mark.parametrize("named_by", ["--config", "GPU_MON_CONFIG"])
def test_config_ignore_lists_apply_when_named(occ, sim, tmp_path, named_by):
    from conftest import write_config

    conf = write_config(tmp_path / "c.conf", "[gpu-all]\ngpus = ALL\nignore_programs = monitor-x\n")
    if named_by == "GPU_MON_CONFIG":
        occ.env["GPU_MON_CONFIG"] = str(conf)
    mon = subprocess.Popen(["bash", "-c", f"exec -a monitor-x sleep 600 < {sim.device(0)}"])
    try:
        wait_for(
            lambda: Path(f"/proc/{mon.pid}/cmdline").read_bytes().startswith(b"monitor-x"), what="monitor"
        )
        named = ["--config", str(conf)] if named_by == "--config" else []
        r = occ(*named, "on", *FAST, *stand_in(occ, tmp_path / "gpus"))
        assert r.returncode == 0, r.stderr
        occ.wait_state("occupying")  # the monitor holding GPU 0 is ignored
    finally:
        mon.kill()
        mon.wait()


def test_the_stressor_command_is_one_the_stressor_accepts(tmp_path):
    from gpu_mon.cli import build_parser
    from gpu_mon.commands.occupy import _memory
    from gpu_mon.commands.occupy_spec import OccupySpec, config

    spec = OccupySpec(gpus=[1, 0], memory=_memory("20"), compute_min=15, sleep_min=10)
    c = config(spec, str(tmp_path))
    (p,) = c.processes
    assert (p.per_gpu, p.together, p.hold, c.defaults.start_delay_seconds) == (True, True, True, 300.0)
    assert c.gpu_sections[0].busy_memory_mib == 1024 and not c.gpu_sections[0].unreadable_is_busy
    argv = list(p.cmd)
    assert argv[1:4] == ["-m", "gpu_mon", "stress"]
    args = build_parser().parse_args(argv[3:])  # every option is one `gpu-mon stress` has
    assert (args.memory, float(args.compute_seconds), float(args.sleep_seconds)) == ("20GiB", 900.0, 600.0)
    memory_only = config(OccupySpec(no_compute=True), str(tmp_path)).processes[0].cmd
    assert build_parser().parse_args(list(memory_only[3:])).workload == "none"


# ------------------------------------------------------------------------------- as a plain user, --yield

OTHER_UID = 54321  # another user, with no name: its descriptors are unreadable to nobody
PLAIN_LINE = "not root: other users' processes are seen only through NVML"


class PlainOccupier:
    """`gpu-mon occupy` run by nobody on a host and a package nobody can read (the system interpreter)."""

    def __init__(self, public_dir: Path):
        self.sim, code_dir = nobody_host(public_dir)
        self.home = public_dir / "home"
        self.home.mkdir()
        os.chown(self.home, 65534, 65534)
        self.dir = self.home / ".local" / "state" / "gpu-mon" / "occupy"
        self.env = {
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(code_dir),
            "HOME": str(self.home),
            "GPU_MON_SIM": str(self.sim.path),
        }
        self.marker = f"gmo-{uuid.uuid4().hex}"

    def __call__(self, *args: str) -> subprocess.CompletedProcess:
        return run_as_nobody(
            ["/usr/bin/python3", "-m", "gpu_mon", "occupy", *args], self.env, cwd=str(self.home)
        )

    def cmd(self, code: str) -> List[str]:
        """`-- python -c CODE MARKER`: CMD, marked for cleanup."""
        return ["--", "/usr/bin/python3", "-c", code, self.marker]

    def state(self) -> str:
        return str(json.loads(self("status", "--json").stdout)["state"])

    def log(self) -> str:
        try:
            return (self.dir / "occupy.log").read_text(errors="replace")
        except OSError:
            return ""

    def gpu(self, index: int) -> Dict[str, object]:
        """GPU `index` in the occupier's state file ({} before there is one)."""
        try:
            return dict(json.loads((self.dir / "state.json").read_text())["gpus"][index])
        except (OSError, ValueError, LookupError):
            return {}

    def holders(self, index: int) -> List[Dict[str, object]]:
        """The holders of GPU `index` in the occupier's state file."""
        return list(self.gpu(index).get("holders") or [])  # type: ignore[call-overload]

    def close(self) -> None:
        self("off", "--timeout", "10")
        kill_marked(self.marker)


@pytest.fixture
def plain(public_dir):
    p = PlainOccupier(public_dir)
    yield p
    p.close()


def other_user(argv: List[str]) -> subprocess.Popen:
    """A process of another user (a uid nobody cannot inspect), saying a line when it is ready."""
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        user=OTHER_UID,
        group=OTHER_UID,
        extra_groups=[],
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        start_new_session=True,
    )


def test_plain_user_yield_gives_back_at_once_on_another_users_open(plain):
    """nobody's polite occupier, polling once a minute: another user's open alone (unreadable to nobody, and
    not in NVML's list) stops CMD within a couple of seconds, and the GPUs stay given back."""
    out = plain.home / "cmd-ran"
    code = f"import time; open({str(out)!r}, 'w').write('yes'); time.sleep(600)"
    r = plain("on", "--yield", "--wait-minutes", "0.02", "--refresh-minutes", "1", *plain.cmd(code))
    assert r.returncode == 0, r.stderr
    wait_for(lambda: out.exists() and marked(plain.marker), what="CMD running as nobody")
    wait_for(lambda: plain.state() == "occupying", what="occupying")
    opener = other_user(foreign_opener_cmd(plain.sim.device(0)))
    try:
        assert opener.stdout is not None and opener.stdout.readline().strip() == b"open"
        wait_for(lambda: marked(plain.marker) == [], timeout=3, what="CMD stopped by the open alone")
        stop = re.search(
            r"GPU 0 \(\S+\) busy: opened by a process whose files cannot .*stopping occupy", plain.log()
        )
        assert stop, plain.log()
        m = wait_for(lambda: re.search(r"occupy\[\d+\] stopped in (\d+) ms", plain.log()), what="stop line")
        assert int(m.group(1)) < 2000, plain.log()  # type: ignore[union-attr]
        wait_for(lambda: plain.state() == "yielded", what="yielded")
        assert "starting occupy" not in plain.log().split(stop.group(0), 1)[1]
    finally:
        opener.kill()
        opener.wait()


def test_plain_user_yield_never_yields_to_its_own_opens(plain):
    """CMD and its child open the GPUs' nodes (as a CUDA program does) while another user's process keeps
    changing its open files: the occupier sees its own opens as its own and keeps the GPUs."""
    ready = plain.home / "cmd-ready"
    devices = [plain.sim.device(0), plain.sim.device(1)]
    code = (
        "import os, sys, time\n"
        f"a = open({devices[0]!r})\n"
        "if os.fork() == 0:\n"
        f"    b = open({devices[1]!r}); time.sleep(0.3); c = open({devices[0]!r})\n"
        f"    open({str(ready)!r}, 'w').write('yes'); time.sleep(600)\n"
        "time.sleep(600)\n"
    )
    churn = (  # a new descriptor every 2 ms, all closed at 500: its count of open files always moves
        "import os, time\nprint('ok', flush=True)\nfds = []\nwhile True:\n"
        "    fds.append(os.open('/dev/null', 0)); time.sleep(0.002)\n"
        "    if len(fds) > 500:\n        [os.close(f) for f in fds]; fds = []\n"
    )
    churner = other_user(["/usr/bin/python3", "-c", churn])
    try:
        assert churner.stdout is not None and churner.stdout.readline().strip() == b"ok"
        r = plain("on", "--yield", *FAST, *plain.cmd(code))
        assert r.returncode == 0, r.stderr
        wait_for(ready.exists, what="CMD and its child holding both GPUs")
        pids = set(marked(plain.marker))

        def seen_as_ours(index: int) -> bool:
            return {int(h["pid"]) for h in plain.holders(index) if h["ours"]} & pids != set()

        wait_for(lambda: seen_as_ours(0) and seen_as_ours(1), what="the occupier seeing its own holders")
        plain.sim.set(0, name="renamed")  # a poll that sees this comes after every open above was handled
        wait_for(lambda: plain.gpu(0).get("name") == "renamed", what="a poll after the opens")
        assert "stopping occupy" not in plain.log() and "cannot be read" not in plain.log(), plain.log()
        assert plain.state() == "occupying"
    finally:
        churner.kill()
        churner.wait()


def test_plain_user_warning_is_one_line_at_start(plain):
    """What a plain user cannot see is said once, at start; never again for each new process of others."""
    r = plain("on", *FAST, *plain.cmd("import time; time.sleep(600)"))
    assert r.returncode == 0, r.stderr
    wait_for(lambda: plain.state() == "occupying", what="occupying")
    others = [
        other_user(["/usr/bin/python3", "-c", "print('up', flush=True); import time; time.sleep(600)"])
        for _ in range(3)
    ]
    try:
        for p in others:
            assert p.stdout is not None and p.stdout.readline().strip() == b"up"
        plain.sim.set(1, memory_used_mib=2000)  # seen at the next poll, which also reads the new processes
        wait_for(lambda: "2000 MiB used by others" in plain.log(), what="a poll after the others started")
    finally:
        for p in others:
            p.kill()
            p.wait()
    log = plain.log()
    assert log.count(PLAIN_LINE) == 1 and "hold mode keeps the GPUs" in log, log
    assert "cannot read the open files" not in log and "run gpu-mon as root" not in log, log


def test_an_unseen_open_is_someone_elses_use_for_the_wait_then_the_wait_starts_again(tmp_path):
    """Pure: the policy on occupy's config. An unseen open makes the GPU busy (foreign, so the stop is
    urgent) for --wait-minutes; then the GPU is free and the usual wait starts. Not for an ignored user, and
    never where unreadable processes make a GPU busy anyway (the root daemon)."""
    from gpu_mon.api.model import Denied, Gpu, GpuReading, Running, Snapshot, UnseenOpen
    from gpu_mon.commands.occupy_spec import OccupySpec, config
    from gpu_mon.policy import decide as policy
    from gpu_mon.policy import gpustate, words
    from gpu_mon.policy.decisions import PolicyState, Start, Stop

    gpus = tuple(Gpu(index=i, uuid=f"GPU-{i}", device=f"/dev/nvidia{i}", memory_used_mib=0) for i in (0, 1))
    opened = (UnseenOpen("GPU-0", 1000.0, (Denied(4242, "bob", "python3"), Denied(7, "root", "cron"))),)

    def decide(spec: OccupySpec, now: float, running: bool, state: Optional[PolicyState] = None):
        c = config(spec, str(tmp_path))
        run = (Running(key=f"occupy@{g.uuid}", pid=1, started_at=0.0) for g in gpus) if running else ()
        snap = Snapshot(now=now, reading=GpuReading(gpus), unseen_opens=opened, running=tuple(run))
        return policy.decide(c, policy.resolve(c, gpus), snap, state or PolicyState())

    polite = OccupySpec(polite=True, wait_minutes=1.0)
    d = decide(polite, 1000.0, running=True)
    reason = d.verdicts["GPU-0"].reasons[0]
    assert words.reason(reason) == (
        "opened by a process whose files cannot be read here (bob python3[4242], or one of 1 others)"
    )
    assert reason.kind in gpustate.FOREIGN_REASONS  # an urgent stop, counted as foreign use
    assert {a.key for a in d.actions if isinstance(a, Stop)} == {"occupy@GPU-0", "occupy@GPU-1"}
    d = decide(polite, 1059.0, running=False)
    assert d.verdicts["GPU-0"].busy and not d.verdicts["GPU-1"].busy
    d = decide(polite, 1060.0, running=False, state=d.state)  # the wait after it, counted from now
    assert not d.verdicts["GPU-0"].busy and d.waiting["occupy@GPU-0"].until == 1120.0
    assert not any(isinstance(a, Start) for a in decide(polite, 1119.0, False, d.state).actions)
    assert any(isinstance(a, Start) for a in decide(polite, 1120.0, False, d.state).actions)
    ignoring = OccupySpec(polite=True, wait_minutes=1.0, ignore_users=["bob", "root"])
    assert not decide(ignoring, 1000.0, running=False).verdicts["GPU-0"].busy
    wait_zero = OccupySpec(polite=True, wait_minutes=0.0, refresh_minutes=0.05)  # still until the next look
    assert decide(wait_zero, 1002.9, running=False).verdicts["GPU-0"].busy
    assert not decide(wait_zero, 1003.0, running=False).verdicts["GPU-0"].busy

    from gpu_mon import config as cfg

    daemon = cfg.parse("[gpu-all]\ngpus = ALL\n[process-m]\ncmd = m\nuser = root\n", "/t.conf")
    snap = Snapshot(now=1000.0, reading=GpuReading(gpus), unseen_opens=opened)
    assert not policy.decide(daemon, policy.resolve(daemon, gpus), snap, PolicyState()).verdicts["GPU-0"].busy
