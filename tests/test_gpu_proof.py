"""bench/gpu_proof.py without a GPU: its plan, its one-line exit when there is no usable GPU, the table
rendered from a recorded run (a hand-written, clearly synthetic record), the judges, and a check's process
tree ended at its budget or on Ctrl-C with nothing left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Dict, Optional

import psutil
import pytest
from conftest import ROOT, wait_for

sys.path.insert(0, str(ROOT / "bench"))
from proof import checks, host, render

PROOF = [sys.executable, str(ROOT / "bench" / "gpu_proof.py")]
SYNTHETIC = Path(__file__).resolve().parent / "data" / "gpu_proof_synthetic.json"


def proof(
    *args: str, env: Optional[Dict[str, str]] = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    return subprocess.run([*PROOF, *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_plan_lists_every_check_with_its_readme_claim():
    r = proof("--plan")
    assert r.returncode == 0, r.stderr
    for number, check in enumerate(checks.CHECKS, 1):
        assert f"{number:2}. {check.name}: " in r.stdout
        assert f"docs: {check.claim}" in r.stdout
        assert f"holds if: {check.holds_if}" in r.stdout
    assert "budgets: 19.5 min in all (7.5 min with --quick), plus under 30 s" in r.stdout


def test_budgets_fit_the_promised_run_times():
    quick, full = (sum(c.budget[i] for c in checks.CHECKS) for i in (0, 1))
    # full at most 20 minutes, --quick at most 8, with 30 s left for the header and the last NVML look
    assert quick <= 8 * 60 - 30 and full <= 20 * 60 - 30, (quick, full)


def test_only_with_an_unknown_check_is_one_line_and_exit_2():
    r = proof("--plan", "--only", "nvml-cost,stres")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        "gpu_proof.py: --only: unknown check 'stres' (known: "
        + ", ".join(c.name for c in checks.CHECKS)
        + ")"
    ]
    r = proof("--plan", "--only", "stress,nvml-cost")
    assert [line.split(":")[0] for line in r.stdout.splitlines() if line[:2].strip().isdigit()] == [
        " 1. nvml-cost",
        " 2. stress",
    ]


FAKE_PYNVML = {
    "driver not loaded": (
        "class NVMLError(Exception):\n    pass\ndef nvmlInit():\n    raise NVMLError('Driver Not Loaded')\n",
        "no NVIDIA GPU: NVML cannot start: Driver Not Loaded; nothing measured",
    ),
    "no device": (
        "def nvmlInit():\n    pass\ndef nvmlShutdown():\n    pass\ndef nvmlDeviceGetCount():\n    return 0\n"
        "def nvmlSystemGetCudaDriverVersion():\n    return 13000\n"
        "def nvmlSystemGetDriverVersion():\n    return '580.0'\n",
        "no NVIDIA GPU: NVML lists no GPU; nothing measured",
    ),
    "pynvml missing": (
        "raise ImportError('No module named pynvml')\n",
        "no NVIDIA GPU: nvidia-ml-py (pynvml) is not installed; nothing measured",
    ),
    "NVML hangs": (
        "import time\ndef nvmlInit():\n    time.sleep(60)\n",
        f"no NVIDIA GPU: NVML did not answer within {host.PROBE_TIMEOUT_S:g} s; nothing measured",
    ),
}


@pytest.mark.parametrize("case", sorted(FAKE_PYNVML))
def test_without_a_gpu_one_line_exit_2_without_waiting_out_nvml(tmp_path, case):
    """A stand-in pynvml first on the path makes every case happen here (and on a GPU machine). Never
    longer than the probe's own timeout, with room for a loaded machine's start-up: far below the 60 s a
    hung NVML would take (its speed on an idle machine is bench's to measure)."""
    module, line = FAKE_PYNVML[case]
    (tmp_path / "pynvml.py").write_text(module)
    sim = tmp_path / "host.json"  # a simulated GPU is not a GPU: the proof never uses one
    sim.write_text(json.dumps({"gpus": [{"uuid": "GPU-1", "memory_total_mib": 1, "memory_used_mib": 0}]}))
    env = dict(os.environ, PYTHONPATH=str(tmp_path), GPU_MON_SIM=str(sim))
    start = time.monotonic()
    r = proof("--quick", env=env)
    took = time.monotonic() - start
    assert (r.returncode, r.stdout, r.stderr) == (2, "", line + "\n")
    assert took < host.PROBE_TIMEOUT_S + 20, took


def test_from_json_renders_the_recorded_run():
    r = proof("--from-json", str(SYNTHETIC), "--format", "json")
    assert r.returncode == 0, r.stderr
    verdicts = {c["name"]: c["verdict"] for c in json.loads(r.stdout)["checks"]}
    assert verdicts == {
        "nvml-cost": "holds",
        "memory-v2": "differs",  # its test failed and its figures are outside the bound
        "handoff-torch": "holds",
        "handoff-libcuda": "differs",  # one of two trials ran out of memory
        "stress": "holds",
        "utilization": "failed",  # ran past its budget with no figures
        "watch": "holds",
        "occupy": "failed",  # its test was skipped
        "sentinel": "holds",
        "status": "holds",
    }


def test_from_json_text_and_markdown_carry_the_header_and_every_row():
    text = proof("--from-json", str(SYNTHETIC)).stdout
    lines = text.splitlines()
    assert lines[0].startswith("SYNTHETIC DATA, NOT A MEASUREMENT")
    assert "GPU 0: Synthetic GPU (1000 MiB)" in text and "driver 0.0.0, CUDA 0.0" in text
    assert any(line.startswith("handoff-libcuda") and line.endswith("differs") for line in lines)
    assert "utilization left a process running (ended by the proof): 1234 python3" in text
    md = proof("--from-json", str(SYNTHETIC), "--format", "markdown").stdout
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert table[0] == "| check | the docs claim | measured | verdict |"
    recorded = {c["name"] for c in json.loads(SYNTHETIC.read_text())["checks"]}
    assert [row.split(" | ")[0] for row in table[1:]] == [
        f"| {c.name}" for c in checks.CHECKS if c.name in recorded
    ]
    assert table[5].startswith("| stress | bf16 686 vs 690 TFLOP/s") and table[5].endswith("| holds |")


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot read {path}: No such file or directory"),
        ("{not json", "{path}: not JSON: "),
        ('{"checks": 3}', "{path}: not a gpu_proof record (no list of checks)"),
    ],
    ids=["missing", "not-json", "not-a-record"],
)
def test_from_json_bad_file_is_one_line_and_exit_2(tmp_path, content, message):
    path = tmp_path / "proof.json"
    if content is not None:
        path.write_text(content)
    r = proof("--from-json", str(path))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("gpu_proof.py: --from-json: " + message.format(path=path))


def test_a_recorded_check_that_was_interrupted_keeps_its_figures_and_says_so():
    record = json.loads(SYNTHETIC.read_text())
    entry = next(c for c in record["checks"] if c["name"] == "handoff-torch")
    entry["why"] = "interrupted (SIGINT)"
    verdict, measured = render.judged(entry)
    assert verdict == "holds" and measured.endswith("; interrupted (SIGINT)")
    assert render.judged({"name": "stress", "why": None, "figures": {}}) == ("failed", "it wrote no figures")
    assert render.judged({"name": "gone", "figures": {"x": 1}})[0] == "failed"


def test_handoff_judge_wants_memory_freed_before_the_foreign_process_is_ready():
    trial = {"ok": True, "ours_mib": 1024, "freed_ms": 250.0, "ready_ms": 200.0}
    late = {"memory": "88%", "trials": [trial]}
    assert checks.handoff(need_margin=True)(late)[0] == "differs"  # freed after it was ready: no margin
    assert checks.handoff(need_margin=False)(late)[0] == "holds"  # no out-of-memory is the libcuda bound
    assert checks.handoff(need_margin=True)({"trials": []}) == ("failed", "no trial ran")


def test_plan_lists_the_greedy_handoff_without_a_gpu():
    r = proof("--plan", "--only", "handoff-greedy")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(" 1. handoff-greedy: handoff to a newcomer that takes 90% at once")
    assert "p99 freed < p50 ready" in r.stdout
    assert (
        "runs: python bench/gpu_preempt.py --trials 10 --memory default --foreign-alloc 90% "
        "--json OUT/raw/handoff-greedy.json"
    ) in r.stdout


def greedy(freed, ready, ok=True, **extra):
    trial = {"ok": ok, "ours_mib": 126188, "freed_ms": freed, "ready_ms": ready, **extra}
    return trial


def test_greedy_judge_wants_no_oom_and_p99_freed_before_p50_ready():
    judge = checks.handoff_greedy
    on_time = {"memory": "default", "foreign_alloc": 0.9, "trials": [greedy(200, 260), greedy(240, 250)]}
    verdict, measured = judge(on_time)
    assert verdict == "holds", measured
    assert measured.startswith("0/2 out of memory (newcomer takes 90% at once; stressor at default hold")
    assert "memory freed p50 220 ms, p99 240 ms" in measured and "newcomer ready p50 255 ms" in measured
    # p99 freed (256) after p50 ready (255), though each trial freed before its own newcomer was ready
    late = {"foreign_alloc": 0.9, "trials": [greedy(200, 260), greedy(256, 250)]}
    assert judge(late)[0] == "differs"
    oom = {"foreign_alloc": 0.9, "trials": [greedy(200, 260), greedy(100, 250, ok=False)]}
    assert judge(oom)[0] == "differs"
    unfreed = {"foreign_alloc": 0.9, "trials": [greedy(200, 260), greedy(float("nan"), 250)]}
    assert judge(unfreed)[0] == "differs"
    assert judge({"trials": []}) == ("failed", "no trial ran")


def test_handoff_trials_a_foreign_opener_disturbed_are_not_counted():
    disturbed = greedy(-469, 261, disturbed="stress[2450] was stopped for root x[1] 1.0 s before it began")
    record = {"memory": "88%", "foreign_alloc": 0.9, "trials": [disturbed, greedy(200, 260)]}
    verdict, measured = checks.handoff_greedy(record)
    assert verdict == "holds" and measured.startswith("0/1 out of memory"), measured
    assert measured.endswith("; 1 trial(s) not counted (a foreign opener stopped the workload)")
    verdict, measured = checks.handoff(need_margin=True)(record)
    assert verdict == "holds" and "smallest margin 60 ms" in measured, measured
    only = {"trials": [disturbed]}
    assert checks.handoff_greedy(only)[0] == checks.handoff(need_margin=True)(only)[0] == "failed"


def test_nvml_cost_judges_a_polls_look_where_it_was_measured():
    status = [{"by_node": True, "by_nvml": True}]
    h200 = {"whole_look_us": [1596, 1846], "status": status}  # recorded before: the whole look's bound
    assert checks.nvml_cost(h200)[0] == "differs"
    now = {**h200, "poll_look_us": [150, 180]}
    verdict, measured = checks.nvml_cost(now)
    assert verdict == "holds" and measured.startswith("a poll's look 150 / 180 µs, a full look"), measured
    assert checks.nvml_cost({**h200, "poll_look_us": [201, 220]})[0] == "differs"


def test_the_table_names_foreign_openers_per_check():
    record = json.loads(SYNTHETIC.read_text())
    entry = next(c for c in record["checks"] if c["name"] == "handoff-torch")
    entry["figures"]["foreign_openers"] = [
        {"who": "root ld-linux-x86-64.so.2", "node": "/usr/local/nvidia/dev/nvidia0", "stops": 15, "pids": 15}
    ]
    assert (
        "handoff-torch: foreign openers made the daemon stop the workload: root ld-linux-x86-64.so.2 via "
        "/usr/local/nvidia/dev/nvidia0 (15 stops, 15 processes)"
    ) in render.text(record)


def test_tested_judge_counts_only_tests_that_ran():
    judge = checks.tested(checks.sentinel)
    assert judge({}) == ("failed", "no test result")
    error = {"outcomes": {"test_a": "error: fixture 'x' not found"}}
    assert judge(error) == ("failed", "test_a: error: fixture 'x' not found")
    early = {"outcomes": {"test_a": "failed: AssertionError: never armed"}}
    assert judge(early) == ("differs", "test_a: failed: AssertionError: never armed")
    silent = {"outcomes": {"test_a": "passed"}}
    assert judge(silent) == ("failed", "a test recorded no figure 'fired_count'")


def test_stress_judge_follows_the_benchmarks_own_verdicts():
    figures = json.loads(SYNTHETIC.read_text())["checks"][4]["figures"]
    assert checks.stress(figures)[0] == "holds"
    figures["rows"][0]["result"] = "MISS"
    assert checks.stress(figures)[0] == "differs"
    figures["rows"][0]["result"] = "ERROR"
    figures["rows"][0]["reference"] = "RuntimeError: no 'stress: start ' line"
    assert checks.stress(figures) == ("failed", "RuntimeError: no 'stress: start ' line")


# ----- a check's processes are ended at its budget and on Ctrl-C

DRIVER = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, {bench!r})
    from pathlib import Path
    from proof import run
    run.become_subreaper()
    run.catch_signals()
    # a check whose grandchild leaves its session, as the daemon's workloads do
    script = "setsid sleep 997 & echo $! > {pidfile}; wait"
    outcome = run.run(["sh", "-c", script], float(sys.argv[1]), Path({log!r}), dict(os.environ), Path("/"))
    print(json.dumps({{"why": outcome.why, "left": outcome.left, "interrupted": outcome.interrupted}}))
    """
)


def _driver(tmp_path: Path, budget: float) -> subprocess.Popen:
    pidfile = tmp_path / "grandchild.pid"
    code = DRIVER.format(bench=str(ROOT / "bench"), pidfile=pidfile, log=str(tmp_path / "check.log"))
    return subprocess.Popen([sys.executable, "-c", code, str(budget)], stdout=subprocess.PIPE, text=True)


def _grandchild(tmp_path: Path) -> psutil.Process:
    pidfile = tmp_path / "grandchild.pid"
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), what="the check's grandchild")
    child = psutil.Process(int(pidfile.read_text()))
    wait_for(lambda: child.cmdline() == ["sleep", "997"], what="setsid to become sleep 997")
    return child


def _end(driver: subprocess.Popen, grandchild: psutil.Process) -> None:
    if driver.poll() is None:
        driver.kill()
        driver.wait()
    if grandchild.is_running() and grandchild.cmdline() == ["sleep", "997"]:
        grandchild.kill()


def test_a_check_past_its_budget_is_ended_with_everything_it_started(tmp_path):
    driver = _driver(tmp_path, budget=1)
    grandchild = _grandchild(tmp_path)
    try:
        out, _ = driver.communicate(timeout=60)
        result = json.loads(out)
        assert result["why"] == "ran past its budget of 1 s" and not result["interrupted"]
        assert result["left"] == [f"{grandchild.pid} sleep 997"]
        assert not grandchild.is_running()
    finally:
        _end(driver, grandchild)


def test_ctrl_c_ends_the_running_check_and_everything_it_started(tmp_path):
    driver = _driver(tmp_path, budget=300)
    grandchild = _grandchild(tmp_path)
    try:
        driver.send_signal(signal.SIGINT)
        out, _ = driver.communicate(timeout=60)
        result = json.loads(out)
        assert result["why"] == "interrupted (SIGINT)" and result["interrupted"]
        assert result["left"] == [f"{grandchild.pid} sleep 997"]
        assert not grandchild.is_running()
    finally:
        _end(driver, grandchild)


PROBE_ONLY_NVML = textwrap.dedent(
    """
    # One GPU for the proof's own probe (run as `python -c`); for everything else there is no NVML, as here.
    import sys
    from types import SimpleNamespace
    if sys.argv[0] != "-c":
        raise ImportError("no NVML outside the proof's probe")
    def nvmlInit(): pass
    def nvmlShutdown(): pass
    def nvmlDeviceGetCount(): return 1
    def nvmlDeviceGetHandleByIndex(i): return i
    def nvmlDeviceGetUUID(h): return "GPU-00000000-1111-2222-3333-444444444444"
    def nvmlDeviceGetName(h): return "Stand-in GPU"
    def nvmlDeviceGetMemoryInfo(h): return SimpleNamespace(total=1 << 30, used=0)
    def nvmlDeviceGetComputeRunningProcesses(h): return []
    def nvmlDeviceGetGraphicsRunningProcesses(h): return []
    def nvmlSystemGetCudaDriverVersion(): return 13000
    def nvmlSystemGetDriverVersion(): return "0.0-stand-in"
    """
)


@pytest.mark.skipif(os.geteuid() != 0, reason="the proof runs as root")
def test_a_run_whose_tests_cannot_run_records_them_as_failed(tmp_path):
    """The whole path of a run (its checks' pytest runs, the record, the table files, the GPU afterwards)
    with a stand-in NVML that only the proof's probe sees: the GPU tests are skipped, so they fail."""
    (tmp_path / "pynvml.py").write_text(PROBE_ONLY_NVML)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    r = proof("--quick", "--only", "memory-v2,sentinel", "--out", str(out), env=env, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    record = json.loads((out / "proof.json").read_text())
    assert record["host"]["driver"] == "0.0-stand-in" and record["quick"] is True
    assert [c["name"] for c in record["checks"]] == ["memory-v2", "sentinel"]
    for entry in record["checks"]:
        verdict, measured = render.judged(entry)
        assert verdict == "failed" and "skipped: needs an NVIDIA GPU" in measured, measured
        assert entry["left"] == [] and (out / "logs" / f"{entry['name']}.log").exists()
    assert record["left_on_gpu"] == []
    assert (out / "proof.md").read_text().count("| failed |") == 2
    assert (out / "proof.txt").read_text() in r.stdout


def test_a_run_with_ignored_openers_says_so_in_its_header(tmp_path):
    record = json.loads(SYNTHETIC.read_text())
    assert "ignored these openers" not in proof("--from-json", str(SYNTHETIC)).stdout
    record["ignored_openers"] = "ld-linux-x86-64.so.2"
    told = tmp_path / "proof.json"
    told.write_text(json.dumps(record))
    text = proof("--from-json", str(told)).stdout
    assert "the handoff checks' daemon ignored these openers: ld-linux-x86-64.so.2" in text.splitlines()[:5]
