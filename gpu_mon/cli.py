"""Command line: argument parsing, wiring of the real adapters, exit codes.

Exit codes: 0 ok; 1 runtime failure; 2 bad usage or bad config. Errors are one line on stderr naming what
is wrong and where; a traceback only with --debug.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import os
import sys
from typing import Dict, Optional, Sequence, Tuple

from gpu_mon import __version__
from gpu_mon.api.text import sanitize
from gpu_mon.commands import base, queue, reference
from gpu_mon.config import DEFAULT_PATH, ConfigError
from gpu_mon.outputs import logs


class _Parser(argparse.ArgumentParser):
    """argparse whose errors point at what was mistyped: a wrong option gets the usage of the command it
    was given to, a mistyped command the nearest one's name."""

    strict = False  # a command's parser: an option it does not know is its error, not the top level's

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        found, extras = super().parse_known_args(args, namespace)
        if extras and self.strict:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._near_option(extras)}")
        return found, extras

    def _near_option(self, extras: Sequence[str]) -> str:
        """' (did you mean --array?)' for the first mistyped option that is close to one this command has."""
        known = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        for word in extras:
            if word.startswith("--"):
                near = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.6)
                if near:
                    return f" (did you mean {near[0]}?)"
        return ""

    def _check_value(self, action: argparse.Action, value: object) -> None:
        if not isinstance(action, argparse._SubParsersAction) or value in (action.choices or ()):
            super()._check_value(action, value)
            return
        # Only the commands --help lists (not a hidden one such as occupy's `serve`).
        shown = [a.dest for a in action._choices_actions] or list(action.choices or ())
        near = difflib.get_close_matches(str(value), shown, n=1, cutoff=0.6)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise argparse.ArgumentError(
            action, f"invalid choice: {value!r}{hint}; choose from {', '.join(shown)}"
        )


def _strict_commands(parser: argparse.ArgumentParser) -> None:
    """Every command's parser (occupy's on/off/status too) reports its own unknown options."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.strict = True
                _strict_commands(sub)


def _add_common(p: argparse.ArgumentParser, top: bool, config: bool = True, sim: bool = True) -> None:
    """--config, --sim and --debug, accepted (and listed in --help) before or after the command; a
    command lists --config and --sim only if it reads them.

    After the command their default is SUPPRESS, so that a value given before it is kept."""
    d = None if top else argparse.SUPPRESS
    if config:
        p.add_argument(
            "--config",
            metavar="PATH",
            default=d,
            help=f"config file (default $GPU_MON_CONFIG, else {DEFAULT_PATH})",
        )
    if sim:
        p.add_argument(
            "--sim",
            metavar="FILE",
            default=d,
            help="simulated GPUs from a JSON file instead of NVML (tests, demos; also GPU_MON_SIM)",
        )
    p.add_argument(
        "--debug",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="debug logging, and tracebacks on errors",
    )


# The commands other than the queue's and the reference's, in --help's order: (name, help, description,
# which common options it takes); each one's own options come from its module (build_parser).
_COMMANDS: Tuple[Tuple[str, str, Optional[str], Dict[str, bool]], ...] = (
    (
        "run",
        "the daemon, in the foreground (systemd runs it so); logs to stderr",
        "Run the daemon in the foreground until SIGTERM or Ctrl-C: watch the GPUs, start the config's "
        "workloads on GPUs nobody else uses, stop them when someone needs one. Logs go to stderr; SIGHUP "
        "reloads the config. Exit 1 when another daemon has the same state_file, 2 on a bad config.",
        {},
    ),
    (
        "check",
        "validate the config and check it against this host; exit 0, 1 or 2",
        "Read the config and report every problem at once, with its file and line: then check it against "
        "this host (the GPUs, users, commands and directories it names). Problems that would stop the "
        "daemon exit 2; GPUs that cannot be read (NVML does not start, or a GPU the config names is "
        "unreadable: every GPU would count as busy) exit 1; warnings alone exit 0.",
        {},
    ),
    ("status", "GPUs, who holds each, terminal users, workloads", None, {}),
    (
        "stress",
        "built-in CUDA stressor (needs the gpu-mon[stress] extra)",
        None,
        {"config": False, "sim": False},
    ),
    (
        "sentinel",
        "act once (exit, shut down, reboot, run a command) when the GPUs go idle after being busy",
        "Arm once the GPUs have been busy for --arm-duration, then act once when they have been idle for "
        "--kill-duration. A GPU that cannot be read counts as active. Exit 0 when end_process fires or "
        "SIGTERM/SIGINT/SIGQUIT stops it, 1 when the action fails, 2 on bad usage.",
        {"config": False},
    ),
    (
        "watch",
        "run CMD; stop its whole process tree when the GPUs it uses stay idle (exit 124)",
        "Run CMD and stop its whole process tree when the GPUs it uses stay below the threshold for the "
        "last N samples: exit 124 then, else CMD's own exit status.",
        {"config": False},
    ),
    (
        "occupy",
        "your own reservation: wait until GPUs are idle, then hold them (on, off, status)",
        "Wait until the GPUs are idle for a while, then hold their memory (and compute) in the background "
        "until `occupy off`; with --yield, give them back whenever anyone else needs one. No root, no "
        "config file. `occupy status` exits 3 when nothing runs.",
        {},
    ),
    (
        "report",
        "what the history says: GPU-hours harvested, preemptions, yield latency, idle holders",
        "Read the daemon's [history] (read-only) and report on a period: a table, --json, or --plot FILE. "
        "Exit 1 when there is no history yet.",
        {"sim": False},
    ),
)


def build_parser(only_queue: bool = False) -> argparse.ArgumentParser:
    """The whole `gpu-mon` argument parser; `only_queue`: with the queue's commands alone (all that
    `gpu-mon jobs` or `submit` needs: the other commands' modules are not even imported)."""
    parser = _Parser(
        prog="gpu-mon",
        description="Run work on idle NVIDIA GPUs and yield the instant anyone else needs them.",
        epilog=reference.EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gpu-mon {__version__}")
    _add_common(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    if only_queue:
        queue.add_arguments(sub, _add_common)
        _strict_commands(parser)
        return parser
    from gpu_mon.commands import occupy, report, sentinel, stress, watch

    arguments = {
        "status": lambda p: p.add_argument("--json", action="store_true", help="machine-readable output"),
        "stress": stress.add_arguments,
        "sentinel": sentinel.add_arguments,
        "watch": watch.add_arguments,
        "occupy": lambda p: occupy.add_arguments(p, _add_common),
        "report": report.add_arguments,
    }
    for name, help_, description, common in _COMMANDS:
        p = sub.add_parser(name, help=help_, description=description)
        _add_common(p, top=False, **common)
        if name in arguments:
            arguments[name](p)
    queue.add_arguments(sub, _add_common)
    reference.add_arguments(sub)
    _strict_commands(parser)
    return parser


# ---------------------------------------------------------------------------------------------------------


def _stderr(line: str, priority: int = 3) -> None:
    """One line on stderr; with a syslog priority prefix when stderr is the journal."""
    prefix = f"<{priority}>" if logs.stderr_is_journal() else ""
    print(f"{prefix}{sanitize(line, 4096)}", file=sys.stderr)


def _queue_command(argv: Sequence[str]) -> bool:
    """Whether the command is one of the queue's (a user's `gpu-mon jobs` starts faster without the rest)."""
    words = iter(argv)
    for word in words:
        if word in ("--config", "--sim"):
            next(words, None)
        elif word in ("-h", "--help", "--"):
            return False
        elif not word.startswith("-"):
            return word in queue.COMMANDS
    return False


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `gpu-mon`; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(only_queue=_queue_command(argv))
    args = parser.parse_args(argv)
    logs.setup(debug=args.debug)
    try:
        if args.command in queue.COMMANDS:
            return queue.cmd_queue(args)
        if args.command in ("help", "completion"):
            return {"help": reference.cmd_help, "completion": reference.cmd_completion}[args.command](
                args, parser
            )
        from gpu_mon.commands import occupy_run, report, sentinel, stress, watch
        from gpu_mon.commands.check import cmd_check
        from gpu_mon.commands.run import cmd_run
        from gpu_mon.commands.status import cmd_status

        if args.command == "stress":
            return stress.run(args)
        if args.command == "sentinel":
            return sentinel.cmd_sentinel(args)
        if args.command == "report":
            return report.cmd_report(args)
        if args.command == "occupy":
            return occupy_run.cmd_occupy(args)
        if args.command == "watch":
            return watch.cmd_watch(args)
        if args.command == "check":
            return cmd_check(args, _stderr)
        return {"run": cmd_run, "status": cmd_status}[args.command](args)
    except ConfigError as err:
        for line in err.errors:
            _stderr(line)
        return base.EXIT_USAGE
    except base.CliError as err:
        _stderr(f"gpu-mon: {err}")
        return err.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return base.EXIT_OK
    except Exception as err:
        if args.debug:
            # Through the logger, so that under systemd every traceback line carries its priority.
            logging.getLogger("gpu_mon").exception("gpu-mon: unexpected error")
        else:
            _stderr(f"gpu-mon: error: {type(err).__name__}: {err} (run with --debug for a traceback)")
        return base.EXIT_FAILURE


def console_main() -> None:
    """The `gpu-mon` executable and `python -m gpu_mon`: main(), then exit at once.

    A CUDA context is released only when its process exits, and with torch loaded the interpreter's own
    teardown takes 0.4-0.6 s more (measured on an H100): exiting right away hands a stopped stressor's GPU
    back that much sooner. Everything main() owns is closed by the time it returns.
    """
    code = main()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    console_main()
