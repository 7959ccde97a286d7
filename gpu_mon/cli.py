"""Command line: argument parsing, wiring of the real adapters, exit codes.

Exit codes: 0 ok; 1 runtime failure; 2 bad usage or bad config. Errors are one line on stderr naming what
is wrong and where; a traceback only with --debug.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import time
from typing import List, Optional, Sequence, Tuple

from gpu_mon import __version__
from gpu_mon.api.observe import Backend, Observer
from gpu_mon.api.sim import SimBackend, SimError
from gpu_mon.api.text import sanitize
from gpu_mon.commands import stress
from gpu_mon.config import (
    DEFAULT_PATH,
    Config,
    ConfigError,
    Defaults,
    TtySection,
    trusted_uid_for_this_process,
)
from gpu_mon.config import load as load_config_file
from gpu_mon.engine import policy
from gpu_mon.engine.decisions import PolicyState
from gpu_mon.engine.workloads.supervisor import workload_env
from gpu_mon.outputs import logs, statefile
from gpu_mon.outputs import status as report

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class CliError(Exception):
    """A one-line error with an exit code."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


def _add_common(p: argparse.ArgumentParser, top: bool) -> None:
    """--config, --sim and --debug, accepted before or after the command."""
    d = None if top else argparse.SUPPRESS
    p.add_argument(
        "--config",
        metavar="PATH",
        default=d,
        help=f"config file (default {DEFAULT_PATH})" if top else argparse.SUPPRESS,
    )
    p.add_argument(
        "--sim",
        metavar="FILE",
        default=d,
        help="simulated GPUs from a JSON file instead of NVML (tests, demos; also GPU_MON_SIM)"
        if top
        else argparse.SUPPRESS,
    )
    p.add_argument(
        "--debug",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="debug logging, and tracebacks on errors" if top else argparse.SUPPRESS,
    )


def build_parser() -> argparse.ArgumentParser:
    """The whole `gpu-mon` argument parser."""
    parser = argparse.ArgumentParser(
        prog="gpu-mon",
        description="Run work on idle NVIDIA GPUs and yield the instant anyone else needs them.",
    )
    parser.add_argument("--version", action="version", version=f"gpu-mon {__version__}")
    _add_common(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    p = sub.add_parser("run", help="the daemon, in the foreground (systemd runs it so); logs to stderr")
    _add_common(p, top=False)
    p = sub.add_parser("check", help="validate the config and check it against this host; exit 0 or 2")
    _add_common(p, top=False)
    p = sub.add_parser("status", help="GPUs, who holds each, terminal users, workloads")
    _add_common(p, top=False)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("stress", help="built-in CUDA stressor (needs the gpu-mon[stress] extra)")
    _add_common(p, top=False)
    stress.add_arguments(p)
    return parser


# ---------------------------------------------------------------------------------------------------------


def _stderr(line: str, priority: int = 3) -> None:
    """One line on stderr; with a syslog priority prefix when stderr is the journal."""
    prefix = f"<{priority}>" if logs.stderr_is_journal() else ""
    print(f"{prefix}{sanitize(line, 4096)}", file=sys.stderr)


def _config_path(args: argparse.Namespace) -> Tuple[str, bool]:
    return (args.config, True) if args.config else (DEFAULT_PATH, False)


def _load_config(args: argparse.Namespace, required: bool) -> Optional[Config]:
    path, explicit = _config_path(args)
    if not required and not explicit and not os.path.lexists(path):
        return None
    return load_config_file(path, trusted_uid_for_this_process())


def _sim_path(args: argparse.Namespace) -> Optional[str]:
    return args.sim or os.environ.get("GPU_MON_SIM") or None


def _backend(args: argparse.Namespace) -> Tuple[Backend, str]:
    sim = _sim_path(args)
    if sim:
        backend = SimBackend(sim)
        try:
            backend.load()
        except SimError as err:
            raise CliError(str(err)) from None
        return backend, f"simulated GPUs from {backend.path}"
    from gpu_mon.api.nvml import NvmlBackend

    return NvmlBackend(), "NVML"


def _fresh_look(config: Optional[Config], backend: Backend, source: str) -> dict:
    observer = Observer(backend)
    observer.read_gpus()
    observer.scan("full")
    tty = config.tty if config else TtySection()
    snap = observer.snapshot(time.monotonic(), (), tty.devices)
    cfg = config or Config(path="(none)")
    plan = policy.resolve(cfg, snap.reading.gpus) if not snap.reading.error else policy.Plan({}, (), {})
    decision = policy.decide(cfg, plan, snap, PolicyState())
    backend.close()
    return report.build(config, plan, snap, decision, source=source)


# ---------------------------------------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    """`gpu-mon status`: the daemon's view, or one fresh look when no daemon runs."""
    config = _load_config(args, required=False)
    state_file = config.defaults.state_file if config else Defaults().state_file
    doc = statefile.read_live(state_file)
    if doc is None:
        backend, source = _backend(args)
        doc = _fresh_look(config, backend, source)
        if config is None:
            doc["config"] = f"{DEFAULT_PATH} (missing: showing the host only)"
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(report.render(doc))
    return EXIT_FAILURE if doc.get("error") and not doc.get("daemon") else EXIT_OK


def _host_warnings(config: Config) -> List[str]:
    warnings: List[str] = []
    for p in config.processes:
        where = f"{config.path}:{p.line}: [process-{p.name}]"
        exe = p.cmd[0]
        path = workload_env(p, ())["PATH"]
        if "/" in exe:
            full = exe if os.path.isabs(exe) else os.path.join(p.dir, exe)
            if not os.access(full, os.X_OK):
                warnings.append(f"{where} cmd: {exe!r} is not an executable file")
        elif shutil.which(exe, path=path) is None:
            warnings.append(f"{where} cmd: {exe!r} is not on the workload's PATH ({path}); use a full path")
        if not os.path.isdir(p.dir):
            warnings.append(f"{where} dir: {p.dir!r} does not exist")
        if p.log and not os.path.isdir(os.path.dirname(p.log) or "/"):
            warnings.append(f"{where} log: the directory of {p.log!r} does not exist")
    if os.geteuid() != 0:
        warnings.append(
            "not running as root: processes of other users cannot be inspected, so the daemon "
            "would count every GPU as busy while any runs, and cannot switch workload users"
        )
    return warnings


def cmd_check(args: argparse.Namespace) -> int:
    """`gpu-mon check`: the config, then the GPUs, device nodes and commands it names on this host."""
    config = _load_config(args, required=True)
    assert config is not None
    warnings = list(config.warnings) + _host_warnings(config)
    backend, source = _backend(args)
    reading = backend.read()
    errors: List[str] = []
    if reading.error:
        warnings.append(f"cannot check the GPUs the config names: {reading.error}")
    else:
        plan = policy.resolve(config, reading.gpus)
        errors.extend(f"{config.path}: {p}" for p in plan.problems)
        observer = Observer(backend)
        observer.read_gpus()
        for uuid, why in observer.node_errors.items():
            if uuid in plan.rules:
                warnings.append(
                    f"GPU {plan.index_of.get(uuid)} ({uuid}): {why}: it will always count as busy"
                )
    backend.close()
    for w in warnings:
        _stderr(f"warning: {w}", 4)
    for e in errors:
        _stderr(e)
    if errors:
        return EXIT_USAGE
    n_gpus = len(reading.gpus)
    print(
        f"{config.path}: OK: {len(config.gpu_sections)} [gpu-*] and {len(config.processes)} [process-*] "
        f"section(s); {n_gpus} GPU(s) seen ({source}); {len(warnings)} warning(s)"
    )
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    """`gpu-mon run`: the daemon in the foreground."""
    from gpu_mon.engine.daemon import ContainmentError, Daemon
    from gpu_mon.engine.lock import DaemonLock, LockError

    config = _load_config(args, required=True)
    assert config is not None
    lock = DaemonLock(config.defaults.state_file)
    try:
        lock.acquire()
    except LockError as err:
        raise CliError(str(err), EXIT_FAILURE) from None
    backend, source = _backend(args)
    if os.geteuid() != 0:
        logging.getLogger("gpu_mon").warning(
            "not running as root: processes of other users cannot be inspected (GPUs count as busy while "
            "any runs) and workloads run as %s",
            os.environ.get("USER", "this user"),
        )
    daemon = Daemon(
        config, backend, trusted_uid=trusted_uid_for_this_process(), source="" if source == "NVML" else source
    )
    try:
        return daemon.run()
    except ContainmentError as err:
        raise CliError(str(err), EXIT_USAGE) from None
    finally:
        lock.release()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `gpu-mon`; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logs.setup(debug=args.debug)
    try:
        if args.command == "stress":
            return stress.run(args)
        handler = {"run": cmd_run, "check": cmd_check, "status": cmd_status}[args.command]
        return handler(args)
    except ConfigError as err:
        for line in err.errors:
            _stderr(line)
        return EXIT_USAGE
    except CliError as err:
        _stderr(f"gpu-mon: {err}")
        return err.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except Exception as err:
        if args.debug:
            # Through the logger, so that under systemd every traceback line carries its priority.
            logging.getLogger("gpu_mon").exception("gpu-mon: unexpected error")
        else:
            _stderr(f"gpu-mon: error: {type(err).__name__}: {err} (run with --debug for a traceback)")
        return EXIT_FAILURE


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
