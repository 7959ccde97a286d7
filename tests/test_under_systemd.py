"""The shipped units under a real systemd: `systemd-nspawn --volatile=yes` boots one as PID 1 of a container
over this machine's own root (tests/nspawn.py), and every test drives gpu-mon only through `systemctl`,
`journalctl` and files, as an admin would.

Installation: the unit files exactly as shipped (systemd/gpu-mon.service, systemd/gpu-mon-sentinel.service)
in the container's /etc/systemd/system, with one drop-in each that changes only where gpu-mon is
(`ExecStart=` runs this test run's Python on `-m gpu_mon`, with the checkout and its virtual environment's
packages on PYTHONPATH, bind-mounted read-only under /srv: the unit's PrivateTmp=yes hides the host's /tmp
from the service, and a checkout may be there) and sets GPU_MON_SIM for the simulated GPUs. Not
the .deb: the container's /usr is the host's, mounted read-only by `--volatile=yes`, so dpkg cannot put
files there, and installing the package on the host itself is tests/test_deb.py's business. Everything
else (Type=notify, the watchdog, KillMode=process, Delegate=yes, the sandbox, the restart rules) is the
shipped unit's own.

The container boots once for the module (the two tests in which a sentinel powers the machine off each
boot one of their own); its /etc and /var are its own tmpfs, so the config, the history and the textfile
written here never reach the host. The simulated GPUs' files are in a scratch directory
bind-mounted at /srv/gpu-mon-test; the device stand-ins exist before the service starts (the sandbox makes
the file system read-only for the daemon). Where the container cannot boot, every test fails with one
line saying why (root and `systemd-nspawn`, from the Debian package systemd-container, are needed).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import site
import sys
import time
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import pytest
from conftest import ROOT, SimHost, pid_alive, wait_for
from nspawn import BootError, Container, python_binds
from test_systemd_unit import MAX_EXPOSURE

SRV = "/srv/gpu-mon-test"
CHECKOUT = "/srv/gpu-mon-checkout"  # the checkout, read-only, for the service
SIM = f"{SRV}/sim.json"
UNIT = "gpu-mon.service"
SENTINEL = "gpu-mon-sentinel.service"
INSTALLATION = "test-installation.conf"  # the drop-in saying where gpu-mon is
DROP_INS = f"/etc/systemd/system/{UNIT}.d"
# A workload that says who it is and every SIGTERM or SIGUSR1 it gets; it ends on its stop signal (argv[2]),
# like a training job that checkpoints on SIGUSR1.
JOB = """\
import os, signal, sys, time
name, stop_signal = sys.argv[1], sys.argv[2]
got = []
def note(signum, frame):  # ends the loop below only after every pending signal's handler has run
    got.append(signal.Signals(signum).name)
    print(f"{name} got {got[-1]}", flush=True)
for s in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(s, note)
print(f"{name} up as uid {os.getuid()} on {os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
while stop_signal not in got:
    time.sleep(0.1)  # a handler does not cut a sleep short (PEP 475)
"""
JOB_CMD = f"/usr/bin/python3 {SRV}/job.py"
CONFIG = f"""\
[defaults]
start_delay_seconds = 0
interval_seconds = 10

[gpu-all]
gpus = ALL

[process-w]
cmd = {JOB_CMD} w SIGUSR1
gpus = 0
stop_signal = SIGUSR1

[process-x]
cmd = {JOB_CMD} x SIGTERM
gpus = 1
"""
# Someone else's program opening a GPU: it notes the time just before its open.
OPENER = (
    "import sys, time; t = time.time(); f = open(sys.argv[1]); "
    "print(f'opened at {t:.6f}', flush=True); time.sleep(600)"
)


def _site_dirs() -> List[str]:
    """This test run's package directories outside /usr (a virtual environment's site-packages)."""
    return [d for d in site.getsitepackages() if not d.startswith("/usr/") and os.path.isdir(d)]


def _checkout_binds() -> List[str]:
    """The checkout and its packages, read-only at fixed places under /srv: the unit's PrivateTmp hides the
    host's /tmp from the service, and a checkout (CI's clone, say) may well be there."""
    binds = [f"{ROOT}:{CHECKOUT}"]
    binds += [f"{d}:{CHECKOUT}-site{i}" for i, d in enumerate(_site_dirs())]
    return binds


def _drop_in(args: str) -> str:
    """Where the service finds this checkout's gpu-mon: the interpreter itself, with the checkout and its
    packages on PYTHONPATH (at their places under /srv)."""
    path = ":".join([CHECKOUT] + [f"{CHECKOUT}-site{i}" for i in range(len(_site_dirs()))])
    python = os.path.realpath(sys.executable)
    return (
        f"[Service]\nEnvironment=GPU_MON_SIM={SIM} PYTHONPATH={path}\n"
        f"ExecStart=\nExecStart={python} -m gpu_mon {args}\n"
    )


def _gpu_mon() -> str:
    """This checkout's installed `gpu-mon`, for commands run in the container outside the service."""
    return str(Path(sys.executable).with_name("gpu-mon"))


def _install(box: Container) -> None:
    """The shipped units, and drop-ins that only say where this checkout's gpu-mon is."""
    for unit in (UNIT, SENTINEL):
        box.write(f"/etc/systemd/system/{unit}", (ROOT / "systemd" / unit).read_text())
    box.write(f"{DROP_INS}/{INSTALLATION}", _drop_in("run"))
    sentinel = _drop_in("sentinel $GPU_MON_SENTINEL_OPTS")
    box.write(f"/etc/systemd/system/{SENTINEL}.d/{INSTALLATION}", sentinel)
    box.run(["systemctl", "daemon-reload"])


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> SimHost:
    srv = tmp_path_factory.mktemp("under-systemd")
    os.chmod(srv, 0o755)  # the workloads run as nobody
    (srv / "job.py").write_text(JOB)
    return SimHost(srv, 3)


def _boot(container: Container) -> str:
    """Boot it; why not, or ""."""
    try:
        container.boot()
    except BootError as err:
        return str(err)
    return ""


@contextlib.contextmanager
def _booted(host: SimHost) -> Iterator[Container]:
    """A booted container with gpu-mon installed; afterwards nothing of it is left (checked)."""
    bound = [str(ROOT)]
    bound += [p for p in python_binds() if not any(p.startswith(b + "/") or p == b for b in bound)]
    bound += _checkout_binds()
    container = Container(host.dir, binds_ro=bound, binds_rw={str(host.dir): SRV})
    try:
        why = _boot(container)
        if why:
            pytest.fail(f"cannot boot systemd in a container: {why}", pytrace=False)
        _install(container)
        yield container
    finally:
        left = container.stop()
    assert not left, f"the container left things behind: {left}"


@pytest.fixture(scope="module")
def box(host: SimHost) -> Iterator[Container]:
    """One container for the module's tests."""
    with _booted(host) as container:
        yield container


@pytest.fixture
def spare(tmp_path: Path) -> Iterator[Tuple[Container, SimHost]]:
    """A container of the test's own, with one idle GPU (for a test that powers it off)."""
    host = SimHost(tmp_path, 1)
    with _booted(host) as container:
        yield container, host


class Service:
    """gpu-mon.service in the container, with the journal since this test began."""

    def __init__(self, box: Container, host: SimHost):
        self.box = box
        self.host = host
        self.since = time.time()

    def show(self, *props: str) -> dict:
        return self.box.show(UNIT, *props)

    def systemctl(self, *args: str, check: bool = True):
        """systemctl in the container; a failure says what the unit's journal said (its last lines)."""
        try:
            return self.box.run(["systemctl", *args], check=check)
        except AssertionError as err:
            said = "\n".join(line for _t, line in self.lines()[-15:])
            raise AssertionError(f"{err}\n--- journal of {UNIT}:\n{said}") from None

    def lines(self, unit: str = UNIT, priority: Optional[str] = None) -> List[Tuple[float, str]]:
        return self.box.journal(unit, self.since, priority)

    def wait_line(self, pattern: str, unit: str = UNIT, timeout: float = 20.0, after: float = 0.0):
        """The first journal line (time, match) of the unit matching the pattern, later than `after`."""

        def find():
            for t, line in self.lines(unit):
                m = re.search(pattern, line)
                if m and t >= after:
                    return t, m
            return None

        return wait_for(find, timeout, f"a journal line of {unit} matching {pattern!r}", interval=0.1)

    def group_dir(self) -> Path:
        """The unit's cgroup directory, as the host reaches it."""
        group = self.show("ControlGroup")["ControlGroup"]
        unified = self.box.path("/sys/fs/cgroup/unified")
        top = unified if (unified / "cgroup.procs").exists() else self.box.path("/sys/fs/cgroup")
        return top / group.lstrip("/")

    def jobs(self) -> List[Tuple[str, int]]:
        """(name, host pid) of every job.py process in the container."""
        out = []
        for pid in _pids_in_namespace(self.box.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if len(argv) > 2 and argv[1] == f"{SRV}/job.py".encode() and pid_alive(pid):
                out.append((argv[2].decode(), pid))
        return sorted(out)


def _pids_in_namespace(init_pid: int) -> List[int]:
    """Host pids of the processes in the PID namespace of `init_pid`."""
    ns = os.readlink(f"/proc/{init_pid}/ns/pid")
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.readlink(f"/proc/{name}/ns/pid") == ns:
                    pids.append(int(name))
            except OSError:
                continue
    return pids


def _write_config(box: Container, text: str) -> None:
    box.write("/etc/gpu_mon.conf", text, 0o600)


@pytest.fixture
def service(box: Container, host: SimHost) -> Iterator[Service]:
    """gpu-mon started with CONFIG on three idle GPUs; stopped, and test drop-ins removed, afterwards."""
    _write_config(box, CONFIG)
    svc = Service(box, host)
    svc.systemctl("start", UNIT)
    try:
        yield svc
    finally:
        svc.systemctl("stop", UNIT, check=False)
        svc.systemctl("reset-failed", UNIT, check=False)
        extra = [p for p in box.path(DROP_INS).iterdir() if p.name != INSTALLATION]
        for p in extra:
            p.unlink()
        if extra:
            svc.systemctl("daemon-reload")


def _both_jobs_up(svc: Service, after: float = 0.0) -> None:
    for name in ("w", "x"):
        svc.wait_line(rf"^{name}\[\d+\]: {name} up as uid", after=after)


def test_start_returns_after_ready_with_the_status_line(service: Service):
    # Read at once after `systemctl start` returned: gpu-mon sends its first STATUS= just before READY=1
    # (a unit that counted as started at the fork would have no status line yet).
    state = service.show("ActiveState", "SubState", "StatusText")
    assert (state["ActiveState"], state["SubState"]) == ("active", "running")
    assert re.match(r"\d+/3 GPUs running work", state["StatusText"]), state
    status = service.systemctl("status", UNIT, "--no-pager", "--lines=0").stdout
    assert f'Status: "{state["StatusText"]}"' in status, status


def test_workloads_contained_as_nobody_with_history(service: Service):
    _t, m = service.wait_line(r"^containment: (\w+) \(a group per workload under (\S+)\)")
    assert m.group(1) == "cgroup"
    assert m.group(2).endswith("/system.slice/gpu-mon.service")
    _both_jobs_up(service)
    main = service.show("MainPID")["MainPID"]
    groups = sorted(p.name for p in service.group_dir().iterdir() if p.is_dir())
    assert len(groups) == 2 and all(g.startswith(f"gpu-mon.{main}.") for g in groups), groups
    _t, m = service.wait_line(r"^w\[\d+\]: w up as uid (\d+) on (\S+)")
    assert (m.group(1), m.group(2)) == ("65534", service.host.uuid(0))
    # systemd leaves the unit's subgroups to gpu-mon, also when it reloads its units and sets properties.
    service.systemctl("daemon-reload")
    service.systemctl("set-property", "--runtime", UNIT, "TasksMax=4096")
    for group in groups:
        procs = (service.group_dir() / group / "cgroup.procs").read_text().split()
        assert len(procs) == 2, f"{group}: leader and job expected, found {procs}"  # leader + job
    # An admin's `gpu-mon status` reads what the daemon keeps in /run/gpu_mon under the sandbox.
    doc = json.loads(service.box.run([_gpu_mon(), "status", "--json"]).stdout)
    assert str(doc["daemon"]["pid"]) == main, doc["daemon"]
    assert {(w["key"], w["state"]) for w in doc["workloads"]} == {("w", "running"), ("x", "running")}
    history = service.box.path("/var/lib/gpu_mon/history.sqlite")
    wait_for(lambda: history.exists() and history.stat().st_size > 0, what="the history database written")
    assert not service.lines(priority="warning"), service.lines(priority="warning")


def test_a_foreign_open_stops_the_workload_until_it_ends(service: Service):
    _both_jobs_up(service)
    device = f"{SRV}/dev/nvidia0"
    foreign = "gpu-mon-test-foreign.service"
    run = ["systemd-run", "--collect", f"--unit={foreign}", "/usr/bin/python3", "-c", OPENER, device]
    service.box.run(run)
    try:
        _t, opened = service.wait_line(r"^opened at ([\d.]+)$", unit=foreign)
        service.wait_line(rf"^GPU 0 \(\S+\) busy: root python3\[\d+\] holds {device}; stopping w\[")
        stopped_at, _m = service.wait_line(r"^w\[\d+\] stopped in \d+ ms \(SIGUSR1\)$")
        service.wait_line(r"^w\[\d+\]: w got SIGUSR1$")
        latency = stopped_at - float(opened.group(1))
        print(f"foreign open to workload stopped: {latency * 1000:.0f} ms (journal time)")
        # Seen as it happened (inotify); a yield left to the poll (every 10 s) would mostly take longer.
        assert latency < 5.0, f"{latency:.3f} s from the open to the stop"
        assert [name for name, _pid in service.jobs()] == ["x"]
    finally:
        service.systemctl("stop", foreign, check=False)
    service.wait_line(r"^w\[\d+\]: w up as uid", after=stopped_at)
    assert [name for name, _pid in service.jobs()] == ["w", "x"]
    # The history under the sandbox has the preemption, timed from the open to the stop signal.
    service.systemctl("stop", UNIT)
    report = json.loads(service.box.run([_gpu_mon(), "report", "--json", "--since", "1h"]).stdout)
    gpu0 = next(g for g in report["gpus"] if g["uuid"] == service.host.uuid(0))
    assert gpu0["preemptions"] >= 1, gpu0
    print(f"gpu-mon report: yield latency p50 {gpu0['yield_ms_p50']} ms")


def test_reload_adds_a_section(service: Service):
    _both_jobs_up(service)
    main = service.show("MainPID")["MainPID"]
    # y's output goes to a file in the unit's LogsDirectory (root's, written without CAP_DAC_OVERRIDE).
    log = "/var/log/gpu-mon/y.log"
    _write_config(service.box, CONFIG + f"\n[process-y]\ncmd = {JOB_CMD} y SIGTERM\ngpus = 2\nlog = {log}\n")
    service.systemctl("reload", UNIT)
    service.wait_line(r"^reloaded /etc/gpu_mon.conf; added: \[process-y\]$")
    path = service.box.path(log)
    wait_for(lambda: path.exists() and "y up as uid 65534" in path.read_text(), what=f"y's line in {log}")
    assert service.show("MainPID")["MainPID"] == main
    assert not any(re.match(r"^[wx]\[\d+\] stopped", line) for _t, line in service.lines())


def test_reload_refuses_a_bad_config_and_keeps_the_old(service: Service):
    _both_jobs_up(service)
    main = service.show("MainPID")["MainPID"]
    _write_config(service.box, CONFIG + "\n[process-y]\ncmd = /bin/true\ngpus = x\n")
    service.systemctl("reload", UNIT)
    service.wait_line(r"^reload failed .*still running on the old config$")
    errors = [line for _t, line in service.lines(priority="err")]
    reason = [
        line for line in errors if line.startswith("reload: /etc/gpu_mon.conf:") and "[process-y]" in line
    ]
    assert reason, errors
    state = service.show("MainPID", "ActiveState")
    assert (state["MainPID"], state["ActiveState"]) == (main, "active")
    assert [name for name, _pid in service.jobs()] == ["w", "x"]


def test_stop_gives_each_workload_its_stop_signal_and_leaves_nothing(service: Service):
    _both_jobs_up(service)
    group = service.group_dir()
    jobs = service.jobs()
    began = time.monotonic()
    service.systemctl("stop", UNIT)
    took = time.monotonic() - began
    timeout = service.show("TimeoutStopUSec")["TimeoutStopUSec"]
    assert timeout == "30s" and took < 30, (timeout, took)
    for name, signame in (("w", "SIGUSR1"), ("x", "SIGTERM")):
        service.wait_line(rf"^{name}\[\d+\]: {name} got {signame}$")
        service.wait_line(rf"^{name}\[\d+\] stopped in \d+ ms \({signame}\)$")
    # Only gpu-mon signals its workloads (KillMode=process): w never saw systemd's SIGTERM.
    assert not [line for _t, line in service.lines() if re.match(r"^w\[\d+\]: w got SIGTERM", line)]
    state = service.show("Result", "ActiveState", "ExecMainStatus")
    assert state == {"Result": "success", "ActiveState": "inactive", "ExecMainStatus": "0"}
    assert not group.exists() or not any(p.read_text().split() for p in group.rglob("cgroup.procs"))
    assert not [pid for _name, pid in jobs if pid_alive(pid)]
    print(f"systemctl stop took {took * 1000:.0f} ms")


def _restarted(service: Service, old_main: str) -> dict:
    def fresh():
        state = service.show("MainPID", "NRestarts", "ActiveState", "SubState")
        ok = (
            state["NRestarts"] == "1"
            and state["SubState"] == "running"
            and state["MainPID"] not in ("0", old_main)
        )
        return state if ok else None

    return wait_for(fresh, 30, "systemd to restart gpu-mon", interval=0.1)


def _one_copy_each_of_the_new_daemon(service: Service, old_jobs: List[Tuple[str, int]], restarted_at: float):
    _both_jobs_up(service, after=restarted_at)
    main = service.show("MainPID")["MainPID"]
    assert not [pid for _name, pid in old_jobs if pid_alive(pid)], "a workload of the old daemon is left"
    assert [name for name, _pid in service.jobs()] == ["w", "x"], service.jobs()
    groups = [p.name for p in service.group_dir().iterdir() if p.is_dir()]
    assert sorted(g.split(".")[1] for g in groups) == [main, main], groups


def test_a_killed_daemon_is_restarted_without_leftovers(service: Service):
    _both_jobs_up(service)
    old_main, old_jobs = service.show("MainPID")["MainPID"], service.jobs()
    service.systemctl("kill", "--signal=SIGKILL", "--kill-whom=main", UNIT)
    killed_at, _m = service.wait_line(r"Main process exited, code=killed, status=9/KILL")
    _restarted(service, old_main)
    _one_copy_each_of_the_new_daemon(service, old_jobs, killed_at)


def test_a_crash_gives_each_workload_its_stop_signal_not_systemds_sigkill(service: Service):
    """KillMode=process: when gpu-mon dies, systemd signals nothing else; each workload's leader gives it
    its stop signal and grace (with mixed, systemd SIGKILLed every workload 2 ms after gpu-mon died)."""
    logged = CONFIG.replace(
        "stop_signal = SIGUSR1\n", "stop_signal = SIGUSR1\nlog = /var/log/gpu-mon/w.log\n"
    )
    _write_config(service.box, logged)
    service.systemctl("restart", UNIT)
    log = service.box.path("/var/log/gpu-mon/w.log")
    wait_for(lambda: log.exists() and " up as uid " in log.read_text(), 20, "w up, its output in its log")
    old_main = service.show("MainPID")["MainPID"]
    service.systemctl("kill", "--signal=SIGKILL", "--kill-whom=main", UNIT)
    wait_for(
        lambda: "w got SIGUSR1" in log.read_text(),
        10,
        f"w's stop signal from its leader: {log.read_text()!r}",
    )
    assert "w got SIGTERM" not in log.read_text()
    _restarted(service, old_main)
    service.box.run(["rm", "-f", "/var/log/gpu-mon/w.log"])


def test_the_watchdog_restarts_a_hung_daemon(service: Service):
    service.box.write(f"{DROP_INS}/test-watchdog.conf", "[Service]\nWatchdogSec=2s\n")
    service.systemctl("daemon-reload")
    service.systemctl("restart", UNIT)
    restarted_at = time.time()
    _both_jobs_up(service, after=restarted_at)
    old_main, old_jobs = service.show("MainPID")["MainPID"], service.jobs()
    service.systemctl("kill", "--signal=SIGSTOP", "--kill-whom=main", UNIT)
    timed_out, _m = service.wait_line(r"Watchdog timeout \(limit 2s\)!", after=restarted_at)
    service.wait_line(r"Failed with result 'watchdog'", after=restarted_at)
    _restarted(service, old_main)
    _one_copy_each_of_the_new_daemon(service, old_jobs, timed_out)


def test_a_bad_config_at_start_exits_2_without_a_restart_loop(service: Service):
    service.systemctl("stop", UNIT)
    _write_config(service.box, CONFIG.replace("interval_seconds = 10", "interval_seconds = soon"))
    assert service.systemctl("start", UNIT, check=False).returncode != 0
    state = service.show("ExecMainStatus", "Result", "ActiveState", "SubState", "NRestarts")
    # SubState "auto-restart" would be a restart scheduled; "failed" is none.
    expected = {"ExecMainStatus": "2", "Result": "exit-code", "ActiveState": "failed", "SubState": "failed"}
    assert state == {**expected, "NRestarts": "0"}
    errors = [line for _t, line in service.lines(priority="err")]
    assert any(line.startswith("/etc/gpu_mon.conf:3: [defaults] interval_seconds") for line in errors), errors


def test_the_running_unit_is_no_more_exposed_than_the_static_bound(service: Service):
    out = service.box.run(["systemd-analyze", "security", UNIT, "--no-pager"]).stdout
    m = re.search(r"Overall exposure level for gpu-mon\.service: (\d+\.\d+)", out)
    assert m, out
    print(f"systemd-analyze security gpu-mon (running): {m.group(1)}")
    assert float(m.group(1)) <= MAX_EXPOSURE, out


def test_the_sentinel_unit_runs_with_its_default_options(service: Service):
    service.systemctl("stop", UNIT)
    opts = "--interval 0.2 --arm-duration 0.4 --kill-duration 0.6 --kill-action end_process"
    service.box.write("/etc/default/gpu-mon-sentinel", f'GPU_MON_SENTINEL_OPTS="{opts}"\n')
    host = service.host
    try:
        service.systemctl("start", SENTINEL)
        service.wait_line(r"^sentinel: arms after 0\.4 s .* a tick every 0\.2 s; GPUs: ALL", unit=SENTINEL)
        for i in range(3):
            host.set(i, utilization_pct=100)
        service.wait_line(r"^sentinel: armed after 0\.4 s", unit=SENTINEL)
        for i in range(3):
            host.set(i, utilization_pct=0)
        service.wait_line(r"^sentinel: ending \(kill_action = end_process\)$", unit=SENTINEL)

        def ended():
            state = service.box.show(SENTINEL, "ActiveState", "Result", "ExecMainStatus")
            return state if state["ActiveState"] == "inactive" else None

        assert wait_for(ended, what="the sentinel to end") == {
            "ActiveState": "inactive",
            "Result": "success",
            "ExecMainStatus": "0",
        }
    finally:
        for i in range(3):
            host.set(i, utilization_pct=0)
        service.systemctl("stop", SENTINEL, check=False)
        service.systemctl("reset-failed", SENTINEL, check=False)


def test_the_metrics_textfile_is_written_under_the_sandbox_and_removed_at_stop(service: Service):
    directory = service.box.path("/var/lib/prometheus/node-exporter")
    # node-exporter's package makes it; the unit's ReadWritePaths=- makes it writable only if it exists.
    directory.mkdir(parents=True, exist_ok=True)
    textfile = directory / "gpu_mon.prom"
    metrics = "\n[metrics]\ntextfile = /var/lib/prometheus/node-exporter/gpu_mon.prom\n"
    _write_config(service.box, CONFIG + metrics)
    service.systemctl("restart", UNIT)
    wait_for(lambda: textfile.exists() and "gpu_mon_" in textfile.read_text(), what="the textfile written")
    assert not service.lines(priority="warning"), service.lines(priority="warning")
    service.systemctl("stop", UNIT)
    assert not textfile.exists()


@pytest.mark.parametrize("unit", [SENTINEL, UNIT])
def test_a_sentinel_powers_the_machine_off_from_inside_the_sandbox(
    spare: Tuple[Container, SimHost], unit: str
):
    box, host = spare
    if unit == SENTINEL:
        opts = "--interval 0.2 --arm-duration 0.4 --kill-duration 0.6 --kill-action shutdown"
        box.write("/etc/default/gpu-mon-sentinel", f'GPU_MON_SENTINEL_OPTS="{opts}"\n')
    else:
        settings = "arm_duration_seconds = 0.5\nkill_duration_seconds = 1\nkill_action = shutdown\n"
        config = f"[defaults]\ninterval_seconds = 0.5\n\n[gpu-all]\ngpus = ALL\n\n[sentinel]\n{settings}"
        _write_config(box, config)
    since = time.time()
    box.run(["systemctl", "start", unit])

    def logged(pattern: str) -> None:
        def seen():
            return any(re.search(pattern, line) for _t, line in box.journal(unit, since))

        wait_for(seen, what=f"{pattern!r} in the journal of {unit}", interval=0.1)

    logged(r"sentinel: arms after")
    host.set(0, utilization_pct=100)
    logged(r"sentinel: armed after")
    host.set(0, utilization_pct=0)
    logged(r"sentinel: .*shutting down")
    status = box.wait_ended(30)
    assert status == 0, f"the container did not power off (systemd-nspawn: {status})"
