"""gpu_mon.api.sim.SimBackend: the JSON file that stands in for NVML, re-read on every look.

load() raises SimError with one line naming the file and the field; read() never raises and returns
GpuReading(error=...) instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import foreign_opener_cmd, wait_for, workload_cmd

from gpu_mon.api.model import Gpu, GpuProcess, GpuReading
from gpu_mon.api.sim import MAX_SIM_BYTES, SimBackend, SimError

ROOT = Path(__file__).resolve().parent.parent
UUID0 = "GPU-5a1c0f3e-8d2b-4c6a-9f10-3b7e2d4c8a01"
UUID1 = "GPU-9e47b2d1-1c3f-4a8e-b5d6-0f2a7c9e1b52"

# The example of DESIGN.md ("Simulated host"), verbatim.
DESIGN_EXAMPLE = """\
{"gpus": [{"uuid": "GPU-5a1c...", "name": "Simulated H100", "memory_total_mib": 81559,
           "memory_used_mib": 0, "utilization_pct": 0, "device": "dev/nvidia0",
           "processes": [{"pid": 4242, "used_memory_mib": 1024}]}]}
"""


def write(path, doc):
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(doc, bytes):
        path.write_bytes(doc)
    elif isinstance(doc, str):
        path.write_text(doc)
    else:
        path.write_text(json.dumps(doc))
    return path


def two_gpus(**over1):
    g1 = {"uuid": UUID1, "device": "dev/nvidia1"}
    g1.update(over1)
    return {"gpus": [{"uuid": UUID0, "device": "dev/nvidia0"}, g1]}


def test_design_example(tmp_path):
    path = write(tmp_path / "sim.json", DESIGN_EXAMPLE)
    reading = SimBackend(str(path)).read()
    assert reading == GpuReading(
        gpus=(
            Gpu(
                index=0,
                uuid="GPU-5a1c...",
                name="Simulated H100",
                minor=0,
                device=str(tmp_path / "dev" / "nvidia0"),
                memory_total_mib=81559,
                memory_used_mib=0,
                utilization_pct=0,
                processes=(GpuProcess(pid=4242, used_memory_mib=1024, kind="compute"),),
                errors=(),
            ),
        )
    )
    assert (tmp_path / "dev" / "nvidia0").is_file()


def test_shipped_example_loads():
    """examples/sim-host.json (load() only: it creates nothing)."""
    gpus = SimBackend(str(ROOT / "examples" / "sim-host.json")).load()
    assert [g.uuid for g in gpus] == [UUID0, UUID1]
    assert [g.device for g in gpus] == [str(ROOT / "examples" / "dev" / f"nvidia{i}") for i in (0, 1)]


def test_defaults_of_a_minimal_gpu(tmp_path):
    path = write(tmp_path / "sim.json", {"gpus": [{"uuid": UUID0}, {"uuid": UUID1}]})
    g0, g1 = SimBackend(str(path)).load()
    assert g0 == Gpu(
        index=0,
        uuid=UUID0,
        name="Simulated GPU",
        minor=0,
        device=str(tmp_path / "dev" / "nvidia0"),
        memory_total_mib=81559,
        memory_used_mib=0,
        utilization_pct=0,
        processes=(),
        errors=(),
    )
    assert (g1.index, g1.minor, g1.device) == (1, 1, str(tmp_path / "dev" / "nvidia1"))


def test_no_gpus(tmp_path):
    path = write(tmp_path / "sim.json", {"gpus": []})
    assert SimBackend(str(path)).read() == GpuReading(gpus=())


def test_processes_without_memory(tmp_path):
    path = write(tmp_path / "sim.json", two_gpus(processes=[{"pid": 1}, {"pid": 2, "used_memory_mib": None}]))
    g1 = SimBackend(str(path)).load()[1]
    assert g1.processes == (GpuProcess(1, None), GpuProcess(2, None))
    assert g1.errors == ()


def test_mig_uuid_and_zero_values(tmp_path):
    mig = "MIG-GPU-5a1c0f3e-8d2b-4c6a-9f10-3b7e2d4c8a01/1/0"
    path = write(
        tmp_path / "sim.json", {"gpus": [{"uuid": mig, "memory_total_mib": 0, "utilization_pct": 100}]}
    )
    (g,) = SimBackend(str(path)).load()
    assert (g.uuid, g.memory_total_mib, g.utilization_pct) == (mig, 0, 100)


# ---------------------------------------------------------------------------------------------------------
# Device stand-in files


def test_device_files_are_created_relative_to_the_sim_file(tmp_path, monkeypatch):
    monkeypatch.chdir("/")  # not the sim file's directory
    path = write(tmp_path / "host" / "sim.json", two_gpus(device="deep/er/nvidia1"))
    reading = SimBackend(str(path)).read()
    assert reading.error is None
    assert [g.device for g in reading.gpus] == [
        str(tmp_path / "host" / "dev" / "nvidia0"),
        str(tmp_path / "host" / "deep" / "er" / "nvidia1"),
    ]
    for g in reading.gpus:
        assert Path(g.device).is_file()


def test_relative_sim_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "sim.json", two_gpus())
    b = SimBackend("sim.json")
    monkeypatch.chdir("/")
    reading = b.read()
    assert reading.error is None
    assert reading.gpus[0].device == str(tmp_path / "dev" / "nvidia0")


def test_absolute_device_path(tmp_path):
    device = tmp_path / "elsewhere" / "nv0"
    path = write(tmp_path / "sim.json", {"gpus": [{"uuid": UUID0, "device": str(device)}]})
    assert SimBackend(str(path)).read().gpus[0].device == str(device)
    assert device.is_file()


def test_existing_device_file_is_left_alone(tmp_path):
    device = tmp_path / "dev" / "nvidia0"
    device.parent.mkdir()
    device.write_bytes(b"keep")
    os.chmod(device, 0o600)
    path = write(tmp_path / "sim.json", {"gpus": [{"uuid": UUID0}]})
    SimBackend(str(path)).read()
    assert device.read_bytes() == b"keep"
    assert os.stat(device).st_mode & 0o777 == 0o600


def test_load_alone_creates_no_device(tmp_path):
    path = write(tmp_path / "sim.json", two_gpus())
    SimBackend(str(path)).load()
    assert not (tmp_path / "dev").exists()


def test_device_that_cannot_be_created_is_an_error_reading(tmp_path):
    (tmp_path / "blocker").write_bytes(b"")
    path = write(tmp_path / "sim.json", {"gpus": [{"uuid": UUID0, "device": "blocker/nvidia0"}]})
    reading = SimBackend(str(path)).read()
    assert reading.gpus == ()
    assert (
        reading.error
        == f"{tmp_path / 'blocker' / 'nvidia0'}: cannot create the simulated device: File exists"
    )


# ---------------------------------------------------------------------------------------------------------
# Re-read on every look


def test_file_is_read_again_on_every_look(tmp_path):
    path = write(tmp_path / "sim.json", {"gpus": [{"uuid": UUID0}]})
    b = SimBackend(str(path))
    assert [g.uuid for g in b.read().gpus] == [UUID0]
    write(path, two_gpus(memory_used_mib=500, processes=[{"pid": 77, "used_memory_mib": 499}]))
    reading = b.read()
    assert [g.uuid for g in reading.gpus] == [UUID0, UUID1]
    assert reading.gpus[1].memory_used_mib == 500
    assert reading.gpus[1].processes == (GpuProcess(77, 499),)
    write(path, "{broken")
    assert b.read().error
    write(path, {"gpus": []})
    assert b.read() == GpuReading(gpus=())
    path.unlink()
    assert b.read().error == f"{path}: No such file or directory"


# ---------------------------------------------------------------------------------------------------------
# Unreadable GPUs and fields (the fail-closed paths)


def test_gpu_is_lost(tmp_path):
    path = write(tmp_path / "sim.json", two_gpus(error="GPU is lost", memory_used_mib=5))
    g0, g1 = SimBackend(str(path)).read().gpus
    assert g0.errors == () and g0.processes == ()
    assert (g1.uuid, g1.device) == (UUID1, str(tmp_path / "dev" / "nvidia1"))
    assert g1.processes is None
    assert (g1.memory_total_mib, g1.memory_used_mib, g1.utilization_pct) == (None, None, None)
    assert g1.errors == ("gpu: GPU is lost",)


def test_empty_error_string_is_no_error(tmp_path):
    path = write(tmp_path / "sim.json", two_gpus(error=""))
    assert SimBackend(str(path)).load()[1].errors == ()


NULLS = [
    ("memory-used", {"memory_used_mib": None}, "memory_used_mib", ("memory: unreadable (simulated)",)),
    ("memory-total", {"memory_total_mib": None}, "memory_total_mib", ("memory: unreadable (simulated)",)),
    ("utilization", {"utilization_pct": None}, "utilization_pct", ("utilization: unreadable (simulated)",)),
    ("processes", {"processes": None}, "processes", ("compute processes: unreadable (simulated)",)),
    ("name", {"name": None}, "name", ("name: unreadable (simulated)",)),
]


@pytest.mark.parametrize(("fields", "attr", "errors"), [n[1:] for n in NULLS], ids=[n[0] for n in NULLS])
def test_null_field_reads_as_unreadable(tmp_path, fields, attr, errors):
    path = write(tmp_path / "sim.json", two_gpus(**fields))
    g0, g1 = SimBackend(str(path)).read().gpus
    assert getattr(g1, attr) is None
    assert g1.errors == errors
    assert g0.errors == ()


def test_several_nulls(tmp_path):
    doc = two_gpus(memory_used_mib=None, memory_total_mib=None, utilization_pct=None, processes=None)
    g1 = SimBackend(str(write(tmp_path / "sim.json", doc))).load()[1]
    assert g1.errors == (
        "memory: unreadable (simulated)",
        "utilization: unreadable (simulated)",
        "compute processes: unreadable (simulated)",
    )


# ---------------------------------------------------------------------------------------------------------
# Malformed files: one line naming the file and the field


MALFORMED = [
    # (id, file content (bytes, str or a JSON-able value), field named in the message, fragment)
    ("not-json", "{gpus: []}", "", "not valid JSON: Expecting property name"),
    ("empty-file", "", "", "not valid JSON"),
    ("trailing-garbage", '{"gpus": []} x', "", "not valid JSON: Extra data"),
    ("not-an-object", [], "", 'expected an object with a "gpus" list'),
    ("missing-gpus", {}, "", 'expected an object with a "gpus" list'),
    ("gpus-not-a-list", {"gpus": {"0": {}}}, "", 'expected an object with a "gpus" list'),
    ("unknown-top-level-key", {"gpus": [], "gpu": []}, "", "unknown top-level key 'gpu'"),
    ("gpu-not-an-object", {"gpus": [{"uuid": UUID0}, 5]}, "gpus[1]", "expected an object"),
    ("uuid-missing", {"gpus": [{"name": "x"}]}, "gpus[0].uuid", 'expected a string like "GPU-5a1c..."'),
    ("uuid-number", two_gpus(uuid=5), "gpus[1].uuid", "expected a string"),
    ("uuid-no-prefix", two_gpus(uuid="5a1c0f3e"), "gpus[1].uuid", "expected a string"),
    ("uuid-lowercase-prefix", two_gpus(uuid="gpu-5a1c"), "gpus[1].uuid", "expected a string"),
    ("uuid-bare-prefix", two_gpus(uuid="GPU-"), "gpus[1].uuid", "expected a string"),
    ("uuid-with-comma", two_gpus(uuid="GPU-a,GPU-b"), "gpus[1].uuid", "expected a string"),
    ("uuid-with-blank", two_gpus(uuid="GPU-a b"), "gpus[1].uuid", "expected a string"),
    ("uuid-with-newline", two_gpus(uuid="GPU-a\nb"), "gpus[1].uuid", "expected a string"),
    ("uuid-null", two_gpus(uuid=None), "gpus[1].uuid", "expected a string"),
    ("uuid-duplicate", two_gpus(uuid=UUID0), "gpus[1].uuid", f"'{UUID0}' is used twice"),
    ("unknown-gpu-key", two_gpus(memory_free_mib=3), "gpus[1]", "unknown key 'memory_free_mib'"),
    ("name-number", two_gpus(name=5), "gpus[1].name", "expected a string"),
    ("device-empty", two_gpus(device=""), "gpus[1].device", "expected a path"),
    ("device-number", two_gpus(device=0), "gpus[1].device", "expected a path"),
    ("device-null", two_gpus(device=None), "gpus[1].device", "expected a path"),
    ("error-number", two_gpus(error=15), "gpus[1].error", "expected a string"),
    (
        "memory-negative",
        two_gpus(memory_used_mib=-1),
        "gpus[1].memory_used_mib",
        "expected a number >= 0, got -1",
    ),
    (
        "memory-string",
        two_gpus(memory_used_mib="5"),
        "gpus[1].memory_used_mib",
        'expected a number >= 0, got "5"',
    ),
    (
        "memory-bool",
        two_gpus(memory_used_mib=True),
        "gpus[1].memory_used_mib",
        "expected a number >= 0, got true",
    ),
    (
        "memory-list",
        two_gpus(memory_total_mib=[1]),
        "gpus[1].memory_total_mib",
        "expected a number >= 0, got [1]",
    ),
    ("memory-huge-float", two_gpus(memory_total_mib=1e300), "gpus[1].memory_total_mib", "number too large"),
    ("memory-huge-int", two_gpus(memory_total_mib=1 << 60), "gpus[1].memory_total_mib", "number too large"),
    ("utilization-over-100", two_gpus(utilization_pct=101), "gpus[1].utilization_pct", "at most 100"),
    (
        "utilization-negative",
        two_gpus(utilization_pct=-5),
        "gpus[1].utilization_pct",
        "expected a number >= 0",
    ),
    ("utilization-bool", two_gpus(utilization_pct=False), "gpus[1].utilization_pct", "got false"),
    ("processes-not-a-list", two_gpus(processes={"pid": 1}), "gpus[1].processes", "expected a list"),
    ("processes-string", two_gpus(processes="4242"), "gpus[1].processes", "expected a list"),
    ("process-not-an-object", two_gpus(processes=[4242]), "gpus[1].processes[0]", "expected {"),
    (
        "process-unknown-key",
        two_gpus(processes=[{"pid": 1, "user": "x"}]),
        "gpus[1].processes[0]",
        "expected {",
    ),
    (
        "process-pid-missing",
        two_gpus(processes=[{"used_memory_mib": 1}]),
        "gpus[1].processes[0].pid",
        "missing",
    ),
    (
        "process-pid-zero",
        two_gpus(processes=[{"pid": 0}]),
        "gpus[1].processes[0].pid",
        "expected a number >= 1",
    ),
    (
        "process-pid-string",
        two_gpus(processes=[{"pid": "1"}]),
        "gpus[1].processes[0].pid",
        "expected a number",
    ),
    ("process-pid-bool", two_gpus(processes=[{"pid": True}]), "gpus[1].processes[0].pid", "got true"),
    (
        "process-memory-negative",
        two_gpus(processes=[{"pid": 1}, {"pid": 2, "used_memory_mib": -1}]),
        "gpus[1].processes[1].used_memory_mib",
        "expected a number >= 0",
    ),
    ("nan", '{"gpus": [{"uuid": "GPU-1", "memory_used_mib": NaN}]}', "gpus[0].memory_used_mib", "got NaN"),
    (
        "infinity",
        '{"gpus": [{"uuid": "GPU-1", "memory_used_mib": Infinity}]}',
        "gpus[0].memory_used_mib",
        "too large",
    ),
    (
        "minus-infinity",
        '{"gpus": [{"uuid": "GPU-1", "utilization_pct": -Infinity}]}',
        "gpus[0].utilization_pct",
        ">= 0",
    ),
    ("non-utf8", b'{"gpus": [{"uuid": "GPU-\xff"}]}', "", "not UTF-8 text (bad byte at offset 24)"),
    ("utf16", '{"gpus": []}'.encode("utf-16"), "", "not UTF-8 text (bad byte at offset 0)"),
    ("too-large", b'{"gpus": []}' + b" " * MAX_SIM_BYTES, "", f"too large (at most {MAX_SIM_BYTES} bytes)"),
    ("nested-too-deeply", "[" * 100_000 + "]" * 100_000, "", "not valid JSON: nested too deeply"),
    (
        "enormous-int",
        '{"gpus": [{"uuid": "GPU-1", "memory_used_mib": ' + "9" * 5000 + "}]}",
        "",
        "not valid JSON",
    ),
]


@pytest.mark.parametrize(
    ("doc", "field", "fragment"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_malformed_file(tmp_path, doc, field, fragment):
    path = write(tmp_path / "sim.json", doc)
    b = SimBackend(str(path))
    with pytest.raises(SimError) as info:
        b.load()
    message = str(info.value)
    head = f"{path}: {field}" if field else f"{path}: "
    assert message.startswith(head), (message, head)
    assert fragment in message, (message, fragment)
    assert "\n" not in message and len(message) < 400
    reading = b.read()
    assert reading == GpuReading(gpus=(), error=message)
    assert not (tmp_path / "dev").exists()  # nothing created from a file that does not load


def test_missing_file(tmp_path):
    b = SimBackend(str(tmp_path / "nope.json"))
    with pytest.raises(SimError) as info:
        b.load()
    assert str(info.value) == f"{tmp_path / 'nope.json'}: No such file or directory"
    assert b.read() == GpuReading(gpus=(), error=str(info.value))


def test_directory_instead_of_a_file(tmp_path):
    assert SimBackend(str(tmp_path)).read() == GpuReading(gpus=(), error=f"{tmp_path}: not a regular file")


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_fifo_or_device_is_refused_without_hanging(tmp_path, kind, alarm):
    # Opening a FIFO for reading blocks until a writer comes; /dev/zero never ends.
    path = tmp_path / "sim.json"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path = Path("/dev/zero")
    assert SimBackend(str(path)).read() == GpuReading(gpus=(), error=f"{path}: not a regular file")


def test_file_at_the_size_limit_loads(tmp_path):
    doc = b'{"gpus": []}'
    path = write(tmp_path / "sim.json", doc + b" " * (MAX_SIM_BYTES - len(doc)))
    assert SimBackend(str(path)).load() == ()


def test_close_is_harmless(tmp_path):
    b = SimBackend(str(write(tmp_path / "sim.json", {"gpus": []})))
    b.close()
    assert b.read() == GpuReading(gpus=())


def test_a_held_device_file_that_is_renamed_keeps_its_gpu_busy(tmp_path, sim, daemon_factory):
    d = daemon_factory(
        f"[gpu-all]\ngpus = ALL\n\n[process-miner]\ncmd = {workload_cmd(tmp_path)}\ngpus = 0\nuser = root\n"
    )
    d.wait_running("miner")
    opener = subprocess.Popen(foreign_opener_cmd(sim.device(0)), stdout=subprocess.PIPE)
    try:
        assert opener.stdout is not None and opener.stdout.readline() == b"open\n"
        d.wait_log(rf"\[{opener.pid}\] holds .*; stopping miner")
        os.rename(sim.device(0), sim.device(0) + ".old")  # the holder keeps the old inode
        wait_for(lambda: os.path.exists(sim.device(0)), what="the daemon's next look making a new file")
        d.signal(signal.SIGUSR1)  # answered after the round that made the new file
        (line,) = d.wait_log(r"status: ")
        assert line.endswith("0/2 GPUs running work; GPU 0 busy (root)"), line
        assert d.workload("miner").get("state") != "running"
    finally:
        opener.kill()
        opener.wait()
    try:
        d.wait_running("miner")  # and once the holder is gone, the GPU is free again
    except AssertionError:
        raise AssertionError(d.log()) from None


def test_energy_and_power_in_nvml_units(tmp_path):
    path = write(tmp_path / "sim.json", two_gpus(energy_mj=9_000_000, power_mw=300_000))
    g0, g1 = SimBackend(str(path)).read().gpus
    assert (g0.energy_mj, g0.power_mw) == (None, None)  # absent: not supported, never 0
    assert (g1.energy_mj, g1.power_mw) == (9_000_000, 300_000)
    write(path, two_gpus(energy_mj=9_500_000, power_mw=None))  # (re-read: the counter moved on)
    g1 = SimBackend(str(path)).read().gpus[1]
    assert (g1.energy_mj, g1.power_mw, g1.errors) == (9_500_000, None, ())
    write(path, two_gpus(energy_mj=-1))
    with pytest.raises(SimError, match=r"gpus\[1\]\.energy_mj: expected a number >= 0"):
        SimBackend(str(path)).load()
    write(path, two_gpus(energy_mj=5, error="GPU is lost"))
    assert SimBackend(str(path)).read().gpus[1].energy_mj is None
