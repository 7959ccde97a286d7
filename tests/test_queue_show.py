"""`gpu-mon show`: a real daemon on simulated GPUs whose energy counters and power move in sim.json while a
job runs; each run is recorded in the queue's database (runs table, schema 3) as it starts and ends, so a
restart of the daemon in the middle of a run loses none of its energy."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3

import pytest
from conftest import wait_for
from test_queue import JOB, made_lab, queue_body
from test_queue_outputs import by, report, report_json

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them: needs root")


@pytest.fixture
def lab(sim):
    with made_lab("gms", ("gmsalice", "gmsbob"), JOB) as made:
        yield made


def show(lab, user, job_id, *args):
    r = lab.run(user, "show", "--json", str(job_id), *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["jobs"]


def test_show_gives_every_run_its_energy_and_processes_across_a_restart(lab, daemon_factory, sim):
    # GPU 0 has NVML's energy counter; GPU 1 only its power draw (integrated over the rounds)
    sim.set(0, energy_mj=1_000_000, power_mw=200_000)
    sim.set(1, power_mw=100_000)
    d = daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    job_id = lab.submit(lab.alice, "--gpus", "2", "--name", "train", *lab.job_cmd("forever"))
    pid = lab.wait_running(lab.alice, job_id)[0]["pid"]
    sim.set(0, energy_mj=1_500_000, processes=[{"pid": pid, "used_memory_mib": 1024, "utilization_pct": 35}])

    def running_so_far():
        (j,) = show(lab, lab.bob, job_id)  # (anyone's job; not its environment)
        sampled = j["processes"] and j["processes"][0]["utilization_pct"] is not None  # (every few polls)
        ok = sampled and j["runs"] and j["runs"][0]["energy"][sim.gpus[0]["uuid"]]["used_mj"] == 500_000
        return ok and j

    j = wait_for(running_so_far, 30, "the job's processes and its energy so far")
    assert j["processes"] == [
        {
            "gpu": sim.gpus[0]["uuid"],
            "gpu_index": 0,
            "pid": pid,
            "name": "python3",
            "user": "gmsalice",
            "used_memory_mib": 1024,
            "utilization_pct": 35,
        }
    ]
    assert j["submitted_as"]["env"] is None and j["submitted_as"]["gpus_wanted"] == 2
    assert j["state"] == "running" and j["runs"][0]["how"] == "running" and j["runs"][0]["end"] is None
    mine = show(lab, lab.alice, job_id)[0]["submitted_as"]
    assert ["GMQ_MARK", lab.marker] in mine["env"]

    assert d.stop() == 0  # the run ends (back in the queue) at the counter it had then
    sim.set(0, energy_mj=1_700_000, processes=[])  # (used between the runs: nobody's)
    d.start()
    wait_for(lab.socket.exists, 20, "the queue's socket again")
    lab.wait_state(lab.alice, job_id, "running")
    wait_for(lambda: len(show(lab, lab.alice, job_id)[0]["runs"]) == 2, 20, "the second run's record")
    sim.set(0, energy_mj=2_000_000)
    u0, u1 = sim.gpus[0]["uuid"], sim.gpus[1]["uuid"]
    wait_for(
        lambda: show(lab, lab.alice, job_id)[0]["runs"][1]["energy"][u0]["used_mj"] == 300_000,
        20,
        "the second run's energy so far",
    )
    r = lab.run(lab.alice, "cancel", str(job_id))
    assert r.returncode == 0, r.stderr
    lab.wait_state(lab.alice, job_id, "cancelled")
    (j,) = show(lab, lab.alice, job_id)
    first, second = j["runs"]
    assert (first["how"], second["how"]) == ("requeued", "cancelled")
    assert (first["restart"], second["restart"]) == (0, 1)
    assert first["energy"][u0]["start_mj"] == 1_000_000 and first["energy"][u0]["end_mj"] == 1_500_000
    assert (second["energy"][u0]["start_mj"], second["energy"][u0]["end_mj"]) == (1_700_000, 2_000_000)
    # GPU 1: no counter; 100 W sampled over the run (a look every second or two)
    assert first["energy"][u1]["start_mj"] is None and first["energy"][u1]["sampled_mj"] > 0
    assert first["energy_mj"] == 500_000 + first["energy"][u1]["sampled_mj"]
    assert j["energy_mj"] == pytest.approx(first["energy_mj"] + second["energy_mj"], abs=0.2)
    assert j["run_seconds_total"] >= (first["end"] - first["start"]) + (second["end"] - second["start"]) - 0.2
    assert j["gpu_seconds_total"] == pytest.approx(2 * j["run_seconds_total"], abs=0.5)
    assert j["processes"] == [] and j["state"] == "cancelled"
    # the records are the database's (and written once a start, once an end)
    with contextlib.closing(sqlite3.connect(lab.database)) as db:
        rows = db.execute("SELECT job, how FROM runs ORDER BY start").fetchall()
    assert rows == [(job_id, "requeued"), (job_id, "cancelled")]
    text = lab.run(lab.alice, "show", str(job_id))
    assert text.returncode == 0, text.stderr
    assert f"Job {job_id} train of gmsalice: cancelled" in text.stdout
    kwh = f"{j['energy_mj'] / 3.6e9:.3g} kWh"
    assert f"Energy: {kwh}" in text.stdout and "requeued" in text.stdout

    # the history has each run's energy: report --by job and --by user in kWh
    def reported() -> dict:
        doc = report_json(d)
        row = by(doc["jobs"], "job").get(job_id, {})
        return doc if row.get("runs") == 2 and row.get("last") == "cancelled" else {}

    doc = wait_for(reported, 30, "the history to have both runs")
    total_kwh = j["energy_mj"] / 3.6e9
    assert by(doc["jobs"], "job")[job_id]["energy_kwh"] == pytest.approx(total_kwh, abs=1e-6)
    assert by(doc["users"], "user")["gmsalice"]["job_energy_kwh"] == pytest.approx(total_kwh, abs=1e-6)
    lines = report(d, "--by", "user").stdout.splitlines()
    assert lines[2].split()[-1] == "kWh"
    assert next(x for x in lines if x.startswith("gmsalice")).split()[-1] == f"{round(total_kwh, 6):.3g}"


def test_show_of_a_job_that_is_not_there_is_one_line(lab, daemon_factory):
    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    r = lab.run(lab.alice, "show", "99")
    assert (r.returncode, r.stderr.strip()) == (1, "gpu-mon: job 99: no such job")
