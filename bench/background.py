"""Background load for the benchmarks: N cheap processes (`sleep`) holding ~10 open fds each."""

from __future__ import annotations

import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, TypeVar

T = TypeVar("T")


class Background:
    """N `sleep` processes, each holding stdin/stdout/stderr plus `extra_fds` inherited fds."""

    def __init__(
        self,
        count: int,
        filler: str = os.devnull,
        extra_fds: int = 7,
        holders: Optional[Dict[int, str]] = None,
    ):
        """`holders` maps process number -> a file that process also holds (a GPU stand-in)."""
        self.procs: List[subprocess.Popen] = []
        fill = [os.open(filler, os.O_RDONLY) for _ in range(extra_fds)]
        try:
            for i in range(count):
                fds = list(fill)
                extra = None
                if holders and i in holders:
                    extra = os.open(holders[i], os.O_RDONLY)
                    fds[-1] = extra
                p = subprocess.Popen(
                    ["sleep", "1000000"],
                    pass_fds=fds,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
                if extra is not None:
                    os.close(extra)
                self.procs.append(p)
        finally:
            for fd in fill:
                os.close(fd)

    @property
    def pids(self) -> List[int]:
        """Pids of the background processes."""
        return [p.pid for p in self.procs]

    def close(self) -> None:
        """Kill and reap them all."""
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (p99 of 50 samples is the largest but one... nearest rank: the 50th)."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * pct // 100))
    return ordered[int(rank) - 1]


def median(values: Sequence[float]) -> float:
    """statistics.median, for symmetry with percentile."""
    return statistics.median(values)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain text table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(
    condition: Callable[[], T], timeout: float, what: str, prog: str = "", every: float = 0.02
) -> T:
    """condition()'s first true value, asked every `every` s; after `timeout` s, exit naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            said = f"timed out waiting for {what}"
            raise SystemExit(f"{prog}: {said}" if prog else said)
        time.sleep(every)


def sim_gpus(work: Path, count: int = 2) -> None:
    """`count` simulated GPUs for start_daemon: work/dev/nvidiaN and work/sim.json (uuids GPU-bench-N)."""
    (work / "dev").mkdir()
    gpus = []
    for i in range(count):
        (work / "dev" / f"nvidia{i}").touch()
        gpus.append({"uuid": f"GPU-bench-{i}", "device": f"dev/nvidia{i}"})
    (work / "sim.json").write_text(json.dumps({"gpus": gpus}))


def start_daemon(work: Path, conf: str, pythonpath: str) -> Tuple[subprocess.Popen, IO[bytes]]:
    """`gpu-mon run` on work/sim.json with conf (written to work/gpu_mon.conf, 0600), in its own session,
    its output to work/daemon.log: (the process, the log file to close after it)."""
    path = work / "gpu_mon.conf"
    path.write_text(conf)
    os.chmod(path, 0o600)
    env = dict(os.environ, PYTHONPATH=pythonpath)
    env.pop("NOTIFY_SOCKET", None)
    log = open(work / "daemon.log", "wb")  # noqa: SIM115 - the daemon writes it until the caller closes it
    argv = [sys.executable, "-m", "gpu_mon", "--config", str(path), "--sim", str(work / "sim.json"), "run"]
    # Run from `work`: `python -m` puts the current directory first on sys.path, and from a checkout that
    # would be the checkout's gpu_mon, not the one `pythonpath` names (a baseline).
    daemon = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(work), start_new_session=True
    )
    return daemon, log


def queue_request(path: str, obj: dict, timeout: float = 60.0) -> dict:
    """One request on a gpu-mon queue socket, as `gpu-mon submit` sends it (a 4-byte big-endian length and
    a JSON object; the answer alike, a long one in pages: `"continued": true` on each but the last, their
    lists joined), without importing gpu_mon (a baseline's or this checkout's)."""
    header = struct.Struct(">I")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        for _ in range(2000):  # (a full backlog in a flood of connections: EAGAIN; again, as a client does)
            try:
                s.connect(path)
                break
            except BlockingIOError:
                time.sleep(0.005)
        body = json.dumps(obj).encode()
        s.sendall(header.pack(len(body)) + body)
        buf = bytearray()
        answer: Dict[str, object] = {"continued": True}
        while answer.pop("continued", False) is True:
            while len(buf) < header.size or len(buf) < header.size + header.unpack_from(buf)[0]:
                data = s.recv(1 << 18)
                if not data:
                    raise ConnectionError(f"{path}: closed without an answer")
                buf += data
            size = header.size + header.unpack_from(buf)[0]
            page = json.loads(bytes(buf[header.size : size]))
            del buf[:size]
            for key, value in page.items():
                old = answer.get(key)
                answer[key] = old + value if isinstance(old, list) and isinstance(value, list) else value
        return answer


def extract_ref(repo: Path, ref: str, dest: Path) -> Path:
    """The files of `ref` (a git ref of `repo`) in dest, a new directory: a baseline to run side by side."""
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(repo), "archive", ref], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def no_storage_caps(code: Path) -> str:
    """The per-user storage caps off, in a version that has them (a load about memory or speed, not disk)."""
    schema = code / "gpu_mon" / "config" / "schema_features.py"
    known = schema.exists() and "max_stored_mib_per_user" in schema.read_text()
    return "max_kept_per_user = 0\nmax_stored_mib_per_user = 0\n" if known else ""


def side_by_side(
    prog: str,
    a: Any,
    prefix: str,
    say: str,
    measure: Callable[[Path, Path, Any], Sequence[object]],
    errors: Tuple[Type[BaseException], ...] = (RuntimeError,),
) -> Optional[List[list]]:
    """This checkout, then `a.baseline` (a git ref, extracted; '' for none), each measured by `measure(its
    directory, its code, a)` in a new work directory: a row each, the version's label first. None after one
    line on stderr when a measure raises one of `errors`. The directory is removed unless `a.keep`."""
    root = Path(__file__).resolve().parent.parent
    work = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(work, 0o755)
    versions = [("this checkout", root)]
    if a.baseline:
        versions.append((a.baseline, extract_ref(root, a.baseline, work / "baseline-code")))
    rows = []
    try:
        for i, (label, code) in enumerate(versions):
            print(f"{label}: {say}", flush=True)
            rows.append([label, *measure(work / f"run-{i}", code, a)])
    except errors as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return None
    finally:
        if a.keep:
            print(f"left in {work}")
        else:
            subprocess.run(["rm", "-rf", str(work)], check=False)
    return rows
