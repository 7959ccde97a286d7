"""What one user's arrays and readers cost the others (issue 46, item 4): five 1000-element arrays of a 60 KB
argument, cancelled, made every user's `jobs --all --json` 296 MB (3.5-7.7 s), and three looping readers
held the daemon at 92 % of a core. A listing holds an array's command once (elements carry what differs;
a long command is cut unless the jobs are named).

Real daemon, users made here.
"""

from __future__ import annotations

import json
import os
from typing import Iterator, List

import pytest
from conftest import wait_for
from test_queue import JOB, Lab, made_lab, queue_body

from gpu_mon.queue.listing import LIST_COMMAND

pytestmark_root = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them")

ARG = "\x01" * 60000  # the 60 KB argument, each byte six in JSON (\u0001)
ARRAYS, ELEMENTS = 5, 200  # the 5 x 1000, scaled down: per-element copies would be 360 MB


@pytest.fixture
def lab(sim) -> Iterator[Lab]:
    with made_lab("gmr", ("gmralice", "gmrbob"), JOB) as made:
        yield made


def _arrays(lab: Lab) -> List[int]:
    """alice's ARRAYS arrays of ELEMENTS held elements with ARG, cancelled: their ids."""
    ids = []
    for _ in range(ARRAYS):
        r = lab.run(
            lab.alice, "submit", "--json", "--hold", "--array", f"0-{ELEMENTS - 1}", "--", "true", ARG
        )
        assert r.returncode == 0, r.stderr
        ids.append(json.loads(r.stdout)["id"])
    r = lab.run(lab.alice, "cancel", "--all")
    assert r.returncode == 0, r.stderr
    return ids


@pytestmark_root
def test_cancelled_arrays_of_a_long_argument_list_small_with_each_elements_id_and_state(lab, daemon_factory):
    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    ids = _arrays(lab)
    r = lab.run(lab.bob, "jobs", "--all", "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout) < 1_000_000, len(r.stdout)  # (71478dc: every element with the 360 KB argument)
    doc = json.loads(r.stdout)
    listed = [(j["array_id"], j["array_index"], j["state"]) for j in doc["jobs"]]
    assert listed == [(a, i, "cancelled") for a in ids for i in range(ELEMENTS)]
    assert len({j["id"] for j in doc["jobs"]}) == ARRAYS * ELEMENTS
    assert all("command" not in j and j["exit_status"] is None for j in doc["jobs"])
    assert sorted(doc["arrays"]) == sorted(map(str, ids))
    for shared in doc["arrays"].values():
        assert shared["command_cut"] is True and shared["command"][0] == "true"
        assert len(json.dumps(shared["command"], separators=(",", ":"))) <= LIST_COMMAND
    # named, it is whole (in its array's entry, once)
    r = lab.run(lab.bob, "jobs", "--json", f"{ids[1]}_7", timeout=60)
    one = json.loads(r.stdout)
    assert [j["array_index"] for j in one["jobs"]] == [7]
    assert one["arrays"] == {str(ids[1]): {"command": ["true", ARG], "command_cut": False}}
    # the table is as it was: a line per array and state, its command's start
    r = lab.run(lab.bob, "jobs", "--all", timeout=60)
    lines = [line for line in r.stdout.splitlines() if line.startswith(f"{ids[0]}_[")]
    assert len(lines) == 1 and f"{ids[0]}_[0-{ELEMENTS - 1}] ({ELEMENTS})" in lines[0], r.stdout
    assert "cancelled" in lines[0] and " true " in lines[0]
    r = lab.run(lab.bob, "jobs", "--all", "--expand", timeout=60)
    element = [line for line in r.stdout.splitlines() if line.startswith(f"{ids[4]}_199 ")]
    assert len(element) == 1 and " true " in element[0], r.stdout[-2000:]
