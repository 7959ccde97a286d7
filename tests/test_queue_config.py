"""[queue]: off unless written, every key at its documented default, bad values one line each."""

from __future__ import annotations

import dataclasses
import re
import subprocess

import pytest
from conftest import GPU_MON, ROOT

from gpu_mon.config import ConfigError, GpuSelection, QueueSection, parse


def test_the_queue_is_off_unless_the_section_is_written():
    assert parse("[gpu-all]\ngpus = ALL\n").queue is None
    assert dataclasses.replace(parse("[queue]\n").queue, line=0) == QueueSection()


def test_the_shipped_config_documents_every_queue_key_at_its_default():
    text = (ROOT / "conf" / "gpu_mon.conf").read_text()
    lines = [line[1:] if re.match(r"^;\[?[a-z_-]+(\]| =)", line) else line for line in text.splitlines()]
    queue = parse("\n".join(lines) + "\n").queue
    assert queue is not None and dataclasses.replace(queue, line=0) == QueueSection()
    section = re.split(r"^;\[", text.split(";[queue]", 1)[1], maxsplit=1, flags=re.M)[0]
    written = set(re.findall(r"^;([a-z_]+) =", section, re.M))
    assert written == {f.name for f in dataclasses.fields(QueueSection)} - {"line"}


def test_every_queue_key_at_a_non_default_value(tmp_path):
    q = parse(
        "[queue]\nsocket = q.sock\ngpus = 1, 0\nusers = root\ngroups = root\nmax_running_per_user = 2\n"
        "max_gpus_per_user = 3\nmax_queued_per_user = 5\nmax_gpus_per_job = 1\norder = FIFO\n"
        "fair_window_hours = 1.5\ngrace_seconds = 5\nmax_grace_seconds = 60\nstart_delay_seconds = 0\n"
        "preempt_workloads = no\ndatabase = q.sqlite\n",
        str(tmp_path / "gpu_mon.conf"),
    ).queue
    assert q == QueueSection(
        socket=str(tmp_path / "q.sock"),
        gpus=GpuSelection(refs=(1, 0)),
        users=("root",),
        groups=("root",),
        max_running_per_user=2,
        max_gpus_per_user=3,
        max_queued_per_user=5,
        max_gpus_per_job=1,
        order="fifo",
        fair_window_hours=1.5,
        grace_seconds=5.0,
        max_grace_seconds=60.0,
        start_delay_seconds=0.0,
        preempt_workloads=False,
        database=str(tmp_path / "q.sqlite"),
        line=1,
    )


def test_bad_queue_values_are_each_one_line_with_file_and_line():
    with pytest.raises(ConfigError) as err:
        parse(
            "[queue]\norder = lifo\ngrace_seconds = 700\nmax_gpus_per_job = -1\nsocket =\nmax_queued = 3\n",
            "/etc/x.conf",
        )
    assert err.value.errors == [
        "/etc/x.conf:2: [queue] order: 'lifo' is not one of fair, fifo",
        "/etc/x.conf:3: [queue] grace_seconds: 700 is over max_grace_seconds (600)",
        "/etc/x.conf:4: [queue] max_gpus_per_job: must be 0 (no limit) or more, not -1",
        "/etc/x.conf:5: [queue] socket: is empty",
        "/etc/x.conf:6: [queue] max_queued: unknown key (did you mean 'max_queued_per_user'?)",
    ]


def test_check_reports_a_bad_queue_key(tmp_path):
    path = tmp_path / "gpu_mon.conf"
    path.write_text("[gpu-all]\ngpus = ALL\n[queue]\norder = random\n")
    path.chmod(0o600)
    r = subprocess.run([*GPU_MON, "--config", str(path), "check"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert f"{path}:4: [queue] order: 'random' is not one of fair, fifo" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_config_with_a_queue_and_no_process_section_does_not_say_it_only_watches():
    only_watch = "no [process-*] section: gpu-mon will only watch"
    assert [w for w in parse("[gpu-all]\ngpus = ALL\n").warnings if only_watch in w]
    assert parse("[gpu-all]\ngpus = ALL\n[queue]\n").warnings == ()
