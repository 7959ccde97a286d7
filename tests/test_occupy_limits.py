"""The admin's [occupy] limits in the system config, and the host-wide view of every user's occupier.

Root's runs point the system config and the registry into the test's directory with the variables that
only root may use; `nobody` runs a copy of the package whose two paths point there (conftest), and the
variables do nothing for it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List

import pytest
from conftest import GPU_MON, SimHost, kill_marked, nobody_host, run_as_nobody, wait_for, write_config

from gpu_mon import config
from gpu_mon.api import occupiers, procfs
from gpu_mon.commands.occupy_holdlimit import HoldLimit
from gpu_mon.commands.occupy_limits import Refusal, Who, refusal

FAST = ["--wait-minutes", "0.02", "--refresh-minutes", "0.002"]


class Occupy:
    """`gpu-mon occupy` run by root, with the system config and the registry in `base`."""

    def __init__(self, sim: SimHost, base: Path, state: str = "state"):
        self.sim, self.base = sim, base
        self.system = base / "etc" / "gpu_mon.conf"
        self.system.parent.mkdir(exist_ok=True)
        self.env = dict(os.environ)
        self.env.update(
            GPU_MON_SIM=str(sim.path),
            XDG_STATE_HOME=str(base / state),
            GPU_MON_SYSTEM_CONFIG=str(self.system),
            GPU_MON_OCCUPIERS_DIR=str(base / "occupiers"),
        )
        self.dir = base / state / "gpu-mon" / "occupy"
        self.markers: List[str] = []

    def limits(self, text: str) -> None:
        self.system.write_text(text)
        os.chmod(self.system, 0o644)

    def __call__(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*GPU_MON, "occupy", *args], capture_output=True, text=True, env=self.env, timeout=60
        )

    def sleeper(self) -> List[str]:
        """`-- python -c 'sleep' MARKER`: a CMD that holds on, marked for cleanup."""
        marker = f"gmol-{uuid.uuid4().hex}"
        self.markers.append(marker)
        return ["--", sys.executable, "-c", "import time; time.sleep(600)", marker]

    def status(self) -> Dict[str, object]:
        return json.loads(self("status", "--json").stdout)

    def log(self) -> str:
        try:
            return (self.dir / "occupy.log").read_text(errors="replace")
        except OSError:
            return ""

    def cleanup(self) -> None:
        self("off", "--timeout", "10")
        for marker in self.markers:
            kill_marked(marker)


@pytest.fixture
def occ(sim, tmp_path):
    o = Occupy(sim, tmp_path)
    yield o
    o.cleanup()


def one_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


# ----------------------------------------------------------------------------------------------- config


def test_the_occupy_section_is_checked_like_any_other(tmp_path):
    conf = write_config(
        tmp_path / "c.conf",
        "[gpu-all]\ngpus = ALL\n[occupy]\nmax_gpu_per_user = 2\nrequire_yield = maybe\nmax_hold_hours = 0\n",
    )
    r = subprocess.run([*GPU_MON, "--config", str(conf), "check"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert f"{conf}:4: [occupy] max_gpu_per_user: unknown key (did you mean 'max_gpus_per_user'?)" in r.stderr
    assert (
        f"{conf}:5: [occupy] require_yield:" in r.stderr and f"{conf}:6: [occupy] max_hold_hours:" in r.stderr
    )
    good = config.parse(
        "[occupy]\nusers = alice, bob\ngroups = gpu\nmax_gpus_per_user = 2\nmax_hold_hours = 12\n"
    )
    assert good.occupy == config.OccupySection(("alice", "bob"), ("gpu",), 2, 12.0, False, line=1)
    assert config.parse("[gpu-all]\ngpus = ALL\n").occupy is None


def test_the_shipped_config_documents_every_occupy_key_at_its_default():
    from conftest import ROOT

    text = (ROOT / "conf" / "gpu_mon.conf").read_text()
    assert config.parse(text).occupy is None  # shipped commented out: no limits
    section = text[text.index("\n;[occupy]\n") :].split("\n;[", 2)[1]
    for key in ("users", "groups", "max_gpus_per_user", "max_hold_hours", "require_yield"):
        assert f"\n;{key} =" in section, key
    keys = re.compile(r"^;\[?[a-z_-]+(\]| =)")
    uncommented = "\n".join(line[1:] if keys.match(line) else line for line in section.splitlines())
    found = config.parse("[" + uncommented + "\n").occupy
    assert found is not None and found == config.OccupySection(line=1)  # at the defaults: no limits


def test_a_reload_names_the_occupy_section():
    from gpu_mon.engine import reload

    old = config.parse("[gpu-all]\ngpus = ALL\n")
    new = config.parse("[gpu-all]\ngpus = ALL\n[occupy]\nmax_gpus_per_user = 1\n")
    assert str(reload.changes(old, new)) == "added: [occupy]"
    other = config.parse("[gpu-all]\ngpus = ALL\n\n[occupy]\nmax_gpus_per_user = 2\n")
    assert str(reload.changes(new, other)) == "changed: [occupy]"


def test_who_is_refused_and_why():
    lists = config.OccupySection(users=("alice",), groups=("gpu",))
    assert refusal(lists, Who("bob", 1001, frozenset({"bob"})), 1, 0) == Refusal("users")
    assert refusal(lists, Who("bob", 1001, frozenset({"bob", "gpu"})), 1, 0) is None
    assert refusal(lists, Who("alice", 1000, frozenset()), 1, 0) is None
    assert refusal(lists, Who("root", 0, frozenset()), 1, 0) is None  # root is always allowed
    assert refusal(config.OccupySection(), Who("bob", 1001, frozenset()), 8, 0) is None  # no limits
    most = config.OccupySection(max_gpus_per_user=2)
    bob = Who("bob", 1001, frozenset())
    assert refusal(most, bob, 2, 0) is None
    assert refusal(most, bob, 3, 0) == Refusal("max_gpus_per_user", 3, 0, 2)
    assert refusal(most, bob, 1, 2) == Refusal("max_gpus_per_user", 1, 2, 2)  # other occupiers count
    assert refusal(most, bob, None, 0) == Refusal("max_gpus_per_user", None, 0, 2)  # unknown: refused


# ------------------------------------------------------------------------------------------- `occupy on`


def test_too_many_gpus_is_refused_in_one_line_and_counts_other_occupiers(occ, sim, tmp_path):
    occ.limits("[occupy]\nmax_gpus_per_user = 1\n")
    r = occ("on", *FAST, *occ.sleeper())  # every GPU: 2
    assert r.returncode == 1
    assert "refused: this takes 2 GPU(s), more than [occupy] max_gpus_per_user = 1" in one_line(r)
    assert occ("status").returncode == 3
    assert occ("on", "--gpus", "1", *FAST, *occ.sleeper()).returncode == 0
    other = Occupy(sim, tmp_path, state="state2")  # the same user, another state directory
    try:
        r = other("on", "--gpus", "0", *FAST, *other.sleeper())
        assert r.returncode == 1 and "and your other occupiers take 1" in one_line(r)
    finally:
        other.cleanup()


def test_limits_are_not_bypassed_by_the_users_own_config_or_environment(occ, tmp_path):
    occ.limits("[occupy]\nmax_gpus_per_user = 1\n")
    mine = write_config(tmp_path / "mine.conf", "[gpu-all]\ngpus = ALL\n[occupy]\nmax_gpus_per_user = 8\n")
    r = occ("--config", str(mine), "on", *FAST, *occ.sleeper())
    assert r.returncode == 1 and "max_gpus_per_user = 1" in one_line(r)


def test_require_yield_makes_a_firm_request_polite(occ):
    occ.limits("[occupy]\nrequire_yield = yes\n")
    r = occ("on", *FAST, *occ.sleeper())
    assert r.returncode == 0, r.stderr
    assert "--yield is required here ([occupy] require_yield in" in one_line(r)
    assert occ.status()["mode"] == "yield"
    wait_for(lambda: [o["polite"] for o in occupiers.list_occupiers(str(occ.base / "occupiers"))] == [True])


def test_max_hold_hours_gives_the_gpus_back_and_exits_saying_why(occ):
    occ.limits("[occupy]\nmax_hold_hours = 0.0005\n")  # 1.8 s
    r = occ("on", "--gpus", "0", *FAST, *occ.sleeper())
    assert r.returncode == 0, r.stderr
    assert "gives them back after 0.0005 h ([occupy] max_hold_hours in" in r.stdout
    wait_for(lambda: "starting occupy" in occ.log(), what="occupying")
    wait_for(lambda: occ("status").returncode == 3, timeout=30, what="the occupier gone")
    log = occ.log()
    assert (
        log.index("starting occupy") < log.index("held the GPUs for 0.0005 h") < log.index("gpu-mon stopped")
    )
    assert "[occupy] max_hold_hours in " + str(occ.system) in log
    wait_for(lambda: not any(_marked(m) for m in occ.markers), what="the CMD stopped")


def test_the_hold_limit_counts_from_the_first_hold_and_ends_once(caplog):
    now = [100.0]
    ended: List[float] = []
    limit = HoldLimit(0.5, "/etc/gpu_mon.conf", lambda: ended.append(now[0]), clock=lambda: now[0])
    limit.on_round(SimpleNamespace(workloads=()))  # type: ignore[arg-type]
    assert limit.deadline() is None  # waiting: nothing held yet
    now[0] = 200.0
    limit.on_round(SimpleNamespace(workloads=({"stopping": False},)))  # type: ignore[arg-type]
    assert limit.deadline() == 200.0 + 1800
    limit.on_round(SimpleNamespace(workloads=()))  # type: ignore[arg-type]  # yielded: the time still runs
    now[0] = 1999.0
    limit.on_event("alive")
    assert ended == []
    now[0] = 2000.0
    with caplog.at_level(logging.INFO, logger="gpu_mon"):
        limit.on_event("alive")
        limit.on_event("alive")
    assert ended == [2000.0] and limit.deadline() is None
    assert (
        "held the GPUs for 0.5 h, the most the admin allows ([occupy] max_hold_hours in /etc/gpu_mon.conf)"
        in (caplog.text)
    )


def _marked(marker: str) -> bool:
    from conftest import marked

    return bool(marked(marker))


@pytest.mark.parametrize(
    "text, mode, message",
    [
        (
            "[occupy]\nmax_gpus_per_user = two\n",
            0o644,
            ":2: [occupy] max_gpus_per_user: 'two' is not a whole number",
        ),
        ("[ocupy]\nmax_gpus_per_user = 1\n", 0o644, "unknown section (did you mean [occupy]?)"),
        ("[occupy]\n", 0o664, "writable by group or others"),
    ],
)
def test_a_system_config_that_cannot_be_trusted_refuses(occ, text, mode, message):
    occ.limits(text)
    os.chmod(occ.system, mode)
    r = occ("on", *FAST, *occ.sleeper())
    line = one_line(r)
    assert r.returncode == 1 and "refused: the admin's limits cannot be read" in line and message in line, (
        line
    )
    assert occ("status").returncode == 3


def test_no_occupy_section_means_no_limits(occ):
    occ.limits("[gpu-all]\ngpus = ALL\n")
    assert occ("on", *FAST, *occ.sleeper()).returncode == 0


# --------------------------------------------------------------------------------- the host-wide view


def test_a_plain_user_is_held_to_the_limits_and_sees_every_users_occupier(public_dir):
    os.chmod(public_dir, 0o1777)  # sticky, as /tmp: the system config below counts as root's alone
    sim, code_dir = nobody_host(public_dir)
    system = public_dir / "gpu_mon.conf"  # where the copy's SYSTEM_CONFIG points
    system.write_text("[occupy]\nusers = root\n")
    os.chmod(system, 0o644)
    home = public_dir / "home"
    home.mkdir()
    os.chown(home, 65534, 65534)
    escape = public_dir / "free.conf"  # what nobody would like the limits to be
    escape.write_text("[gpu-all]\ngpus = ALL\n")
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(code_dir),
        "HOME": str(home),
        "GPU_MON_SIM": str(sim.path),
        "GPU_MON_SYSTEM_CONFIG": str(escape),  # honoured only for root
        "GPU_MON_OCCUPIERS_DIR": str(home),
    }

    def nobody(*args: str) -> subprocess.CompletedProcess:
        return run_as_nobody(["/usr/bin/python3", "-m", "gpu_mon", *args], env, cwd=str(home))

    root = Occupy(sim, public_dir)  # root's occupier, in the registry nobody's copy uses
    marker = f"gmol-{uuid.uuid4().hex}"
    cmd = ["--", "/usr/bin/python3", "-c", "import time; time.sleep(600)", marker]
    try:
        r = nobody("--config", str(escape), "occupy", "on", *FAST, *cmd)
        assert (
            r.returncode == 1
            and "refused: nobody may not occupy GPUs here ([occupy] users and groups in" in one_line(r)
        )
        system.write_text("[occupy]\nusers = root\ngroups = nogroup\n")  # nobody's own group
        assert nobody("occupy", "on", "--gpus", "1", *FAST, *cmd).returncode == 0
        assert root("on", "--yield", "--gpus", "0", *FAST, *root.sleeper()).returncode == 0
        assert not list(home.glob("*.json"))  # GPU_MON_OCCUPIERS_DIR did nothing for nobody
        wait_for(lambda: "occupying" in nobody("occupy", "status", "--all").stdout, what="nobody occupying")
        r = nobody("occupy", "status", "--all")
        assert r.returncode == 0
        lines = {line.split()[0]: line for line in r.stdout.splitlines()[1:]}
        assert set(lines) == {"root", "nobody"}
        assert "firm" in lines["nobody"] and "polite (--yield)" in lines["root"] and "GPU 0" in lines["root"]
        shown = nobody("--sim", str(sim.path), "status")
        assert "Occupiers (gpu-mon occupy, every user's):" in shown.stdout
        assert "GPU 1, firm" in shown.stdout and "GPU 0, polite" in shown.stdout
        records = json.loads(nobody("occupy", "status", "--all", "--json").stdout)["occupiers"]
        assert sorted(o["user"] for o in records) == ["nobody", "root"]
    finally:
        nobody("occupy", "off")
        root.cleanup()
        kill_marked(marker)
    assert nobody("occupy", "status", "--all").returncode == 3


def test_a_record_is_believed_only_from_its_owner_for_its_live_process(tmp_path):
    registry = tmp_path / "occupiers"
    registry.mkdir(mode=0o1777)
    sleeper = subprocess.Popen(["sleep", "600"], user=65534, group=65534, extra_groups=[])
    try:
        wait_for(lambda: procfs.read_uid(sleeper.pid) == 65534, what="the sleeper as nobody")
        ticks = procfs.read_stat(sleeper.pid).start_ticks  # type: ignore[union-attr]

        def record(name: str, owner: int, **doc: object) -> Path:
            path = registry / name
            path.write_text(json.dumps({"uid": 65534, "pid": sleeper.pid, "start_ticks": ticks, **doc}))
            os.chown(path, owner, owner)
            return path

        honest = record(f"65534-{sleeper.pid}.json", 65534, phase="occupying")
        assert [(o["user"], o["phase"]) for o in occupiers.list_occupiers(str(registry))] == [
            ("nobody", "occupying")
        ]
        os.chown(honest, 0, 0)  # written by someone else in nobody's name
        assert occupiers.list_occupiers(str(registry)) == []
        honest.unlink()
        record(f"0-{sleeper.pid}.json", 65534, uid=0)  # nobody claiming to be root
        record(f"65534-{sleeper.pid + 1}.json", 65534, pid=sleeper.pid + 1)  # a pid that is not the writer's
        record(f"x-{sleeper.pid}.json", 65534)
        stale = record(f"65534-{sleeper.pid}.json", 65534, start_ticks=ticks - 1)  # the pid reused
        assert occupiers.list_occupiers(str(registry)) == []
        assert str(stale) in occupiers.stale_records(str(registry), 65534)
        stale.unlink()
        real = record("real.json", 65534)
        os.symlink(real, registry / f"65534-{sleeper.pid}.json")
        assert occupiers.list_occupiers(str(registry)) == []
    finally:
        sleeper.kill()
        sleeper.wait()
