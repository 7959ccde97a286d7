"""What one user's queue clients can make the root daemon hold in memory is bounded (issue 36, item 2): a
long `jobs` answer goes in pages made as the client reads them, one user's connections, unread answers
and half-sent requests have limits (one line refuses the rest), and another user is answered meanwhile.

The hostile user's jobs each have a 64 KiB argument that JSON escapes byte by byte to six (\\u0001), and
the listings name them (a listing that names its jobs gives their commands whole; others cut them, and
give an array's once): a listing of a few hundred is hundreds of MB. The daemon's memory is the kernel's
word: VmHWM (its peak RSS) in /proc/PID/status.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Dict, Iterator, List

import pytest
from conftest import wait_for
from test_queue import JOB, PY, Lab, made_lab, queue_body

ARG = "\x01" * 65000  # the command's limit is 64 KiB; in JSON each byte is \u0001
PEAK_MB = 400  # the daemon's peak RSS in these tests, at most (7c4bf7b: over 1 GB in the first)

# The hostile clients, run as the hostile user for argv[2] seconds: argv[3] that send a 1 MiB frame but
# its last byte, argv[4] that ask for `jobs` of the ids in argv[5], read 16 bytes and stop reading; each
# reopened when the daemon closes it. Prints {error line: count} of the one-line refusals it was sent.
CLIENTS = r"""
import json, select, socket, struct, sys, time
path, seconds, half, stalled = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
body = json.dumps({"op": "jobs", "all": True, "ids": json.loads(sys.argv[5])}).encode()
ASK = struct.pack(">I", len(body)) + body
refusals, conns = {}, {}
poller = select.poll()
def note(data):
    if len(data) > 4 and b'"ok": false' in data[4:].replace(b'"ok":false', b'"ok": false'):
        try:
            line = json.loads(data[4:4 + struct.unpack(">I", data[:4])[0]])["error"]
        except ValueError:
            line = "?"
        refusals[line] = refusals.get(line, 0) + 1
def add(kind):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(path)
        if kind == "half":
            s.sendall(struct.pack(">I", 1 << 20) + b"x" * ((1 << 20) - 1))
        else:
            s.sendall(ASK)
            got = b""
            while len(got) < 16:
                chunk = s.recv(16 - len(got))
                if not chunk:
                    break
                got += chunk
            if len(got) < 16 or b'"ok":false' in got:
                got += s.recv(4096)
                note(got)
                s.close()
                return
    except OSError:
        s.close()
        return
    s.setblocking(False)
    conns[s.fileno()] = (s, kind)
    poller.register(s, select.POLLIN if kind == "half" else 0x2000)  # (POLLRDHUP: closed, read nothing)
kinds = ["half"] * half + ["stalled"] * stalled
end = time.monotonic() + seconds
while time.monotonic() < end:
    for kind in kinds:
        if sum(1 for c in conns.values() if c[1] == kind) < kinds.count(kind):
            add(kind)
    for fd, ev in poller.poll(20):
        s, kind = conns[fd]
        if ev & select.POLLIN:
            try:
                data = s.recv(65536)
            except OSError:
                data = b""
            note(data)
            if data:
                continue
        poller.unregister(fd)
        conns.pop(fd)
        s.close()
print(json.dumps(refusals), flush=True)
"""

# argv: socket, count: that many held jobs of ARG submitted (as `gpu-mon submit` sends them); their ids
SUBMIT = r"""
import json, sys
from gpu_mon.queue.protocol import request
path, count = sys.argv[1], int(sys.argv[2])
req = {"op": "submit", "command": ["true", "\x01" * 65000], "cwd": "/", "env": {"PATH": "/bin"},
       "hold": True, "checked_as_user": True}
print(json.dumps([request(path, req)["id"] for _ in range(count)]))
"""


@pytest.fixture
def lab() -> Iterator[Lab]:
    with made_lab("gmm", ("gmmalice", "gmmbob"), JOB) as made:
        yield made


def _daemon_pid(d) -> int:
    assert d.proc is not None
    return d.proc.pid


def _status_mb(pid: int, key: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {key} in /proc/{pid}/status")


def _big_jobs(lab: Lab, count: int) -> List[int]:
    """alice's `count` held jobs, each with the 64 KiB argument: their ids."""
    u = lab.alice
    r = subprocess.run(
        [PY, "-c", SUBMIT, str(lab.socket), str(count)],
        capture_output=True,
        text=True,
        user=u.uid,
        group=u.gid,
        extra_groups=[],
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(lab.code)},
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _clients(lab: Lab, seconds: float, half: int, stalled: int, ids: List[int]) -> subprocess.Popen:
    script = lab.dir / "clients.py"
    script.write_text(CLIENTS)
    os.chmod(script, 0o644)
    u = lab.alice
    return subprocess.Popen(
        [
            PY,
            "-I",
            str(script),
            str(lab.socket),
            str(seconds),
            str(half),
            str(stalled),
            json.dumps(ids),
            lab.marker,
        ],
        stdout=subprocess.PIPE,
        text=True,
        user=u.uid,
        group=u.gid,
        extra_groups=[],
        cwd="/",
    )


def test_one_users_stalled_and_half_sent_clients_keep_the_daemon_small_and_another_user_answered(
    lab, daemon_factory
):
    d = daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    pid = _daemon_pid(d)
    ids = _big_jobs(lab, 150)  # a listing of ~59 MB: 7c4bf7b made it whole for each client (over 1 GB)
    clients = _clients(lab, 10, half=20, stalled=24, ids=ids)
    try:
        # another user meanwhile: each command answered (a generous deadline: not a timing target)
        answered: Dict[str, int] = {}
        start = time.monotonic()
        while time.monotonic() - start < 8:
            r = lab.run(lab.bob, "submit", "--hold", "--json", "--", "true", "bob", timeout=60)
            assert r.returncode == 0, r.stderr
            r = lab.run(lab.bob, "jobs", "--me", timeout=60)
            assert r.returncode == 0 and "gmmbob" in r.stdout, r.stderr
            answered["bob"] = answered.get("bob", 0) + 1
        out, _ = clients.communicate(timeout=60)
    finally:
        if clients.poll() is None:
            clients.kill()
            clients.wait()
    peak = _status_mb(pid, "VmHWM")
    assert peak < PEAK_MB, f"the daemon's peak RSS was {peak:.0f} MB"
    refusals = json.loads(out)
    # one line told alice why: her connections at once, and her half-sent requests, are bounded
    assert refusals.get("too many connections from you at once (at most 32)", 0) > 0, refusals
    assert refusals.get("too many unfinished requests from you at once (at most 16 MiB in all)", 0) > 0, (
        refusals
    )
    assert answered["bob"] >= 2
    assert d.proc is not None and d.proc.poll() is None


def test_jobs_json_lists_any_number_of_big_jobs_and_the_daemon_stays_small(lab, daemon_factory):
    uncapped = "max_kept_per_user = 0\nmax_stored_mib_per_user = 0\n"  # (273 MB stored: a test of memory)
    d = daemon_factory(queue_body(lab, uncapped), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    pid = _daemon_pid(d)
    ids = _big_jobs(lab, 700)  # ~275 MB of JSON: more than one message could ever hold (7c4bf7b: too large)
    out = lab.dir / "jobs.json"
    with open(out, "wb") as f:
        r = subprocess.run(
            [PY, "-m", "gpu_mon", "--config", str(lab.client_conf), "jobs", "--json", *map(str, ids)],
            stdout=f,
            stderr=subprocess.PIPE,
            text=False,
            user=lab.bob.uid,
            group=lab.bob.gid,
            extra_groups=[],
            cwd=str(lab.bob.work),
            env={"PATH": "/usr/bin:/bin", "HOME": str(lab.bob.home), "PYTHONPATH": str(lab.code)},
            timeout=300,
        )
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    with open(out) as f:
        jobs = json.load(f)["jobs"]
    out.unlink()
    assert [j["id"] for j in jobs] == ids
    assert all(j["command"] == ["true", ARG] and j["command_cut"] is False for j in jobs)
    peak = _status_mb(pid, "VmHWM")
    assert peak < PEAK_MB, f"the daemon's peak RSS was {peak:.0f} MB"
