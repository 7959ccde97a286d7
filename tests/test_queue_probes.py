"""Brief opens of a running job's GPU (issue 46, item 2): a plain user's process that opens the job's GPU
node and lets go within [queue] brief_open_seconds leaves another user's job running; one that still holds
it then gets the job its stop signal, and who it was is named in the daemon's log, the job's own log,
`jobs` and `report --by job`, each time. A [process-*] workload still yields to a brief open at once. A
real daemon, real users, simulated GPUs. Bounds, not timings (bench/probes.py measures them)."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
from conftest import GPU_MON, foreign_open, wait_for, workload_cmd
from test_open_flood import FLOOD  # (as fast as Python goes; says how many opens when stopped)
from test_queue import JOB, PY, Lab, User, made_lab, queue_body

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them: needs root")

# Opens the node when told (a line on stdin) and says when (wall clock), closes it at the next line
PROBE = r"""
import os, sys, time
while sys.stdin.readline():
    fd = os.open(sys.argv[1], os.O_RDONLY)
    print(time.time(), flush=True)
    sys.stdin.readline()
    os.close(fd)
    print("closed", flush=True)
"""
# Opens the node for 50 ms (a monitor's or a script's look), then exits
BRIEF = r"""
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
print(time.time(), flush=True)
time.sleep(0.05)
"""
FLOOD_SECONDS = 3.0  # how long the flood runs: the load, not a wait for a result
# Opens the node and keeps it (a newcomer's CUDA program), saying when (wall clock)
HOLD = r"""
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
print(time.time(), flush=True)
time.sleep(600)
"""


@pytest.fixture
def lab(sim) -> Iterator[Lab]:
    with made_lab("gmqprb", ("gmqpann", "gmqpbob"), JOB) as made:
        yield made


def public_nodes(lab: Lab, sim) -> list:
    """The simulated GPUs' nodes where a plain user may open them (0666, as /dev/nvidiaN are)."""
    nodes = []
    for i in range(2):
        node = lab.dir / f"nvidia{i}"
        node.touch(mode=0o666)
        os.chmod(node, 0o666)
        sim.set(i, device=str(node))
        nodes.append(node)
    return nodes


def as_user(user: User, code: str, node: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [PY, "-c", code, str(node)],
        user=user.uid,
        group=user.gid,
        extra_groups=[],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def log_time(line: str) -> float:
    """The wall time of a line of the daemon's log (`2026-11-28 15:45:50.915 gpu-mon[1] INFO ...`)."""
    stamp = " ".join(line.split()[:2])
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f").timestamp()


def test_brief_probes_leave_a_job_running_and_a_workload_still_yields_to_one_at_once(
    lab, sim, daemon_factory, tmp_path
):
    node0, node1 = public_nodes(lab, sim)
    # (brief_open_seconds 1: each probe holds the node until the daemon's log says it saw it, which takes
    # milliseconds, not the 0.3 s of the default, on a machine that others load too)
    body = queue_body(lab, "brief_open_seconds = 1\n", gpus="0")
    body += f"[process-miner]\ncmd = {workload_cmd(tmp_path)}\ngpus = 1\nuser = root\n"
    d = daemon_factory(body, defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    a = lab.submit(lab.alice, *lab.job_cmd("run"))
    lab.wait_running(lab.alice, a)
    d.wait_running("miner")
    probe = as_user(lab.bob, PROBE, node0)
    try:
        who = rf"gmqpbob python3\[{probe.pid}\]"
        for i in range(4):
            probe.stdin.write("open\n")
            probe.stdin.flush()
            opened = float(probe.stdout.readline())
            d.wait_log(rf"GPU 0 \(.*\) busy: {who} holds {re.escape(str(node0))}$", count=i + 1)
            probe.stdin.write("close\n")
            probe.stdin.flush()
            assert probe.stdout.readline() == "closed\n"
            held = datetime.datetime.now().timestamp() - opened
            assert held < 1.0, f"probe {i + 1} held the node {held:.2f} s: not brief on this machine"
            # the daemon looked again, found it gone, and said so naming who
            d.wait_log(rf"queue: job {a} runs on: {who} let go of GPU 0 \(.*\) within 1 s$", count=i + 1)
    finally:
        probe.kill()
        probe.wait()
    job = lab.jobs(lab.alice)[a]
    assert (job["state"], job["restarts"], job["preempted"]) == ("running", 0, None)
    assert [e["event"] for e in lab.reports(lab.alice, a)] == ["start"]  # no stop signal, ever
    assert "stopping job" not in d.log()

    # the admin's workload on GPU 1 still yields to one 50 ms open, on its first look
    brief = as_user(lab.bob, BRIEF, node1)
    opened = float(brief.stdout.readline())
    brief.wait(10)
    by = rf"busy: gmqpbob python3\[{brief.pid}\] holds {re.escape(str(node1))}"
    (line,) = d.wait_log(rf"{by}; stopping miner")
    assert log_time(line) - opened < 0.5  # (about 5 ms; a job's GPU waits brief_open_seconds: 1 s here)


def test_a_holder_gets_the_job_stopped_and_each_preemption_names_who_in_jobs_the_jobs_log_and_report(
    lab, sim, daemon_factory
):
    node0, _node1 = public_nodes(lab, sim)
    d = daemon_factory(queue_body(lab, gpus="0"), defaults={"start_delay_seconds": 0.3})  # (0.3 s: default)
    wait_for(lab.socket.exists, 20, "the queue's socket")
    a = lab.submit(lab.alice, *lab.job_cmd("run"))
    lab.wait_running(lab.alice, a)
    gpu0 = f"GPU 0 ({sim.uuid(0)})"
    holder = as_user(lab.bob, HOLD, node0)
    try:
        opened = float(holder.stdout.readline())
        first = f"{gpu0} busy: gmqpbob python3[{holder.pid}] holds {node0}"
        d.wait_log(rf"queue: {re.escape(first)}; stopping job {a}$")
        signalled = wait_for(
            lambda: [e for e in lab.reports(lab.alice, a) if e["event"] == "signal"], 10, "the stop signal"
        )
        took = signalled[0]["t"] - opened
        # its opener still held the node 0.3 s after it was first seen: then at once (bench/probes.py)
        assert 0.25 < took < 2.0, f"open -> the job's stop signal: {took:.3f} s"
        assert signalled[0]["sig"] == signal.SIGTERM
        job = lab.wait_state(lab.alice, a, "queued")
        assert job["restarts"] == 1 and job["preempted_reason"] == first
        table = lab.run(lab.alice, "jobs").stdout
        assert f"last preempted at {job['preempted'][11:19]}: {first}" in table
    finally:
        holder.kill()
        holder.wait()
    output = lab.alice.home / ".local/state/gpu-mon/jobs" / f"{a}.log"
    lines = output.read_text().splitlines()
    said = rf"gpu-mon: job {a} preempted at [\d:]+: {re.escape(first)}; requeued \(restart 1\)"
    assert re.fullmatch(said, lines[-1])

    # again, by someone else: each preemption is named
    wait_for(lambda: len(lab.reports(lab.alice, a)) == 3, 30, "the job's second run")  # start, signal, start
    with foreign_open(str(node0)) as opener:
        second = f"{gpu0} busy: root python3[{opener.pid}] holds {node0}"
        d.wait_log(rf"queue: {re.escape(second)}; stopping job {a}$")
        job = lab.wait_state(lab.alice, a, "queued")
        assert job["restarts"] == 2 and job["preempted_reason"] == second
        assert f": {second}" in lab.run(lab.alice, "jobs").stdout
    wait_for(lambda: len(lab.reports(lab.alice, a)) == 5, 30, "the job's third run")
    told = [x for x in output.read_text().splitlines() if " preempted at " in x]
    assert [re.sub(rf"^gpu-mon: job {a} preempted at [\d:]+: ", "", x) for x in told] == [
        f"{first}; requeued (restart 1)",
        f"{second}; requeued (restart 2)",
    ]
    assert d.stop() == 0  # (the history is written in batches: all of it once stopped)
    report = [*GPU_MON, "--config", str(d.config_path), "report", "--since", "1h"]
    doc = json.loads(subprocess.run([*report, "--json"], capture_output=True, text=True, check=True).stdout)
    (row,) = [j for j in doc["jobs"] if j["job"] == a]
    assert row["preemptions"] == 2 and row["preempted_by"] == [first, second]
    text = subprocess.run([*report, "--by", "job"], capture_output=True, text=True, check=True).stdout
    (line,) = [x for x in text.splitlines() if x.startswith(f"{a} ")]
    assert line.endswith(f"  {first}; {second}")


def test_an_open_close_loop_on_a_jobs_gpu_stops_it_once_and_is_looked_at_about_once_a_second(
    lab, sim, daemon_factory
):
    node0, _node1 = public_nodes(lab, sim)
    d = daemon_factory(queue_body(lab, gpus="0"), defaults={"start_delay_seconds": 0.3})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    a = lab.submit(lab.alice, *lab.job_cmd("run"))
    lab.wait_running(lab.alice, a)
    before = len(d.log().splitlines())
    flood = as_user(lab.bob, FLOOD, node0)
    try:
        assert flood.stdout.readline() == "flooding\n"
        # opens that go on past brief_open_seconds are use: the job yields to them, once
        d.wait_log(rf"queue: GPU 0 \(.*\) busy: .*gmqpbob python3\[{flood.pid}\].*; stopping job {a}$")
        began = time.monotonic()
        time.sleep(FLOOD_SECONDS)  # (the load goes on: the daemon must not look at each of its opens)
    finally:
        flood.send_signal(signal.SIGTERM)
        opens = int(flood.communicate(timeout=20)[0].strip() or 0)
    assert opens > 10_000, opens
    assert time.monotonic() - began >= FLOOD_SECONDS
    said = [line for line in d.log().splitlines()[before:] if "GPU 0 (" in line]
    # (a line, a stop, its end; looked at about once a second: hundreds a second before the node was let go)
    assert len(said) <= 8, said
    assert [e["event"] for e in lab.reports(lab.alice, a)][:2] == ["start", "signal"]
    assert len([x for x in d.log().splitlines() if f"; stopping job {a}" in x]) == 1
