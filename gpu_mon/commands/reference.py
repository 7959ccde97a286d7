"""`gpu-mon help [COMMAND|TOPIC]` and `gpu-mon completion SHELL`: the reference from the command line."""

from __future__ import annotations

import argparse
import sys
from typing import List

from gpu_mon.commands import base
from gpu_mon.commands.base import CliError

# Printed as it is (lines of at most 80 characters): argparse would break /usr/share/doc/gpu-mon/ at its '-'.
EPILOG = """\
manual: man gpu-mon (commands, exit codes, signals, files), man gpu_mon.conf (the
config), man gpu-mon-queue (queueing your own jobs); gpu-mon help TOPIC (config,
queue, exit-codes, signals, files, environment); /usr/share/doc/gpu-mon/"""


def add_arguments(sub: argparse._SubParsersAction) -> None:
    """The `help` and `completion` commands."""
    p = sub.add_parser(
        "help",
        help="a command's --help, or a short text on a topic and the page to read",
        description="`gpu-mon help COMMAND` is `gpu-mon COMMAND --help`; `gpu-mon help TOPIC` prints a short "
        "text and names the man page to read. Topics: config, queue, exit-codes, signals, files, "
        "environment. Without an argument: `gpu-mon --help`.",
    )
    p.add_argument("what", nargs="*", metavar="COMMAND|TOPIC", help="a command (occupy on) or a topic")
    p = sub.add_parser(
        "completion",
        help="print the bash, zsh or fish completion script",
        description="Print the completion script for SHELL (the .deb installs them already). bash: "
        "`gpu-mon completion bash > ~/.local/share/bash-completion/completions/gpu-mon`; zsh: into a "
        "directory of $fpath as _gpu-mon; fish: `> ~/.config/fish/completions/gpu-mon.fish`.",
    )
    p.add_argument("shell", choices=("bash", "zsh", "fish"), help="the shell")


def cmd_help(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Print the help asked for."""
    from gpu_mon.reference import topics

    words: List[str] = list(args.what)
    named = {t.name: t for t in topics.TOPICS}
    if len(words) == 1 and words[0] in named:
        sys.stdout.write(topics.text(named[words[0]]))
        return base.EXIT_OK
    target = parser
    for word in words:
        subs = [a for a in target._actions if isinstance(a, argparse._SubParsersAction)]
        listed = [c.dest for s in subs for c in s._choices_actions]
        if word not in listed:
            what = f"{' '.join(words[: words.index(word)])} " if target is not parser else ""
            raise CliError(
                f"help: no command or topic {what}{word!r}; commands: {', '.join(listed)}"
                + (f"; topics: {', '.join(named)}" if target is parser else ""),
                base.EXIT_USAGE,
            )
        target = subs[0].choices[word]
    target.print_help()
    return base.EXIT_OK


def cmd_completion(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Print a completion script."""
    from gpu_mon.reference import completion, model

    sys.stdout.write(completion.script(args.shell, model.command(parser)))
    return base.EXIT_OK
