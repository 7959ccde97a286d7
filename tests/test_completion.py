"""Shell completion of job ids with a real daemon: `gpu-mon cancel <TAB>` in bash offers the user's own
jobs (those the command can act on), asked of the daemon through `gpu-mon _job-ids`."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import List

from conftest import wait_for
from test_queue import PY, User, lab, queue_body  # noqa: F401  (lab: the fixture)

ROOT = Path(__file__).resolve().parent.parent
BASH = ROOT / "docs" / "completion" / "bash" / "gpu-mon"
FISH = ROOT / "docs" / "completion" / "fish" / "gpu-mon.fish"
ZSH = ROOT / "docs" / "completion" / "zsh" / "_gpu-mon"
# zsh's completion function outside a completion widget: compadd (a builtin only there) is a function here
# that prints what it was given to offer.
ZSH_COMPADD = 'compadd() { local i=${@[(i)--]}; print -l -- "${@[i+1,-1]}"; }; '


def _complete(
    lab,  # noqa: F811
    user: User,
    words: List[str],
    env_config: bool = False,
    shell: str = "bash",
) -> List[str]:
    """bash's (or fish's, or zsh's) completion of the last of `words` as `user`, with this checkout's
    `gpu-mon` on PATH."""
    bin_dir = lab.dir / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        wrapper = bin_dir / "gpu-mon"
        wrapper.write_text(f'#!/bin/sh\nexec {PY} -m gpu_mon "$@"\n')
        os.chmod(bin_dir, 0o755)
        os.chmod(wrapper, 0o755)
    script = (
        f"source {BASH}; COMP_WORDS=({' '.join(repr(w) for w in words)}); COMP_CWORD={len(words) - 1};"
        '_gpu_mon; printf "%s\\n" "${COMPREPLY[@]}"'
    )
    if shell == "fish":
        script = f"source {FISH}; complete -C {' '.join(words)!r}"
    if shell == "zsh":
        typed = " ".join(shlex.quote(w) for w in words)
        script = f"autoload -Uz compinit; compinit -u -D; source {ZSH}; {ZSH_COMPADD}"
        script += f"words=({typed}); CURRENT={len(words)}; PREFIX={shlex.quote(words[-1])}; _gpu-mon"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(user.home), "PYTHONPATH": str(lab.code)}
    if env_config:
        env["GPU_MON_CONFIG"] = str(lab.client_conf)
    r = subprocess.run(
        {"bash": ["bash", "-c", script], "zsh": ["zsh", "-fc", script]}.get(
            shell, ["fish", "--no-config", "-c", script]
        ),
        capture_output=True,
        text=True,
        user=user.uid,
        group=user.gid,
        env=env,
        cwd=str(user.work),
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    offered = (line.split("\t")[0] for line in r.stdout.splitlines() if line)
    return sorted(offered, key=lambda i: [int(n) for n in i.split("_")])  # (17 < 17_0 < 17_1 < 18)


def test_cancel_hold_release_and_logs_complete_to_the_users_own_jobs(lab, daemon_factory):  # noqa: F811
    daemon_factory(queue_body(lab, gpus="0"), defaults={"start_delay_seconds": 0})
    wait_for(lab.socket.exists, 20, "the queue's socket")
    held = [lab.submit(lab.alice, "--hold", *lab.job_cmd("forever")) for _ in range(2)]
    bobs = lab.submit(lab.bob, "--hold", *lab.job_cmd("forever"))
    conf = ["--config", str(lab.client_conf)]
    assert _complete(lab, lab.alice, ["gpu-mon", *conf, "cancel", ""]) == [str(i) for i in held]
    assert _complete(lab, lab.alice, ["gpu-mon", *conf, "release", ""]) == [str(i) for i in held]
    assert _complete(lab, lab.alice, ["gpu-mon", *conf, "hold", ""]) == []  # (none queued: both held)
    assert _complete(lab, lab.bob, ["gpu-mon", *conf, "cancel", ""]) == [str(bobs)]
    # The prefix typed so far; the ids already on the line are offered again (bash's compgen filters
    # only by prefix); the config from GPU_MON_CONFIG.
    typed = str(held[1])
    assert _complete(lab, lab.alice, ["gpu-mon", "cancel", str(held[0]), typed], env_config=True) == [typed]
    r = lab.run(lab.alice, "cancel", str(held[0]))
    assert r.returncode == 0, r.stderr
    lab.wait_state(lab.alice, held[0], "cancelled")
    assert _complete(lab, lab.alice, ["gpu-mon", *conf, "cancel", ""]) == [str(held[1])]
    assert _complete(lab, lab.alice, ["gpu-mon", *conf, "logs", ""]) == [str(i) for i in held]
    assert shutil.which("fish"), "fish is not installed: apt-get install fish (as .ci/run does)"
    assert _complete(lab, lab.alice, ["gpu-mon", *conf, "logs", ""], shell="fish") == [str(i) for i in held]
    assert shutil.which("zsh"), "zsh is not installed: apt-get install zsh (as .ci/run does)"
    assert _complete(lab, lab.alice, ["gpu-mon", *conf, "logs", ""], shell="zsh") == [str(i) for i in held]
    assert _complete(lab, lab.bob, ["gpu-mon", *conf, "cancel", ""], shell="zsh") == [str(bobs)]
    joined = [f"--config={lab.client_conf}"]  # (the other way to write it)
    for shell in ("bash", "zsh", "fish"):
        assert _complete(lab, lab.bob, ["gpu-mon", *joined, "cancel", ""], shell=shell) == [str(bobs)], shell
    assert _complete(lab, lab.alice, ["gpu-mon", "release", typed], env_config=True, shell="zsh") == [typed]
