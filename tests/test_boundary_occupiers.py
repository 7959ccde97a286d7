"""Issue 36 item 7b: a user may write anything into their own occupier's record (it is their file); every
field is checked when the registry is read, so that a hostile record never crashes root's `gpu-mon status`
or anyone's `gpu-mon occupy status --all`: it is listed as an unreadable record of its user, in one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator, List

import pytest
from conftest import GPU_MON, SimHost, made_user

from gpu_mon.api import procfs

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="makes a user")
PY = "/usr/bin/python3"
WRITE = "import sys; open(sys.argv[1], 'w').write(sys.argv[2])"

HOSTILE = {
    "text-time": {"started_wall": "x"},
    "huge-time": {"started_wall": 1e300, "since_wall": 1e300},
    "nan-time": {"since_wall": float("nan")},
    "negative-time": {"since_wall": -5.0},
    "huge-string": {"phase": "occupying" * 6000},
    "list-for-text": {"phase": ["occupying"], "runs": {"x": 1}},
    "text-for-list": {"gpus": "GPU 0", "gpus_asked": [["0"]]},
    "huge-count": {"gpu_count": 10**30, "polite": "yes"},
    "nan-hours": {"max_hold_hours": float("nan")},
}


@pytest.fixture
def registry() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="gpu-mon-occupiers-", dir="/tmp"))
    os.chmod(base, 0o755)
    directory = base / "occupiers"
    directory.mkdir()
    os.chmod(directory, 0o1777)  # root's, as systemd-tmpfiles makes it
    yield directory
    shutil.rmtree(base, ignore_errors=True)


def occupier_record(uid: int, pid: int, **fields: object) -> dict:
    st = procfs.read_stat(pid)
    assert st is not None
    doc = {
        "start_ticks": st.start_ticks,
        "started_wall": 1700000000.0,
        "gpus_asked": ["0"],
        "gpu_count": 1,
        "polite": False,
        "runs": "stressor (memory only)",
        "max_hold_hours": None,
        "uid": uid,
        "pid": pid,
        "phase": "occupying",
        "since_wall": 1700000000.0,
        "gpus": [],
    }
    doc.update(fields)
    return doc


def as_user(user, argv: List[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(argv, user=user.pw_uid, group=user.pw_gid, extra_groups=[], **kw)


@pytest.mark.parametrize("hostile", sorted(HOSTILE))
def test_a_users_hostile_record_is_one_line_never_a_crash(registry, tmp_path, hostile):
    sim = SimHost(tmp_path, 1)
    with made_user("gmocuser") as user:
        procs = [as_user(user, ["sleep", "600"]) for _ in range(2)]
        try:
            good, bad = procs
            for proc, doc in (
                (good, occupier_record(user.pw_uid, good.pid)),
                (bad, occupier_record(user.pw_uid, bad.pid, **HOSTILE[hostile])),
            ):
                path = registry / f"{user.pw_uid}-{proc.pid}.json"
                as_user(user, [PY, "-c", WRITE, str(path), json.dumps(doc)]).wait(30)
                assert path.stat().st_uid == user.pw_uid  # the user's own file, written by the user
            env = {**os.environ, "GPU_MON_OCCUPIERS_DIR": str(registry)}
            sim_args = ["--sim", str(sim.path)]
            for argv in (
                [*GPU_MON, *sim_args, "status"],
                [*GPU_MON, *sim_args, "status", "--json"],
                [*GPU_MON, "occupy", "status", "--all"],
                [*GPU_MON, "occupy", "status", "--all", "--json"],
            ):
                r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
                assert r.returncode == 0 and "Traceback" not in r.stderr, (argv, r.stderr[-2000:])
                if "--json" in argv:
                    found = {o["pid"]: o for o in json.loads(r.stdout)["occupiers"]}
                    assert found[bad.pid]["unreadable"].endswith("is not what an occupier writes")
                    assert found[good.pid]["phase"] == "occupying" and "unreadable" not in found[good.pid]
                else:
                    lines = [x for x in r.stdout.splitlines() if "gmocuser" in x]
                    assert len(lines) == 2 and "unreadable record" in lines[1] + lines[0], r.stdout
                    assert len(r.stdout) < 20000
        finally:
            for p in procs:
                p.kill()
                p.wait()
