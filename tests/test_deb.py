"""The Debian package: packaging/build-deb builds it, its contents and metadata are right, and it installs,
runs and purges cleanly on this machine.

Building needs the build dependencies (build-deb installs them with apt-get when run as root). The install
tests change the machine (apt-get install, then purge), so they run only as root: elsewhere they fail
with a message saying so. They leave the machine as found, except for the Debian packages apt pulled in
as dependencies: gpu-mon's own paths that exist before (a pip install's /etc/gpu_mon.conf, its history)
are moved out of the package's way, since a purge deletes them, and put back after it.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import re
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Tuple

import pytest

import gpu_mon

ROOT = Path(__file__).resolve().parent.parent
VERSION = gpu_mon.__version__
DEB = ROOT / "dist" / f"gpu-mon_{VERSION}_all.deb"
UNIT_PATH = "/lib/systemd/system/gpu-mon.service"
SENTINEL_UNIT_PATH = "/lib/systemd/system/gpu-mon-sentinel.service"
ENABLE_LINK = Path("/etc/systemd/system/multi-user.target.wants/gpu-mon.service")
# The installed gpu-mon runs with the system's python3, not the test's virtualenv.
SYSTEM_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
APT_ENV = dict(SYSTEM_ENV, DEBIAN_FRONTEND="noninteractive")
APT_GET = ["apt-get", "-o", "DPkg::Lock::Timeout=300"]  # wait for another apt/dpkg run instead of failing
# What the package installs or its purge deletes, and a pip install may already have.
OWN_PATHS = ("/etc/gpu_mon.conf", "/var/lib/gpu_mon", "/var/log/gpu-mon", "/tmp/gpu-mon-occupiers")
ASIDE = ".before-test-deb"


def _run(
    args: List[str], timeout: float = 120, env: Dict[str, str] = SYSTEM_ENV
) -> subprocess.CompletedProcess:
    # From /, so that nothing is imported from the source tree by accident.
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd="/")


def _check(args: List[str], timeout: float = 120, env: Dict[str, str] = SYSTEM_ENV) -> str:
    result = _run(args, timeout, env)
    assert result.returncode == 0, (
        f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout}{result.stderr}"
    )
    return result.stdout


def _installed_status() -> str:
    """dpkg's status of gpu-mon ('' when dpkg knows nothing of it)."""
    result = _run(["dpkg-query", "-W", "-f=${db:Status-Status}", "gpu-mon"])
    status = result.stdout.strip() if result.returncode == 0 else ""
    return "" if status == "not-installed" else status


# ------------------------------------------------------------------------------------------ building


@pytest.fixture(scope="module")
def deb() -> Path:
    """Build the package once for this module."""
    if DEB.exists():
        DEB.unlink()
    result = _run([str(ROOT / "packaging" / "build-deb")], timeout=1500)
    assert result.returncode == 0, (
        f"packaging/build-deb failed ({result.returncode}):\n{result.stdout[-6000:]}{result.stderr[-6000:]}"
    )
    assert DEB.is_file(), f"packaging/build-deb did not produce {DEB}"
    return DEB


@pytest.fixture(scope="module")
def members(deb: Path) -> Dict[str, Tuple[tarfile.TarInfo, bytes]]:
    """Every file of the package's data archive: path (absolute, no leading '.') -> (info, content)."""
    data = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
    out: Dict[str, Tuple[tarfile.TarInfo, bytes]] = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for info in tar.getmembers():
            f = tar.extractfile(info) if info.isfile() else None
            out[info.name.lstrip(".").rstrip("/") or "/"] = (info, f.read() if f else b"")
    return out


@pytest.fixture(scope="module")
def control_files(deb: Path) -> Dict[str, str]:
    """The package's control archive: control, conffiles, maintainer scripts."""
    data = subprocess.run(["dpkg-deb", "--ctrl-tarfile", str(deb)], capture_output=True, check=True).stdout
    out: Dict[str, str] = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for info in tar.getmembers():
            if info.isfile():
                f = tar.extractfile(info)
                assert f is not None
                out[Path(info.name).name] = f.read().decode("utf-8")
    return out


def test_listing_shows_the_files(deb: Path) -> None:
    listing = _check(["dpkg-deb", "-c", str(deb)])
    for path in (
        "./usr/bin/gpu-mon",
        "./etc/gpu_mon.conf",
        "." + UNIT_PATH,
        "./usr/share/doc/gpu-mon/copyright",
    ):
        assert re.search(rf" {re.escape(path)}$", listing, re.M), f"{path} missing from:\n{listing}"


def test_files_and_modes(members: Dict[str, Tuple[tarfile.TarInfo, bytes]]) -> None:
    def mode(path: str) -> int:
        assert path in members, f"{path} is not in the package"
        return stat.S_IMODE(members[path][0].mode)

    assert mode("/usr/bin/gpu-mon") == 0o755
    assert members["/usr/bin/gpu-mon"][1].startswith(b"#!/usr/bin/python3\n")
    assert mode("/etc/gpu_mon.conf") == 0o644
    assert mode(UNIT_PATH) == 0o644
    for module in sorted((ROOT / "gpu_mon").glob("*.py")):
        assert mode(f"/usr/lib/python3/dist-packages/gpu_mon/{module.name}") == 0o644
    assert mode("/usr/share/doc/gpu-mon/examples/gpu_mon.conf") == 0o644
    assert mode("/usr/share/doc/gpu-mon/README.md") == 0o644
    for path, (info, _) in members.items():
        assert (info.uname, info.gname, info.uid, info.gid) == ("root", "root", 0, 0), f"{path} not root:root"
        assert not info.mode & 0o002, f"{path} is world-writable"
        assert not info.mode & (stat.S_ISUID | stat.S_ISGID), f"{path} is setuid/setgid"
        assert "__pycache__" not in path and not path.endswith(".pyc"), f"{path}: compiled at install instead"


def test_installed_files_are_the_sources(members: Dict[str, Tuple[tarfile.TarInfo, bytes]]) -> None:
    assert members["/etc/gpu_mon.conf"][1] == (ROOT / "conf" / "gpu_mon.conf").read_bytes()
    assert members[UNIT_PATH][1] == (ROOT / "systemd" / "gpu-mon.service").read_bytes()
    assert members[SENTINEL_UNIT_PATH][1] == (ROOT / "systemd" / "gpu-mon-sentinel.service").read_bytes()
    tmpfiles = members["/usr/lib/tmpfiles.d/gpu-mon.conf"][1]
    assert tmpfiles == (ROOT / "systemd" / "gpu-mon.tmpfiles").read_bytes()
    # The unit's Documentation= points here: not compressed.
    assert members["/usr/share/doc/gpu-mon/README.md"][1] == (ROOT / "README.md").read_bytes()
    # The guides, as they are, in docs/ beside it, where README's links point (docs/_incoming is not shipped).
    guides = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "history-demo.png"]
    assert {p.name for p in guides} >= {"admin-guide.md", "users-guide.md", "operations.md"}
    for path in guides:
        packaged = f"/usr/share/doc/gpu-mon/docs/{path.name}"
        assert packaged in members and members[packaged][1] == path.read_bytes(), packaged
    assert not [p for p in members if p.startswith("/usr/share/doc/gpu-mon/docs/_")]
    # The fleet view's files, as they are (docs/operations.md "Many servers" points here).
    for path in (ROOT / "contrib").rglob("*"):
        if path.is_file():
            packaged = f"/usr/share/doc/gpu-mon/{path.relative_to(ROOT)}"
            assert packaged in members and members[packaged][1] == path.read_bytes(), packaged
    for module in sorted((ROOT / "gpu_mon").glob("*.py")):
        packaged = members[f"/usr/lib/python3/dist-packages/gpu_mon/{module.name}"][1]
        assert packaged == module.read_bytes(), f"the packaged gpu_mon/{module.name} differs from the source"


def test_man_pages_and_completions_are_installed(members: Dict[str, Tuple[tarfile.TarInfo, bytes]]) -> None:
    """The pages under docs/man/ (compressed, in their sections) and the completions, where each shell
    looks for them; the unit names the pages."""
    pages = sorted((ROOT / "docs" / "man").glob("*.[1-8]"))
    assert {p.name for p in pages} >= {"gpu-mon.1", "gpu-mon-queue.7"}
    for page in pages:
        packaged = f"/usr/share/man/man{page.suffix[1:]}/{page.name}.gz"
        assert packaged in members, f"{packaged} is not in the package"
        assert gzip.decompress(members[packaged][1]) == page.read_bytes(), packaged
    for source, packaged in (
        ("bash/gpu-mon", "/usr/share/bash-completion/completions/gpu-mon"),
        ("zsh/_gpu-mon", "/usr/share/zsh/vendor-completions/_gpu-mon"),
        ("fish/gpu-mon.fish", "/usr/share/fish/vendor_completions.d/gpu-mon.fish"),
    ):
        assert packaged in members, f"{packaged} is not in the package"
        assert members[packaged][1] == (ROOT / "docs" / "completion" / source).read_bytes(), packaged
    for unit in (UNIT_PATH, SENTINEL_UNIT_PATH):
        assert b"\nDocumentation=man:gpu-mon(1) man:gpu_mon.conf(5) file:" in members[unit][1], unit


def test_lintian_reports_no_errors_and_no_warnings_but_overrides_with_a_reason(deb: Path) -> None:
    """lintian on the built package: no error or warning, except the ones debian/gpu-mon.lintian-overrides
    names, each after a comment that says why."""
    assert shutil.which("lintian"), "lintian is not installed (apt-get install lintian)"
    result = _run(["lintian", "--fail-on", "none", "--tag-display-limit", "0", str(deb)], timeout=600)
    found = [line for line in result.stdout.splitlines() if line[:2] in ("E:", "W:")]
    assert result.returncode == 0 and not found, f"lintian:\n{result.stdout}{result.stderr}"
    overrides = ROOT / "packaging" / "debian" / "gpu-mon.lintian-overrides"
    lines = overrides.read_text().splitlines() if overrides.exists() else []
    for i, line in enumerate(lines):
        if line.strip() and not line.startswith("#"):
            assert i > 0 and lines[i - 1].startswith("# "), (
                f"{overrides.name}:{i + 1}: an override without a reason"
            )


def test_control_metadata(deb: Path) -> None:
    fields = {}
    for name in ("Package", "Version", "Architecture", "Depends", "Recommends"):
        fields[name] = _check(["dpkg-deb", "-f", str(deb), name]).strip()
    assert fields["Package"] == "gpu-mon"
    assert fields["Version"] == VERSION
    assert fields["Architecture"] == "all"
    depends = [d.strip() for d in fields["Depends"].split(",")]
    for dep in ("python3 (>= 3.9)", "python3-psutil", "python3-sdnotify", "procps"):
        assert dep in depends, f"Depends: lacks {dep}: {fields['Depends']}"
    # NVML bindings: recommended only (contrib, non-free libnvidia-ml); never a guessed package name.
    assert "python3-pynvml" in fields["Recommends"]
    assert "pynvml" not in fields["Depends"] and "nvidia" not in fields["Depends"]
    assert "torch" not in fields["Depends"]


def test_config_is_a_conffile(deb: Path, control_files: Dict[str, str]) -> None:
    assert control_files.get("conffiles", "").split() == ["/etc/gpu_mon.conf"]
    info = _check(["dpkg-deb", "-I", str(deb)])
    assert re.search(r"^\s+\d+ bytes,\s+\d+ lines\s+conffiles\s*$", info, re.M), info


def test_maintainer_scripts_enable_but_never_start(control_files: Dict[str, str]) -> None:
    postinst = control_files["postinst"]
    assert "deb-systemd-helper enable 'gpu-mon.service'" in postinst
    for script in ("preinst", "postinst", "prerm", "postrm"):
        # Commands only: not comments, not the messages that tell the admin what to run.
        lines = control_files.get(script, "").splitlines()
        text = "\n".join(line for line in lines if not line.strip().startswith(("#", "echo ")))
        assert not re.search(r"deb-systemd-invoke\s+(start|restart|try-restart)", text), f"{script} starts it"
        assert not re.search(r"systemctl\s+(--\S+\s+)*(start|restart|try-restart)\b", text), (
            f"{script} starts it"
        )
    # Stopped on removal only, never on upgrade (that would stop the running workloads).
    assert "deb-systemd-invoke stop" not in control_files.get("preinst", "")
    prerm = control_files["prerm"]
    assert re.search(r'\[ "\$1" = remove \].*\n\s*deb-systemd-invoke stop gpu-mon\.service', prerm), prerm


# ---------------------------------------------------------------------------------------- installing


@contextlib.contextmanager
def set_aside(paths: Sequence[str]) -> Iterator[None]:
    """Rename each existing path to PATH.before-test-deb (same directory: content, owner, modes and times
    stay as they are) for the block, then remove whatever the block left at PATH and rename it back."""
    for path in paths:
        if os.path.lexists(path + ASIDE):
            pytest.fail(f"{path + ASIDE} exists (an interrupted run?): put it back first", pytrace=False)
    moved = []
    try:
        for path in paths:
            if os.path.lexists(path):
                os.rename(path, path + ASIDE)
                moved.append(path)
        yield
    finally:
        for path in moved:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.unlink(path)
            os.rename(path + ASIDE, path)


def test_set_aside_puts_back_what_was_there(tmp_path: Path) -> None:
    conf, state, absent = tmp_path / "gpu_mon.conf", tmp_path / "lib", tmp_path / "log"
    conf.write_text("mine\n")
    state.mkdir()
    (state / "history.sqlite").write_bytes(b"rows")
    before = {p: os.lstat(p) for p in (conf, state, state / "history.sqlite")}
    with set_aside([str(conf), str(state), str(absent)]):
        assert not conf.exists() and not state.exists()
        conf.write_text("the package's\n")  # what an install and a purge may leave
        absent.mkdir()
    assert conf.read_text() == "mine\n" and (state / "history.sqlite").read_bytes() == b"rows"
    for path, st in before.items():
        after = os.lstat(path)
        assert (after.st_ino, after.st_mode, after.st_mtime_ns) == (st.st_ino, st.st_mode, st.st_mtime_ns)
    assert absent.is_dir()  # not there before, so not the block's to remove: the purge's test checks it
    assert not list(tmp_path.glob("*" + ASIDE))


@pytest.fixture(scope="module")
def installed(deb: Path) -> Iterator[str]:
    """Install the package with apt (pulling its Debian dependencies); purge it afterwards."""
    if os.geteuid() != 0:
        pytest.fail(
            "the install tests install and purge the package on this machine: run them as root (CI does)",
            pytrace=False,
        )
    before = _installed_status()
    if before:
        pytest.fail(
            f"gpu-mon is already known to dpkg here (status {before!r}): refusing to install over it and "
            "purge it afterwards",
            pytrace=False,
        )
    with set_aside(OWN_PATHS):
        result = _run([*APT_GET, "install", "-y", str(deb)], timeout=900, env=APT_ENV)
        try:
            assert result.returncode == 0, (
                f"apt-get install failed:\n{result.stdout[-6000:]}{result.stderr[-6000:]}"
            )
            yield result.stdout + result.stderr
        finally:
            if _installed_status():
                purge = _run([*APT_GET, "purge", "-y", "gpu-mon"], timeout=600, env=APT_ENV)
                assert purge.returncode == 0, f"apt-get purge failed:\n{purge.stdout}{purge.stderr}"


def test_installed_command_runs(installed: str) -> None:
    assert _check(["/usr/bin/gpu-mon", "--version"]).strip() == f"gpu-mon {VERSION}"
    where = _check(["/usr/bin/python3", "-c", "import gpu_mon; print(gpu_mon.__file__)"]).strip()
    assert where == "/usr/lib/python3/dist-packages/gpu_mon/__init__.py"


def test_installed_config_checks_ok(installed: str) -> None:
    result = _run(["/usr/bin/gpu-mon", "check"])
    if result.returncode == 1 and "NVML: " in result.stderr:  # the config is good; no NVIDIA driver here
        errors = [line for line in result.stderr.splitlines() if not line.startswith("warning: ")]
        assert len(errors) == 1 and errors[0].startswith("NVML: "), result.stderr
    else:
        assert result.returncode == 0, (
            f"gpu-mon check failed ({result.returncode}):\n{result.stdout}{result.stderr}"
        )
        assert result.stdout.startswith("/etc/gpu_mon.conf: OK"), result.stdout
    st = os.stat("/etc/gpu_mon.conf")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o644)
    conffiles = _check(["dpkg-query", "-W", "-f=${Conffiles}", "gpu-mon"])
    assert "/etc/gpu_mon.conf" in conffiles


def test_installed_occupiers_registry_is_made_by_root(installed: str) -> None:
    # Made at install (and at every boot) before any user can squat it (api/occupiers.py).
    entry = Path("/usr/lib/tmpfiles.d/gpu-mon.conf").read_text().splitlines()[-1]
    assert entry == "d /tmp/gpu-mon-occupiers 1777 root root -"
    st = os.lstat("/tmp/gpu-mon-occupiers")
    assert (stat.S_ISDIR(st.st_mode), st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (True, 0, 0, 0o1777)


def test_installed_unit_is_enabled_not_started(installed: str) -> None:
    assert ENABLE_LINK.is_symlink(), f"{ENABLE_LINK} missing: the unit was not enabled"
    assert os.readlink(ENABLE_LINK) == UNIT_PATH
    assert Path(SENTINEL_UNIT_PATH).is_file()
    assert not ENABLE_LINK.with_name("gpu-mon-sentinel.service").exists(), "the sentinel must not be enabled"
    assert "not started" in installed, installed
    if os.path.isdir("/run/systemd/system"):
        state = _run(["systemctl", "is-active", "gpu-mon.service"]).stdout.strip()
        assert state != "active", "installing must not start the service"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        assert not (b"/usr/bin/gpu-mon" in cmdline and b"run" in cmdline), f"pid {pid} runs the daemon"


def test_purge_leaves_nothing(installed: str) -> None:
    _check([*APT_GET, "purge", "-y", "gpu-mon"], timeout=600, env=APT_ENV)
    assert _installed_status() == ""
    for path in (
        "/usr/bin/gpu-mon",
        "/etc/gpu_mon.conf",
        UNIT_PATH,
        "/usr/lib/python3/dist-packages/gpu_mon",
        "/tmp/gpu-mon-occupiers",
    ):
        assert not os.path.lexists(path), f"{path} left behind"
    assert not os.path.lexists(ENABLE_LINK), f"{ENABLE_LINK} left behind"
