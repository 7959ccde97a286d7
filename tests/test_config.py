"""gpu_mon.config: parse() and load(), table-driven.

Every error is one line `PATH:LINE: [section] key: what is wrong`, and all errors of a file come at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import grp
import math
import os
import pwd
import re
import signal
import socket
from pathlib import Path

import pytest
from conftest import made_user

from gpu_mon import config
from gpu_mon.config import (
    ConfigError,
    Defaults,
    GpuSelection,
    HistorySection,
    SentinelSection,
    SlurmSection,
    TtySection,
)

ROOT = Path(__file__).resolve().parent.parent
PATH = "/etc/gpu_mon.conf"
UUID0 = "GPU-5a1c0f3e-8d2b-4c6a-9f10-3b7e2d4c8a01"
UUID1 = "GPU-9e47b2d1-1c3f-4a8e-b5d6-0f2a7c9e1b52"
MIG = "MIG-GPU-5a1c0f3e-8d2b-4c6a-9f10-3b7e2d4c8a01/1/0"
NOBODY = pwd.getpwnam("nobody")
IS_ROOT = os.geteuid() == 0
# The uid the root-safety check trusts besides root: root itself in CI; the test user elsewhere, so the
# checks on modes and symlinks still run.
TRUSTED = os.geteuid()
needs_root = pytest.mark.skipif(not IS_ROOT, reason="chown to another user needs root")

# The two example configs of the gpu_mon seed README, byte for byte (comments, `True`, and the two
# trailing blanks after `cmd=miner-run` in [process-1]).
SEED_ALL = """\
[defaults]
; how frequently perform GPU and tty checks
interval_seconds=10

; configuration of GPUs to monitor for external program access. It could be several such sections with 'gpu-' prefix
[gpu-all]
; list of comma-separated gpu indices or ALL to handle all available gpus
gpus=ALL
; comma-separated list of programs which can access gpu and should be ignored
ignore_programs=nvidia-smi

; program which will be started on gpu during idle time
[process-all]
dir=/tmp
cmd=miner-run
; list of gpu indices or ALL to handle all available gpus
gpus=ALL
; log for processes. If not specified, show on console, if specified to file, data will be appended
log=/dev/null

; configuration of tty monitoring if enabled and user is active and not in whitelist, all processes will be stopped
[tty]
enabled=True
whitelist=user1,user2
; how long user should be inactive in tty to be ignored by checker
idle_seconds=300
"""  # noqa: E501

SEED_PER_GPU = """\
[defaults]
; how frequently perform GPU and tty checks
interval_seconds=10

; configuration of GPUs to monitor for external program access. It could be several such sections with 'gpu-' prefix
[gpu-all]
; list of comma-separated gpu indices or ALL to handle all available gpus
gpus=ALL
; comma-separated list of programs which can access gpu and should be ignored
ignore_programs=nvidia-smi

; program which will be started on gpu during idle time
[process-0]
dir=/tmp
cmd=miner-run
; list of gpu indices or ALL to handle all available gpus
gpus=0
; log for processes. If not specified, show on console, if specified to file, data will be appended
log=/dev/null

; program which will be started on gpu during idle time
[process-1]
dir=/tmp
cmd=miner-run\x20\x20
; list of gpu indices or ALL to handle all available gpus
gpus=1
; log for processes. If not specified, show on console, if specified to file, data will be appended
log=/dev/null

; configuration of tty monitoring if enabled and user is active and not in whitelist, all processes will be stopped
[tty]
enabled=True
whitelist=user1,user2
; how long user should be inactive in tty to be ignored by checker
idle_seconds=300
"""  # noqa: E501

# Every key of every section, none at its default.
EVERY_KEY = f"""\
[defaults]
interval_seconds = 0.5
start_delay_seconds = 0
stop_timeout_seconds = 3
restart_delay_seconds = 1.5
restart_delay_max_seconds = 30
healthy_run_seconds = 5
full_scan_seconds = 7
watch_opens = no
state_file = /var/lib/gpu_mon/state.json
containment = subreaper
[gpu-a]
gpus = 0, {UUID1}
ignore_programs = nvitop, gpustat
ignore_users = root
busy_memory_mib = 0
holder_grace_seconds = 45

[process-miner]
cmd = /opt/miner --pool "a b"
gpus = 1
dir = /srv/miner
log = /var/log/miner.log
user = nobody
group = root
env = A=1 B="x y"
per_gpu = yes

[tty]
enabled = yes
whitelist = root
idle_seconds = 60
devices = /dev/pts/*, /dev/ttyS*
"""


def parse(text, path=PATH):
    return config.parse(text, path)


def errors_of(text, path=PATH):
    with pytest.raises(ConfigError) as info:
        config.parse(text, path)
    assert str(info.value) == "\n".join(info.value.errors)
    return info.value.errors


def write(path, data, mode=0o600):
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    os.chmod(path, mode)
    return path


def load_errors(path, trusted_uid=None):
    with pytest.raises(ConfigError) as info:
        config.load(str(path), trusted_uid)
    return info.value.errors


# ---------------------------------------------------------------------------------------------------------
# The seed's example configs load unchanged.


@pytest.mark.parametrize("text", [SEED_ALL, SEED_PER_GPU], ids=["seed-all", "seed-per-gpu"])
def test_seed_example_common_parts(text):
    c = parse(text)
    assert c.defaults == Defaults(interval_seconds=10.0)
    assert len(c.gpu_sections) == 1
    g = c.gpu_sections[0]
    assert (g.name, g.gpus, g.ignore_programs, g.line) == ("all", GpuSelection(all=True), ("nvidia-smi",), 6)
    assert c.tty == TtySection(enabled=True, whitelist=("user1", "user2"), idle_seconds=300.0)
    for p in c.processes:
        assert p.cmd == ("miner-run",)
        assert (p.dir, p.log) == ("/tmp", "/dev/null")
        assert (p.user, p.uid, p.gid, p.user_explicit) == ("nobody", NOBODY.pw_uid, NOBODY.pw_gid, False)
        assert not p.per_gpu and p.env == ()
    # Users named on the whitelist that this host lacks are warnings, not errors.
    for user in ("user1", "user2"):
        if _no_user(user):
            assert any(f"[tty] whitelist: no user {user!r}" in w for w in c.warnings), c.warnings
    assert all(w.startswith(f"{PATH}:") for w in c.warnings)


def _no_user(name):
    try:
        pwd.getpwnam(name)
    except KeyError:
        return True
    return False


def test_seed_example_all_gpus():
    c = parse(SEED_ALL)
    assert [(p.name, p.gpus, p.line) for p in c.processes] == [("all", GpuSelection(all=True), 13)]


def test_seed_example_per_gpu():
    c = parse(SEED_PER_GPU)
    got = [(p.name, p.gpus, p.line) for p in c.processes]
    assert got == [("0", GpuSelection(refs=(0,)), 13), ("1", GpuSelection(refs=(1,)), 22)]
    # The trailing blanks after `cmd=miner-run  ` are not part of the command.
    assert c.processes[1].cmd == ("miner-run",)


@pytest.mark.parametrize("text", [SEED_ALL, SEED_PER_GPU], ids=["seed-all", "seed-per-gpu"])
def test_seed_example_loads_from_a_root_only_file(tmp_path, text):
    path = write(tmp_path / "gpu_mon.conf", text)
    c = config.load(str(path), TRUSTED)
    assert c.path == str(path) and c.defaults.interval_seconds == 10.0
    assert c.tty.whitelist == ("user1", "user2")


def test_shipped_config_loads():
    path = ROOT / "conf" / "gpu_mon.conf"
    c = config.load(str(path))
    assert c.defaults == Defaults()
    assert [(g.name, g.gpus) for g in c.gpu_sections] == [("all", GpuSelection(all=True))]
    assert c.processes == ()
    assert c.tty == TtySection()
    assert c.warnings == (f"{path}: no [process-*] section: gpu-mon will only watch",)


def test_shipped_config_with_every_commented_key_enabled_is_valid():
    """Uncommenting the `;key = default` lines of conf/gpu_mon.conf keeps the defaults (it documents them)."""
    text = (ROOT / "conf" / "gpu_mon.conf").read_text()
    lines = []
    for line in text.splitlines():
        if re.match(r"^;\[?[a-z_-]+(\]| =)", line):
            line = line[1:]
        lines.append(line)
    c = parse("\n".join(lines) + "\n")
    assert c.defaults == Defaults()
    assert c.tty == TtySection()
    assert c.sentinel is not None and dataclasses.replace(c.sentinel, line=0) == SentinelSection()
    assert c.history == HistorySection()
    assert c.slurm is not None and c.slurm == SlurmSection(
        preemptible_partitions=("scavenger",), line=c.slurm.line
    )
    (g,) = c.gpu_sections
    assert (g.gpus, g.ignore_programs, g.ignore_users, g.busy_memory_mib, g.holder_grace_seconds) == (
        GpuSelection(all=True),
        (),
        (),
        1024,
        None,
    )
    assert (g.idle_holder_seconds, g.idle_holder_memory_mib, g.idle_holder_utilization_pct) == (7200, 1024, 1)
    (p,) = c.processes
    assert p.name == "stress" and p.cmd == ("/usr/bin/gpu-mon", "stress", "--memory", "88%")
    assert (p.gpus, p.per_gpu, p.dir, p.log, p.env) == (GpuSelection(all=True), False, "/", None, ())
    assert (p.user, p.gid) == ("nobody", NOBODY.pw_gid)
    assert p.stop_signal == signal.SIGTERM
    assert p.stop_timeout_seconds is None and p.urgent_stop_timeout_seconds is None
    assert c.metrics is not None
    assert (c.metrics.textfile, c.metrics.listen) == (
        "/var/lib/prometheus/node-exporter/gpu_mon.prom",
        ("127.0.0.1", 9842),
    )


# ---------------------------------------------------------------------------------------------------------
# Valid configs


def test_every_key_at_a_non_default_value():
    c = parse(EVERY_KEY)
    assert c.defaults == Defaults(
        interval_seconds=0.5,
        start_delay_seconds=0.0,
        stop_timeout_seconds=3.0,
        restart_delay_seconds=1.5,
        restart_delay_max_seconds=30.0,
        healthy_run_seconds=5.0,
        full_scan_seconds=7.0,
        watch_opens=False,
        state_file="/var/lib/gpu_mon/state.json",
        containment="subreaper",
    )
    (g,) = c.gpu_sections
    assert g.name == "a" and g.line == 12
    assert g.gpus == GpuSelection(refs=(0, UUID1))
    assert g.ignore_programs == ("nvitop", "gpustat")
    assert g.ignore_users == ("root",)
    assert g.busy_memory_mib == 0
    assert g.holder_grace_seconds == 45.0
    (p,) = c.processes
    assert p.name == "miner" and p.line == 19
    assert p.cmd == ("/opt/miner", "--pool", "a b")
    assert p.gpus == GpuSelection(refs=(1,))
    assert (p.dir, p.log) == ("/srv/miner", "/var/log/miner.log")
    assert (p.user, p.uid, p.user_explicit) == ("nobody", NOBODY.pw_uid, True)
    assert (p.group, p.gid) == ("root", 0)
    assert p.groups == tuple(sorted(set(os.getgrouplist("nobody", 0))))
    assert p.env == (("A", "1"), ("B", "x y"))
    assert p.per_gpu is True
    assert c.tty == TtySection(
        enabled=True, whitelist=("root",), idle_seconds=60.0, devices=("/dev/pts/*", "/dev/ttyS*")
    )
    assert c.warnings == ()


def test_defaults_of_every_section():
    c = parse("[gpu-x]\ngpus = 0\n[process-y]\ncmd = run\n")
    (g,) = c.gpu_sections
    assert (g.ignore_programs, g.ignore_users, g.busy_memory_mib, g.holder_grace_seconds) == (
        (),
        (),
        1024,
        None,
    )
    (p,) = c.processes
    assert p.gpus == GpuSelection(all=True)
    assert (p.dir, p.log, p.env, p.per_gpu) == ("/", None, (), False)
    assert (p.user, p.uid, p.gid, p.user_explicit) == ("nobody", NOBODY.pw_uid, NOBODY.pw_gid, False)
    assert p.group == grp.getgrgid(NOBODY.pw_gid).gr_name
    assert p.groups == tuple(sorted(set(os.getgrouplist("nobody", NOBODY.pw_gid))))
    assert c.defaults == Defaults() and c.tty == TtySection()
    assert c.warnings == ()


def _gpus(c):
    return c.gpu_sections[0].gpus


def _proc(c):
    return c.processes[0]


VALID = [
    ("gpus-all-lowercase", "[gpu-a]\ngpus = all\n", _gpus, GpuSelection(all=True)),
    ("gpus-index-list", "[gpu-a]\ngpus = 3, 1,2\n", _gpus, GpuSelection(refs=(3, 1, 2))),
    ("gpus-largest-index", "[gpu-a]\ngpus = 4096\n", _gpus, GpuSelection(refs=(4096,))),
    ("gpus-uuid", f"[gpu-a]\ngpus = {UUID0}\n", _gpus, GpuSelection(refs=(UUID0,))),
    ("gpus-mig-uuid", f"[gpu-a]\ngpus = {MIG}\n", _gpus, GpuSelection(refs=(MIG,))),
    (
        "gpus-mixed-index-uuid",
        f"[gpu-a]\ngpus = 0,{UUID1} , 2\n",
        _gpus,
        GpuSelection(refs=(0, UUID1, 2)),
    ),
    ("gpus-newline-list", "[gpu-a]\ngpus = 0,\n  1\n  2\n", _gpus, GpuSelection(refs=(0, 1, 2))),
    ("colon-syntax", "[defaults]\ninterval_seconds: 4\n", lambda c: c.defaults.interval_seconds, 4.0),
    ("colon-before-equals", "[process-a]\ncmd: run --x=1\n", lambda c: _proc(c).cmd, ("run", "--x=1")),
    ("equals-before-colon", "[process-a]\ncmd = run a:b\n", lambda c: _proc(c).cmd, ("run", "a:b")),
    ("no-blanks", "[defaults]\nstop_timeout_seconds=4\n", lambda c: c.defaults.stop_timeout_seconds, 4.0),
    (
        "continuation-lines",
        "[gpu-a]\ngpus = 0\nignore_programs = a,\n    b,\n\tc\n",
        lambda c: c.gpu_sections[0].ignore_programs,
        ("a", "b", "c"),
    ),
    (
        "continuation-of-empty-value",
        "[tty]\nwhitelist =\n  root\n  nobody\n",
        lambda c: c.tty.whitelist,
        ("root", "nobody"),
    ),
    (
        "continuation-of-cmd",
        "[process-a]\ncmd = /bin/run\n   --flag 'a b'\n",
        lambda c: _proc(c).cmd,
        ("/bin/run", "--flag", "a b"),
    ),
    (
        "comment-inside-continuation",
        "[process-a]\ncmd = /bin/run\n; a comment\n  --flag\n",
        lambda c: _proc(c).cmd,
        ("/bin/run", "--flag"),
    ),
    (
        "hash-and-semicolon-comments",
        "# top\n[defaults]\n; one\n  # indented\ninterval_seconds = 3\n#interval_seconds = 9\n",
        lambda c: c.defaults.interval_seconds,
        3.0,
    ),
    (
        "case-insensitive-keys",
        "[defaults]\nInterval_SECONDS = 6\n",
        lambda c: c.defaults.interval_seconds,
        6.0,
    ),
    ("crlf", "[defaults]\r\ninterval_seconds = 7\r\n", lambda c: c.defaults.interval_seconds, 7.0),
    ("bom", "\ufeff[defaults]\ninterval_seconds = 8\n", lambda c: c.defaults.interval_seconds, 8.0),
    ("no-final-newline", "[defaults]\ninterval_seconds = 9", lambda c: c.defaults.interval_seconds, 9.0),
    (
        "unicode-value-and-comment",
        "; café ☕ 矿工\n[process-a]\ncmd = /opt/mïner --tag 矿工\n",
        lambda c: _proc(c).cmd,
        ("/opt/mïner", "--tag", "矿工"),
    ),
    (
        "env-quoted",
        '[process-a]\ncmd = x\nenv = A=1 B="x y" C= D=a=b\n',
        lambda c: _proc(c).env,
        (("A", "1"), ("B", "x y"), ("C", ""), ("D", "a=b")),
    ),
    (
        "cmd-quotes",
        "[process-a]\ncmd = sh -c 'echo \"$X\"'\n",
        lambda c: _proc(c).cmd,
        ("sh", "-c", 'echo "$X"'),
    ),
    ("cmd-hash-is-an-argument", "[process-a]\ncmd = run # x\n", lambda c: _proc(c).cmd, ("run", "#", "x")),
    ("per-gpu-on", "[process-a]\ncmd = x\nper_gpu = on\n", lambda c: _proc(c).per_gpu, True),
    ("per-gpu-1", "[process-a]\ncmd = x\nper_gpu = 1\n", lambda c: _proc(c).per_gpu, True),
    ("per-gpu-no", "[process-a]\ncmd = x\nper_gpu = NO\n", lambda c: _proc(c).per_gpu, False),
    ("tty-enabled-false", "[tty]\nenabled = False\n", lambda c: c.tty.enabled, False),
    ("tty-enabled-off", "[tty]\nenabled = off\n", lambda c: c.tty.enabled, False),
    (
        "holder-grace",
        "[gpu-a]\ngpus = 0\nholder_grace_seconds = 2.5\n",
        lambda c: c.gpu_sections[0].holder_grace_seconds,
        2.5,
    ),
    (
        "holder-grace-empty-is-off",
        "[gpu-a]\ngpus = 0\nholder_grace_seconds =\n",
        lambda c: c.gpu_sections[0].holder_grace_seconds,
        None,
    ),
    ("log-empty-is-the-daemons-log", "[process-a]\ncmd = x\nlog =\n", lambda c: _proc(c).log, None),
    (
        "group-empty-is-the-primary-group",
        "[process-a]\ncmd = x\nuser = root\ngroup =\n",
        lambda c: (_proc(c).group, _proc(c).gid),
        ("root", 0),
    ),
    (
        "holder-grace-zero",
        "[gpu-a]\ngpus = 0\nholder_grace_seconds = 0\n",
        lambda c: c.gpu_sections[0].holder_grace_seconds,
        0.0,
    ),
    (
        "start-delay-zero",
        "[defaults]\nstart_delay_seconds = 0\n",
        lambda c: c.defaults.start_delay_seconds,
        0.0,
    ),
    (
        "one-year",
        "[defaults]\nhealthy_run_seconds = 31536000\n",
        lambda c: c.defaults.healthy_run_seconds,
        31536000,
    ),
    ("exponent", "[defaults]\nfull_scan_seconds = 1e2\n", lambda c: c.defaults.full_scan_seconds, 100.0),
    (
        "busy-memory-max",
        "[gpu-a]\ngpus=0\nbusy_memory_mib = 1073741824\n",
        lambda c: c.gpu_sections[0].busy_memory_mib,
        1 << 30,
    ),
    (
        "devices-blank-separated",
        "[tty]\ndevices = /dev/pts/*   /dev/tty[0-9]*\n",
        lambda c: c.tty.devices,
        ("/dev/pts/*", "/dev/tty[0-9]*"),
    ),
    (
        "empty-ignore-list",
        "[gpu-a]\ngpus = 0\nignore_programs =\n",
        lambda c: c.gpu_sections[0].ignore_programs,
        (),
    ),
    (
        "sections-in-any-order",
        "[tty]\nenabled = yes\n[process-b]\ncmd = y\n[gpu-a]\ngpus = 1\n[defaults]\ninterval_seconds = 5\n",
        lambda c: (c.tty.enabled, _proc(c).name, c.gpu_sections[0].name, c.defaults.interval_seconds),
        (True, "b", "a", 5.0),
    ),
    (
        "section-name-characters",
        "[gpu-A_b.c:1-2]\ngpus = 0\n",
        lambda c: c.gpu_sections[0].name,
        "A_b.c:1-2",
    ),
    (
        "disjoint-gpu-sections",
        f"[gpu-a]\ngpus = 0, {UUID0}\n[gpu-b]\ngpus = 1, {UUID1}\n",
        lambda c: [g.gpus.refs for g in c.gpu_sections],
        [(0, UUID0), (1, UUID1)],
    ),
    (
        "several-processes",
        "[process-a]\ncmd = x\n[process-b]\ncmd = y\ngpus = 0\n",
        lambda c: [(p.name, p.cmd, p.line) for p in c.processes],
        [("a", ("x",), 1), ("b", ("y",), 3)],
    ),
]


@pytest.mark.parametrize(("text", "get", "expected"), [c[1:] for c in VALID], ids=[c[0] for c in VALID])
def test_valid(text, get, expected):
    assert get(parse(text)) == expected


PATHS = [
    (
        "relative",
        "work",
        "log/m.log",
        "state.json",
        "/srv/gpu/work",
        "/srv/gpu/log/m.log",
        "/srv/gpu/state.json",
    ),
    ("dotdot", "../w", "./../l.log", "../run/s.json", "/srv/w", "/srv/l.log", "/srv/run/s.json"),
    ("absolute", "/tmp", "/dev/null", "/run/s.json", "/tmp", "/dev/null", "/run/s.json"),
    ("normalised", "/tmp//a/./b/", "/var/log/../log/x", "/run//s", "/tmp/a/b", "/var/log/x", "/run/s"),
]


@pytest.mark.parametrize(
    ("d", "log", "state", "want_d", "want_log", "want_state"),
    [p[1:] for p in PATHS],
    ids=[p[0] for p in PATHS],
)
def test_paths_are_relative_to_the_config_file(d, log, state, want_d, want_log, want_state):
    c = parse(
        f"[defaults]\nstate_file = {state}\n[process-a]\ncmd = x\ndir = {d}\nlog = {log}\n",
        "/srv/gpu/gpu_mon.conf",
    )
    assert (c.processes[0].dir, c.processes[0].log, c.defaults.state_file) == (want_d, want_log, want_state)


def test_relative_paths_of_a_loaded_file(tmp_path):
    path = write(
        tmp_path / "gpu_mon.conf", "[defaults]\nstate_file = s.json\n[process-a]\ncmd = x\nlog = l.log\n"
    )
    c = config.load(str(path), TRUSTED)
    assert c.defaults.state_file == str(tmp_path / "s.json")
    assert c.processes[0].log == str(tmp_path / "l.log")


def test_tilde_in_a_path_is_the_daemons_home():
    c = parse("[process-a]\ncmd = x\ndir = ~/miner\n")
    assert c.processes[0].dir == os.path.normpath(os.path.expanduser("~/miner"))


def test_user_root_written_explicitly_is_a_warning():
    c = parse("[process-a]\ncmd = x\nuser = root\n")
    p = c.processes[0]
    assert (p.user, p.uid, p.gid, p.user_explicit) == ("root", 0, 0, True)
    assert p.groups == tuple(sorted(set(os.getgrouplist("root", 0))))
    assert p.home == pwd.getpwnam("root").pw_dir
    (warning,) = [w for w in c.warnings if "root" in w]
    assert warning.startswith(f"{PATH}:3: [process-a] user: runs as root")


def test_default_user_is_nobody_without_a_warning():
    c = parse("[gpu-a]\ngpus = ALL\n[process-a]\ncmd = x\n")
    p = c.processes[0]
    assert (p.user, p.uid, p.user_explicit) == ("nobody", NOBODY.pw_uid, False)
    assert c.warnings == ()


def test_group_overrides_the_primary_group_and_supplementary_groups_follow_the_user():
    c = parse("[process-a]\ncmd = x\nuser = nobody\ngroup = daemon\n")
    p = c.processes[0]
    gid = grp.getgrnam("daemon").gr_gid
    assert (p.group, p.gid) == ("daemon", gid)
    assert p.groups == tuple(sorted(set(os.getgrouplist("nobody", gid))))
    assert gid in p.groups


def test_supplementary_groups_come_from_getgrouplist(monkeypatch):
    """The workload gets the user's own supplementary groups (e.g. `video`), sorted, without duplicates."""
    calls = []

    def grouplist(user, gid):
        calls.append((user, gid))
        return [44, gid, 27, 44]

    monkeypatch.setattr(config.os, "getgrouplist", grouplist)
    p = parse("[process-a]\ncmd = x\nuser = nobody\n").processes[0]
    assert calls == [("nobody", NOBODY.pw_gid)]
    assert p.groups == tuple(sorted({27, 44, NOBODY.pw_gid}))


@pytest.mark.skipif(not IS_ROOT, reason="makes a user and a group: needs root")
def test_supplementary_groups_of_a_real_user():
    """A user made here, in a secondary group made here (a fresh machine may have no such user)."""
    with made_user("gmcfgsecondary", groups=("gmcfgextra",)) as user:
        extra = grp.getgrnam("gmcfgextra").gr_gid
        p = parse("[process-a]\ncmd = x\nuser = gmcfgsecondary\n").processes[0]
        assert (p.user, p.uid, p.gid) == ("gmcfgsecondary", user.pw_uid, user.pw_gid)
        assert extra != user.pw_gid
        assert p.groups == tuple(sorted({user.pw_gid, extra}))


def test_supplementary_groups_fall_back_to_the_primary_group(monkeypatch):
    def grouplist(user, gid):
        raise OSError("no group database")

    monkeypatch.setattr(config.os, "getgrouplist", grouplist)
    p = parse("[process-a]\ncmd = x\ngroup = daemon\n").processes[0]
    assert p.groups == (grp.getgrnam("daemon").gr_gid,)


def test_unknown_ignore_users_are_warnings():
    c = parse("[gpu-a]\ngpus = 0\nignore_users = root, no-such-user-x1\n")
    assert c.gpu_sections[0].ignore_users == ("root", "no-such-user-x1")
    assert f"{PATH}:3: [gpu-a] ignore_users: no user 'no-such-user-x1' on this host" in c.warnings


def test_fingerprint_follows_the_raw_values():
    a = parse("[process-a]\ncmd = x\ngpus = 0\n").processes[0]
    b = parse("[process-a]\ngpus = 0\ncmd =  x\n").processes[0]
    c = parse("[process-a]\ncmd = y\ngpus = 0\n").processes[0]
    assert a.fingerprint == b.fingerprint == (("cmd", "x"), ("gpus", "0"))
    assert c.fingerprint != a.fingerprint


def test_config_is_frozen():
    c = parse(SEED_ALL)
    with pytest.raises(AttributeError):
        c.defaults.interval_seconds = 1  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------------------
# Invalid configs: exactly one error line each, with its line number, section/key and what is wrong.

INVALID = [
    # (id, text, line, "[section] key:" or "" for lexical errors, fragment)
    ("unknown-section", "[defualts]\ninterval_seconds = 1\n", 1, "[defualts]:", "did you mean [defaults]"),
    ("unknown-section-gpu", "[gpus-a]\ngpus = 0\n", 1, "[gpus-a]:", "did you mean [gpu-NAME]"),
    ("unknown-section-case", "[TTY]\n", 1, "[TTY]:", "did you mean [tty]"),
    ("unknown-section-empty", "[]\n", 1, "[]:", "unknown section"),
    (
        "unknown-key",
        "[defaults]\nintervl_seconds = 5\n",
        2,
        "[defaults] intervl_seconds:",
        "did you mean 'interval_seconds'",
    ),
    (
        "unknown-key-far",
        "[tty]\nfoo = 1\n",
        2,
        "[tty] foo:",
        "known keys: enabled, whitelist, idle_seconds, devices",
    ),
    ("seed-key-in-wrong-section", "[defaults]\ncmd = x\n", 2, "[defaults] cmd:", "unknown key"),
    (
        "key-with-blank",
        "[gpu-a]\ngpus = 0\nbusy memory mib = 1\n",
        3,
        "[gpu-a] busy memory mib:",
        "did you mean 'busy_memory_mib'",
    ),
    ("duplicate-section", "[tty]\nenabled = yes\n\n[tty]\n", 4, "", "[tty] appears twice (first at line 1)"),
    (
        "duplicate-key",
        "[defaults]\ninterval_seconds = 1\nINTERVAL_SECONDS = 2\n",
        3,
        "[defaults] interval_seconds:",
        "set twice (first at line 2)",
    ),
    (
        "key-before-section",
        "; c\ninterval_seconds = 1\n[defaults]\n",
        2,
        "",
        "'key = value' before any [section]",
    ),
    (
        "no-equals",
        "[defaults]\ninterval_seconds\n",
        2,
        "",
        "expected 'key = value' or '[section]', found 'interval_seconds'",
    ),
    ("empty-key", "[defaults]\n= 5\n", 2, "", "expected 'key = value'"),
    (
        "missing-bracket",
        "[defaults\ninterval_seconds = 1\n",
        1,
        "",
        "section header is missing its closing ']'",
    ),
    ("comment-after-header", "[tty] ; c\nenabled = yes\n", 1, "", "text after the section header's ']'"),
    ("bad-section-name-empty", "[gpu-]\ngpus = 0\n", 1, "[gpu-]:", "bad section name"),
    ("bad-section-name-blank", "[process-a b]\ncmd = x\n", 1, "[process-a b]:", "bad section name"),
    ("bad-section-name-unicode", "[gpu-矿工]\ngpus = 0\n", 1, "[gpu-矿工]:", "bad section name"),
    ("unicode-section", "[矿工]\n", 1, "[矿工]:", "unknown section"),
    ("gpus-missing", "[gpu-a]\nignore_programs = x\n", 1, "[gpu-a] gpus:", "missing"),
    ("gpus-empty", "[gpu-a]\ngpus =\n", 2, "[gpu-a] gpus:", "is empty"),
    ("gpus-empty-item", "[gpu-a]\ngpus = 0,,1\n", 2, "[gpu-a] gpus:", "empty item in the list"),
    ("gpus-trailing-comma", "[gpu-a]\ngpus = 0,\n", 2, "[gpu-a] gpus:", "empty item in the list"),
    ("gpus-not-a-ref", "[gpu-a]\ngpus = x\n", 2, "[gpu-a] gpus:", "'x' is not a GPU index or UUID"),
    ("gpus-negative", "[gpu-a]\ngpus = -1\n", 2, "[gpu-a] gpus:", "'-1' is not a GPU index or UUID"),
    (
        "gpus-huge-index",
        "[gpu-a]\ngpus = 4097\n",
        2,
        "[gpu-a] gpus:",
        "'4097' is not a GPU index (too large)",
    ),
    ("gpus-enormous-index", "[gpu-a]\ngpus = " + "9" * 5000 + "\n", 2, "[gpu-a] gpus:", "(too large)"),
    ("gpus-unicode-digit", "[gpu-a]\ngpus = ٣\n", 2, "[gpu-a] gpus:", "is not a GPU index or UUID"),
    (
        "gpus-lowercase-uuid-prefix",
        "[gpu-a]\ngpus = gpu-5a1c\n",
        2,
        "[gpu-a] gpus:",
        "is not a GPU index or UUID",
    ),
    ("gpus-bare-prefix", "[gpu-a]\ngpus = GPU-\n", 2, "[gpu-a] gpus:", "is not a GPU index or UUID"),
    ("gpus-duplicate-index", "[gpu-a]\ngpus = 0, 1, 0\n", 2, "[gpu-a] gpus:", "'0' is listed twice"),
    ("gpus-duplicate-uuid", f"[gpu-a]\ngpus = {UUID0},{UUID0}\n", 2, "[gpu-a] gpus:", "is listed twice"),
    ("gpus-all-in-list", "[gpu-a]\ngpus = ALL, 0\n", 2, "[gpu-a] gpus:", "ALL means every GPU and cannot be"),
    (
        "gpus-all-7",
        "[gpu-a]\ngpus = ALL, 7\n",
        2,
        "[gpu-a] gpus:",
        "'ALL, 7': ALL means every GPU and cannot",
    ),
    (
        "process-gpus-bad",
        "[process-a]\ncmd = x\ngpus = 1.5\n",
        3,
        "[process-a] gpus:",
        "'1.5' is not a GPU index",
    ),
    (
        "seconds-negative",
        "[defaults]\nstart_delay_seconds = -1\n",
        2,
        "[defaults] start_delay_seconds:",
        "must be at least 0",
    ),
    (
        "seconds-text",
        "[defaults]\nstop_timeout_seconds = ten\n",
        2,
        "[defaults] stop_timeout_seconds:",
        "'ten' is not a number of seconds",
    ),
    ("seconds-with-unit", "[tty]\nidle_seconds = 5m\n", 2, "[tty] idle_seconds:", "not a number of seconds"),
    (
        "seconds-empty",
        "[defaults]\nhealthy_run_seconds =\n",
        2,
        "[defaults] healthy_run_seconds:",
        "not a number of seconds",
    ),
    (
        "seconds-nan",
        "[defaults]\nrestart_delay_seconds = nan\n",
        2,
        "[defaults] restart_delay_seconds:",
        "not a finite number",
    ),
    ("seconds-inf", "[tty]\nidle_seconds = inf\n", 2, "[tty] idle_seconds:", "not a finite number"),
    (
        "seconds-overflow",
        "[defaults]\nfull_scan_seconds = 1e400\n",
        2,
        "[defaults] full_scan_seconds:",
        "not a finite number",
    ),
    (
        "seconds-huge",
        "[defaults]\nstart_delay_seconds = 1e9\n",
        2,
        "[defaults] start_delay_seconds:",
        "too large (at most 31536000 seconds",
    ),
    (
        "interval-zero",
        "[defaults]\ninterval_seconds = 0\n",
        2,
        "[defaults] interval_seconds:",
        "'0' must be at least 0.1",
    ),
    (
        "interval-too-small",
        "[defaults]\ninterval_seconds = 0.001\n",
        2,
        "[defaults] interval_seconds:",
        "'0.001' must be at least 0.1",
    ),
    (
        "restart-delay-too-small",
        "[defaults]\nrestart_delay_seconds = 0\n",
        2,
        "[defaults] restart_delay_seconds:",
        "must be at least 0.1",
    ),
    (
        "stop-timeout-zero",
        "[defaults]\nstop_timeout_seconds = 0.0\n",
        2,
        "[defaults] stop_timeout_seconds:",
        "must be greater than 0",
    ),
    (
        "full-scan-zero",
        "[defaults]\nfull_scan_seconds = 0\n",
        2,
        "[defaults] full_scan_seconds:",
        "must be at least 1",
    ),
    (
        "holder-grace-negative",
        "[gpu-a]\ngpus = 0\nholder_grace_seconds = -5\n",
        3,
        "[gpu-a] holder_grace_seconds:",
        "at least 0",
    ),
    (
        "busy-memory-negative",
        "[gpu-a]\ngpus = 0\nbusy_memory_mib = -1\n",
        3,
        "[gpu-a] busy_memory_mib:",
        "must be 0 or more",
    ),
    (
        "busy-memory-fraction",
        "[gpu-a]\ngpus = 0\nbusy_memory_mib = 1.5\n",
        3,
        "[gpu-a] busy_memory_mib:",
        "not a whole number of MiB",
    ),
    (
        "busy-memory-unit",
        "[gpu-a]\ngpus = 0\nbusy_memory_mib = 1GiB\n",
        3,
        "[gpu-a] busy_memory_mib:",
        "not a whole number of MiB",
    ),
    (
        "busy-memory-huge",
        "[gpu-a]\ngpus = 0\nbusy_memory_mib = 1073741825\n",
        3,
        "[gpu-a] busy_memory_mib:",
        "too large",
    ),
    (
        "busy-memory-enormous",
        "[gpu-a]\ngpus = 0\nbusy_memory_mib = " + "9" * 5000 + "\n",
        3,
        "[gpu-a] busy_memory_mib:",
        "too large",
    ),
    ("bool-bad", "[tty]\nenabled = maybe\n", 2, "[tty] enabled:", "'maybe' is not a boolean"),
    ("bool-empty", "[tty]\nenabled =\n", 2, "[tty] enabled:", "is not a boolean"),
    ("per-gpu-bad", "[process-a]\ncmd = x\nper_gpu = 2\n", 3, "[process-a] per_gpu:", "'2' is not a boolean"),
    ("cmd-missing", "[process-a]\ngpus = ALL\n", 1, "[process-a] cmd:", "missing"),
    ("cmd-empty", "[process-a]\ncmd =\n", 2, "[process-a] cmd:", "is empty"),
    ("cmd-blank", "[process-a]\ncmd =    \n", 2, "[process-a] cmd:", "is empty"),
    (
        "cmd-empty-program",
        "[process-a]\ncmd = '' --flag\n",
        2,
        "[process-a] cmd:",
        "the program name is empty",
    ),
    ("cmd-unbalanced-quote", '[process-a]\ncmd = echo "hi\n', 2, "[process-a] cmd:", "No closing quotation"),
    ("cmd-trailing-backslash", "[process-a]\ncmd = echo \\\n", 2, "[process-a] cmd:", "cannot split"),
    (
        "env-unbalanced-quote",
        "[process-a]\ncmd = x\nenv = A='1\n",
        3,
        "[process-a] env:",
        "No closing quotation",
    ),
    (
        "env-no-equals",
        "[process-a]\ncmd = x\nenv = A=1 FOO\n",
        3,
        "[process-a] env:",
        "'FOO' is not NAME=VALUE",
    ),
    ("env-bad-name", "[process-a]\ncmd = x\nenv = 1A=2\n", 3, "[process-a] env:", "'1A=2' is not NAME=VALUE"),
    ("env-empty-name", "[process-a]\ncmd = x\nenv = =2\n", 3, "[process-a] env:", "is not NAME=VALUE"),
    (
        "env-reserved",
        "[process-a]\ncmd = x\nenv = CUDA_VISIBLE_DEVICES=0\n",
        3,
        "[process-a] env:",
        "CUDA_VISIBLE_DEVICES is set by gpu-mon itself",
    ),
    (
        "user-unknown",
        "[process-a]\ncmd = x\nuser = no-such-user-x1\n",
        3,
        "[process-a] user:",
        "no such user 'no-such-user-x1'",
    ),
    ("user-empty", "[process-a]\ncmd = x\nuser =\n", 3, "[process-a] user:", "no such user ''"),
    ("user-uid-number", "[process-a]\ncmd = x\nuser = 0\n", 3, "[process-a] user:", "no such user '0'"),
    (
        "group-unknown",
        "[process-a]\ncmd = x\ngroup = no-such-group-x1\n",
        3,
        "[process-a] group:",
        "no such group 'no-such-group-x1'",
    ),
    ("dir-empty", "[process-a]\ncmd = x\ndir =\n", 3, "[process-a] dir:", "is empty"),
    ("state-file-empty", "[defaults]\nstate_file =\n", 2, "[defaults] state_file:", "is empty"),
    ("devices-empty", "[tty]\ndevices = ,\n", 2, "[tty] devices:", "is empty"),
    ("whitelist-stray-comma", "[tty]\nwhitelist = a,,b\n", 2, "[tty] whitelist:", "empty item"),
    (
        "same-gpu-twice",
        "[gpu-a]\ngpus = 0\n[gpu-b]\ngpus = 1,0\n",
        3,
        "[gpu-b] gpus:",
        "0 is already named by [gpu-a]",
    ),
    (
        "same-uuid-twice",
        f"[gpu-a]\ngpus = {UUID0}\n[gpu-b]\ngpus = {UUID0}\n",
        3,
        "[gpu-b] gpus:",
        f"{UUID0} is already named by [gpu-a]",
    ),
    (
        "all-after-list",
        "[gpu-a]\ngpus = 0\n[gpu-b]\ngpus = ALL\n",
        3,
        "[gpu-b] gpus:",
        "ALL overlaps another [gpu-*] section",
    ),
    (
        "list-after-all",
        "[gpu-a]\ngpus = ALL\n[gpu-b]\ngpus = 1\n",
        3,
        "[gpu-b] gpus:",
        "overlaps [gpu-a] which names ALL",
    ),
    ("all-twice", "[gpu-a]\ngpus = ALL\n[gpu-b]\ngpus = all\n", 3, "[gpu-b] gpus:", "ALL overlaps"),
    (
        "restart-max-below-delay",
        "[defaults]\nrestart_delay_seconds = 20\nrestart_delay_max_seconds = 10\n",
        3,
        "[defaults] restart_delay_max_seconds:",
        "must be at least restart_delay_seconds (20)",
    ),
    (
        "restart-max-below-default-delay",
        "[defaults]\nrestart_delay_max_seconds = 5\n",
        2,
        "[defaults] restart_delay_max_seconds:",
        "must be at least restart_delay_seconds (10)",
    ),
    (
        "restart-delay-above-default-max",
        "[defaults]\nrestart_delay_seconds = 700\n",
        2,
        "[defaults] restart_delay_seconds:",
        "must be at most restart_delay_max_seconds (600, the default)",
    ),
    ("control-char-in-value", "[process-a]\ncmd = run\x1b[31m\n", 2, "", "control character U+001B"),
    ("nul-in-value", "[process-a]\ncmd = a\x00b\n", 2, "", "control character U+0000"),
    ("form-feed-in-key-line", "[defaults]\ninterval_seconds = 1\x0c\n", 2, "", "control character U+000C"),
    (
        "bare-cr",
        "[defaults]\ninterval_seconds = 1\rstart_delay_seconds = 2\n",
        2,
        "",
        "control character U+000D",
    ),
]


INVALID += [
    ("history-key", "[history]\nretention = 3\n", 2, "[history] retention: ", "retention_days"),
    ("history-sample", "[history]\nsample_seconds = 0.1\n", 2, "[history] sample_seconds: ", "at least 1"),
    (
        "idle-pct",
        "[gpu-a]\ngpus = 0\nidle_holder_utilization_pct = 200\n",
        3,
        "[gpu-a] idle_holder",
        "0 to 100",
    ),
    ("sentinel-threshold", "[sentinel]\narm_threshold = 70\n", 2, "[sentinel] arm_threshold: ", "fraction"),
    ("sentinel-action", "[sentinel]\nkill_action = halt\n", 2, "[sentinel] kill_action: ", "not one of"),
    ("sentinel-no-cmd", "[sentinel]\nkill_action = command\n", 2, "[sentinel] command: ", "needs command"),
    ("sentinel-cmd-unused", "[sentinel]\ncommand = x\n", 2, "[sentinel] command: ", "only used with"),
    (
        "sentinel-key",
        "[sentinel]\narm_duration = 3\n",
        2,
        "[sentinel] arm_duration: ",
        "arm_duration_seconds",
    ),
    (
        "sentinel-negative",
        "[sentinel]\nkill_duration_seconds = -1\n",
        2,
        "[sentinel] kill_duration",
        "at least 0",
    ),
    ("sentinel-typo", "[sentinal]\n", 1, "[sentinal]: ", "did you mean [sentinel]"),
]


def test_sentinel_section():
    c = parse(
        "[sentinel]\nkill_action = command\ncommand = /usr/bin/notify 'GPUs idle'\n"
        "gpus = 1, 0\naggregate = max\n"
    )
    assert c.sentinel is not None
    assert (c.sentinel.command, c.sentinel.gpus, c.sentinel.aggregate) == (
        ("/usr/bin/notify", "GPUs idle"),
        GpuSelection(refs=(1, 0)),
        "max",
    )
    assert parse("[tty]\n").sentinel is None  # off unless written


@pytest.mark.parametrize(
    ("text", "line", "head", "fragment"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_invalid(text, line, head, fragment):
    errors = errors_of(text)
    assert len(errors) == 1, errors
    (error,) = errors
    prefix = f"{PATH}:{line}: {head}"
    assert error.startswith(prefix), (error, prefix)
    assert fragment in error, (error, fragment)
    assert "\n" not in error and len(error) < 400


def test_error_lines_use_the_given_path():
    (error,) = errors_of("[tty]\nenabled = maybe\n", "/srv/x y/gpu.conf")
    assert error.startswith("/srv/x y/gpu.conf:2: [tty] enabled: ")


def test_unknown_user_and_unknown_group_are_both_reported():
    errors = errors_of("[process-a]\ncmd = x\nuser = no-such-user-x1\ngroup = no-such-group-x1\n")
    assert errors == [
        f"{PATH}:3: [process-a] user: no such user 'no-such-user-x1'",
        f"{PATH}:4: [process-a] group: no such group 'no-such-group-x1'",
    ]


def test_keys_of_a_broken_section_are_not_reported_again():
    """A duplicate or unclosed header is one error; its keys are not 'before any section' too."""
    errors = errors_of(
        "[defaults\ninterval_seconds = x\nstop_timeout_seconds = 1\n[tty]\n[tty]\nenabled = 7\n"
    )
    assert [e.split(": ", 1)[0] for e in errors] == [f"{PATH}:1", f"{PATH}:5"]


def test_a_bad_value_is_not_reported_twice_by_the_restart_check():
    errors = errors_of("[defaults]\nrestart_delay_seconds = 700\nrestart_delay_max_seconds = x\n")
    assert errors == [f"{PATH}:3: [defaults] restart_delay_max_seconds: 'x' is not a number of seconds"]


def test_all_errors_at_once_sorted_by_line():
    text = (
        "[gpu-a]\n"  # 1
        "gpus = 0\n"  # 2
        "[gpu-b]\n"  # 3: overlaps [gpu-a] (found last, by the cross-check)
        "gpus = 0\n"  # 4
        "[defaults]\n"  # 5
        "intervl_seconds = 5\n"  # 6: unknown key
        "[process-x]\n"  # 7
        "cmd = 'unbalanced\n"  # 8: bad cmd
        "env = CUDA_VISIBLE_DEVICES=1\n"  # 9: reserved
        "[tty]\n"  # 10
        "enabled = maybe\n"  # 11: bad boolean
        "this line has no equals sign\n"  # 12: lexical error (found first)
    )
    errors = errors_of(text)
    lines = [int(e.split(":")[1]) for e in errors]
    assert lines == [3, 6, 8, 9, 11, 12], errors
    assert errors[0].startswith(f"{PATH}:3: [gpu-b] gpus: 0 is already named by [gpu-a]")
    assert errors[1].startswith(f"{PATH}:6: [defaults] intervl_seconds: unknown key")
    assert errors[2].startswith(f"{PATH}:8: [process-x] cmd: cannot split")
    assert errors[3].startswith(f"{PATH}:9: [process-x] env: CUDA_VISIBLE_DEVICES")
    assert errors[4].startswith(f"{PATH}:11: [tty] enabled: 'maybe'")
    assert errors[5].startswith(f"{PATH}:12: expected 'key = value'")


def test_five_problems_five_lines():
    text = "[gpu-a]\ngpus = x\n[process-p]\nuser = no-such-user-x1\n[tty]\nenabled = 2\nidle_seconds = -1\n"
    errors = errors_of(text)
    assert len(errors) == 5, errors
    assert [int(e.split(":")[1]) for e in errors] == [2, 3, 4, 6, 7]


def test_errors_reported_across_many_sections():
    text = "".join(f"[gpu-s{i}]\ngpus = x{i}\n" for i in range(50))
    errors = errors_of(text)
    assert [int(e.split(":")[1]) for e in errors] == list(range(2, 101, 2))


# ---------------------------------------------------------------------------------------------------------
# Hostile input


def test_empty_file_is_valid_with_a_warning():
    c = parse("")
    assert (c.gpu_sections, c.processes, c.defaults, c.tty) == ((), (), Defaults(), TtySection())
    assert c.warnings == (f"{PATH}: no [gpu-*] section: no GPU is watched, so no workload will ever start",)


@pytest.mark.parametrize(
    "text",
    ["   \n\t\n  \n", "; only\n# comments\n   ; indented\n", "\ufeff", "\r\n\r\n", "\n" * 10000],
    ids=["whitespace", "comments", "bom-only", "crlf-blank", "many-blank-lines"],
)
def test_nothing_but_blanks_or_comments_is_an_empty_config(text):
    c = parse(text)
    assert c.gpu_sections == () and c.processes == ()
    assert "no GPU is watched" in c.warnings[0]


def test_line_numbers_count_only_newlines():
    """A form feed, U+2028 or U+0085 in a comment is not a line break: later line numbers stay right."""
    text = "; a\x0cb\n; c\u2028d\u0085e\u2029f\n[tty]\nenabled = maybe\n"
    (error,) = errors_of(text)
    assert error.startswith(f"{PATH}:4: [tty] enabled: ")


def test_crlf_line_numbers():
    (error,) = errors_of("[defaults]\r\n\r\ninterval_seconds = 0\r\n")
    assert error.startswith(f"{PATH}:3: [defaults] interval_seconds: ")


def test_very_long_lines():
    long_comment = "; " + "x" * 500_000 + "\n"
    c = parse(long_comment + "[defaults]\ninterval_seconds = 3\n")
    assert c.defaults.interval_seconds == 3
    # A huge bad value: still one short line, naming the key.
    (error,) = errors_of("[process-a]\ncmd = x\nper_gpu = " + "y" * 500_000 + "\n")
    assert error.startswith(f"{PATH}:3: [process-a] per_gpu: ")
    assert error.endswith("value too long (500000 characters; at most 65536)")
    assert len(error) < 400
    (error,) = errors_of("[tty]\n" + "k" * 300_000 + " = 1\n")
    assert error.startswith(f"{PATH}:2: [tty] kkkk") and len(error) < 400
    (error,) = errors_of("[tty]\n" + "z" * 300_000 + "\n")
    assert error.startswith(f"{PATH}:2: expected 'key = value'") and len(error) < 400


def test_long_valid_value_is_kept_whole():
    arg = "a" * 20_000
    assert parse(f"[process-a]\ncmd = run {arg}\n").processes[0].cmd == ("run", arg)


def test_ten_thousand_sections():
    text = "".join(f"[gpu-s{i}]\ngpus = GPU-{i:08x}\n" for i in range(10_000))
    c = parse(text)
    assert len(c.gpu_sections) == 10_000
    assert c.gpu_sections[-1].line == 19_999 and c.gpu_sections[-1].gpus.refs == ("GPU-0000270f",)


def test_ten_thousand_bad_sections_report_every_one():
    text = "".join(f"[gpu-s{i}]\n" for i in range(10_000))
    errors = errors_of(text)
    assert len(errors) == 10_000
    assert errors[-1].startswith(f"{PATH}:10000: [gpu-s9999] gpus: missing (use ALL or")


def test_control_characters_never_reach_the_messages():
    errors = errors_of("[gpu-\x1b]0;pwned\x07]\ngpus = 0\x1b[2J\n")
    assert errors, errors
    for error in errors:
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", error), error
    assert errors[0].startswith(f"{PATH}:1: control character U+001B")


def test_control_character_in_a_comment_is_ignored():
    assert parse("; bell \x07 here\n[tty]\nenabled = yes\n").tty.enabled


def test_tab_is_allowed():
    assert parse("[process-a]\ncmd =\t/bin/run\t--x\n").processes[0].cmd == ("/bin/run", "--x")


# ---------------------------------------------------------------------------------------------------------
# load(): the file itself


def test_load_bom_crlf_and_unicode(tmp_path):
    data = "\ufeff; café\r\n[process-a]\r\ncmd = /opt/mïner --tag 矿工\r\n".encode()
    c = config.load(str(write(tmp_path / "c.conf", data)), TRUSTED)
    assert c.processes[0].cmd == ("/opt/mïner", "--tag", "矿工")
    assert c.processes[0].line == 2


def test_load_empty_file(tmp_path):
    c = config.load(str(write(tmp_path / "c.conf", b"")), TRUSTED)
    assert "no GPU is watched" in c.warnings[0]


def test_load_reports_every_error_with_the_file_path(tmp_path):
    path = write(tmp_path / "c.conf", "[tty]\nenabled = maybe\n[defualts]\n")
    errors = load_errors(path, TRUSTED)
    assert [e.split(": ")[0] for e in errors] == [f"{path}:2", f"{path}:3"]


BAD_FILES = [
    ("too-large", b"; " + b"x" * (2 << 20) + b"\n", "too large ("),
    ("nul-bytes", b"[tty]\nenabled = yes\x00\n", "not a text file (NUL byte at offset 19)"),
    ("binary", bytes(range(256)) * 8, "not a text file (NUL byte at offset 0)"),
    ("invalid-utf8", b"[tty]\n; caf\xe9\n", "not UTF-8 text (bad byte at offset 11)"),
    ("latin1-value", b"[process-a]\ncmd = m\xefner\n", "not UTF-8 text (bad byte at offset 19)"),
    ("utf16", "[tty]\n".encode("utf-16"), "not a text file (NUL byte at offset 3)"),
]


@pytest.mark.parametrize(("data", "fragment"), [b[1:] for b in BAD_FILES], ids=[b[0] for b in BAD_FILES])
def test_load_refuses_bad_files_in_one_line(tmp_path, data, fragment):
    path = write(tmp_path / "c.conf", data)
    errors = load_errors(path)
    assert len(errors) == 1 and errors[0].startswith(f"{path}: {fragment}"), errors


def test_load_limit_is_one_mib(tmp_path):
    at_limit = b"[tty]\n" + b"; " + b"x" * (config.MAX_CONFIG_BYTES - 9) + b"\n"
    assert len(at_limit) == config.MAX_CONFIG_BYTES
    assert config.load(str(write(tmp_path / "a.conf", at_limit))).tty == TtySection()
    (error,) = load_errors(write(tmp_path / "b.conf", at_limit + b"\n"))
    limit = config.MAX_CONFIG_BYTES
    assert error == f"{tmp_path / 'b.conf'}: too large ({limit + 1} bytes; at most {limit})"


def test_load_missing_file(tmp_path):
    path = tmp_path / "nope.conf"
    assert load_errors(path) == [f"{path}: No such file or directory"]


def test_load_missing_directory(tmp_path):
    path = tmp_path / "no-dir" / "c.conf"
    assert load_errors(path) == [f"{path}: No such file or directory"]


def test_load_directory(tmp_path):
    assert load_errors(tmp_path) == [f"{tmp_path}: not a regular file"]


def test_load_fifo_does_not_block(tmp_path, alarm):
    path = tmp_path / "c.conf"
    os.mkfifo(path, 0o600)
    assert load_errors(path, TRUSTED) == [f"{path}: not a regular file"]


def test_load_socket(tmp_path):
    path = tmp_path / "c.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        (error,) = load_errors(path)
    assert error.startswith(f"{path}: not a regular file")


def test_load_device(tmp_path):
    assert load_errors("/dev/null") == ["/dev/null: not a regular file"]


def test_load_parent_is_a_file(tmp_path):
    write(tmp_path / "f", b"")
    (error,) = load_errors(tmp_path / "f" / "c.conf")
    assert error.startswith(f"{tmp_path / 'f'}: ") and "not a directory" in error


def test_without_trusted_uid_modes_are_not_checked(tmp_path):
    path = write(tmp_path / "c.conf", "[tty]\nenabled = yes\n", 0o666)
    assert config.load(str(path)).tty.enabled


def test_trusted_uid_for_this_process():
    assert config.trusted_uid_for_this_process() == (0 if IS_ROOT else None)


# ---------------------------------------------------------------------------------------------------------
# load(path, trusted_uid): the root-safety check. Each refusal is one line naming the path and why.


def test_root_only_file_is_accepted(tmp_path):
    path = write(tmp_path / "c.conf", "[tty]\nenabled = yes\n", 0o600)
    assert config.load(str(path), TRUSTED).tty.enabled
    os.chmod(path, 0o644)  # readable by others is fine: only writing matters
    assert config.load(str(path), TRUSTED).tty.enabled


@pytest.mark.parametrize(
    "mode", [0o620, 0o602, 0o666, 0o660], ids=["group-w", "other-w", "all-w", "group-rw"]
)
def test_writable_by_others_is_refused(tmp_path, mode):
    path = write(tmp_path / "c.conf", "[tty]\n", mode)
    (error,) = load_errors(path, TRUSTED)
    assert error.startswith(f"{path}: writable by group or others (refused")
    assert f"chmod go-w {path}" in error


@needs_root
def test_file_owned_by_another_user_is_refused(tmp_path):
    path = write(tmp_path / "c.conf", "[tty]\n", 0o600)
    os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    (error,) = load_errors(path, 0)
    assert error.startswith(f"{path}: owned by uid {NOBODY.pw_uid}, not root (refused")


@needs_root
def test_file_owned_by_the_trusted_uid_is_accepted(tmp_path):
    path = write(tmp_path / "c.conf", "[tty]\n", 0o600)
    os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    assert config.load(str(path), NOBODY.pw_uid).tty == TtySection()


def test_symlink_is_refused(tmp_path):
    target = write(tmp_path / "real.conf", "[tty]\n", 0o600)
    link = tmp_path / "c.conf"
    link.symlink_to(target)
    for trusted in (TRUSTED, None):
        (error,) = load_errors(link, trusted)
        assert error == f"{link}: is a symlink (refused: it could be redirected)"


def test_dangling_symlink_is_refused(tmp_path):
    link = tmp_path / "c.conf"
    link.symlink_to(tmp_path / "missing")
    (error,) = load_errors(link, TRUSTED)
    assert error == f"{link}: is a symlink (refused: it could be redirected)"


def test_symlinked_directory_is_resolved_and_checked(tmp_path):
    """A symlink in the directory part is resolved once (like /var/run -> /run); the real directories are
    then checked."""
    real = tmp_path / "real"
    real.mkdir(mode=0o755)
    write(real / "c.conf", "[tty]\nenabled = yes\n")
    (tmp_path / "link").symlink_to(real)
    assert config.load(str(tmp_path / "link" / "c.conf"), TRUSTED).tty.enabled
    os.chmod(real, 0o777)
    (error,) = load_errors(tmp_path / "link" / "c.conf", TRUSTED)
    assert error.startswith(f"{real}: directory is writable by group or others (refused); chmod go-w it")


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757], ids=["0777", "group-w", "other-w"])
def test_writable_parent_directory_is_refused(tmp_path, mode):
    d = tmp_path / "etc"
    d.mkdir()
    path = write(d / "c.conf", "[tty]\n")
    os.chmod(d, mode)
    (error,) = load_errors(path, TRUSTED)
    assert error.startswith(f"{d}: directory is writable by group or others (refused); chmod go-w it")


def test_writable_grandparent_directory_is_refused(tmp_path):
    top = tmp_path / "top"
    (top / "etc").mkdir(parents=True)
    path = write(top / "etc" / "c.conf", "[tty]\n")
    os.chmod(top, 0o777)
    (error,) = load_errors(path, TRUSTED)
    assert error.startswith(f"{top}: directory is writable by group or others (refused); chmod go-w it")


def test_sticky_world_writable_directory_owned_by_root_is_accepted(tmp_path):
    """Like /tmp: nobody else can rename or remove a root-owned file in it."""
    d = tmp_path / "sticky"
    d.mkdir()
    os.chmod(d, 0o1777)
    path = write(d / "c.conf", "[tty]\nenabled = yes\n")
    assert config.load(str(path), TRUSTED).tty.enabled


@needs_root
def test_sticky_directory_owned_by_another_user_is_refused(tmp_path):
    d = tmp_path / "sticky"
    d.mkdir()
    os.chmod(d, 0o1777)
    os.chown(d, NOBODY.pw_uid, NOBODY.pw_gid)
    path = write(d / "c.conf", "[tty]\n")
    (error,) = load_errors(path, 0)
    assert error.startswith(
        f"{d}: directory is owned by uid {NOBODY.pw_uid}, not root (refused: whoever owns it could swap"
    )


@needs_root
def test_directory_owned_by_another_user_is_refused(tmp_path):
    d = tmp_path / "etc"
    d.mkdir(mode=0o755)
    path = write(d / "c.conf", "[tty]\n")
    os.chown(d, NOBODY.pw_uid, NOBODY.pw_gid)
    (error,) = load_errors(path, 0)
    assert error.startswith(
        f"{d}: directory is owned by uid {NOBODY.pw_uid}, not root (refused: whoever owns it could swap"
    )


def test_refusals_are_one_line(tmp_path):
    path = write(tmp_path / "c.conf", "[tty]\n", 0o666)
    with pytest.raises(ConfigError) as info:
        config.load(str(path), TRUSTED)
    assert len(info.value.errors) == 1 and "\n" not in str(info.value)


def test_seconds_values_are_finite():
    """Every parsed duration is a finite float (NaN or inf never get through)."""
    c = parse(EVERY_KEY)
    for value in vars(c.defaults).values():
        if isinstance(value, float):
            assert math.isfinite(value)


def test_a_huge_config_parses_in_linear_time():
    # Was 27 s for a 1 MB cmd (shlex builds a word a character at a time) and quadratic in the number of
    # keys of a section. Bounded now: a value has a size limit, the splitter is linear (tests below).
    import time

    cases = [
        "[gpu-all]\ngpus = ALL\n[process-x]\ncmd = " + "a" * 1_000_000 + "\n",
        "[gpu-all]\ngpus = ALL\n[process-x]\ncmd = '" + "a b " * 16_000 + "'\n",
        "[gpu-all]\ngpus = ALL\n[process-x]\ncmd = a\n" + " b\n" * 300_000,
        "[process-x]\ncmd = a\n" + "".join(f"k{i} = 1\n" for i in range(20_000)),
    ]
    for text in cases:
        started = time.process_time()
        with contextlib.suppress(ConfigError):
            parse(text, PATH)
        assert time.process_time() - started < 3, text[:60]
    assert len(errors_of(cases[-1])) == 20_000  # every problem, at once


def test_shellwords_split_is_shlex_split():
    import random
    import shlex

    from gpu_mon import shellwords

    rng = random.Random(7)
    alphabet = ["a", "b", " ", "\t", "'", '"', "\\", "\n", "é", "$"]
    for _ in range(20_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        try:
            want: object = shlex.split(text)
        except ValueError as err:
            want = str(err)
        try:
            got: object = shellwords.split(text)
        except ValueError as err:
            got = str(err)
        assert got == want, repr(text)


def test_each_key_remembers_its_line_and_a_missing_one_falls_back_to_the_header():
    c = parse(
        "[defaults]\ninterval_seconds = 1\nstate_file = /tmp/s.json\n"
        "[gpu-a]\n; a comment\ngpus = 0\n"
        "[process-burn]\nuser = root\n\ncmd = /bin/true\ngpus = 0\n"
        "[process-plain]\ncmd = /bin/true\nuser = root\n"
        "[sentinel]\narm_threshold = 0.5\ngpus = 0\n"
    )
    line_of = config.line_of
    assert line_of(c.defaults, "state_file") == 3
    assert line_of(c.gpu_sections[0], "gpus") == 6
    burn, plain = c.processes
    assert (line_of(burn, "cmd"), line_of(burn, "gpus"), line_of(burn, "user")) == (10, 11, 8)
    assert line_of(plain, "gpus") == 12  # not written: the section's header
    assert line_of(c.sentinel, "gpus") == 17
    assert line_of(Defaults(), "state_file") == 0  # the default, written nowhere


def test_moving_a_key_within_its_section_is_no_change():
    a = parse("[gpu-a]\ngpus = 0\nbusy_memory_mib = 5\n")
    b = parse("[gpu-a]\nbusy_memory_mib = 5\ngpus = 0\n")
    assert a.gpu_sections == b.gpu_sections


def test_reload_names_the_sections_added_changed_and_removed():
    from gpu_mon.engine import reload

    old = parse(
        "[gpu-a]\ngpus = 0\n[process-m]\ncmd = /bin/true\nuser = root\n[process-old]\ncmd = x\nuser = root\n"
    )
    new = parse(
        "[tty]\nenabled = yes\n[gpu-a]\ngpus = 0\n[process-m]\ncmd = /bin/true --x\nuser = root\n"
        "[process-burn]\ncmd = burn\nuser = root\n"
    )
    changes = reload.changes(old, new)
    assert (changes.added, changes.changed, changes.removed) == (
        ("process-burn",),
        ("tty", "process-m"),
        ("process-old",),
    )
    assert str(changes) == "added: [process-burn]; changed: [tty], [process-m]; removed: [process-old]"
    moved = parse(
        "\n\n[process-m]\ncmd = /bin/true\nuser = root\n[gpu-a]\ngpus = 0\n"
        "[process-old]\ncmd = x\nuser = root\n"
    )
    assert str(reload.changes(old, moved)) == "nothing changed"
