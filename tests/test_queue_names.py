"""One name for an array's element everywhere a person reads it: `A_I`, as `jobs` and every command take
it, never its own number (an element's number is its array's, or reads as another job's). A real daemon,
a 2-element array and users made here: status, the daemon's log, the lines in a job's log, waiting reasons
(`jobs` and a workload's in status), and completion."""

from __future__ import annotations

import os
import re
import subprocess
from typing import Iterator

import pytest
from conftest import GPU_MON, wait_for
from test_completion import _complete
from test_queue import PY, Lab, made_lab, queue_body

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them: needs root")

JOB = "import time\nwhile True: time.sleep(0.05)\n"


@pytest.fixture
def lab(sim) -> Iterator[Lab]:
    with made_lab("gmn", ("gmnalma", "gmnbert"), JOB) as made:
        yield made


def test_an_element_is_named_a_i_in_status_the_logs_reasons_and_completion(lab, daemon_factory, sim):
    sim_uuid = sim.uuid(0)
    miner = f"[process-miner]\ncmd = {PY} -c 'import time; time.sleep(600)' {lab.marker}\ngpus = 0\n"
    d = daemon_factory(queue_body(lab, gpus="0") + miner, defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    held = lab.submit(lab.alice, "--hold", "--", PY, str(lab.job))  # (so that the array is job 2, not 1)
    array = lab.submit(lab.alice, "--array", "0-1", "--", PY, str(lab.job))
    after = lab.submit(lab.alice, "--after", f"{array}_1", "--", PY, str(lab.job))
    a0, a1 = f"{array}_0", f"{array}_1"
    jobs = lab.jobs(lab.alice)
    number = {f"{j['array_id']}_{j['array_index']}": i for i, j in jobs.items() if j["array_id"] == array}
    assert (held, number[a0], number[a1]) == (1, array, array + 1)  # (2_0's own number is its array's)
    lab.wait_state(lab.alice, array, "running")
    # waiting reasons
    reason = lambda i: lab.jobs(lab.alice)[i]["reason"]  # noqa: E731
    wait_for(lambda: reason(number[a1]) == f"waiting: GPU 0 taken by job {a0}", 10, f"{a1}'s reason")
    wait_for(lambda: reason(after) == f"waiting: after job {a1}", 10, "the dependent job's reason")
    # the daemon's log; status: the GPU's job, and why the workload waits
    d.wait_log(rf"queue: starting job {a0}\[\d+\] of gmnalma on GPU 0")
    d.wait_log(rf"queue: job {a0} takes GPU 0 .*; stopping miner")
    cmd = [*GPU_MON, "--config", str(d.config_path), "status"]
    said = lambda: subprocess.run(cmd, capture_output=True, text=True).stdout  # noqa: E731
    status = wait_for(lambda: (s := said()) and f"GPU 0 ({sim_uuid}) runs job {a0}" in s and s, 20, "miner")
    assert f"\n    job {a0} gmnalma " in status.split("GPU 0 (", 1)[1].split("GPU 1 (")[0], status
    # completion: the array and its elements; `A_<TAB>`: the elements
    conf = ["--config", str(lab.client_conf)]
    offered = ["1", str(array), a0, a1, str(after)]
    assert _complete(lab, lab.alice, ["gpu-mon", *conf, "cancel", ""]) == offered
    assert _complete(lab, lab.alice, ["gpu-mon", *conf, "cancel", f"{array}_"]) == [a0, a1]
    assert _complete(lab, lab.alice, ["gpu-mon", *conf, "logs", f"{array}_"], shell="zsh") == [a0, a1]
    assert _complete(lab, lab.alice, ["gpu-mon", *conf, "logs", f"{array}_"], shell="fish") == [a0, a1]
    # a cancel: the daemon's log, and the line in the job's own log
    assert lab.run(lab.alice, "cancel", a0).returncode == 0
    d.wait_log(rf"queue: job {a0} \(gmnalma\): cancelled; stopping it")
    out = lab.alice.home / ".local/state/gpu-mon/jobs" / f"{a0}.log"
    wait_for(lambda: f"gpu-mon: job {a0} cancelled at " in out.read_text(), 10, "the line in the job's log")
    d.wait_log(rf"queue: job {a0} of gmnalma .*: cancelled")
    assert not re.search(rf"job {array}\b(?!_)", d.log()), d.log()  # (never its own number)
