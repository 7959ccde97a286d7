"""The suite's guard (tests/machine_guard.py) catches a test that changes the machine's gpu-mon files.

Each case runs pytest in a subprocess over a tiny test module, with the guard pointed at a temporary
directory and file instead of the machine's real paths, and checks what that run reports.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Tuple

import pytest

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def guarded(tmp_path: Path) -> Tuple[Path, Path]:
    """A stand-in for /var/lib/gpu_mon (a directory with a file) and for /etc/gpu_mon.conf (a file)."""
    state = tmp_path / "machine" / "var-lib-gpu_mon"
    state.mkdir(parents=True)
    (state / "history.sqlite").write_bytes(b"rows")
    conf = tmp_path / "machine" / "gpu_mon.conf"
    conf.write_text("[gpu-all]\ngpus = ALL\n")
    return state, conf


def run_guarded(tmp_path: Path, guarded: Tuple[Path, Path], **modules: str) -> Tuple[int, str]:
    """Run pytest with the guard over the given test modules (name -> source); (exit code, output)."""
    suite = tmp_path / "suite"
    suite.mkdir()
    for name, source in modules.items():
        (suite / f"{name}.py").write_text(textwrap.dedent(source))
    env = dict(
        os.environ,
        GPU_MON_TEST_MACHINE_PATHS=os.pathsep.join(str(p) for p in guarded),
        PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
        STATE=str(guarded[0]),
        CONF=str(guarded[1]),
    )
    env.pop("PYTEST_ADDOPTS", None)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "machine_guard", "-p", "no:cacheprovider", "-q", str(suite)],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return r.returncode, r.stdout + r.stderr


CLEAN = """
    import os

    def test_reads_and_writes_its_own_files(tmp_path):
        assert open(os.environ["CONF"]).read().startswith("[gpu-all]")
        (tmp_path / "history.sqlite").write_bytes(b"mine")
"""


def test_a_clean_suite_passes(tmp_path, guarded):
    code, out = run_guarded(tmp_path, guarded, test_clean=CLEAN)
    assert code == 0, out
    assert "changed the machine" not in out


def test_a_created_file_fails_the_module_that_made_it(tmp_path, guarded):
    dirty = """
        import os

        def test_first():
            pass

        def test_writes_history():
            open(os.path.join(os.environ["STATE"], "new.sqlite"), "w").close()

        def test_third():
            pass
    """
    code, out = run_guarded(tmp_path, guarded, test_a_dirty=dirty, test_b_clean=CLEAN)
    assert code == 1, out
    new = guarded[0] / "new.sqlite"
    assert (
        f"test_a_dirty.py changed the machine (first seen after test_a_dirty.py::test_writes_history): "
        f"changed {guarded[0]}; created {new}"
    ) in out, out
    assert "test_b_clean.py changed" not in out, out
    assert "1 error" in out, out


def test_a_rewrite_that_keeps_size_and_mtime_is_caught(tmp_path, guarded):
    sneaky = """
        import os

        def test_rewrites_in_place():
            path = os.environ["CONF"]
            st = os.stat(path)
            with open(path, "r+") as f:
                f.write("[gpu-ALL]")
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    """
    code, out = run_guarded(tmp_path, guarded, test_sneaky=sneaky)
    assert code == 1, out
    assert f"test_sneaky.py changed the machine: changed {guarded[1]}" in out, out


def test_a_removed_file_is_caught(tmp_path, guarded):
    remover = """
        import os

        def test_removes():
            os.unlink(os.environ["CONF"])
    """
    code, out = run_guarded(tmp_path, guarded, test_remover=remover)
    assert code == 1, out
    assert f"removed {guarded[1]}" in out, out


def test_a_change_behind_a_failing_teardown_still_fails_the_run(tmp_path, guarded):
    broken = """
        import os
        import pytest

        @pytest.fixture
        def leaves_a_file():
            yield
            open(os.path.join(os.environ["STATE"], "left.db"), "w").close()
            raise RuntimeError("teardown broke")

        def test_it(leaves_a_file):
            pass
    """
    code, out = run_guarded(tmp_path, guarded, test_broken=broken)
    assert code == 1, out
    assert "RuntimeError: teardown broke" in out, out
    left = guarded[0] / "left.db"
    assert f"the tests changed the machine: changed {guarded[0]}; created {left}" in out, out


def test_the_guard_watches_the_real_paths_by_default(monkeypatch):
    import machine_guard

    monkeypatch.delenv(machine_guard.PATHS_ENV, raising=False)
    assert machine_guard.guarded_paths() == (
        "/var/lib/gpu_mon",
        "/run/gpu_mon",
        "/etc/gpu_mon.conf",
        "/var/log/gpu-mon",
        "/tmp/gpu-mon-occupiers",
    )
