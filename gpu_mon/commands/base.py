"""What every command needs: its errors and exit codes, the config it names, the GPU backend it reads."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Optional, Tuple

from gpu_mon.config import DEFAULT_PATH, Config, ConfigError, trusted_uid_for_this_process
from gpu_mon.config import load as load_config_file

if TYPE_CHECKING:  # (imported when used: the queue's commands read no GPU and start faster without)
    from gpu_mon.api.observe import Backend

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
# Where an admin finds a config to start from (the Debian package installs it; a checkout has conf/).
EXAMPLE_CONFIGS = ("/usr/share/doc/gpu-mon/examples/gpu_mon.conf", "conf/gpu_mon.conf in the source")


def seed_option(p: argparse.ArgumentParser, name: str, **kw: object) -> None:
    """--arm-duration, and the original tools' --arm_duration, as one option (a name without a dash is
    listed once)."""
    names = dict.fromkeys((f"--{name}", f"--{name.replace('-', '_')}"))
    p.add_argument(*names, **kw)  # type: ignore[arg-type]


class CliError(Exception):
    """A one-line error with an exit code."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


def config_path(args: argparse.Namespace) -> Tuple[str, bool]:
    """The config to read (--config, else $GPU_MON_CONFIG, else the default), and whether it was named."""
    named = args.config or os.environ.get("GPU_MON_CONFIG")
    return (named, True) if named else (DEFAULT_PATH, False)


def load_config(args: argparse.Namespace, required: bool) -> Optional[Config]:
    """The config (None when it is optional, not named and not there); ConfigError when it is bad."""
    path, explicit = config_path(args)
    if not os.path.lexists(path):
        if not required and not explicit:
            return None
        hint = f"; start from {EXAMPLE_CONFIGS[0]} or {EXAMPLE_CONFIGS[1]}" if not explicit else ""
        raise ConfigError([f"{path}: No such file or directory{hint} (or pass --config PATH)"])
    return load_config_file(path, trusted_uid_for_this_process())


def sim_path(args: argparse.Namespace) -> Optional[str]:
    """--sim, else $GPU_MON_SIM, else None (NVML)."""
    return args.sim or os.environ.get("GPU_MON_SIM") or None


def backend(args: argparse.Namespace, writes: bool = False) -> Tuple[Backend, str]:
    """The GPU backend the arguments ask for, and how to name it. Only a daemon (`writes`) creates the
    simulator's missing device files."""
    from gpu_mon.api.sim import SimBackend, SimError

    sim = sim_path(args)
    if sim:
        found = SimBackend(sim, create_devices=writes)
        try:
            found.load()
        except SimError as err:
            named_by = "--sim" if args.sim else "GPU_MON_SIM"
            raise CliError(f"{named_by}: {err}") from None
        return found, f"simulated GPUs from {found.path}"
    from gpu_mon.api.nvml import NvmlBackend

    return NvmlBackend(), "NVML"
