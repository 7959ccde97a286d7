"""`gpu-mon submit` as most submits are typed is answered without importing the whole CLI
(commands/quicksubmit.py, through gpu_mon/entry.py), and gives what the CLI gives: the same job queued,
the same line printed; anything else (errors, --help, misspelt options, refusals) is the CLI's own answer,
byte for byte. Real daemon, users made here. And gpu_mon.jobids no longer imports gpu_mon.cli."""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import subprocess
from pathlib import Path
from typing import List

import pytest
from conftest import wait_for
from test_queue import JOB, PY, Lab, User, made_lab, queue_body

from gpu_mon import config, jobids, quickclient
from gpu_mon.commands import quicksubmit
from gpu_mon.queue import arrays, protocol

AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs jobs as them: needs root")
ROOT = Path(__file__).resolve().parent.parent
# The full CLI, as `gpu-mon` was before the quick path
FULL = "import sys; from gpu_mon.cli import console_main; sys.argv[0] = 'gpu-mon'; console_main()"


@pytest.fixture
def lab(sim):
    with made_lab("gmz", ("gmzann", "gmzben"), JOB) as made:
        yield made


def _run(lab: Lab, user: User, args: List[str], full: bool) -> subprocess.CompletedProcess:
    entry = ["-c", FULL] if full else ["-m", "gpu_mon"]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(user.home), "PYTHONPATH": str(lab.code), "LANG": "C.UTF-8"}
    if not full:
        env["PYTHONPROFILEIMPORTTIME"] = "1"  # (every module imported, on stderr)
    return subprocess.run(
        [PY, *entry, "--config", str(lab.client_conf), *args],
        capture_output=True,
        text=True,
        user=user.uid,
        group=user.gid,
        extra_groups=os.getgrouplist(user.name, user.gid),
        cwd=str(user.work),
        env=env,
        timeout=60,
    )


def _imports(stderr: str) -> List[str]:
    return [line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")]


def _said(stderr: str) -> str:
    return "".join(line + "\n" for line in stderr.splitlines() if not line.startswith("import time:"))


def _stored(lab: Lab, user: User, job_id: int) -> List[dict]:
    """The job (or the array's elements) as stored, less what differs between two submits."""
    jobs = json.loads(lab.run(user, "jobs", "--json", str(job_id)).stdout)["jobs"]
    for job in jobs:
        for key in ("id", "submitted", "array_id", "reason"):
            job.pop(key, None)
    return jobs


SUBMITS = [
    ["submit", "--hold", "--", "true"],
    ["submit", "--json", "--hold", "true", "--an-option-of-the-command"],
    [
        "submit",
        "--hold",
        "--name=sweep",
        "--gpus",
        "2",
        "--priority",
        "7",
        "--stop-signal",
        "B:USR1",
        "--grace",
        "3.5",
        "--time-limit",
        "1.5h",
        "--no-requeue",
        "--notify",
        "true",
        "--notify-each",
        "--output",
        "out-%a.log",
        "--array",
        "0-3%2",
        "--",
        "sh",
        "-c",
        "exit 0",
    ],
]
MISTAKES = [
    ["submit", "--", "no-such-command-here"],
    ["submit", "--arrya", "0-3", "--", "true"],
    ["submit", "--gpus", "x", "--", "true"],
    ["submit", "--time-limit", "0", "--", "true"],
    ["submit", "--output", "/root/out.log", "--", "true"],
    ["submit", "--output", "no-dir/out.log", "--", "true"],
    ["submit", "--after", "0", "--", "true"],
    ["submit", "--timeout", "5", "--", "true"],
    ["submit", "--hold"],
    ["submit", "--help"],
]


@pytest.fixture
def both_ways(lab, daemon_factory):
    """A daemon for the lab; then each line typed, first as the quick path, then by the full CLI."""
    daemon_factory(queue_body(lab), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    return lambda args: (_run(lab, lab.alice, args, full=False), _run(lab, lab.alice, args, full=True))


@AS_ROOT
def test_a_common_submit_skips_the_cli_and_queues_and_prints_what_the_cli_does(lab, both_ways):
    for args in SUBMITS:
        quick, full = both_ways(args)
        assert (quick.returncode, _said(quick.stderr)) == (full.returncode, full.stderr) == (0, ""), args
        assert "gpu_mon.cli" not in _imports(quick.stderr), args
        assert "argparse" not in _imports(quick.stderr), args
        if "--json" not in args:  # (json loads re: 9 ms of a 23 ms submit; --json prints with it)
            assert {"json", "re"} & set(_imports(quick.stderr)) == set(), args
        if "--json" in args:
            a, b = json.loads(quick.stdout), json.loads(full.stdout)
            assert a.pop("id") + 1 == b.pop("id") and a == b
        else:
            a_id, b_id = (int(r.stdout.split()[1].rstrip(":")) for r in (quick, full))
            assert quick.stdout.replace(f"job {a_id}", "job N") == full.stdout.replace(f"job {b_id}", "job N")
            assert _stored(lab, lab.alice, a_id) == _stored(lab, lab.alice, b_id), args


@AS_ROOT
def test_every_mistake_gets_the_clis_own_answer_byte_for_byte(lab, both_ways):
    for args in MISTAKES:
        quick, full = both_ways(args)
        assert quick.returncode == full.returncode == (0 if args[-1] == "--help" else full.returncode), args
        assert full.returncode != 0 or args[-1] == "--help", (args, full.stderr)
        assert (quick.stdout, _said(quick.stderr)) == (full.stdout, full.stderr), args
    assert json.loads(lab.run(lab.alice, "jobs", "--json", "--all").stdout)["jobs"] == []


def test_the_quick_paths_table_and_constants_are_the_clis():
    from gpu_mon.cli import build_parser

    parser = build_parser(only_queue=True)
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    options = {
        a.option_strings[0]: a
        for a in sub.choices["submit"]._actions
        if a.option_strings and a.option_strings[0] not in ("-h", "--debug", "--wait", "--timeout")
    }
    assert set(options) == set(quicksubmit.SUBMIT_OPTIONS)
    for name, kind in quicksubmit.SUBMIT_OPTIONS.items():
        assert (options[name].nargs == 0) == (kind is None), name
        assert kind is None or (options[name].type or str) is kind, name
    assert config.QueueSection().socket == quicksubmit.DEFAULT_SOCKET
    assert quicksubmit.DEFAULT_CONFIG == config.DEFAULT_PATH
    assert quicksubmit.DEFAULT_OUTPUT == protocol.DEFAULT_OUTPUT
    assert quicksubmit.MAX_SPEC == arrays.MAX_SPEC
    assert quicksubmit._MAX_ANSWER == protocol.MAX_ANSWER and quicksubmit._MAX_REQUEST == protocol.MAX_FRAME
    assert inspect.signature(protocol.request).parameters["timeout"].default == quicksubmit._TIMEOUT
    assert quickclient.HEADER.format == protocol._HEADER.format


def test_the_quick_request_says_it_was_checked_as_the_user_as_the_clis_does():
    """Else the daemon checks every quick submit again as its user (a process each: 3x the latency)."""
    req = quicksubmit._request({"--hold": True}, ["true"])
    assert req is not None and req["checked_as_user"] is True
    source = (ROOT / "gpu_mon" / "commands" / "queue.py").read_text()
    assert 'req["checked_as_user"] = True' in source


def test_jobids_imports_neither_the_cli_nor_the_entry():
    """gpu_mon.entry imports gpu_mon.jobids, and jobids sits below the CLI: importing either (even inside a
    function) would load what a TAB cannot wait for, or make a circle."""
    tree = ast.parse(Path(jobids.__file__).read_text())
    named = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    named |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not named & {"gpu_mon.cli", "gpu_mon.entry"}, named


@pytest.mark.parametrize(
    "text",
    [
        "[queue]\n  socket = /tmp/a.sock\n",  # (indented: the config's reader takes it as a key)
        "[queue]\nsocket = /tmp/a.sock\n[queue]\n",  # (twice: the CLI's error)
        "[queue]\nallowed_users = a\n  b\n",  # (a continued value)
    ],
)
def test_a_config_the_quick_scan_may_read_otherwise_goes_to_the_cli(tmp_path, text):
    conf = tmp_path / "gpu_mon.conf"
    conf.write_text(text)
    conf.chmod(0o644)
    assert quicksubmit._socket(str(conf)) is None
    conf.write_text("[queue]\nsocket = /tmp/a.sock\n")
    assert quicksubmit._socket(str(conf)) == "/tmp/a.sock"
