"""One name for an array's element everywhere, and ranges of elements as Slurm's scancel takes them
(`26_[0-1]`, `1_[2,7]`, `1_[0-3,8]`): the real daemon on simulated GPUs with users made here (their own
names: other queue tests use theirs). Also what `logs` says of an element that never ran, and who a
cancel while running names."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Dict

import pytest
from conftest import wait_for
from test_queue import PY, made_lab, queue_body
from test_queue_door import raw

from gpu_mon.queue import arrays

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them: needs root")

# An element that reports its own name, as its environment gives it (GPU_MON_JOB_REF), then sleeps
JOB = r"""
import json, os, sys, time
env = os.environ
keys = ("GPU_MON_JOB_ID", "GPU_MON_JOB_REF", "GPU_MON_ARRAY_ID", "GPU_MON_ARRAY_INDEX")
with open(os.path.join(os.getcwd(), "env-" + env["GPU_MON_JOB_REF"] + ".json"), "w") as f:
    json.dump({k: env.get(k) for k in keys}, f)
time.sleep(float(sys.argv[1]))
"""


@pytest.fixture
def rlab(sim):
    with made_lab("gmr", ("gmrann", "gmrben"), JOB) as lab:
        yield lab


def _states(lab, user, array_id: int) -> Dict[int, str]:
    """index -> state of every element of the array."""
    r = lab.run(user, "jobs", "--json", "--all")
    assert r.returncode == 0, r.stderr
    jobs = json.loads(r.stdout)["jobs"]
    return {j["array_index"]: j["state"] for j in jobs if j["array_id"] == array_id}


def _report(d, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "gpu_mon", "--config", str(d.config_path), "report", "--since", "1h", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )


def _one_line(r: subprocess.CompletedProcess, code: int, says: str) -> None:
    assert r.returncode == code and r.stderr.count("\n") == 1, (r.returncode, r.stderr)
    assert r.stderr.startswith("gpu-mon: ") and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_ranges_name_elements_for_every_command_and_bad_ones_are_one_line(rlab, daemon_factory):
    lab = rlab
    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    ann, ben = lab.alice, lab.bob
    cmd = ["--", PY, str(lab.job), "0", lab.marker]
    arr = lab.submit(ann, "--hold", "--array", "0-9", *cmd)
    # `jobs` takes what it prints back; one element is named as itself
    r = lab.run(ann, "jobs", f"{arr}_1")
    assert r.returncode == 0 and r.stdout.splitlines()[1].startswith(f"{arr}_1 "), r.stdout
    assert "_[" not in r.stdout and "(1)" not in r.stdout, r.stdout
    r = lab.run(ann, "jobs", f"{arr}_[2,7]")
    assert r.returncode == 0 and f"{arr}_[2,7] (2)" in r.stdout, r.stdout
    listed = json.loads(lab.run(ann, "jobs", "--json", f"{arr}_[0-3,8]", f"{arr}_[3]").stdout)["jobs"]
    assert [j["array_index"] for j in listed] == [0, 1, 2, 3, 8]
    # show and update take them too
    shown = json.loads(lab.run(ann, "show", "--json", f"{arr}_[4,6]").stdout)["jobs"]
    assert [j["array_index"] for j in shown] == [4, 6]
    r = lab.run(ann, "update", "--name", "two", f"{arr}_[4,6]")
    assert r.returncode == 0, r.stderr
    named = json.loads(lab.run(ann, "jobs", "--json", f"{arr}_[3-6]").stdout)["jobs"]
    assert [j["name"] for j in named] == ["", "two", "", "two"]
    # release, hold, cancel: each element the range names, in one go; someone else's: refused
    r = lab.run(ben, "cancel", f"{arr}_[0-1]")
    assert (r.returncode, r.stderr) == (1, f"gpu-mon: job {arr}_[0-1] is gmrann's, not yours\n")
    r = lab.run(ann, "release", f"{arr}_[0-1]")
    assert (r.returncode, r.stdout) == (0, f"job {arr}_[0-1]: queued (2 of 2 elements)\n"), r.stderr
    r = lab.run(ann, "wait", f"{arr}_[0-1]")
    assert r.returncode == 0 and f"job {arr}_[0-1] done" in r.stderr, r.stderr
    r = lab.run(ann, "cancel", f"{arr}_[2,7]", f"{arr}_[3-5,9]")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (
        f"job {arr}_[2,7]: cancelled (2 of 2 elements)\njob {arr}_[3-5,9]: cancelled (4 of 4 elements)\n"
    )
    states = _states(lab, ann, arr)
    cancelled = dict.fromkeys((2, 3, 4, 5, 7, 9), "cancelled")
    assert states == {0: "done", 1: "done", 6: "held", 8: "held", **cancelled}
    # an element that never ran has no output: `logs` says so, not "no output yet"
    _one_line(lab.run(ann, "logs", f"{arr}_2"), 1, f"job {arr}_2 never ran (cancelled by gmrann)")
    _one_line(lab.run(ann, "logs", f"{arr}_[2]"), 1, f"job {arr}_[2] never ran")
    _one_line(
        lab.run(ann, "logs", f"{arr}_[6,8]"), 2, f"job {arr}_[6,8] names 2 elements: name one ({arr}_6, ...)"
    )
    # a range that names no job, or only ended ones: one line, exit 1 (as a job id that names none)
    _one_line(lab.run(ann, "cancel", f"{arr}_[50-60]"), 1, f"job {arr}_[50-60]: no such job")
    _one_line(lab.run(ann, "cancel", f"{arr + 100}_[0-1]"), 1, "no such job")
    _one_line(lab.run(ann, "hold", f"{arr}_[2-3]"), 1, f"array {arr}_[2-3]: nothing to change")
    # malformed or enormous: one line, exit 2, from the client or (too many for [queue]) the daemon
    for bad, says in (
        (f"{arr}_[3-1]", "range 3-1 ends before it starts"),
        (f"{arr}_[", "a range ends with ]"),
        (f"{arr}_[]", "no indices given"),
        (f"{arr}_[1%2]", "a range takes indices only"),
        (f"{arr}_[0-999999999]", "index 999999999 is over the largest allowed, 9999"),
        (f"{arr}_[0-9999,0-9999]", "more than 10000 elements"),
    ):
        for op in ("cancel", "jobs", "wait"):
            _one_line(lab.run(ann, op, bad), 2, says)
    assert _states(lab, ann, arr) == states  # nothing changed by them


def test_an_enormous_range_costs_the_daemon_nothing(rlab, daemon_factory):
    """Straight to the socket, past the client's checks: each refused in one line, at once, and the
    daemon's memory does not grow with what they name."""
    lab = rlab
    d = daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    ann = lab.alice
    arr = lab.submit(ann, "--hold", "--array", "0-3", "--", PY, str(lab.job), "0", lab.marker)
    status = Path(f"/proc/{d.proc.pid}/status")
    rss = lambda: int(status.read_text().split("VmRSS:")[1].split()[0])  # noqa: E731
    before = rss()
    huge = ",".join("0-9999" for _ in range(arrays.MAX_SPEC // 8))  # (each item alone allowed)
    t = time.monotonic()
    answers = raw(
        lab,
        ann,
        {"op": "cancel", "ids": [f"{arr}_[0-999999999]"]},
        {"op": "cancel", "ids": [f"{arr}_[{huge}]"]},
        {"op": "jobs", "ids": [f"{arr}_[0-99999999]"]},
        {"op": "jobs", "ids": [f"{arr}_[0-1]"] * 101},
        {"op": "hold", "ids": [f"{arr}_[0-1]" for _ in range(101)]},
    )
    assert time.monotonic() - t < 10
    first = answers[0]["results"][0]
    assert first["ok"] is False and first["code"] == 2 and "over the largest allowed" in first["error"]
    second = answers[1]["results"][0]
    assert second["ok"] is False and "more than 10000 elements" in second["error"]
    assert answers[2]["ok"] is False and answers[2]["code"] == 2
    assert answers[3]["ok"] is False and "at most 100 ranges" in answers[3]["error"]
    assert answers[4]["ok"] is False and "at most 100 ranges" in answers[4]["error"]
    assert rss() - before < 20 * 1024  # KiB
    assert set(_states(lab, ann, arr).values()) == {"held"}


def test_an_element_is_named_as_jobs_names_it_in_its_environment_and_in_report(rlab, daemon_factory):
    lab = rlab
    d = daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    ann = lab.alice
    single = lab.submit(ann, "--", PY, str(lab.job), "0", lab.marker)
    arr = lab.submit(ann, "--array", "3,5", "--", PY, str(lab.job), "0", lab.marker)
    assert lab.run(ann, "wait", str(single), str(arr)).returncode == 0
    env = json.loads((ann.work / f"env-{arr}_5.json").read_text())
    assert env["GPU_MON_JOB_REF"] == f"{arr}_5" and env["GPU_MON_ARRAY_INDEX"] == "5"
    assert env["GPU_MON_JOB_ID"] == str(arr + 1)  # (its own number, as before: unique on the machine)
    assert json.loads((ann.work / f"env-{single}.json").read_text())["GPU_MON_JOB_REF"] == str(single)

    def recorded() -> list:
        r = _report(d, "--json")  # (no history yet until its writer's first flush)
        rows = json.loads(r.stdout).get("jobs", []) if r.returncode == 0 else []
        return rows if len(rows) == 3 and all(r["last"] == "done" for r in rows) else []

    rows = wait_for(recorded, 30, "the history to have the three runs")
    assert [r["job"] for r in rows] == [single, f"{arr}_3", f"{arr}_5"]
    text = _report(d, "--by", "job").stdout
    names = [line.split()[0] for line in text.splitlines() if line[:1].isdigit() and " report" not in line]
    assert names == [str(single), f"{arr}_3", f"{arr}_5"], text


def test_a_job_cancelled_while_it_runs_says_by_whom(rlab, daemon_factory):
    lab = rlab
    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    ann = lab.alice
    arr = lab.submit(ann, "--array", "0-1", "--", PY, str(lab.job), "600", lab.marker)
    wait_for(lambda: set(_states(lab, ann, arr).values()) == {"running"}, 30, "both elements running")
    r = subprocess.run(
        [PY, "-m", "gpu_mon", "--config", str(lab.client_conf), "cancel", f"{arr}_[1]"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(lab.code)},
    )
    assert r.returncode == 0, r.stderr
    wait_for(lambda: _states(lab, ann, arr)[1] == "cancelled", 30, "element 1 cancelled")
    jobs = json.loads(lab.run(ann, "jobs", "--json", f"{arr}_1").stdout)["jobs"]
    assert jobs[0]["reason"] == "cancelled by root while running"
    assert lab.run(ann, "cancel", str(arr)).returncode == 0
