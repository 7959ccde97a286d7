"""bench/queue_readers.py checks what it needs before it starts anything (one line, exit 2), and runs at a
tiny scale; its figures belong to the benchmark itself (docs/measured.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import run_script

BENCH = Path(__file__).resolve().parent.parent / "bench" / "queue_readers.py"


def test_a_baseline_that_is_not_a_commit_is_one_line_before_anything_starts(tmp_path):
    r = run_script(BENCH, "--baseline", "no-such-ref", cwd=tmp_path)
    assert (r.returncode, r.stdout) == (2, ""), r.stdout + r.stderr
    assert r.stderr.startswith("bench/queue_readers.py: cannot start: ") and r.stderr.count("\n") == 1
    assert "--baseline no-such-ref is not a commit of this checkout" in r.stderr


def test_bad_numbers_are_a_usage_error(tmp_path):
    r = run_script(BENCH, "--seconds", "1", "--baseline", "", cwd=tmp_path)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr.splitlines()[-1].endswith("--readers and --trials must be at least 1, --seconds 5")


@pytest.mark.skipif(
    os.geteuid() != 0, reason="the benchmark's daemon runs as root, its users nobody and daemon"
)
def test_it_runs_and_prints_every_row(tmp_path):
    quick = ["--arrays", "2", "--elements", "20", "--arg-bytes", "100", "--seconds", "5", "--trials", "1"]
    r = run_script(BENCH, *quick, "--baseline", "", cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    for row in ("`jobs --all --json` size", "daemon CPU under 3 looping readers", "another user's `submit"):
        assert row in r.stdout, r.stdout
