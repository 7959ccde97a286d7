"""policy.py is pure: tables of snapshots in, verdicts and actions out. No processes, no clock."""

from __future__ import annotations

import dataclasses

import pytest

from gpu_mon import config as cfg
from gpu_mon.api.model import Denied, Exited, Gpu, GpuProcess, GpuReading, Holder, Running, Snapshot, TtyUser
from gpu_mon.policy import decide as policy
from gpu_mon.policy import words
from gpu_mon.policy.decisions import PolicyState, Start, Stop

U0, U1, U2 = "GPU-aaaa", "GPU-bbbb", "GPU-cccc"


def gpu(index: int, uuid: str, **kw) -> Gpu:
    base = dict(
        index=index,
        uuid=uuid,
        name="G",
        minor=index,
        device=f"/dev/nvidia{index}",
        memory_total_mib=80000,
        memory_used_mib=0,
        utilization_pct=0,
        processes=(),
    )
    base.update(kw)
    return Gpu(**base)


def holder(
    pid: int, gpus=(U0,), name="python3", user="alice", ours=False, start=100, monitor=False
) -> Holder:
    return Holder(
        pid=pid,
        start_ticks=start,
        name=name,
        argv0=name,
        uid=1000,
        user=user,
        sid=pid,
        gpus=frozenset(gpus),
        ours=ours,
        monitor=monitor,
    )


def snap(now: float = 100.0, gpus=None, **kw) -> Snapshot:
    gpus = gpus if gpus is not None else (gpu(0, U0), gpu(1, U1))
    return Snapshot(now=now, reading=GpuReading(gpus=tuple(gpus)), **kw)


def config(text: str = "") -> cfg.Config:
    base = "[defaults]\nstart_delay_seconds = 10\nrestart_delay_seconds = 5\nrestart_delay_max_seconds = 40\n"
    base += "healthy_run_seconds = 60\n"
    return cfg.parse(base + (text or "[gpu-all]\ngpus = ALL\n[process-m]\ncmd = m\nuser = root\n"), "/t.conf")


RULES = cfg.GpuSection(
    name="all",
    gpus=cfg.GpuSelection(all=True),
    ignore_programs=("nvitop",),
    ignore_users=("monitor",),
    busy_memory_mib=1024,
)


VERDICTS = [
    # (id, snapshot, expected busy, fragment of the first reason)
    ("idle", snap(), False, None),
    ("foreign-holder", snap(holders=(holder(42),)), True, "alice python3[42] holds /dev/nvidia0"),
    ("holder-on-other-gpu", snap(holders=(holder(42, gpus=(U1,)),)), False, None),
    ("our-holder", snap(holders=(holder(42, ours=True),)), False, None),
    ("ignored-program", snap(holders=(holder(42, name="nvitop"),)), False, None),
    ("builtin-monitor", snap(holders=(holder(42, name="nvidia-smi", monitor=True),)), False, None),
    # A user's job named like a monitor is not one: only a root-owned nvidia-smi executable is (holders.py).
    ("borrowed-monitor-name", snap(holders=(holder(42, name="nvidia-smi"),)), True, "nvidia-smi[42] holds"),
    ("ignored-user", snap(holders=(holder(42, user="monitor"),)), False, None),
    (
        "nvml-foreign",
        snap(gpus=(gpu(0, U0, processes=(GpuProcess(7, 500),)),), nvml_procs=(holder(7),)),
        True,
        "alice python3[7] has a compute context on it (NVML, 500 MiB)",
    ),
    (
        "nvml-invisible-pid",
        snap(gpus=(gpu(0, U0, processes=(GpuProcess(7, None),)),)),
        True,
        "pid 7 (not visible here)",
    ),
    (
        "nvml-ours",
        snap(gpus=(gpu(0, U0, processes=(GpuProcess(7, 900),)),), nvml_procs=(holder(7, ours=True),)),
        False,
        None,
    ),
    ("memory-by-others", snap(gpus=(gpu(0, U0, memory_used_mib=2000),)), True, "2000 MiB used by others"),
    ("memory-at-threshold", snap(gpus=(gpu(0, U0, memory_used_mib=1024),)), False, None),
    (
        "memory-ours-subtracted",
        snap(
            gpus=(gpu(0, U0, memory_used_mib=70500, processes=(GpuProcess(7, 70000),)),),
            nvml_procs=(holder(7, ours=True),),
        ),
        False,
        None,
    ),
    (
        "reading-error",
        Snapshot(now=1, reading=GpuReading(gpus=(), error="NVML: Driver Not Loaded")),
        True,
        "GPUs cannot be read: NVML: Driver Not Loaded",
    ),
    ("gpu-missing", snap(gpus=(gpu(1, U1),)), True, "not found on this host"),
    (
        "memory-unreadable",
        snap(gpus=(gpu(0, U0, memory_used_mib=None, errors=("memory: Unknown Error",)),)),
        True,
        "cannot be read: memory: Unknown Error",
    ),
    (
        "processes-unreadable",
        snap(gpus=(gpu(0, U0, processes=None, errors=("compute processes: Timeout",)),)),
        True,
        "cannot be read: compute processes: Timeout",
    ),
    ("gpu-lost", snap(gpus=(gpu(0, U0, processes=None, errors=("gpu: GPU is lost",)),)), True, "GPU is lost"),
    (
        "utilization-unreadable-is-harmless",
        snap(gpus=(gpu(0, U0, errors=("utilization: Not Found",)),)),
        False,
        None,
    ),
    (
        "node-unwatchable",
        snap(node_errors=((U0, "/dev/nvidia0: No such file or directory"),)),
        True,
        "device node cannot be watched",
    ),
    (
        "denied-process",
        snap(denied=(Denied(9, "bob", "python3"),)),
        True,
        "cannot see the open files of bob python3[9]",
    ),
    ("denied-but-ignored", snap(denied=(Denied(9, "monitor", "agent"),)), False, None),
    ("hostile-name", snap(holders=(holder(42, name="x)\n(y"),)), True, "alice x)\\x0a(y[42]"),
]


@pytest.mark.parametrize("s,busy,reason", [v[1:] for v in VERDICTS], ids=[v[0] for v in VERDICTS])
def test_gpu_verdict(s, busy, reason):
    got, typed = policy.gpu_verdict(U0, RULES, s, {})
    reasons = [words.reason(r) for r in typed]
    assert got is busy, reasons
    if reason:
        assert reason in reasons[0]
    else:
        assert reasons == []


GRACE = dataclasses.replace(RULES, holder_grace_seconds=30)


@pytest.mark.parametrize(
    "now,nvml_pids,nvml_readable,busy",
    [
        (100, (), True, True),  # just seen: counts
        (129, (), True, True),
        (130, (), True, False),  # grace over, NVML never showed it: a monitor
        (200, (42,), True, True),  # NVML shows it on the GPU: counts again
        (200, (), False, True),  # NVML unreadable: holders always count
    ],
    ids=["new", "within", "expired", "nvml-shows-it", "nvml-unreadable"],
)
def test_holder_grace(now, nvml_pids, nvml_readable, busy):
    procs = tuple(GpuProcess(p, 10) for p in nvml_pids) if nvml_readable else None
    errors = () if nvml_readable else ("compute processes: Timeout",)
    first_seen = {(42, 100, U0): 100.0}
    s = snap(
        now=now,
        gpus=(gpu(0, U0, processes=procs, errors=errors),),
        holders=(holder(42),),
        nvml_procs=tuple(holder(p) for p in nvml_pids),
    )
    got, reasons = policy.gpu_verdict(U0, GRACE, s, first_seen)
    if nvml_readable or not busy:
        assert got is busy, reasons
    else:
        assert got  # unreadable GPU: busy whatever the holders


HELD = [
    # (id, snapshot at 100.0, first seen (pid -> time), held_since expected)
    ("free", snap(), {}, None),
    ("one-holder-new", snap(holders=(holder(42),)), {}, 100.0),
    ("one-holder-seen-before", snap(holders=(holder(42),)), {42: 99.5}, 99.5),
    ("the-longest-of-two", snap(holders=(holder(42), holder(43))), {42: 99.8, 43: 99.1}, 99.1),
    ("ours-is-not-counted", snap(holders=(holder(42), holder(43, ours=True))), {43: 50.0}, 100.0),
    (
        "an-nvml-context-counts-at-once",
        snap(
            gpus=(gpu(0, U0, processes=(GpuProcess(42, 500),)),),
            holders=(holder(42),),
            nvml_procs=(holder(42),),
        ),
        {42: 99.9},
        None,
    ),
    ("memory-counts-at-once", snap(gpus=(gpu(0, U0, memory_used_mib=2000),), holders=(holder(4),)), {}, None),
    (
        "an-unreadable-process-counts-at-once",
        snap(holders=(holder(42),), denied=(Denied(pid=9, user="bob", name="x"),)),
        {},
        None,
    ),
]


@pytest.mark.parametrize("s, seen, expected", [h[1:] for h in HELD], ids=[h[0] for h in HELD])
def test_a_gpu_busy_only_by_holders_says_since_when_it_is_held(s, seen, expected):
    state = PolicyState(first_seen={(pid, 100, U0): t for pid, t in seen.items()})
    _plan, d = run(config(), s, state)
    assert d.verdicts[U0].held_since == expected


def run(c, s, state=None):
    plan = policy.resolve(c, s.reading.gpus)
    return plan, policy.decide(c, plan, s, state or PolicyState())


def starts(d):
    return [a.instance.key for a in d.actions if isinstance(a, Start)]


def stops(d):
    return [a.key for a in d.actions if isinstance(a, Stop)]


def test_start_waits_for_the_start_delay():
    c = config()
    _, d1 = run(c, snap(now=100))
    assert starts(d1) == [] and d1.next_wake == 110 and d1.waiting["m"].kind == "start_delay"
    assert words.wait(d1.waiting["m"], {}, 100) == "waiting: start delay (10 s left)"
    _, d2 = run(c, snap(now=109.9), d1.state)
    assert starts(d2) == []
    _, d3 = run(c, snap(now=110), d2.state)
    assert starts(d3) == ["m"]
    assert d3.actions[0].instance.gpus == (U0, U1)


def test_busy_resets_the_start_delay():
    c = config()
    _, d1 = run(c, snap(now=100))
    _, d2 = run(c, snap(now=105, holders=(holder(1),)), d1.state)
    assert U0 not in d2.state.free_since
    _, d3 = run(c, snap(now=111), d2.state)
    assert starts(d3) == [] and d3.next_wake == 121


def test_busy_gpu_stops_running_workload_with_reason():
    c = config()
    s = snap(now=100, holders=(holder(42, gpus=(U1,)),), running=(Running("m", 900, 50.0),))
    _, d = run(c, s)
    assert stops(d) == ["m"]
    assert d.actions[0].gpus == (U1,)
    assert (
        words.stop(d.actions[0], {U0: 0, U1: 1})
        == "GPU 1 (GPU-bbbb) busy: alice python3[42] holds /dev/nvidia1"
    )
    assert d.actions[0].busy[0][1].kind == "holds_node" and d.actions[0].busy[0][1].who.pid == 42


def test_stopping_instance_is_not_stopped_again_nor_restarted():
    c = config()
    s = snap(now=100, holders=(holder(42),), running=(Running("m", 900, 50.0, stopping=True),))
    _, d = run(c, s, PolicyState(free_since={U0: 0, U1: 0}))
    assert d.actions == ()


def test_per_gpu_instances():
    c = config("[gpu-all]\ngpus = ALL\n[process-m]\ncmd = m\nper_gpu = yes\nuser = root\n")
    state = PolicyState(free_since={U0: 0.0, U1: 0.0})
    plan, d = run(c, snap(now=100, holders=(holder(42, gpus=(U1,)),)), state)
    assert starts(d) == [f"m@{U0}"]
    assert plan.instances[0].label(plan.index_of) == "m@0"


def test_two_sections_never_share_a_gpu():
    c = config(
        "[gpu-all]\ngpus = ALL\n[process-a]\ncmd = a\ngpus = 0,1\nuser = root\n"
        "[process-b]\ncmd = b\ngpus = 1\nuser = root\n"
    )
    state = PolicyState(free_since={U0: 0.0, U1: 0.0})
    _, d = run(c, snap(now=100), state)
    assert starts(d) == ["a"]
    _, d = run(c, snap(now=101, running=(Running("a", 5, 100.0),)), d.state)
    assert (
        starts(d) == []
        and words.wait(d.waiting["b"], {U0: 0, U1: 1}, 101) == "waiting: GPU 1 (GPU-bbbb) runs a"
    )


def test_removed_instance_is_stopped():
    _, d = run(config(), snap(running=(Running("gone", 5, 1.0),)), PolicyState(free_since={U0: 0, U1: 0}))
    assert [(a.key, words.stop(a, {})) for a in d.actions if isinstance(a, Stop)] == [
        ("gone", "no longer in the config")
    ]


def test_terminal_pause_stops_everything_and_blocks_starts():
    c = config(
        "[gpu-all]\ngpus = ALL\n[process-m]\ncmd = m\nuser = root\n"
        "[tty]\nenabled = yes\nwhitelist = root\nidle_seconds = 60\n"
    )
    bob = TtyUser("/dev/pts/3", "bob", 1001, 5.0)
    root = TtyUser("/dev/pts/1", "root", 0, 1.0)
    idle = TtyUser("/dev/pts/4", "carol", 1002, 3600.0)
    state = PolicyState(free_since={U0: 0.0, U1: 0.0})
    _, d = run(c, snap(now=100, ttys=(root, idle, bob), running=(Running("m", 5, 1.0),)), state)
    assert stops(d) == ["m"] and [words.terminal(t) for t in d.paused_by] == ["bob at pts/3 (active 5 s ago)"]
    assert words.stop(d.actions[0], {}).startswith("paused for terminal user bob")
    _, d = run(c, snap(now=100, ttys=(root, idle, bob)), state)
    assert starts(d) == [] and words.wait(d.waiting["m"], {}, 100).startswith("paused: bob at pts/3")
    _, d = run(c, snap(now=100, ttys=(root, idle)), state)
    assert starts(d) == ["m"]


def test_tty_disabled_ignores_terminals():
    c = config()
    _, d = run(
        c,
        snap(now=100, ttys=(TtyUser("/dev/pts/3", "bob", 1001, 0.0),)),
        PolicyState(free_since={U0: 0, U1: 0}),
    )
    assert starts(d) == ["m"]


def exited(code, ran, at=100.0, by_us=False):
    return Exited("m", started_at=at - ran, ended_at=at, returncode=code, stopped_by_us=by_us)


def test_backoff_doubles_caps_and_resets_after_a_healthy_run():
    c = config()
    state = PolicyState(free_since={U0: 0.0, U1: 0.0})
    delays = []
    now = 100.0
    for _ in range(6):
        _, d = run(c, snap(now=now, exited=(exited(1, 0.5, at=now),)), state)
        b = d.state.backoff["m"]
        delays.append(b.not_before - now)
        assert starts(d) == []
        state = d.state
        now = b.not_before
    assert delays == [5, 10, 20, 40, 40, 40]
    assert d.events[0].failing and "quick failures in a row" in words.restarting(d.events[0])
    _, d = run(c, snap(now=now, exited=(exited(1, 61, at=now),)), state)
    assert d.state.backoff["m"].failures == 0 and d.state.backoff["m"].not_before - now == 5
    _, d = run(c, snap(now=now + 5), d.state)
    assert starts(d) == ["m"]


def test_exit_stopped_by_us_has_no_backoff():
    c = config()
    _, d = run(c, snap(now=100, exited=(exited(143, 3, by_us=True),)), PolicyState(free_since={U0: 0, U1: 0}))
    assert starts(d) == ["m"]
    assert words.last_exit(d.state.backoff["m"].last).startswith("stopped by gpu-mon")


@pytest.mark.parametrize(
    "code,text",
    [
        (0, "exited with status 0"),
        (3, "exited with status 3"),
        (127, "command not found"),
        (126, "permission denied"),
        (137, "killed by signal 9"),
    ],
)
def test_describe_exit(code, text):
    assert text in words.exit_status(code)


def test_resolve_problems():
    c = cfg.parse(
        "[gpu-a]\ngpus = 0,5,GPU-zzzz\n[process-p]\ncmd = p\ngpus = 1\nuser = root\n"
        "[process-q]\ncmd = q\ngpus = 0\nuser = root\n",
        "/t.conf",
    )
    plan = policy.resolve(c, (gpu(0, U0), gpu(1, U1)))
    assert plan.problems == (
        "2: [gpu-a] gpus: no GPU with index 5 (this host has 2)",
        "2: [gpu-a] gpus: no GPU with UUID GPU-zzzz on this host",
        "5: [process-p] gpus: GPU-bbbb is not named by any [gpu-*] section, so it is never used",
    )
    assert [i.key for i in plan.instances] == ["q"]
    assert list(plan.rules) == [U0]


def test_resolve_by_uuid_and_index_lost_uuid():
    c = cfg.parse(f"[gpu-a]\ngpus = {U1},0\n[process-p]\ncmd = p\nuser = root\n", "/t.conf")
    plan = policy.resolve(c, (gpu(0, None), gpu(1, U1)))
    assert plan.problems == ("2: [gpu-a] gpus: GPU 0: its UUID cannot be read",)
    assert plan.instances[0].gpus == (U1,)


def test_unwatched_gpus_get_a_verdict_but_no_workload():
    c = cfg.parse("[gpu-a]\ngpus = 1\n[process-p]\ncmd = p\nuser = root\n", "/t.conf")
    plan, d = run(c, snap(now=100))
    assert set(d.verdicts) == {U0, U1} and list(plan.rules) == [U1]
    assert plan.instances[0].gpus == (U1,)


def test_stops_confirmed_needs_both_looks():
    a, b = Stop("x", "r"), Stop("y", "r")
    assert policy.stops_confirmed([a, b], [b]) == (b,)


def test_resolve_same_gpu_by_index_and_uuid_in_two_sections():
    c = cfg.parse("[gpu-a]\ngpus = 0\n[gpu-b]\ngpus = GPU-AAAA\n", "/t.conf")
    plan = policy.resolve(c, (gpu(0, U0), gpu(1, U1)))
    assert plan.problems == (f"4: [gpu-b] gpus: {U0} is already named by [gpu-a]",)


def test_resolve_uuids_case_insensitively():
    c = cfg.parse(f"[gpu-a]\ngpus = {U1.upper()}\n", "/t.conf")
    plan = policy.resolve(c, (gpu(0, U0), gpu(1, U1)))
    assert plan.problems == () and list(plan.rules) == [U1]


# ---------------------------------------------------------------------------------------------------------
# `gpu-mon occupy`'s sections: together, hold, unreadable processes not busy


def occupy_config(hold: bool, together: bool = True) -> cfg.Config:
    base = config()
    proc = dataclasses.replace(base.processes[0], per_gpu=True, together=together, hold=hold)
    rules = dataclasses.replace(base.gpu_sections[0], unreadable_is_busy=False)
    return dataclasses.replace(base, processes=(proc,), gpu_sections=(rules,))


def test_together_copies_start_only_when_every_gpu_was_free_for_the_delay():
    c = occupy_config(hold=False)
    plan = policy.resolve(c, snap().reading.gpus)
    s1 = policy.decide(c, plan, snap(now=100.0, holders=(holder(42, gpus=(U1,)),)), PolicyState())
    assert s1.actions == ()  # GPU 1 busy: neither copy starts, GPU 0's copy waits for it
    assert s1.waiting[f"m@{U0}"].kind == "busy" and s1.waiting[f"m@{U0}"].gpu == U1
    s2 = policy.decide(c, plan, snap(now=105.0), s1.state)  # GPU 1 free from 105: the timer restarted
    assert s2.actions == () and s2.next_wake == 115.0
    s3 = policy.decide(c, plan, snap(now=115.0), s2.state)
    assert sorted(a.instance.key for a in s3.actions) == [f"m@{U0}", f"m@{U1}"]


@pytest.mark.parametrize("hold", [False, True])
def test_together_copies_yield_together_unless_they_hold(hold):
    c = occupy_config(hold=hold)
    plan = policy.resolve(c, snap().reading.gpus)
    running = (Running(f"m@{U0}", 7, 0.0), Running(f"m@{U1}", 8, 0.0))
    d = policy.decide(c, plan, snap(holders=(holder(42, gpus=(U1,)),), running=running), PolicyState())
    stopped = sorted(a.key for a in d.actions if isinstance(a, Stop))
    assert stopped == ([] if hold else [f"m@{U0}", f"m@{U1}"])


def test_unreadable_processes_do_not_make_an_occupy_gpu_busy():
    c = occupy_config(hold=False)
    plan = policy.resolve(c, snap().reading.gpus)
    hidden = snap(denied=(Denied(pid=9, user="bob", name="python3"),))
    assert not policy.decide(c, plan, hidden, PolicyState()).verdicts[U0].busy
    assert (
        policy.decide(config(), policy.resolve(config(), hidden.reading.gpus), hidden, PolicyState())
        .verdicts[U0]
        .busy
    )  # the daemon's sections: unsure means busy
