"""Issue 47 items 3-6 on the real daemon, as real users (a plain user, a lab user with Slurm habits, an
adversary): --after's Slurm kinds and a dependency that can never be met; `wait --any-end` and an array's
notice in numbers; [queue] default_time_limit and max_time_limit; `gpu-mon update`; `gpu-mon share`."""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import subprocess
from typing import Dict

import pytest
from conftest import GPU_MON, ROOT, wait_for
from test_queue import JOB, Lab, made_lab, queue_body

from gpu_mon.config import ConfigError, QueueSection, parse
from gpu_mon.queue import afterspec, placement
from gpu_mon.queue import jobs as J
from gpu_mon.queue.jobs import Job


@pytest.fixture
def ulab(sim):
    """Two users of this file's own (gmuann, gmuben)."""
    with made_lab("gmu", ("gmuann", "gmuben"), JOB) as lab:
        yield lab


def _started(lab: Lab, daemon_factory, extra: str = "") -> object:
    d = daemon_factory(queue_body(lab, extra), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    return d


def _stored(lab: Lab, job_id: int) -> dict:
    """The job's row as the database holds it."""
    with sqlite3.connect(lab.database) as conn:
        (data,) = conn.execute("SELECT data FROM jobs WHERE id = ?", (job_id,)).fetchone()
    return json.loads(data)


def _reason(lab: Lab, user, job_id: int) -> str:
    return wait_for(  # type: ignore[return-value]
        lambda: (r := lab.jobs(user)[job_id]["reason"]) != "waiting: just submitted" and r, 10, "a reason"
    )


# ------------------------------------------------------------------ --after, as Slurm writes it


def test_after_parses_slurms_kinds_the_same_for_the_cli_and_the_quick_path():
    assert afterspec.parse("afterok:1:2,afterany:3_4,17,afternotok:5") == [
        1,
        2,
        "afterany:3_4",
        17,
        "afternotok:5",
    ]
    for bad, said in (("after:1", "not a dependency kind"), ("afterok:x", "'x' is not a job id"), ("0", "0")):
        with pytest.raises(ValueError, match=said):
            afterspec.parse(bad)


def _job(**kw) -> Job:
    base = dict(id=1, user="u", uid=1, gid=1, command=("x",), cwd="/", env=(), output="", submitted=0.0)
    return Job(**{**base, **kw})


def test_placement_meets_each_kind_and_cancels_what_can_never_be_met():
    gpus = [placement.GpuView("GPU-a", False, free_since=0.0)]
    q = QueueSection()

    def plan(*jobs: Job) -> placement.Placement:
        return placement.place(list(jobs), gpus, q, 0, 100.0, 100.0)

    failed, done, held = _job(id=1, state="failed"), _job(id=2, state="done"), _job(id=3, state="held")
    p = plan(failed, done, held, _job(id=9, after_any=(1,)), _job(id=10, after_notok=(1,)))
    assert [s.job for s in p.starts] == [9] and p.waiting[10].kind == "taken"  # (one GPU: 9 took it)
    p = plan(failed, done, held, _job(id=9, after_notok=(2,)), _job(id=10, after_any=(3,)))
    assert p.cancels == (placement.CancelJob(9, 2, "done", "afternotok"),)
    assert p.waiting[10] == placement.Waiting("after", after="3", after_kind="afterany")
    # an array: afternotok waits for all its elements to end, and is never met when all are done
    cls = J.array_class({**J.values_of(_job(id=20)), "array_id": 20}, range(3))
    elements = [J.element(cls, 20 + i) for i in range(3)]
    ended = [dataclasses.replace(e, state="done") for e in elements]
    p = plan(*ended, _job(id=30, after_notok_arrays=(20,)), _job(id=31, after_any_arrays=(20,)))
    assert p.cancels == (placement.CancelJob(30, 20, "done", "afternotok", 20),)
    assert [s.job for s in p.starts] == [31]


def test_after_kinds_on_the_daemon_and_a_dependency_never_met_is_refused_at_submit(ulab, daemon_factory):
    lab = ulab
    ann, ben = lab.alice, lab.bob
    _started(lab, daemon_factory)
    bad = lab.submit(ann, "--hold", *lab.job_cmd("exit", "3"))
    good = lab.submit(ann, "--hold", *lab.job_cmd("exit", "0"))
    gone = lab.submit(ann, "--hold", *lab.job_cmd("exit", "0"))
    later = lab.submit(ben, "--after", f"afterany:{bad}", *lab.job_cmd("exit", "0"))
    assert _reason(lab, ben, later) == f"waiting: after job {bad} ends (afterany)"
    notok = lab.submit(ben, "--after", f"afternotok:{bad},afterok:{good}", *lab.job_cmd("exit", "0"))
    waits_gone = lab.submit(ben, "--after", str(gone), *lab.job_cmd("exit", "0"))
    assert lab.run(ann, "cancel", str(gone)).returncode == 0
    cancelled = lab.wait_state(ben, waits_gone, "cancelled")
    assert cancelled["reason"] == f"dependency never met: afterok:{gone} (job {gone} cancelled)"
    assert lab.run(ann, "release", str(bad), str(good)).returncode == 0
    lab.wait_state(ben, later, "done")  # (after a failure: afterany)
    lab.wait_state(ben, notok, "done")  # (afternotok of the failed one, afterok of the done one)
    # the adversary's: an afterok on a cancelled job (and others never met) is refused at submit, one line
    for after, why in (
        (str(gone), f"afterok:{gone} can never be met (job {gone} cancelled)"),
        (f"afterok:{bad}", f"afterok:{bad} can never be met (job {bad} failed)"),
        (f"afternotok:{good}", f"afternotok:{good} can never be met (job {good} done)"),
    ):
        r = lab.run(ben, "submit", "--after", after, *lab.job_cmd("exit", "0"))
        assert (r.returncode, r.stderr, r.stdout) == (1, f"gpu-mon: --after {why}\n", ""), after
    r = lab.run(ben, "submit", "--after", "after:1", *lab.job_cmd("exit", "0"))
    assert r.returncode == 2 and r.stderr.startswith("gpu-mon: --after: 'after' is not a dependency kind")
    assert len(lab.jobs(ben, "--me")) == 3  # nothing refused was queued


# ------------------------------------------------------------------ wait --any-end, an array's notice

NOTICE = 'env > "$HOME/work/notice-$GPU_MON_ARRAY_ID.env"'


def test_wait_any_end_and_an_arrays_notice_says_how_its_elements_ended(ulab, daemon_factory):
    lab = ulab
    ann = lab.alice
    _started(lab, daemon_factory)
    arr = lab.submit(ann, "--hold", "--array", "0-3", "--notify", NOTICE, *lab.job_cmd("exit", "0"))
    assert lab.run(ann, "cancel", f"{arr}_1", f"{arr}_2").returncode == 0  # on purpose
    assert lab.run(ann, "release", str(arr)).returncode == 0
    r = lab.run(ann, "wait", str(arr))
    assert r.returncode == 1  # cancelled elements: not all done
    assert f"job {arr}_[1-2] cancelled" in r.stderr
    r = lab.run(ann, "wait", "--any-end", str(arr))
    assert r.returncode == 0, r.stderr  # `wait --any-end 1 && python3 collect.py` runs the collect step
    path = ann.work / f"notice-{arr}.env"
    wait_for(path.exists, 20, "the array's one notice")
    env = dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    assert env["GPU_MON_ARRAY_SUMMARY"] == "2 done, 2 cancelled"
    assert env["GPU_MON_ARRAY_COUNTS"] == "cancelled=2 done=2" and env["GPU_MON_JOB_STATE"] == "cancelled"


# ------------------------------------------------------------------ time limits, update


def test_the_admins_time_limits_are_config_keys_checked_with_file_and_line(tmp_path):
    q = parse("[queue]\ndefault_time_limit = 2h\nmax_time_limit = 1d\n", "/etc/x.conf").queue
    assert (q.default_time_limit, q.max_time_limit, q.share_public) == (7200.0, 86400.0, True)
    with pytest.raises(ConfigError) as err:
        parse("[queue]\nmax_time_limit = soon\ndefault_time_limit = 2d\n", "/etc/x.conf")
    assert err.value.errors == [
        "/etc/x.conf:2: [queue] max_time_limit: 'soon' is not a duration (90, 90s, 30m, 2h, 1d)"
    ]
    with pytest.raises(ConfigError) as err:
        parse("[queue]\nmax_time_limit = 1d\ndefault_time_limit = 2d\n", "/etc/x.conf")
    assert err.value.errors == [
        "/etc/x.conf:3: [queue] default_time_limit: 172800 s is over max_time_limit (86400 s)"
    ]
    path = tmp_path / "gpu_mon.conf"
    path.write_text("[gpu-all]\ngpus = ALL\n[queue]\nmax_time_limit = -5m\n")
    path.chmod(0o600)
    r = subprocess.run([*GPU_MON, "--config", str(path), "check"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{path}:4: [queue] max_time_limit: '-5m' must be more than 0 and at most a year" in r.stderr


OVER = "gpu-mon: --time-limit 3h is over the queue's max_time_limit (2h)\n"


def test_update_changes_what_a_submit_would_check_and_refuses_the_adversary(ulab, daemon_factory):
    lab = ulab
    ann, ben = lab.alice, lab.bob
    _started(lab, daemon_factory, "default_time_limit = 1h\nmax_time_limit = 2h\nshare_public = no\n")
    job = lab.submit(ann, "--hold", "--priority", "5", *lab.job_cmd("forever"))
    assert _stored(lab, job)["time_limit"] == 3600  # the admin's default
    r = lab.run(ann, "submit", "--time-limit", "3h", *lab.job_cmd("exit", "0"))
    assert (r.returncode, r.stderr) == (1, OVER)

    def update(user, *args: str) -> subprocess.CompletedProcess:
        return lab.run(user, "update", *args)

    r = update(ann, "--priority", "10", str(job))  # a plain user raising its priority
    assert (r.returncode, r.stderr) == (
        1,
        f"gpu-mon: job {job}: only root may raise a job's priority (it has 5; --priority 10)\n",
    )
    r = update(ben, "--priority", "0", str(job))  # someone else's job
    assert (r.returncode, r.stderr) == (1, f"gpu-mon: job {job} is gmuann's, not yours\n")
    r = update(ann, "--time-limit", "3h", str(job))  # over the admin's maximum
    assert (r.returncode, r.stderr) == (1, OVER)
    r = update(ann, "--gpus", "9", str(job))  # could never fit, as submit refuses it
    assert r.returncode == 1 and "--gpus 9: the queue has 2 GPUs; the job could never start" in r.stderr
    r = update(ann, "--priority", "1", "--time-limit", "90m", "--name", "smaller", "--gpus", "2", str(job))
    assert (r.returncode, r.stdout) == (0, f"job {job}: updated (held)\n"), r.stderr
    row = _stored(lab, job)
    assert (row["priority"], row["time_limit"], row["name"], row["gpus_wanted"]) == (1, 5400, "smaller", 2)
    r = lab.run(lab.alice, "update", "--priority", "1", str(job))
    assert r.returncode == 0  # (nothing new: still fine)
    # root may raise it
    root = subprocess.run(
        [*GPU_MON, "--config", str(lab.client_conf), "update", "--priority", "50", str(job)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert root.returncode == 0, root.stderr
    assert _stored(lab, job)["priority"] == 50
    # --after: checked as submit checks it; no cycle
    first = lab.submit(ann, "--hold", *lab.job_cmd("exit", "0"))
    second = lab.submit(ann, "--hold", "--after", str(first), *lab.job_cmd("exit", "0"))
    r = update(ann, "--after", str(second), str(first))
    assert (r.returncode, r.stderr) == (
        1,
        f"gpu-mon: --after: job {first} would wait for itself (through job {second})\n",
    )
    assert update(ann, "--after", f"afterany:{first}", str(job)).returncode == 0
    assert _stored(lab, job)["after_any"] == [first] and _stored(lab, job)["after"] == []
    # a running job: only its name and time limit change; --gpus is refused, naming it
    assert update(ann, "--gpus", "1", "--after", "", str(job)).returncode == 0
    assert lab.run(ann, "release", str(job)).returncode == 0
    lab.wait_running(ann, job)
    r = update(ann, "--gpus", "2", str(job))
    assert (r.returncode, r.stderr) == (
        1,
        f"gpu-mon: job {job} is running: --gpus cannot change now (only --name and --time-limit can)\n",
    )
    assert update(ann, "--name", "renamed", str(job)).returncode == 0
    assert lab.jobs(ann)[job]["name"] == "renamed"
    r = update(ann, "--time-limit", "2h", str(job))  # up, while it runs: root's to do (as in Slurm)
    assert (r.returncode, r.stderr) == (
        1,
        f"gpu-mon: job {job} is running: only root may raise its time limit (it has 90m)\n",
    )
    assert update(ann, "--time-limit", "1", str(job)).returncode == 0  # (passed already: it ends now)
    lab.wait_state(ann, job, "timeout")
    r = update(ann, "--name", "late", str(job))
    assert (r.returncode, r.stderr) == (1, f"gpu-mon: job {job} has ended (timeout): nothing to update\n")
    # share_public = no: a plain user sees their own line; root everyone's
    lab.submit(ben, "--hold", *lab.job_cmd("exit", "0"))
    seen = json.loads(lab.run(ann, "share", "--json").stdout)
    assert seen["everyone"] is False and [u["user"] for u in seen["users"]] == ["gmuann"]
    root = _as_root(lab, "share", "--json")
    assert sorted(u["user"] for u in json.loads(root.stdout)["users"]) == ["gmuann", "gmuben"]


def test_update_of_an_array_whole_or_one_element_is_kept(ulab, daemon_factory):
    lab = ulab
    ann = lab.alice
    _started(lab, daemon_factory)
    arr = lab.submit(ann, "--hold", "--array", "0-3", "--name", "sweep", *lab.job_cmd("exit", "0"))
    assert lab.run(ann, "cancel", f"{arr}_3").returncode == 0
    r = lab.run(ann, "update", "--priority", "-4", str(arr))
    assert (r.returncode, r.stdout) == (0, f"job {arr}: updated (3 of 4 elements: held)\n"), r.stderr
    r = lab.run(ann, "update", "--name", "odd-one", f"{arr}_1")
    assert (r.returncode, r.stdout) == (0, f"job {arr}_1: updated (held)\n"), r.stderr
    jobs = {j["array_index"]: j for j in lab.jobs(ann).values()}
    assert [jobs[i]["priority"] for i in range(4)] == [-4, -4, -4, 0]
    assert [jobs[i]["name"] for i in range(4)] == ["sweep", "odd-one", "sweep", "sweep"]
    assert _stored(lab, arr + 1)["name"] == "odd-one"  # (an element's own name is written with it)
    assert "name" not in _stored(lab, arr + 2)  # (the others' is their array's, stored once)


# ------------------------------------------------------------------ share


def test_share_shows_usage_the_fair_order_and_jobs_to_everyone(ulab, daemon_factory):
    lab = ulab
    ann, ben = lab.alice, lab.bob
    _started(lab, daemon_factory)
    used = lab.submit(ann, *lab.job_cmd("exit", "0"))
    lab.wait_state(ann, used, "done")
    drain = _as_root(lab, "queue", "drain")
    assert drain.returncode == 0, drain.stderr
    lab.submit(ann, *lab.job_cmd("exit", "0"))
    lab.submit(ann, "--hold", *lab.job_cmd("exit", "0"))
    lab.submit(ben, *lab.job_cmd("exit", "0"))
    r = lab.run(ben, "share", "--json")
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    rows: Dict[str, dict] = {u["user"]: u for u in seen["users"]}
    assert (seen["order"], seen["window_hours"], seen["everyone"]) == ("fair", 24, True)
    # ben has used nothing: he is first in the fair order; ann, who has, second
    assert (rows["gmuben"]["place"], rows["gmuann"]["place"]) == (1, 2)
    assert rows["gmuann"]["gpu_seconds"] > 0 and rows["gmuben"]["gpu_seconds"] == 0
    assert (rows["gmuann"]["queued"], rows["gmuann"]["held"], rows["gmuann"]["running"]) == (1, 1, 0)
    table = lab.run(ann, "share").stdout.splitlines()
    assert table[0] == "fair order; GPU-hours over the last 24 h; place 1 gets the next free GPU"
    assert table[1].split() == ["PLACE", "USER", "GPU-HOURS", "RUNNING", "GPUS", "QUEUED", "HELD"]
    assert [line.split()[:2] for line in table[2:]] == [["1", "gmuben"], ["2", "gmuann"]]


def _as_root(lab, *argv: str) -> subprocess.CompletedProcess:
    """gpu-mon ARGV as root, with the lab's client config."""
    return subprocess.run(
        [*GPU_MON, "--config", str(lab.client_conf), *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
