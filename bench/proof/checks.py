"""The checks of bench/gpu_proof.py: one table entry each, with the docs' claim, what `holds` means, the
command (an existing benchmark with --json, or GPU-marked tests with a JUnit result), its time budget, and
how its figures are judged. The judges take only the recorded figures, so a recorded run can be rendered
and judged again (`--from-json`)."""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

from proof import junit

ROOT = Path(__file__).resolve().parents[2]
HOLDS, DIFFERS, FAILED = "holds", "differs", "failed"
Figures = Dict[str, Any]
Judged = Tuple[str, str]  # verdict, what was measured (one line)


@dataclass(frozen=True)
class Context:
    """Where a run writes (its --out directory) and how long it may take."""

    out: Path
    quick: bool

    def raw(self, name: str, ext: str) -> Path:
        """The file a check's command writes its figures to."""
        return self.out / "raw" / f"{name}.{ext}"


@dataclass(frozen=True)
class Check:
    """One line of the table."""

    name: str
    title: str
    claim: str  # what the docs say, its figure quoted
    holds_if: str  # the bound the figures are judged against
    budget: Tuple[int, int]  # seconds: --quick, full
    argv: Callable[[Context], List[str]]
    read: Callable[[Context], Figures]
    judge: Callable[[Figures], Judged]

    def seconds(self, quick: bool) -> int:
        """Its time budget in this mode."""
        return self.budget[0 if quick else 1]


# ----- commands and what they write


def bench(name: str, script: str, quick: Sequence[str], full: Sequence[str]) -> Dict[str, Any]:
    """argv and read for an existing benchmark run with --json."""

    def argv(ctx: Context) -> List[str]:
        args = quick if ctx.quick else full
        return [sys.executable, str(ROOT / "bench" / script), *args, "--json", str(ctx.raw(name, "json"))]

    def read(ctx: Context) -> Figures:
        try:
            return json.loads(ctx.raw(name, "json").read_text())
        except (OSError, ValueError):
            return {}

    return {"argv": argv, "read": read}


def tests(name: str, *node_ids: str) -> Dict[str, Any]:
    """argv and read for GPU-marked tests run by pytest with a JUnit XML result."""

    def argv(ctx: Context) -> List[str]:
        junit_xml = f"--junitxml={ctx.raw(name, 'xml')}"
        pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", junit_xml]
        return [*pytest, *(f"tests/{node}" for node in node_ids)]

    return {"argv": argv, "read": lambda ctx: junit.read(ctx.raw(name, "xml"))}


# ----- judging helpers


def finite(values: Sequence[Any]) -> List[float]:
    """The values that are numbers (NaN and None left out)."""
    return [float(v) for v in values if isinstance(v, (int, float)) and not math.isnan(v)]


def spread(values: Sequence[float], unit: str = "", digits: int = 0) -> str:
    """min / median / max, or the one value."""
    if not values:
        return "none"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}{unit}"
    parts = (min(values), statistics.median(values), max(values))
    return " / ".join(f"{v:.{digits}f}" for v in parts) + f"{unit} (min / median / max)"


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile, as the benchmarks compute it."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * pct // 100))
    return ordered[int(rank) - 1]


def verdict(ok: bool) -> str:
    """holds or differs."""
    return HOLDS if ok else DIFFERS


def tested(summary: Callable[[Figures], Judged]) -> Callable[[Figures], Judged]:
    """A judge for GPU-marked tests: failed unless every test ran; a failed assertion differs."""

    def judge(figures: Figures) -> Judged:
        outcomes: Dict[str, str] = figures.get("outcomes") or {}
        if not outcomes:
            return FAILED, "no test result"
        for test, result in outcomes.items():
            if not result.startswith(("passed", "failed")):
                return FAILED, f"{test}: {result}"
        failures = [f"{t}: {r}" for t, r in outcomes.items() if r.startswith("failed")]
        try:
            judged, measured = summary(figures)
        except (KeyError, TypeError, ValueError) as exc:
            if failures:
                return DIFFERS, failures[0]
            return FAILED, f"a test recorded no figure {exc}"
        if failures:
            return DIFFERS, f"{measured}; {failures[0]}"
        return judged, measured

    return judge


# ----- the judges, one per check


POLL_LOOK_US = 200  # a poll's look (no per-process utilization), median


def nvml_cost(f: Figures) -> Judged:
    median_us, p99_us = f["whole_look_us"]
    listed = any(s.get("by_node") and s.get("by_nvml") for s in f.get("status", []))
    seen = f"`status` lists the CUDA process by node and NVML: {'yes' if listed else 'no'}"
    if "poll_look_us" not in f:  # recorded before polls left per-process utilization out
        measured = f"whole look {median_us:.0f} / {p99_us:.0f} µs (median / p99); {seen}"
        return verdict(median_us < 1000 and listed), measured
    poll_us, poll_p99_us = f["poll_look_us"]
    measured = (
        f"a poll's look {poll_us:.0f} / {poll_p99_us:.0f} µs, a full look (per-process utilization) "
        f"{median_us:.0f} / {p99_us:.0f} µs (median / p99); {seen}"
    )
    return verdict(poll_us < POLL_LOOK_US and listed), measured


def memory_v2(f: Figures) -> Judged:
    v1, used, reserved, ours = (
        f[k] for k in ("v1_used_mib", "v2_used_mib", "v2_reserved_mib", "gpu_mon_used_mib")
    )
    measured = (
        f"idle GPU: v1 used {v1:.0f} MiB; v2 used {used:.0f} + reserved {reserved:.0f} MiB; "
        f"gpu-mon's used {ours:.0f} MiB"
    )
    ok = reserved > 0 and abs(v1 - used - reserved) <= 16 and abs(ours - used) <= 16 and used < v1
    return verdict(ok), measured


def counted(f: Figures) -> Tuple[List[Dict[str, Any]], str]:
    """The trials a handoff check judges (those no foreign opener disturbed), and words for the rest."""
    trials = f["trials"]
    kept = [t for t in trials if not t.get("disturbed")]
    left_out = len(trials) - len(kept)
    note = f"; {left_out} trial(s) not counted (a foreign opener stopped the workload)" if left_out else ""
    return kept, note


def handoff(need_margin: bool) -> Callable[[Figures], Judged]:
    def judge(f: Figures) -> Judged:
        trials, note = counted(f)
        if not trials:
            return FAILED, "no trial ran" + note
        ooms = sum(1 for t in trials if not t["ok"])
        freed = finite([t["freed_ms"] for t in trials])
        ready = finite([t["ready_ms"] for t in trials])
        margins = [t["ready_ms"] - t["freed_ms"] for t in trials]
        margin = min(finite(margins), default=float("nan")) if len(finite(margins)) == len(trials) else None
        held = statistics.median(t["ours_mib"] for t in trials) / 1024
        measured = (
            f"{ooms}/{len(trials)} out of memory ({f.get('memory')} held, {held:.1f} GiB); memory freed "
            f"{spread(freed, ' ms')} after the foreign cuInit, p99 {_p99(freed)}; foreign ready to "
            f"allocate {spread(ready, ' ms')}; smallest margin "
            + ("not freed in one trial" if margin is None else f"{margin:.0f} ms")
            + note
        )
        ok = ooms == 0 and (not need_margin or (margin is not None and margin > 0))
        return verdict(ok), measured

    return judge


def handoff_greedy(f: Figures) -> Judged:
    """No newcomer that takes its share at once runs out of memory, and memory is freed before a newcomer
    is ready: p99 of freed < p50 of ready, with every trial freed."""
    trials, note = counted(f)
    if not trials:
        return FAILED, "no trial ran" + note
    ooms = sum(1 for t in trials if not t["ok"])
    freed = finite([t["freed_ms"] for t in trials])
    ready = finite([t["ready_ms"] for t in trials])
    share = f.get("foreign_alloc")
    takes = f"{share:.0%}" if isinstance(share, (int, float)) else "?"
    held = statistics.median(t["ours_mib"] for t in trials) / 1024
    measured = (
        f"{ooms}/{len(trials)} out of memory (newcomer takes {takes} at once; stressor at "
        f"{f.get('memory')} hold, {held:.1f} GiB); memory freed p50 {_p50(freed)}, p99 {_p99(freed)} after "
        f"the newcomer's cuInit; newcomer ready p50 {_p50(ready)}" + note
    )
    ok = ooms == 0 and len(freed) == len(trials) and bool(ready)
    ok = ok and percentile(freed, 99) < statistics.median(ready)
    return verdict(ok), measured


def _p50(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.0f} ms" if values else "none"


def _p99(values: Sequence[float]) -> str:
    return f"{percentile(values, 99):.0f} ms" if values else "none"


def stress(f: Figures) -> Judged:
    rows, figures = f.get("rows") or [], f.get("figures") or {}
    if not rows:
        return FAILED, "the benchmark wrote no rows"
    parts = [
        f"{dtype} {r['ratio']:.3f} of plain (ours {spread(r['ours_tflops'])}, plain "
        f"{spread(r['plain_tflops'])} TFLOP/s)"
        for dtype, r in figures.get("rates", {}).items()
    ]
    memory = figures.get("memory")
    if memory:
        parts.append(f"held {memory['held_mib'] / memory['target_mib']:.4f} of target")
    release = figures.get("release") or []
    for key, label in (("released_ms", "released"), ("all_released_ms", "all"), ("exit_ms", "exit")):
        worst = finite([r.get(key) for r in release])
        if worst:
            parts.append(f"{label} {max(worst):.0f} ms")
    check = figures.get("verify")
    if check and check.get("reference_tflops"):
        ratio = check["tflops"] / check["reference_tflops"]
        parts.append(f"--verify {ratio:.3f} of plain, {'ok' if check['ok'] else 'FAULT'}")
    results = [r["result"] for r in rows]
    errors = [r["reference"] for r in rows if r["result"] == "ERROR"]
    if any(r in ("MISS", "FAIL") for r in results):
        return DIFFERS, "; ".join(parts)
    if errors:
        return FAILED, errors[0]
    return HOLDS, "; ".join(parts)


def utilization(f: Figures) -> Judged:
    mad, samples = f["mean_abs_diff_pct"], int(f["samples"])
    measured = (
        f"mean |gpu-mon - pmon| {mad:.1f} points over {samples} paired samples (gpu-mon mean "
        f"{f['gpu_mon_mean_pct']:.0f}%, pmon {f['pmon_mean_pct']:.0f}%)"
    )
    return verdict(mad <= 10 and samples >= 10 and f["gpu_mon_mean_pct"] >= 50), measured


def watch(f: Figures) -> Judged:
    late = f["idle_took_s"] - f["window_s"]
    left, stopped = int(f["idle_left"]), bool(f["busy_stopped"])
    measured = (
        f"idle job: exit {f['idle_exit']:.0f}, stopped {late:+.1f} s from the window's end "
        f"({f['window_s']:.0f} s), {left} process(es) left; busy job: "
        f"{'stopped' if stopped else 'not stopped'} in {f['busy_ran_s']:.0f} s"
    )
    ok = f["idle_exit"] == 124 and -f["sample_s"] <= late <= f["sample_s"] + 2 and not left and not stopped
    return verdict(ok), measured


def occupy(f: Figures) -> Judged:
    trials, ooms = int(f["yield_trials"]), int(f["yield_ooms"])
    measured = (
        f"held {f['held_mib'] / 1024:.1f} GiB {f['held_s']:.1f} s after `on` (its wait {f['wait_s']:.0f} s); "
        f"memory freed {f['freed_s']:.2f} s after `off`; --yield: {trials - ooms}/{trials} foreign "
        "allocations of half the GPU without out-of-memory"
    )
    ok = ooms == 0 and trials > 0 and f["freed_s"] <= 5 and f["held_s"] <= f["wait_s"] + 60
    return verdict(ok), measured


def sentinel(f: Figures) -> Judged:
    fired = int(f["fired_count"])
    measured = (
        f"armed {f['armed_after_s']:.1f} s into the load; fired {fired} time(s), "
        f"{f['fired_after_end_s']:.1f} s after the load ended (kill duration {f['kill_duration_s']:.0f} s)"
    )
    ok = fired == 1 and f["fired_after_end_s"] <= f["kill_duration_s"] + 3 * f["interval_s"]
    return verdict(ok), measured


def status(f: Figures) -> Judged:
    agree, node = bool(f["pids_agree"]), bool(f["node_holder"])
    measured = (
        f"status vs nvidia-smi: pids {'agree' if agree else 'DIFFER'}, memory within "
        f"{f['memory_diff_mib']:.0f} MiB; job seen as a node holder: {'yes' if node else 'no'}; "
        f"/metrics memory within {f['metrics_memory_diff_pct']:.1f}% of NVML, utilization "
        f"{f['metrics_utilization']:.2f}"
    )
    ok = agree and node and f["memory_diff_mib"] <= 8 and f["metrics_memory_diff_pct"] <= 2
    return verdict(ok and f["metrics_utilization"] >= 0.5), measured


# ----- the table

CHECKS: List[Check] = [
    Check(
        "nvml-cost",
        "NVML look cost",
        "a poll's look leaves per-process utilization out (that call: 1406 µs on an H200, driver 580) and "
        "takes 101/153 µs (median/p99, H100, 2026-11-27); polling NVML is negligible next to the /proc scan",
        f"a poll's look median under {POLL_LOOK_US} µs, and `gpu-mon status` lists a CUDA process by node "
        "and by NVML",
        (12, 30),
        judge=nvml_cost,
        **bench("nvml-cost", "nvml_calls.py", ["--reads", "100"], ["--reads", "200"]),
    ),
    Check(
        "memory-v2",
        "memory on an idle GPU",
        "v1 counts the driver's reserve as used (about 480 MiB on an idle H100); gpu-mon reads v2, the "
        "reserve apart",
        "v1 used = v2 used + reserved (within 16 MiB), reserve > 0, gpu-mon's used = v2 used",
        (12, 30),
        judge=tested(memory_v2),
        **tests("memory-v2", "test_gpu_memory.py"),
    ),
    Check(
        "handoff-torch",
        "handoff to a torch job",
        "0/10 out of memory; memory freed 106 ms (p50; p99 120; H100, the stressor's default hold) after the "
        "foreign cuInit, before it was ready to allocate (320 ms p50)",
        "no out-of-memory, and in every trial memory freed before the foreign process was ready",
        (70, 280),
        judge=handoff(need_margin=True),
        **bench("handoff-torch", "gpu_preempt.py", ["--trials", "5"], ["--trials", "20"]),
    ),
    Check(
        "handoff-libcuda",
        "handoff to raw libcuda, 80% held",
        "a foreign process opening the GPU must see our workload gone before its first allocation",
        "no out-of-memory (the margin is reported)",
        (40, 100),
        judge=handoff(need_margin=False),
        **bench(
            "handoff-libcuda",
            "gpu_preempt.py",
            ["--trials", "3", "--memory", "80%", "--foreign", "libcuda"],
            ["--trials", "10", "--memory", "80%", "--foreign", "libcuda"],
        ),
    ),
    Check(
        "handoff-greedy",
        "handoff to a newcomer that takes 90% at once",
        "a newcomer that allocates 90% of the GPU at once (vLLM's default) never runs out of memory: the "
        "stressor at its default hold has freed its memory before the newcomer is ready to allocate",
        "no out-of-memory, and memory freed before the newcomer is ready: p99 freed < p50 ready (every "
        "trial freed)",
        (70, 150),
        judge=handoff_greedy,
        **bench(
            "handoff-greedy",
            "gpu_preempt.py",
            ["--trials", "5", "--memory", "default", "--foreign-alloc", "90%"],
            ["--trials", "10", "--memory", "default", "--foreign-alloc", "90%"],
        ),
    ),
    Check(
        "stress",
        "the stressor",
        "bf16 686 vs 690 TFLOP/s plain (0.995; fp16 0.999); held 70884.0 of 70885.9 MiB; SIGTERM: released "
        "105 ms, all 153 ms, exit 199 ms; --verify 0.875 of plain",
        "the benchmark's own targets: ratio >= 0.95, memory within 1%, release and exit < 1 s, verify=ok",
        (50, 135),
        judge=stress,
        **bench(
            "stress",
            "stress.py",
            ["--repeats", "1", "--seconds", "5", "--extra-dtypes", "fp16"],
            ["--repeats", "2", "--seconds", "10"],
        ),
    ),
    Check(
        "utilization",
        "per-process utilization",
        "per-process utilization comes from NVML's process samples (shown by `status` next to each process)",
        "a busy torch job: mean |gpu-mon - nvidia-smi pmon| <= 10 points over >= 10 samples, job >= 50%",
        (35, 60),
        judge=tested(utilization),
        **tests("utilization", "test_gpu_utilization.py"),
    ),
    Check(
        "watch",
        "`watch` on torch jobs",
        "stops the whole tree when its GPUs stay idle for the window and exits 124; a busy command runs on",
        "idle: exit 124 within a sample (+2 s start-up) of the window's end, nothing left; busy: not stopped",
        (42, 75),
        judge=tested(watch),
        **tests(
            "watch",
            "test_gpu_idle.py::test_watch_stops_an_idle_torch_job",
            "test_gpu_idle.py::test_watch_never_stops_a_busy_torch_job",
        ),
    ),
    Check(
        "occupy",
        "`occupy` hold, free and --yield",
        "`on` holds the GPUs once idle, `off` stops everything it started; --yield gives them back the "
        "moment anyone else uses one (10 of 10 foreign jobs allocate half without out-of-memory; 3 quick)",
        "no out-of-memory; memory freed within 5 s of `off`; held within its wait + 60 s",
        (65, 190),
        judge=tested(occupy),
        **tests("occupy", "test_gpu_occupy.py"),
    ),
    Check(
        "sentinel",
        "`sentinel` on a torch load",
        "arms on activity, then acts once when idle for --kill-duration (the original acted on every tick)",
        "fired exactly once, within the kill duration + 3 ticks of the load's end",
        (33, 60),
        judge=tested(sentinel),
        **tests("sentinel", "test_gpu_sentinel.py"),
    ),
    Check(
        "status",
        "`status` and /metrics",
        "`gpu-mon status` lists a CUDA process as a node holder and an NVML process with its memory; "
        "/metrics has each GPU's memory and utilization",
        "pids as nvidia-smi, memory within 8 MiB, /metrics memory within 2% of NVML and utilization >= 0.5",
        (21, 60),
        judge=tested(status),
        **tests("status", "test_gpu_status.py"),
    ),
]


def by_name(names: Sequence[str]) -> List[Check]:
    """The checks named (in the table's order); ValueError naming an unknown one."""
    known = {c.name for c in CHECKS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown check {unknown[0]!r} (known: {', '.join(c.name for c in CHECKS)})")
    return [c for c in CHECKS if c.name in names]


def find(name: str) -> Check:
    """The check of this name."""
    return by_name([name])[0]
