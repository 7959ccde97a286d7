"""On a real NVIDIA GPU only (marked `gpu`): `gpu-mon occupy` holding and freeing GPU memory, and `--yield`
handing the GPU to a foreign torch job that allocates half of it at once. Run by bench/gpu_proof.py (check
occupy). The occupier keeps its files in the test's temp dir (XDG_STATE_HOME)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Dict, Iterator, List, Set

import gpujobs
import pytest
from conftest import GPU_MON

WAIT_MINUTES = 0.05  # 3 s of free GPU before it occupies
HELD_TIMEOUT_S = WAIT_MINUTES * 60 + 120  # and the stressor's start-up (torch, CUDA, the allocation)


class Occupier:
    """`gpu-mon occupy` for one test: its own state directory, a config that ignores this process."""

    def __init__(self, tmp_path: Path) -> None:
        self.config = tmp_path / "occupy.conf"
        self.config.write_text(f"[gpu-all]\ngpus = ALL\nignore_programs = {gpujobs.READER_NAME}\n")
        os.chmod(self.config, 0o600)
        self.env = gpujobs.real_env(XDG_STATE_HOME=str(tmp_path / "state"))

    def __call__(self, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
        """`occupy ARGS`; `on` with the config (the other subcommands read none)."""
        config = ["--config", str(self.config)] if args[0] == "on" else []
        argv = [*GPU_MON, "occupy", args[0], *config, *args[1:]]
        return subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=timeout)


@pytest.fixture
def occupy(tmp_path: Path) -> Iterator[Occupier]:
    """An occupier that is turned off at the end whatever happened, while this process is named as the
    NVML reader the occupier's config ignores."""
    occupier = Occupier(tmp_path)
    with gpujobs.named_reader():
        try:
            yield occupier
        finally:
            occupier("off", timeout=120)


def new_holders(reader: gpujobs.Nvml, before: Set[int], at_least_mib: float) -> Dict[int, float]:
    """Processes NVML lists now that were not there before, once together they hold `at_least_mib`."""
    new = {pid: mib for pid, mib in reader.processes().items() if pid not in before}
    return new if sum(new.values()) >= at_least_mib else {}


def wait_held(reader: gpujobs.Nvml, before: Set[int], at_least_mib: float) -> Dict[int, float]:
    deadline = time.monotonic() + HELD_TIMEOUT_S
    while not (held := new_holders(reader, before, at_least_mib)):
        assert time.monotonic() < deadline, f"nothing new holds {at_least_mib:.0f} MiB: {reader.processes()}"
        time.sleep(0.1)
    return held


@pytest.mark.gpu
def test_occupy_holds_and_frees_memory(occupy, record_property):
    with gpujobs.nvml() as reader:
        before = set(reader.processes())
        start = time.monotonic()
        on = occupy(
            "on", "--gpus", "0", "--memory", "20GiB", "--no-compute", "--wait-minutes", str(WAIT_MINUTES)
        )
        assert on.returncode == 0, on.stderr
        held = wait_held(reader, before, 0.98 * 20 * 1024)
        record_property("held_s", round(time.monotonic() - start, 2))
        record_property("wait_s", WAIT_MINUTES * 60)
        record_property("held_mib", round(sum(held.values())))
        start = time.monotonic()
        off = occupy("off")
        assert off.returncode == 0, off.stderr
        deadline = start + 60
        while set(held) & set(reader.processes()):
            assert time.monotonic() < deadline, f"still held a minute after off: {reader.processes()}"
            time.sleep(0.05)
        freed = time.monotonic() - start
        record_property("freed_s", round(freed, 2))
        assert freed <= 5, freed


@pytest.mark.gpu
def test_occupy_yield_hands_off_without_out_of_memory(occupy, record_property):
    trials = gpujobs.repeats(3, 10)
    results: List[dict] = []
    with gpujobs.nvml() as reader:
        seen = set(reader.processes())  # and then each stressor that yielded
        on = occupy("on", "--gpus", "0", "--yield", "--wait-minutes", str(WAIT_MINUTES))
        assert on.returncode == 0, on.stderr
        try:
            for _ in range(trials):
                held = wait_held(reader, seen, 0.8 * reader.total_mib)  # the default 88% is in
                seen |= set(held)
                with gpujobs.Job(gpujobs.FOREIGN_HALF, gpujobs.on_gpu(reader.uuid)) as foreign:
                    results.append(json.loads(foreign.line()))
        finally:
            record_property("yield_trials", len(results))
            record_property("yield_ooms", sum(1 for r in results if not r["ok"]))
    assert len(results) == trials
    assert all(r["ok"] for r in results), [r["err"] for r in results if not r["ok"]]
