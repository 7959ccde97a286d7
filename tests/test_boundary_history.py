"""Issue 36 item 6: one record the history cannot store (a job whose command is a file named with a
non-UTF-8 byte: Python holds it as a lone surrogate) must not end the history writer: it is stored with its
bytes escaped, and every later run and sample is recorded too."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Iterator, List

import pytest
from conftest import wait_for
from test_queue import PY, Lab, made_lab, queue_body

from gpu_mon.outputs.history import cleaned, storable
from gpu_mon.queue.runs import JobRun

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="makes users")


@pytest.fixture
def lab(sim) -> Iterator[Lab]:
    with made_lab("gmhs", ("gmhsalice", "gmhsbob"), "import sys; sys.exit(0)\n") as made:
        yield made


def job_runs(db: Path) -> List[tuple]:
    if not db.exists():
        return []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return list(conn.execute("SELECT job, name, how FROM job_runs ORDER BY job"))


def test_a_job_named_with_a_non_utf8_byte_is_recorded_escaped_and_history_goes_on(lab, daemon_factory):
    odd = os.fsencode(str(lab.alice.work)) + b"/job-\xff.py"
    with open(odd, "w") as f:
        f.write(f"#!{PY}\nimport sys\nsys.exit(0)\n")
    os.chmod(odd, 0o755)
    d = daemon_factory(queue_body(lab, gpus="0"), {"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    bad = lab.submit(lab.alice, "--", os.fsdecode(b"./job-\xff.py"))
    lab.wait_state(lab.alice, bad, "done")
    good = lab.submit(lab.bob, "--name", "after", "--", PY, str(lab.job))
    lab.wait_state(lab.bob, good, "done")
    db = d.tmp / "history.sqlite"
    rows = wait_for(lambda: (r := job_runs(db)) and r[-1][0] == good and r[-1][2] == "done" and r, 30, "runs")
    assert rows[0][0] == bad and rows[0][1] == "./job-\\xff.py" and rows[0][2] == "done", rows
    assert "Traceback" not in d.log() and "skipped" not in d.log()
    d.stop()


def test_every_text_of_an_operation_is_made_storable():
    assert storable("plain") == "plain" and storable("é") == "é"
    assert storable("a\udcffb") == "a\\xffb"  # a file name's byte
    assert storable("\ud800") == "\\ud800"  # any other lone surrogate
    run = JobRun(1, "u\udcfe", "n\udcff", ("g\udc80",), 1.0, 2.0, 0.0, 0)
    op = cleaned(("job_start", (1, 1.0, 2.0), run))
    assert op[2].user == "u\\xfe" and op[2].name == "n\\xff" and op[2].gpus == ("g\\x80",)  # type: ignore
    assert cleaned(("samples", 1.0, [("g\udcff", 1, 2)])) == ("samples", 1.0, [("g\\xff", 1, 2)])
