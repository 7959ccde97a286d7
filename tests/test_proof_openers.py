"""bench/proof/openers.py: a daemon's log into the stops other openers of the GPU caused, told apart from
the check's own newcomers, and whether a handoff trial began too soon after one to be averaged in. The log
excerpt is the H200 proof's (../shared/gpu-proof/2026-11-26-h200/logs/full-handoff-torch.log), where a host
monitor opened the GPU through a second node path every few seconds."""

from __future__ import annotations

import datetime
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from proof import openers

LOG = """\
2026-11-26 04:35:55.875 gpu-mon[1599] INFO GPU 0 (GPU-b2d8e352) free for 2 s; starting stress[2450] on GPU 0 \
as root
2026-11-26 04:35:56.894 gpu-mon[1599] INFO GPU 0 (GPU-b2d8e352) busy: root ld-linux-x86-64.so.2[2467] holds \
/usr/local/nvidia/dev/nvidia0; stopping stress[2450]
2026-11-26 04:35:57.612 gpu-mon[1599] INFO stress[2450] stopped in 720 ms (SIGTERM)
2026-11-26 04:36:03.359 gpu-mon[1599] INFO GPU 0 (GPU-b2d8e352) busy: root python3[2493] holds /dev/nvidia0; \
stopping stress[2471]
2026-11-26 04:36:06.910 gpu-mon[1599] INFO GPU 0 (GPU-b2d8e352) busy: root ld-linux-x86-64.so.2[2511] holds \
/usr/local/nvidia/dev/nvidia0; stopping stress[2512]
2026-11-26 04:36:06.927 gpu-mon[1599] INFO GPU 0 (GPU-b2d8e352) busy: root ld-linux-x86-64.so.2[2514] holds \
/usr/local/nvidia/dev/nvidia0; stopping stress[2515]
2026-11-26 04:36:09.000 gpu-mon[1599] DEBUG stopping stress[2517] before reading the rest of /proc: GPU 0 \
(GPU-b2d8e352) busy: root python3[2539] holds /dev/nvidia0
2026-11-26 04:36:13.817 gpu-mon[1599] INFO GPU 0 (GPU-b2d8e352) busy: root python3[2539] has a compute \
context on it (NVML, 612 MiB); stopping stress[2517]
2026-11-26 04:36:14.819 gpu-mon[1599] INFO stopping on SIGTERM: 1 workload(s) to stop
"""
OWN = {2493, 2539}  # the newcomers the benchmark started


def at(stamp: str) -> float:
    return datetime.datetime.strptime(f"2026-11-26 {stamp}", "%Y-%m-%d %H:%M:%S.%f").timestamp()


def test_stops_name_who_made_the_gpu_busy_and_which_workload_stopped():
    found = openers.stops(LOG)
    assert [(s.workload, [(o.user, o.name, o.pid, o.node) for o in s.openers]) for s in found] == [
        ("stress[2450]", [("root", "ld-linux-x86-64.so.2", 2467, "/usr/local/nvidia/dev/nvidia0")]),
        ("stress[2471]", [("root", "python3", 2493, "/dev/nvidia0")]),
        ("stress[2512]", [("root", "ld-linux-x86-64.so.2", 2511, "/usr/local/nvidia/dev/nvidia0")]),
        ("stress[2515]", [("root", "ld-linux-x86-64.so.2", 2514, "/usr/local/nvidia/dev/nvidia0")]),
        ("stress[2517]", [("root", "python3", 2539, None)]),  # NVML's context: no node
    ]
    assert found[0].time == at("04:35:56.894")


def test_foreign_openers_are_those_the_check_did_not_start():
    foreign = openers.foreign(openers.stops(LOG), OWN)
    assert [s.workload for s in foreign] == ["stress[2450]", "stress[2512]", "stress[2515]"]
    assert openers.summary(openers.stops(LOG), OWN) == [
        {"who": "root ld-linux-x86-64.so.2", "node": "/usr/local/nvidia/dev/nvidia0", "stops": 3, "pids": 3}
    ]
    assert openers.words(openers.summary(openers.stops(LOG), OWN)) == (
        "root ld-linux-x86-64.so.2 via /usr/local/nvidia/dev/nvidia0 (3 stops, 3 processes)"
    )
    assert openers.summary(openers.stops(LOG), OWN | {2467, 2511, 2514}) == []


def test_a_trial_soon_after_or_during_a_foreign_stop_is_disturbed():
    found = openers.stops(LOG)
    why = openers.disturbed(found, OWN, at("04:35:59.894"), at("04:36:01.000"))
    assert why == (
        "stress[2450] was stopped for root ld-linux-x86-64.so.2[2467] via /usr/local/nvidia/dev/nvidia0 "
        "3.0 s before it began"
    )
    assert "during it" in openers.disturbed(found, OWN, at("04:36:06.000"), at("04:36:07.000"))
    # the trial's own newcomer made the daemon stop: that is the trial, not a disturbance
    assert openers.disturbed(found, OWN, at("04:36:03.000"), at("04:36:04.000")) is None
    assert openers.disturbed(found, OWN, at("04:36:02.000"), at("04:36:04.000")) is None  # 5.1 s after
