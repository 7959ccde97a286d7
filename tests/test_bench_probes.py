"""bench/probes.py checks what it needs before it starts anything (one line, exit 2); the benchmark itself
is timing, which belongs in bench/ (its figures: docs/measured.md)."""

from __future__ import annotations

from pathlib import Path

from conftest import run_script

BENCH = Path(__file__).resolve().parent.parent / "bench" / "probes.py"


def test_a_baseline_that_is_not_a_commit_is_one_line_before_anything_starts(tmp_path):
    r = run_script(BENCH, "--seconds", "1", "--trials", "1", "--baseline", "no-such-ref", cwd=tmp_path)
    assert (r.returncode, r.stdout) == (2, ""), r.stdout + r.stderr
    assert r.stderr.startswith("probes.py: cannot start: ") and r.stderr.count("\n") == 1, r.stderr
    assert "--baseline no-such-ref is not a commit of this checkout" in r.stderr


def test_bad_numbers_are_a_usage_error(tmp_path):
    r = run_script(BENCH, "--hold-ms", "0", "--baseline", "", cwd=tmp_path)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr.splitlines()[-1].endswith("--flood-seconds must be more than 0, --trials at least 1")
