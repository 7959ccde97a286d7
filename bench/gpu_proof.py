#!/usr/bin/env python3
"""Re-measure every GPU claim of the docs (docs/measured.md, the guides) on a real NVIDIA GPU, in one go.

    sudo python bench/gpu_proof.py [--quick] [--out DIR] [--only NAME,...]
    python bench/gpu_proof.py --plan
    python bench/gpu_proof.py --from-json DIR/proof.json [--format text|markdown|json]

Runs each check (`--plan` lists them with the docs' claim each is held against) in a subprocess of its own
with a time budget: the existing benchmarks (bench/nvml_calls.py, bench/gpu_preempt.py, bench/stress.py,
with --json) and the tests marked `gpu` (pytest, with a JUnit XML result). Then prints one table: check,
claim, measured, verdict (holds, differs, failed), under the GPU, driver, CUDA, torch and kernel, and writes
it to --out as proof.txt, proof.md and proof.json (the raw figures, re-rendered with --from-json), with each
check's log and raw output. A full run takes at most 20 minutes, --quick at most 8.

Nothing is left behind: a check that runs past its budget, or a Ctrl-C, stops the check's processes
(SIGINT, SIGTERM, SIGKILL), and at the end NVML is asked whether any process that was not on the GPU before
the run is still there. Needs root, the NVIDIA driver, nvidia-ml-py and torch with CUDA. Without a usable
GPU it says why in one line and exits 2. Exit 0 when every check holds, 1 otherwise, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proof import host, render, run
from proof.checks import CHECKS, HOLDS, ROOT, Check, Context, by_name


class UsageError(Exception):
    """Bad options or a bad file: one line, exit 2."""


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gpu_proof.py",
        description=__doc__.split("\n\n")[0],
        epilog="Checks: " + ", ".join(c.name for c in CHECKS),
    )
    p.add_argument("--quick", action="store_true", help="fewer repetitions, the same checks (at most 8 min)")
    p.add_argument("--out", metavar="DIR", help="where to write (default: a new directory under /tmp)")
    p.add_argument("--only", metavar="NAME,...", help="run only these checks")
    p.add_argument("--plan", action="store_true", help="list the checks and their claims; needs no GPU")
    p.add_argument("--from-json", metavar="FILE", help="render a recorded proof.json instead of measuring")
    p.add_argument("--format", choices=sorted(render.FORMATS), default="text", help="for --from-json")
    p.add_argument(
        "--ignore-programs",
        default="",
        metavar="NAME,...",
        help="the handoff checks' daemon ignores these openers too (a host's own monitor that opens the GPU "
        "every few seconds); the table's header names them",
    )
    return p.parse_args(argv)


def chosen(only: Optional[str]) -> List[Check]:
    if not only:
        return list(CHECKS)
    try:
        return by_name([n.strip() for n in only.split(",") if n.strip()])
    except ValueError as exc:
        raise UsageError(f"--only: {exc}") from None


def plan(checks: List[Check]) -> str:
    """The checks, the claim each is held against, and what runs."""
    ctx = Context(out=Path("OUT"), quick=False)
    lines = []
    for number, c in enumerate(checks, 1):
        command = shlex.join(["python", *c.argv(ctx)[1:]]).replace(str(ROOT) + "/", "")
        lines += [
            f"{number:2}. {c.name}: {c.title} (budget {c.budget[0]} s quick, {c.budget[1]} s full)",
            f"    docs: {c.claim}",
            f"    holds if: {c.holds_if}",
            f"    runs: {command}",
        ]
    quick, full = (sum(c.budget[i] for c in checks) for i in (0, 1))
    lines.append(
        f"budgets: {full / 60:.1f} min in all ({quick / 60:.1f} min with --quick), plus under 30 s for the "
        "header and the last NVML look (and up to 30 s to stop a check that runs past its budget)"
    )
    return "\n".join(lines) + "\n"


def load(path: str) -> Dict[str, Any]:
    try:
        record = json.loads(Path(path).read_text())
    except OSError as exc:
        raise UsageError(f"--from-json: cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise UsageError(f"--from-json: {path}: not JSON: {exc}") from None
    if not isinstance(record, dict) or not isinstance(record.get("checks"), list):
        raise UsageError(f"--from-json: {path}: not a gpu_proof record (no list of checks)")
    return record


def output_dir(out: Optional[str]) -> Path:
    path = Path(out) if out else Path(tempfile.mkdtemp(prefix="gpu-proof-", dir="/tmp"))
    try:
        for sub in ("raw", "logs"):
            (path / sub).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out: cannot create {path}: {exc.strerror}") from None
    return path


def check_env(quick: bool) -> Dict[str, str]:
    """The real GPU (never a simulated one), the checkout importable, the mode for the GPU tests."""
    env = {k: v for k, v in os.environ.items() if k != "GPU_MON_SIM"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["GPU_MON_PROOF"] = "quick" if quick else "full"
    return env


def measure(check: Check, ctx: Context, env: Dict[str, str]) -> Dict[str, Any]:
    """Run one check; its record entry."""
    budget = check.seconds(ctx.quick)
    argv = check.argv(ctx)
    for ext in ("json", "xml"):  # an earlier run's figures in a reused --out are not this run's
        ctx.raw(check.name, ext).unlink(missing_ok=True)
    outcome = run.run(argv, budget, ctx.out / "logs" / f"{check.name}.log", env, ROOT)
    return {
        "name": check.name,
        "claim": check.claim,
        "holds_if": check.holds_if,
        "command": argv,
        "budget_s": budget,
        "seconds": round(outcome.seconds, 1),
        "exit": outcome.code,
        "why": outcome.why or _no_figures(check, ctx, outcome.code),
        "figures": check.read(ctx),
        "left": outcome.left,
        "interrupted": outcome.interrupted,
    }


def _no_figures(check: Check, ctx: Context, code: Optional[int]) -> Optional[str]:
    if check.read(ctx):
        return None
    log = (ctx.out / "logs" / f"{check.name}.log").read_text(errors="replace").strip().splitlines()
    return f"exit {code}: {log[-1][:200] if log else 'no output'}"


def write(record: Dict[str, Any], out: Path) -> None:
    """proof.json (the record), proof.md and proof.txt."""
    (out / "proof.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    (out / "proof.md").write_text(render.markdown(record))
    (out / "proof.txt").write_text(render.text(record))


def prove(checks: List[Check], ctx: Context, nvml: Dict[str, Any], ignore: str = "") -> int:
    """Every check in order, the GPU checked afterwards, the table written; the exit code."""
    started = time.monotonic()
    record: Dict[str, Any] = {
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "quick": ctx.quick,
        "host": host.describe(nvml),
        "checks": [],
    }
    if ignore:
        record["ignored_openers"] = ignore
    print("\n".join(render.header_lines(record)), flush=True)
    before = host.gpu_processes(nvml)
    env = check_env(ctx.quick)
    env["GPU_PROOF_IGNORE_PROGRAMS"] = ignore  # = bench/gpu_preempt.py's IGNORE_ENV
    interrupted = False
    try:
        for number, check in enumerate(checks, 1):
            print(f"[{number}/{len(checks)}] {check.name}: {check.title} ...", end=" ", flush=True)
            entry = measure(check, ctx, env)
            record["checks"].append(entry)
            record["seconds"] = time.monotonic() - started
            write(record, ctx.out)
            print(f"{render.judged(entry)[0]} ({entry['seconds']:.0f} s)", flush=True)
            if entry["interrupted"]:
                interrupted = True
                break
    except run.Interrupted:
        interrupted = True
        run.sweep()
    record["left_on_gpu"] = host.left_on_gpu(before)
    record["seconds"] = time.monotonic() - started
    write(record, ctx.out)
    print()
    print(render.text(record), end="")
    print(f"written: {ctx.out}/proof.txt, proof.md, proof.json (raw figures and logs beside them)")
    if interrupted:
        return 130
    holds = all(render.judged(e)[0] == HOLDS for e in record["checks"])
    return 0 if holds and not record["left_on_gpu"] else 1


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        checks = chosen(args.only)
        if args.plan:
            print(plan(checks), end="")
            return 0
        if args.from_json:
            print(render.FORMATS[args.format](load(args.from_json)), end="")
            return 0
        nvml = host.probe()
        if "error" in nvml:
            print(f"no NVIDIA GPU: {nvml['error']}; nothing measured", file=sys.stderr)
            return 2
        if os.geteuid() != 0:
            raise UsageError("run it as root: the daemon's checks start gpu-mon run and stop its workloads")
        ctx = Context(out=output_dir(args.out), quick=args.quick)
    except UsageError as exc:
        print(f"gpu_proof.py: {exc}", file=sys.stderr)
        return 2
    run.become_subreaper()
    run.catch_signals()
    try:
        return prove(checks, ctx, nvml, args.ignore_programs)
    except run.Interrupted as sig:  # outside a check: while describing the host or at the last NVML look
        run.sweep()
        print(f"gpu_proof.py: interrupted ({sig}); what was measured is in {ctx.out}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
