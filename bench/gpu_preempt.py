#!/usr/bin/env python3
"""On a machine with an NVIDIA GPU: does a user's job ever hit out-of-memory because of our workload?

    python bench/gpu_preempt.py [--trials 20] [--memory 88%|default] [--foreign torch|libcuda]
                                [--foreign-alloc 50%] [--json FILE]

A real `gpu-mon run` (NVML backend) runs `gpu-mon stress --memory 88%` on GPU 0 (as a per-GPU workload).
Each trial starts a foreign torch process that, right after CUDA initialisation, allocates half the GPU's
memory at once, as a training job would. We record whether that allocation fails with out-of-memory, and
how long after the foreign process started initialising CUDA NVML shows our workload's memory released.
The foreign process then exits, and the daemon starts the workload again after its start delay.
`--foreign libcuda` makes the foreign process a few lines of ctypes on libcuda (cuInit, a context,
cuMemAlloc): no torch start-up, so its allocation comes as early as a CUDA program's can.
`--foreign-alloc 90%` makes it take that share of the GPU's total at once, with no retry, as a greedy
newcomer does (vLLM's default is 90%, JAX preallocates 75%). `--memory default` runs the stressor at its
own default hold. `--json FILE` also writes every trial and the summary, machine-readable (what
bench/gpu_proof.py reads).

Other openers of the GPU (a host's monitor) make the daemon stop the workload too: its log says which
processes did. A trial that would begin within a few seconds of such a stop waits; one during or just after
which one came is recorded as disturbed, not summed up, and run again (at most --trials more times). The
summary names those openers and the stops they caused.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parent.parent
IGNORE_ENV = "GPU_PROOF_IGNORE_PROGRAMS"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import newcomer  # noqa: E402
from background import median, percentile, table  # noqa: E402
from proof import openers  # noqa: E402

from gpu_mon.api.nvml import NvmlBackend  # noqa: E402


def held_fraction(memory: str) -> Optional[float]:
    """The share of the GPU the workload holds once fully allocated: 88% -> 0.88; 0.8 for absolute sizes;
    None for the stressor's own default (the workload is then waited for until its memory is steady)."""
    if memory == "default":
        return None
    return float(memory[:-1]) / 100 if memory.endswith("%") else 0.8


def share(text: str) -> float:
    """--foreign-alloc: '90%' -> 0.9 (more than 0, at most 100%)."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float("nan")
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a percent of the GPU's total, such as 90%")
    return value


def gpu0(backend: NvmlBackend):
    return backend.read(process_utilization=False).gpus[0]


def wait_for_workload(
    backend: NvmlBackend, ours: set, min_mib: int, steady_s: float = 0.0, timeout: float = 120
) -> Optional[int]:
    """Wait until a process that is not the foreign one holds >= min_mib (and, with `steady_s`, has held
    the same memory that long); return NVML memory used."""
    deadline = time.monotonic() + timeout
    last: Optional[tuple] = None
    since = time.monotonic()
    while time.monotonic() < deadline:
        g = gpu0(backend)
        held = [p for p in g.processes or () if (p.used_memory_mib or 0) >= min_mib]
        now = time.monotonic()
        seen = tuple(sorted((p.pid, p.used_memory_mib) for p in held))
        if seen != last:
            last, since = seen, now
        if held and now - since >= steady_s:
            ours.clear()
            ours.update(p.pid for p in held)
            return g.memory_used_mib
        time.sleep(0.1)
    return None


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--memory", default="88%", help="the stressor's --memory, or 'default' for its own")
    ap.add_argument("--foreign", choices=newcomer.KINDS, default="torch", help="the foreign process")
    ap.add_argument(
        "--foreign-alloc",
        type=share,
        default=0.5,
        metavar="PCT",
        help="the share of the GPU's total the foreign process allocates at once, no retry (default 50%%)",
    )
    ap.add_argument(
        "--ignore-programs",
        default=os.environ.get(IGNORE_ENV, ""),
        metavar="NAME,...",
        help="more ignore_programs for the daemon: a host monitor that opens the GPU "
        f"every few seconds (default ${IGNORE_ENV}, which bench/gpu_proof.py --ignore-programs sets)",
    )
    ap.add_argument("--json", metavar="FILE", help="also write every trial and the summary here as JSON")
    a = ap.parse_args()
    if a.trials < 1:
        ap.error("--trials must be at least 1")
    return a


def daemon_config(work: Path, memory: str, ignore: str = "") -> str:
    """The daemon's config: the stressor on GPU 0, restarted 2 s after a GPU is free again."""
    hold = "" if memory == "default" else f" --memory {memory}"
    ignored = ",".join(["gpu-bench-nvml", *(n.strip() for n in ignore.split(",") if n.strip())])
    return (
        f"[defaults]\ninterval_seconds = 1\nstart_delay_seconds = 2\nstop_timeout_seconds = 5\n"
        f"state_file = {work}/state.json\n[gpu-all]\ngpus = 0\nignore_programs = {ignored}\n"
        "[process-stress]\nuser = root\n"
        f"cmd = {sys.executable} -m gpu_mon stress{hold} --report-seconds 30\n"
        f"env = PYTHONPATH={ROOT}\n"
        f"[history]\npath = {work}/history.sqlite\n"
    )


def settle(log: Path, own: set) -> None:
    """Wait until SETTLE_S have passed since the last stop that a foreign opener caused."""
    while True:
        last = max((s.time for s in openers.foreign(openers.stops(_text(log)), own)), default=0.0)
        left = last + openers.SETTLE_S - time.time()
        if left <= 0:
            return
        print(
            f"a foreign opener stopped the workload {openers.SETTLE_S - left:.1f} s ago: waiting", flush=True
        )
        time.sleep(left)


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def run_trial(backend: NvmlBackend, a: argparse.Namespace, ours: set, used: int) -> Optional[dict]:
    """One foreign process against the workload: its record (None if it printed nothing)."""
    # No go line: it starts timing (t_init) as soon as torch or libcuda is loaded.
    foreign = newcomer.start(a.foreign, a.foreign_alloc, go=False)
    ours_mib = sum(p.used_memory_mib or 0 for p in gpu0(backend).processes or () if p.pid in ours)
    released_at: Optional[int] = None  # our pid gone from NVML's process list
    freed_at: Optional[int] = None  # NVML memory used down by 90% of what our process held
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # poll NVML every ~5 ms until ours is gone and theirs is done
        g = gpu0(backend)
        now = time.monotonic_ns()
        if freed_at is None and g.memory_used_mib is not None and g.memory_used_mib <= used - 0.9 * ours_mib:
            freed_at = now
        if released_at is None and not [p for p in g.processes or () if p.pid in ours]:
            released_at = now
        done = released_at is not None and foreign.poll() is not None
        if done and (freed_at is not None or time.monotonic() > deadline - 55):
            break
        time.sleep(0.005)
    out = json.loads(foreign.stdout.readline() or "{}")
    foreign.wait()
    if not out:
        print(f"the foreign process printed nothing (exit {foreign.returncode})")
        return None
    return {
        "pid": foreign.pid,
        "ok": out["ok"],
        "err": out["err"],
        "ours_mib": ours_mib,
        "free_at_init_mib": out["free_at_ready_mib"],  # the name bench/gpu_proof.py's files have
        "freed_ms": (freed_at - out["t_init"]) / 1e6 if freed_at else float("nan"),
        "off_list_ms": (released_at - out["t_init"]) / 1e6 if released_at else float("nan"),
        "ready_ms": (out["t_ready"] - out["t_init"]) / 1e6,
        "alloc_ms": (out["t_alloc"] - out["t_init"]) / 1e6,
    }


def summary_rows(trials: List[dict]) -> List[list]:
    """The table's one row, over the trials that were not disturbed."""
    counted = [t for t in trials if not t.get("disturbed")]
    if not counted:
        return []
    rel = [t["off_list_ms"] for t in counted if t["off_list_ms"] == t["off_list_ms"]]
    freed = [t["freed_ms"] for t in counted if t["freed_ms"] == t["freed_ms"]]
    ready = [t["ready_ms"] for t in counted]

    def ms(values: List[float], p: Optional[int] = None) -> str:
        if not values:
            return "-"
        return f"{median(values) if p is None else percentile(values, p):.0f}"

    ooms = sum(1 for t in counted if not t["ok"])
    disturbed = len(trials) - len(counted)
    return [[len(counted), disturbed, ooms, ms(freed), ms(freed, 99), ms(rel), ms(rel, 99), ms(ready)]]


def main() -> int:
    a = parse_args()
    # This process reads NVML, so it holds /dev/nvidia0 like any monitor: give it a name of its own and
    # have gpu-mon ignore it (ignore_programs), as an admin would for nvtop or an exporter.
    ctypes.CDLL(None).prctl(15, ctypes.c_char_p(b"gpu-bench-nvml"), 0, 0, 0)  # PR_SET_NAME
    backend = NvmlBackend()
    first = backend.read(process_utilization=False)
    if first.error or not first.gpus:
        print(f"no GPU: {first.error}")
        return 2
    total = first.gpus[0].memory_total_mib
    work = Path(tempfile.mkdtemp(prefix="gpu-mon-gpu-preempt-"))
    conf = work / "gpu_mon.conf"
    conf.write_text(daemon_config(work, a.memory, a.ignore_programs))
    if a.ignore_programs:
        print(f"the daemon ignores these openers (--ignore-programs): {a.ignore_programs}", flush=True)
    os.chmod(conf, 0o600)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    daemon_log = work / "daemon.log"
    log = open(daemon_log, "wb")  # noqa: SIM115 - the daemon writes it until the end
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gpu_mon", "--config", str(conf), "run"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    trials: List[dict] = []
    own: set = set()  # the foreign processes this benchmark started: its own openers
    fraction = held_fraction(a.memory)
    try:
        attempts = 0
        while sum(1 for t in trials if not t.get("disturbed")) < a.trials and attempts < 2 * a.trials:
            attempts += 1
            ours: set = set()
            settle(daemon_log, own)
            if fraction is None:  # the stressor's own hold: fully allocated once its memory is steady
                used = wait_for_workload(backend, ours, min_mib=1024, steady_s=1.0)
            else:
                used = wait_for_workload(backend, ours, min_mib=int(total * fraction * 0.9))
            if used is None:
                print("the workload did not start; daemon log:")
                print(_text(daemon_log)[-3000:])
                return 1
            began = time.time()
            trial = run_trial(backend, a, ours, used)
            if trial is None:
                continue
            own.add(trial["pid"])
            trial["disturbed"] = openers.disturbed(openers.stops(_text(daemon_log)), own, began, time.time())
            trials.append(trial)
            if a.json:  # after every trial: a run cut short still leaves the trials it finished
                write_json(a, first.gpus[0].name, total, trials, daemon_log, own)
            print(
                f"trial {len(trials)}: ours held {trial['ours_mib']} MiB; foreign cuInit->ready "
                f"{trial['ready_ms']:.0f} ms, free at its init {trial['free_at_init_mib']} MiB, "
                f"{a.foreign_alloc:.0%} allocation "
                f"{'OK' if trial['ok'] else 'OUT OF MEMORY: ' + trial['err']}; NVML memory used dropped "
                f"{trial['freed_ms']:.0f} ms and our pid left NVML's list {trial['off_list_ms']:.0f} ms "
                "after its cuInit" + (f"; NOT COUNTED: {trial['disturbed']}" if trial["disturbed"] else ""),
                flush=True,
            )
        print()
        print(
            f"GPU 0: {first.gpus[0].name}, {total} MiB; workload: gpu-mon stress --memory {a.memory}; "
            f"foreign: {a.foreign}, allocates {a.foreign_alloc:.0%} at once; "
            "times from the foreign process's cuInit"
        )
        headers = [
            "trials",
            "disturbed",
            "foreign OOMs",
            "memory freed p50 ms",
            "p99 ms",
            "pid off NVML list p50 ms",
            "p99 ms",
            "foreign cuInit->ready p50 ms",
        ]
        print(table(headers, summary_rows(trials)))
        seen = openers.words(openers.summary(openers.stops(_text(daemon_log)), own))
        print(f"foreign openers that made the daemon stop the workload: {seen or 'none'}")
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()
        print("--- daemon log (last lines) ---")
        print("\n".join(_text(daemon_log).splitlines()[-25:]))
        shutil.rmtree(work, ignore_errors=True)
        backend.close()
    return 0


def write_json(a: argparse.Namespace, gpu: str, total: int, trials: List[dict], log: Path, own: set) -> None:
    """Every trial so far, and the foreign openers the daemon's log names (bench/gpu_proof.py reads it)."""
    found = openers.stops(_text(log))
    doc = {
        "gpu": gpu,
        "total_mib": total,
        "memory": a.memory,
        "foreign": a.foreign,
        "foreign_alloc": a.foreign_alloc,
        "trials_asked": a.trials,
        "trials": trials,
        "foreign_openers": openers.summary(found, own),
        "foreign_stops": len(openers.foreign(found, own)),
    }
    Path(a.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
