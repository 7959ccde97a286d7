"""The reference from the parser: gpu-mon(1), gpu-mon-queue(7), `gpu-mon help` and `gpu-mon completion`
agree with the parser and with the committed files (docs/man/, docs/completion/)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

from gpu_mon import jobids
from gpu_mon.cli import build_parser
from gpu_mon.config import DEFAULT_PATH, QueueSection
from gpu_mon.docs_gen import __main__ as docs_gen
from gpu_mon.queue import jobs as J
from gpu_mon.reference import completion, model

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "man" / "gpu-mon.1"
QUEUE_PAGE = ROOT / "docs" / "man" / "gpu-mon-queue.7"
BASH = ROOT / "docs" / "completion" / "bash" / "gpu-mon"


def _gpu_mon(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpu_mon", *args], capture_output=True, text=True, cwd=ROOT, timeout=60
    )


def _listed(
    parser: argparse.ArgumentParser, path: Tuple[str, ...] = ()
) -> Iterator[Tuple[Tuple[str, ...], str]]:
    """(command path, option string) of every option --help lists, and (path, '') of every command:
    straight from argparse, not through docs_gen.model."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for shown in action._choices_actions:
                yield (*path, shown.dest), ""
                yield from _listed(action.choices[shown.dest], (*path, shown.dest))
        elif action.help != argparse.SUPPRESS:
            for flag in action.option_strings:
                yield path, flag


def _plain(roff: str) -> str:
    """The page's source with roff's escapes for '-' and fonts undone."""
    return re.sub(r"\\f[BIRP]", "", roff.replace("\\-", "-").replace("\\&", ""))


def test_committed_files_are_what_the_generator_makes_now() -> None:
    for name, text in docs_gen.generated().items():
        path = ROOT / name
        assert path.is_file(), f"{name} is missing: run python -m gpu_mon.docs_gen"
        assert path.read_text(encoding="utf-8") == text, (
            f"{name} is out of date: run python -m gpu_mon.docs_gen"
        )
    r = subprocess.run(
        [sys.executable, "-m", "gpu_mon.docs_gen", "--check"], capture_output=True, text=True, cwd=ROOT
    )
    assert (r.returncode, r.stdout) == (0, "")


def test_the_check_names_a_stale_file(tmp_path: Path) -> None:
    assert docs_gen.main([str(tmp_path)]) == 0
    page = tmp_path / "docs" / "man" / "gpu-mon.1"
    page.write_text(page.read_text().replace("\\-\\-stop\\-signal", "\\-\\-stop"))
    r = subprocess.run(
        [sys.executable, "-m", "gpu_mon.docs_gen", "--check", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert (r.returncode, r.stdout) == (
        1,
        "docs/man/gpu-mon.1: out of date (run python -m gpu_mon.docs_gen)\n",
    )


def test_every_command_and_option_of_the_parser_is_in_the_page() -> None:
    page = _plain(PAGE.read_text(encoding="utf-8"))
    listed = list(_listed(build_parser()))
    assert len(listed) > 100
    for path, flag in listed:
        if flag:
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", page), f"{' '.join(path)} {flag}"
        else:
            assert f".SS {' '.join(path)}\n" in page, f"command {' '.join(path)} has no section"
    # Hidden ones stay hidden: occupy's `serve`, stress's --inject-fault-at.
    assert ".SS occupy serve" not in page and "--inject-fault-at" not in page


def test_the_page_has_exit_status_signals_files_environment_and_renders_without_warnings() -> None:
    text = PAGE.read_text(encoding="utf-8")
    for heading in ("EXIT STATUS", "SIGNALS", "FILES", "ENVIRONMENT", "SEE ALSO"):
        assert f"\n.SH {heading}\n" in text
    plain = _plain(text)
    for word in ("124", "SIGHUP", "SIGUSR1", "/etc/gpu_mon.conf.d/*.conf", "/run/gpu_mon/queue.sock"):
        assert word in plain
    assert "GPU_MON_CONFIG" in plain and "GPU_MON_SIM" in plain
    assert "gpu_mon.conf (5)" in plain and "gpu-mon-queue (7)" in plain
    for page in (PAGE, QUEUE_PAGE):
        r = subprocess.run(["groff", "-man", "-ww", "-z", str(page)], capture_output=True, text=True)
        assert (r.returncode, r.stderr) == (0, ""), f"{page.name}: {r.stderr}"


def test_every_page_the_units_name_is_in_docs_man() -> None:
    for unit in ("gpu-mon.service", "gpu-mon-sentinel.service"):
        text = (ROOT / "systemd" / unit).read_text()
        (doc,) = re.findall(r"^Documentation=(.*)$", text, re.M)
        pages = re.findall(r"man:([\w.-]+)\((\d)\)", doc)
        assert ("gpu-mon", "1") in pages and doc.split()[-1] == "file:/usr/share/doc/gpu-mon/README.md"
        for name, section in pages:
            assert (ROOT / "docs" / "man" / f"{name}.{section}").is_file(), (
                f"{unit}: no docs/man/{name}.{section}"
            )


def test_the_queue_page_names_only_real_commands_and_options() -> None:
    top = model.command(build_parser())
    flags = {f for c in model.walk(top) for o in c.options for f in o.flags}
    page = _plain(QUEUE_PAGE.read_text(encoding="utf-8"))
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", page))
    assert named >= {"--stop-signal", "--grace", "--no-requeue", "--hold", "--follow", "--time-limit"}
    assert named <= flags, f"not options of gpu-mon: {sorted(named - flags)}"
    source = QUEUE_PAGE.read_text(encoding="utf-8")
    commands = re.findall(r'(?:\\fB|^\.BI? "?)gpu\\-mon (\w+)', source, re.M)
    assert {"submit", "jobs", "logs", "cancel", "hold", "release", "occupy"} <= set(commands)
    for command in commands:
        assert model.find(top, (command,)) is not None, command
    for command in ("submit", "cancel"):
        for option in [o for o in model.find(top, (command,)).options if o.flags and o.flags[0] != "-h"]:
            flag = option.flags[0]
            if flag not in ("--config", "--debug"):
                assert flag in named, f"the users' page does not explain {command} {flag}"


def test_help_prints_a_commands_help_a_topic_or_one_line_for_neither() -> None:
    assert _gpu_mon("help", "submit").stdout == _gpu_mon("submit", "--help").stdout
    assert _gpu_mon("help", "occupy", "on").stdout == _gpu_mon("occupy", "on", "--help").stdout
    r = _gpu_mon("help", "exit-codes")
    assert r.returncode == 0 and "124" in r.stdout and r.stdout.rstrip().endswith("man gpu-mon (EXIT STATUS)")
    assert "man gpu-mon-queue" in _gpu_mon("help", "queue").stdout
    r = _gpu_mon("help", "nope")
    assert r.returncode == 2 and r.stderr.startswith("gpu-mon: help: no command or topic 'nope'; commands: ")
    assert r.stderr.count("\n") == 1
    assert _gpu_mon("help").stdout == _gpu_mon("--help").stdout
    tail = _gpu_mon("--help").stdout.rstrip().splitlines()[-3:]
    assert tail[0].startswith("manual: man gpu-mon ") and tail[-1].endswith("/usr/share/doc/gpu-mon/")


@pytest.mark.parametrize("shell", completion.SHELLS)
def test_completion_prints_the_committed_script(shell: str) -> None:
    r = _gpu_mon("completion", shell)
    assert r.returncode == 0
    assert r.stdout == (ROOT / "docs" / "completion" / completion.FILES[shell]).read_text(encoding="utf-8")


def test_the_fast_path_agrees_with_the_config_and_the_queue() -> None:
    assert QueueSection().socket == jobids.DEFAULT_SOCKET
    assert jobids.DEFAULT_CONFIG == DEFAULT_PATH
    assert set(jobids.WANTED["cancel"]) == set(J.STATES) - set(J.ENDED)
    assert jobids.WANTED["hold"] == (J.QUEUED,) and jobids.WANTED["release"] == (J.HELD,)


def _bash_complete(line: str) -> List[str]:
    """What bash completes the last word of `line` to ('' after a trailing space)."""
    script = (
        f"source {BASH}; read -ra COMP_WORDS <<< {line!r}; [[ {line!r} == *' ' ]] && COMP_WORDS+=('');"
        'COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); _gpu_mon; printf "%s\\n" "${COMPREPLY[@]}"'
    )
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=30)
    assert r.returncode == 0, r.stderr
    return [w for w in r.stdout.splitlines() if w]


@pytest.mark.parametrize(
    "line, expected",
    [
        ("gpu-mon su", ["submit"]),
        ("gpu-mon submit --stop-s", ["--stop-signal"]),
        ("gpu-mon submit --stop-signal US", ["USR1", "USR2"]),
        ("gpu-mon jobs --state ti", ["timeout"]),
        ("gpu-mon occupy st", ["status"]),
        ("gpu-mon --config /tmp/x occupy on --no-c", ["--no-compute"]),
        ("gpu-mon report --by u", ["user"]),
        ("gpu-mon --config docs/completion/bash/gpu-", ["docs/completion/bash/gpu-mon"]),
        ("gpu-mon submit --name x --", ["--gpus"]),  # (a prefix of every option: they all come)
        ("gpu-mon help su", ["submit"]),  # help's words: the commands and the topics
        ("gpu-mon help exit", ["exit-codes"]),
        ("gpu-mon help en", ["environment"]),
        ("gpu-mon completion z", ["zsh"]),  # a positional's choices
    ],
)
def test_bash_completes_commands_options_and_values(line: str, expected: List[str]) -> None:
    got = _bash_complete(line)
    if line.endswith("--"):
        assert set(expected) <= set(got), got
    else:
        assert got == expected


def test_zsh_script_parses_and_its_tables_answer() -> None:
    if not shutil.which("zsh"):
        pytest.fail("zsh is not installed: apt-get install zsh (as .ci/run does)")
    script = ROOT / "docs" / "completion" / "zsh" / "_gpu-mon"
    r = subprocess.run(["zsh", "-n", str(script)], capture_output=True, text=True)
    assert (r.returncode, r.stderr) == (0, "")
    r = subprocess.run(
        [
            "zsh",
            "-fc",
            f"autoload -Uz compinit; compinit -u -D; source {script}; _gpu_mon_commands occupy;"
            "echo $REPLY; _gpu_mon_value submit --stop-signal; echo $REPLY; _gpu_mon_positional help;"
            "echo $REPLY",
        ],
        capture_output=True,
        text=True,
    )
    occupy, stop_signal, help_words = r.stdout.splitlines()
    assert (occupy, stop_signal, r.returncode) == ("on off status", "signal", 0), r.stderr
    assert help_words.startswith("=") and {"submit", "exit-codes"} <= set(help_words[1:].split()), help_words


@pytest.mark.parametrize(
    "line, expected",
    [
        ("gpu-mon su", "submit"),
        ("gpu-mon submit --stop-signal US", "USR1"),
        ("gpu-mon occupy o", "off"),
        ("gpu-mon help su", "submit"),
        ("gpu-mon help exit", "exit-codes"),
    ],
)
def test_fish_completes(line: str, expected: str, tmp_path) -> None:
    if not shutil.which("fish"):
        pytest.fail("fish is not installed: apt-get install fish (as .ci/run does)")
    script = ROOT / "docs" / "completion" / "fish" / "gpu-mon.fish"
    # (fish makes its data directory under $XDG_DATA_HOME, else ~/.local/share: not in the tester's home)
    env = dict(os.environ, HOME=str(tmp_path), XDG_DATA_HOME=str(tmp_path / "data"))
    r = subprocess.run(
        ["fish", "--no-config", "-c", f"source {script}; complete -C {line!r}"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert r.returncode == 0 and not r.stderr, r.stderr
    assert expected in [w.split("\t")[0] for w in r.stdout.splitlines()], r.stdout
