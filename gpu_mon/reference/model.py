"""The parser as plain data: each command's options and arguments, in the order --help lists them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

# What an argument's value completes to (the completion scripts) besides a fixed list of choices
# (HELP: `gpu-mon help`'s, a command's name or a topic's).
FILE, SIGNAL, JOB_ID, COMMAND, HELP, NOTHING = "file", "signal", "job-id", "command", "help", ""


@dataclass(frozen=True)
class Option:
    """An option or a positional argument (no `flags`)."""

    flags: Tuple[str, ...]
    metavar: str  # '' for a flag that takes no value
    help: str
    choices: Tuple[str, ...]
    value: str  # FILE, SIGNAL, JOB_ID, COMMAND (the rest of the line), HELP or NOTHING: what its value is
    repeats: bool  # a positional that takes more than one value


@dataclass(frozen=True)
class Command:
    """A command (`occupy on` is the command ('occupy', 'on')); the top level is ()."""

    path: Tuple[str, ...]
    help: str
    description: str
    usage: str
    options: Tuple[Option, ...]
    commands: Tuple[Command, ...]  # listed ones only: a hidden command (occupy's `serve`) is left out

    @property
    def name(self) -> str:
        """`occupy on`; '' for the top level."""
        return " ".join(self.path)


def command(parser: argparse.ArgumentParser, path: Tuple[str, ...] = (), help: str = "") -> Command:
    """The parser's command tree."""
    formatter = parser._get_formatter()
    options, commands = [], []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for listed in action._choices_actions:
                sub = action.choices[listed.dest]
                commands.append(command(sub, (*path, listed.dest), listed.help or ""))
        elif action.help != argparse.SUPPRESS:
            options.append(_option(action, formatter))
    usage = " ".join(parser.format_usage().split())[len("usage: ") :]
    return Command(path, help, parser.description or "", usage, tuple(options), tuple(commands))


def walk(top: Command) -> Iterator[Command]:
    """Every command, the top level first, depth first."""
    yield top
    for sub in top.commands:
        yield from walk(sub)


def _option(action: argparse.Action, formatter: argparse.HelpFormatter) -> Option:
    """One argument."""
    takes_value = action.nargs != 0
    metavar = ""
    if takes_value:
        metavar = action.metavar if isinstance(action.metavar, str) else (action.dest.upper())
        if action.choices and action.metavar is None:
            metavar = "{" + ",".join(map(str, action.choices)) + "}"
    text = formatter._expand_help(action) if action.help else ""
    return Option(
        flags=tuple(action.option_strings),
        metavar=metavar,
        help=" ".join(text.split()),
        choices=tuple(str(c) for c in action.choices or ()),
        value=_value(action, metavar) if takes_value else NOTHING,
        repeats=not action.option_strings and action.nargs in ("+", "*"),
    )


def _value(action: argparse.Action, metavar: str) -> str:
    """What the argument's value is, from its name: a signal, a file, a job id, or anything."""
    if action.nargs == argparse.REMAINDER:
        return COMMAND
    if action.dest.endswith("signal") or metavar == "SIG":
        return SIGNAL
    if metavar in ("PATH", "FILE", "DIR") or action.dest in ("config", "output", "plot"):
        return FILE
    if metavar == "ID" and not action.option_strings:
        return JOB_ID
    if metavar == "COMMAND|TOPIC" and not action.option_strings:
        return HELP
    return NOTHING


def find(top: Command, path: Tuple[str, ...]) -> Optional[Command]:
    """The command at this path, or None."""
    for c in walk(top):
        if c.path == path:
            return c
    return None
