"""A real one-node Slurm for tests and benchmarks: Debian's munged, slurmctld and slurmd started as plain
daemons (no systemd), everything in one directory (config, state, spool, logs, the munge key and socket),
found by the commands through SLURM_CONF. Nothing of the machine's own /etc/slurm or /var/spool is used.

Slurm's gres.conf takes only character devices as a GPU's `File=`: each simulated GPU gets a node made
with mknod carrying the numbers of a character device that any process can open and no process holds (FUSE,
TUN, ...); the simulated host matches holders of a char device by its numbers, so a job that opens the
node holds the simulated GPU. Jobs run as root.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

DAEMONS = ("munged", "slurmctld", "slurmd")
# Character devices that open without a driver's set-up and that almost nothing holds.
CANDIDATES = ("/dev/fuse", "/dev/net/tun", "/dev/full", "/dev/loop-control", "/dev/btrfs-control")
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"
# A job: says when it starts (with its restart count), when it gets USR1 (its checkpoint) and TERM, each
# with CLOCK_MONOTONIC in ns (the same clock as gpu-mon's); holds the GPU node it is given.
JOB = r"""
import os, signal, sys, time
log, dev = sys.argv[1], sys.argv[2]
def say(*words):
    with open(log, "a") as f:
        f.write(" ".join(str(w) for w in words) + " %d\n" % time.monotonic_ns())
signal.signal(signal.SIGUSR1, lambda *_: say("usr1", os.environ.get("SLURM_JOB_ID")))
def term(*_):
    say("term", os.environ.get("SLURM_JOB_ID"))
    os._exit(0)
signal.signal(signal.SIGTERM, term)
if "=" in dev:  # several nodes: "nodea=/path,nodeb=/path", this one's by SLURMD_NODENAME
    node = os.environ.get("SLURMD_NODENAME", "")
    dev = dict(item.split("=", 1) for item in dev.split(","))[node]
    say("node", os.environ.get("SLURM_JOB_ID"), node)
fd = os.open(dev, os.O_RDWR)
say("start", os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_RESTART_COUNT", "0"))
while True:
    time.sleep(1)
"""


def running_cluster(directory: Path, **kwargs: object) -> Iterator[SlurmCluster]:
    """A module fixture's body: a started cluster in `directory`, closed afterwards (nothing left running);
    a machine without Slurm fails in one line (a missing tool is a failure, not a skip)."""
    import pytest

    lacking = missing()
    if lacking:
        pytest.fail(
            f"a real Slurm needs {', '.join(lacking)} (Debian: slurmctld slurmd slurm-client munge)",
            pytrace=False,
        )
    c = SlurmCluster(directory, **kwargs)  # type: ignore[arg-type]
    try:
        c.start()
        yield c
    finally:
        left = c.close()
    assert left == [], f"left running after the Slurm tests: {left}"


def missing() -> List[str]:
    """What this machine lacks to run the cluster (empty: nothing)."""
    out = [d for d in (*DAEMONS, "scontrol", "sbatch", "scancel", "squeue") if not _which(d)]
    if os.geteuid() != 0:
        out.append("root")
    return out


def _which(name: str) -> Optional[str]:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def _held_rdevs() -> set:
    """Device numbers of every character device some process holds open now."""
    held = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    if stat.S_ISCHR(st.st_mode):
                        held.add(st.st_rdev)
    return held


def pick_devices(count: int) -> List[int]:
    """`count` device numbers of char devices this machine opens and no process holds."""
    held, out = _held_rdevs(), []
    for path in CANDIDATES:
        try:
            st = os.stat(path)
            os.close(os.open(path, os.O_RDWR))
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode) and st.st_rdev not in held and st.st_rdev not in out:
            out.append(st.st_rdev)
        if len(out) == count:
            return out
    raise RuntimeError(f"only {len(out)} of {count} free character devices among {', '.join(CANDIDATES)}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """munged + slurmctld + slurmd on localhost; partitions `scavenger` (preemptible, PreemptMode=REQUEUE,
    low PriorityTier) and `normal`; one GRES gpu per device node in `devices`.

    With `nodes` (names), one `slurmd -D -N NAME` per node on this host, each with its own Port= and its
    spool, pid and log paths by `%n`, and `gpus` GRES device nodes of its own: `devices` lists them node by
    node (the simulated GPUs in that order), `node_devices` by node. A job finds its node's device by
    SLURMD_NODENAME.

    `proctrack`: Slurm's ProctrackType plugin. linuxproc (the default) finds a job's processes by reading
    every process in /proc, each time it signals the job (~30 ms per 1000 processes on the 2-core VM);
    pgid signals the job's process group (~7 ms, whatever else runs). Clusters use cgroup, which reads the
    job's cgroup: not available to plain processes here."""

    def __init__(
        self, directory: Path, gpus: int = 2, nodes: Sequence[str] = (), proctrack: str = "linuxproc"
    ) -> None:
        self.dir = directory
        self.proctrack = proctrack
        self.nodes: Tuple[str, ...] = tuple(nodes)
        if self.nodes:
            self.node_devices = {
                n: [str(directory / "dev" / f"{n}-gpu{i}") for i in range(gpus)] for n in self.nodes
            }
            self.devices = [p for n in self.nodes for p in self.node_devices[n]]
        else:
            self.devices = [str(directory / "dev" / f"gpu{i}") for i in range(gpus)]
            self.node_devices = {"localhost": list(self.devices)}
        self.conf = directory / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.procs: Dict[str, subprocess.Popen] = {}
        self.started = time.time()
        self.job_file = directory / "job.py"

    # ------------------------------------------------------------------ life

    def start(self) -> SlurmCluster:
        d = self.dir
        for sub in ("munge", "state", "spool", "log", "dev", "jobs", *(f"spool/{n}" for n in self.nodes)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o755)
        os.chmod(d / "munge", 0o711)  # the socket is reached through it
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        for path, rdev in zip(self.devices, pick_devices(len(self.devices))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            os.mknod(path, 0o666 | stat.S_IFCHR, rdev)
            os.chmod(path, 0o666)
        self.job_file.write_text(JOB)
        self._write_config()
        m = d / "munge"
        self._spawn(
            "munged",
            [
                "munged", "-F", "--force", f"--key-file={key}", f"--socket={m / 'munge.sock'}",
                f"--pid-file={m / 'munged.pid'}", f"--seed-file={m / 'seed'}",
                f"--log-file={m / 'munged.log'}",
            ],
        )  # fmt: skip
        self._wait(lambda: (m / "munge.sock").exists(), 10, "munged's socket")
        self.start_ctld()
        if self.nodes:
            for n in self.nodes:
                self._spawn(f"slurmd-{n}", ["slurmd", "-D", "-N", n])
        else:
            self._spawn("slurmd", ["slurmd", "-D", "-N", "localhost"])
        self._wait(self._node_idle, 30, "the node to be idle")
        return self

    def _write_config(self) -> None:
        d = self.dir
        gres = "".join(f"NodeName={n} Name=gpu File={p}\n" for n, ps in self.node_devices.items() for p in ps)
        (d / "gres.conf").write_text(gres)
        text = self._config_text()
        if self.nodes:
            text = self._several_nodes(text)
        self.conf.write_text(text)

    def _several_nodes(self, text: str) -> str:
        """The one-node config made into `nodes`: each its own slurmd port, spool, pid and log file."""
        d, cpus, per = self.dir, max(2, os.cpu_count() or 2), len(self.devices) // len(self.nodes)
        names = ",".join(self.nodes)
        lines = []
        for line in text.splitlines():
            if line.startswith("SlurmdSpoolDir="):
                line = f"SlurmdSpoolDir={d / 'spool' / '%n'}"
            elif line.startswith("SlurmdPidFile="):
                line = f"SlurmdPidFile={d / 'slurmd-%n.pid'}"
            elif line.startswith("SlurmdLogFile="):
                line = f"SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}"
            elif line.startswith("NodeName=localhost"):
                lines += [
                    f"NodeName={n} NodeHostname=localhost Port={free_port()} CPUs={cpus} Gres=gpu:{per} "
                    "State=UNKNOWN"
                    for n in self.nodes
                ]
                continue
            elif line.startswith("PartitionName="):
                line = line.replace("Nodes=localhost", f"Nodes={names}")
            lines.append(line)
        return "\n".join(lines) + "\n"

    def _config_text(self) -> str:
        d = self.dir
        return f"""ClusterName=gpumontest
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d / "munge" / "munge.sock"}
CredType=cred/munge
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={d / "state"}
SlurmdSpoolDir={d / "spool"}
SlurmctldPidFile={d / "slurmctld.pid"}
SlurmdPidFile={d / "slurmd.pid"}
SlurmctldLogFile={d / "log" / "slurmctld.log"}
SlurmdLogFile={d / "log" / "slurmd.log"}
ProctrackType=proctrack/{self.proctrack}
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
ReturnToService=2
KillWait=2
MessageTimeout=5
NodeName=localhost CPUs={max(2, os.cpu_count() or 2)} Gres=gpu:{len(self.devices)} State=UNKNOWN
PartitionName=scavenger Nodes=localhost PriorityTier=1 PreemptMode=REQUEUE Default=YES State=UP
PartitionName=normal Nodes=localhost PriorityTier=10 PreemptMode=OFF State=UP
"""

    def start_ctld(self) -> None:
        """Start slurmctld (again: it recovers its jobs from its state directory)."""
        self._spawn("slurmctld", ["slurmctld", "-D"])
        self._wait(lambda: self.run("scontrol", "ping", check=False).returncode == 0, 20, "slurmctld")

    def stop_ctld(self) -> None:
        """Stop slurmctld (SIGTERM: it saves its state) and wait for it to be gone."""
        self._stop("slurmctld")

    def close(self) -> List[str]:
        """Cancel every job, stop the daemons; return what was left and had to be killed (should be [])."""
        left: List[str] = []
        if "slurmctld" in self.procs:
            self.run("scancel", "--full", "--user=root", check=False)
            with contextlib.suppress(AssertionError):
                self._wait(lambda: not self.jobs(), 20, "the jobs to end")
        for name in [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            self._stop(name)
        for pid, comm in self._ours():
            left.append(f"{comm}[{pid}]")
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        return left

    def _ours(self) -> List[Tuple[int, str]]:
        """Live Slurm processes (slurmstepd, the daemons) and jobs started since the cluster was."""
        out = []
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
        tick = os.sysconf("SC_CLK_TCK")
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)
                comm = fields[0].split("(", 1)[1]
                rest = fields[1].split()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if rest[0] == "Z" or boot + int(rest[19]) / tick < self.started - 1:
                continue
            if comm in ("slurmstepd", *DAEMONS) or str(self.job_file).encode() in cmd:
                out.append((int(pid), comm))
        return out

    def _spawn(self, name: str, argv: Sequence[str]) -> None:
        log = open(self.dir / "log" / f"{name}.out", "ab")  # noqa: SIM115 - the daemon writes it
        self.procs[name] = subprocess.Popen(
            [_which(argv[0]) or argv[0], *argv[1:]],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        log.close()

    def _stop(self, name: str) -> None:
        p = self.procs.pop(name, None)
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)

    def _wait(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"died: {', '.join(dead)}" if dead else "timed out"
                raise AssertionError(f"waiting for {what}: {why}; {self.logs()}")
            time.sleep(0.05)

    def logs(self) -> str:
        """The end of each daemon's own output."""
        out = []
        for name in dict.fromkeys((*DAEMONS, *self.procs)):
            with contextlib.suppress(OSError):
                out.append(
                    f"{name}: {(self.dir / 'log' / f'{name}.out').read_text(errors='replace')[-1500:]}"
                )
        return "\n".join(out)

    # ------------------------------------------------------------------ use

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm command against this cluster."""
        r = subprocess.run(
            [_which(argv[0]) or argv[0], *argv[1:]],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")
        return r

    def _node_idle(self) -> bool:
        r = self.run("sinfo", "-h", "-N", "-o", "%T", check=False)
        states = set(r.stdout.split())  # (one line per partition)
        return r.returncode == 0 and bool(states) and states <= {"idle", "mixed", "allocated"}

    def submit(self, partition: str, gpu: int, log: Path, gpus: int = 1, *extra: str) -> int:
        """A batch job in `partition` asking for `gpus` GPUs, holding device node `gpu` (with several nodes:
        its node's `gpu`th); its job id. `extra`: more sbatch options."""
        dev = self.devices[gpu]
        if self.nodes:
            dev = ",".join(f"{n}={ps[gpu]}" for n, ps in self.node_devices.items())
        r = self.run(
            "sbatch", "--parsable", f"--partition={partition}", f"--gres=gpu:{gpus}", "--requeue",
            f"--output={self.dir / 'jobs' / 'slurm-%j.out'}", f"--chdir={self.dir}", *extra,
            f"--wrap=exec {PYTHON} {self.job_file} {log} {dev}",
        )  # fmt: skip
        return int(r.stdout.strip().split(";")[0])

    def job(self, job: int) -> Dict[str, str]:
        """`scontrol show job` as {key: value} ({} when Slurm no longer knows it)."""
        from gpu_mon.slurm.jobs import fields

        r = self.run("scontrol", "show", "job", "-d", "-o", str(job), check=False)
        return fields(r.stdout) if r.returncode == 0 else {}

    def jobs(self) -> List[str]:
        """Ids of the jobs Slurm has, not finished."""
        r = self.run("squeue", "-h", "-o", "%i", check=False)
        return r.stdout.split() if r.returncode == 0 else ["?"]

    def cancel_all(self) -> None:
        """Cancel every job and wait until none is left, nor any of its processes."""
        self.run("scancel", "--user=root", check=False)
        self._wait(lambda: not self.jobs(), 30, "the jobs to end")
        self._wait(
            lambda: not [p for p, c in self._ours() if c not in DAEMONS], 30, "the jobs' processes to end"
        )


def events(log: Path) -> List[List[str]]:
    """A job log's lines as words (the last is CLOCK_MONOTONIC ns)."""
    try:
        return [line.split() for line in log.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []
