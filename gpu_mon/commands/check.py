"""`gpu-mon check`: the config, then the GPUs, device nodes, users and commands it names on this host."""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Callable, List, Sequence, Set, Tuple

from gpu_mon.api import holders
from gpu_mon.api.model import Gpu, GpuReading
from gpu_mon.commands import base, statedir
from gpu_mon.commands.checkqueue import queue_lines
from gpu_mon.config import Config, ConfigError, GpuSection, ProcessSection, line_of, sort_by_line
from gpu_mon.engine.idle import ACTION_PATH
from gpu_mon.engine.workloads.supervisor import workload_env
from gpu_mon.policy import decide as policy


def host_warnings(config: Config) -> List[str]:
    """Things on this host that will make a workload fail: commands, directories, log directories."""
    warnings: List[str] = []
    for p in config.processes:
        warnings.extend(_process_warnings(p.path or config.path, p))
    for g in config.gpu_sections:
        warnings.extend(_idle_command_warnings(g.path or config.path, g))
    if os.geteuid() != 0:
        warnings.append(
            "not running as root: processes of other users cannot be inspected, so the daemon "
            "would count every GPU as busy while any runs, and cannot switch workload users"
        )
    return warnings


def _process_warnings(path: str, p: ProcessSection) -> List[str]:
    """A [process-*] section's command, dir and log directory, each at the line of its key."""
    found: List[Tuple[str, str]] = []
    exe = p.cmd[0]
    search = workload_env(p, ())["PATH"]
    if "/" in exe:
        full = exe if os.path.isabs(exe) else os.path.join(p.dir, exe)
        if not os.access(full, os.X_OK):
            found.append(("cmd", f"{exe!r} is not an executable file"))
    elif shutil.which(exe, path=search) is None:
        found.append(("cmd", f"{exe!r} is not on the workload's PATH ({search}); use a full path"))
    if not os.path.isdir(p.dir):
        found.append(("dir", f"{p.dir!r} does not exist"))
    if p.log and not os.path.isdir(os.path.dirname(p.log) or "/"):
        found.append(("log", f"the directory of {p.log!r} does not exist"))
    return [f"{path}:{line_of(p, key)}: [process-{p.name}] {key}: {what}" for key, what in found]


def _idle_command_warnings(path: str, g: GpuSection) -> List[str]:
    """A [gpu-*] section's idle_holder_command that will not run: at the line of the key."""
    if not g.idle_holder_command:
        return []
    exe = g.idle_holder_command[0]
    where = f"{path}:{line_of(g, 'idle_holder_command')}: [gpu-{g.name}] idle_holder_command"
    if "/" in exe:  # (it runs in /)
        ok = os.access(os.path.join("/", exe), os.X_OK)
        return [] if ok else [f"{where}: {exe!r} is not an executable file"]
    if shutil.which(exe, path=ACTION_PATH) is None:
        return [f"{where}: {exe!r} is not on its PATH ({ACTION_PATH}); use a full path"]
    return []


def metrics_problems(config: Config) -> List[str]:
    """What would stop the daemon from serving [metrics]: the extra missing, a textfile directory it cannot
    write (the port is tried when the daemon starts: a running daemon holds it)."""
    m = config.metrics
    if m is None:
        return []
    from gpu_mon.outputs.metrics import MetricsError, check_textfile_dir, load_exposition

    problems = []
    try:
        load_exposition()
    except MetricsError as err:
        problems.append(f"{config.path}:{m.line}: {err}")
    try:
        if m.textfile:
            check_textfile_dir(m.textfile)
    except MetricsError as err:
        problems.append(f"{config.path}:{m.line}: {err}")
    return problems


def slurm_problems(config: Config) -> Tuple[List[str], List[str]]:
    """[slurm] on this host: (errors, warnings). Its commands must exist and Slurm answer; the partitions
    (and, with accounting, the QOS) it names must exist."""
    s = config.slurm
    if s is None:
        return [], []
    from gpu_mon.slurm.control import probe

    found = probe(s.scontrol, s.scancel, s.preemptible_partitions, s.preemptible_qos, s.timeout_seconds)
    said = [(f"{config.path}:{s.line}: [slurm] {key}: {what}", error) for key, what, error in found]
    return [t for t, e in said if e], [t for t, e in said if not e]


def _state_file_problem(config: Config, errors: List[str], warnings: List[str]) -> None:
    """A state_file whose directory cannot be made is an error; one only root may write, a warning for a
    plain user checking root's config."""
    found = statedir.problem(config)
    if found is None:
        return
    detail, denied = found
    (warnings if denied else errors).append(statedir.refusal(config, detail, denied))


def _load(args: argparse.Namespace) -> Config:
    """The config; with syntax errors, raise them together with the GPU problems of what did parse."""
    try:
        config = base.load_config(args, required=True)
    except ConfigError as err:
        if err.partial is None:
            raise
        backend, _source = base.backend(args)
        reading = backend.read()
        backend.close()
        if reading.error:
            raise
        problems = policy.resolve(err.partial, reading.gpus).problems
        raise ConfigError(sort_by_line(err.errors + [f"{err.partial.path}:{p}" for p in problems])) from None
    assert config is not None
    return config


def unreadable_gpus(config: Config, reading: GpuReading, plan: policy.Plan) -> List[str]:
    """The GPUs the config watches that cannot be read (each would always count as busy), one line each."""
    every = any(g.gpus.all for g in config.gpu_sections)
    found = []
    for gpu in reading.gpus:
        named = gpu.uuid in plan.rules if gpu.uuid else every
        errors = policy.blinding_errors(gpu) or (["uuid: unreadable"] if gpu.uuid is None else [])
        if named and errors:
            found.append(f"{gpu.label} cannot be read ({'; '.join(errors)}): it will always count as busy")
    return found


def _made_by_the_daemon(gpus: Sequence[Gpu]) -> Set[str]:
    """The simulated GPUs whose device file is missing: the daemon makes it at its start (a sim only)."""
    return {g.uuid for g in gpus if g.device and not os.path.lexists(g.device)}


def cmd_check(args: argparse.Namespace, say: Callable[[str, int], None]) -> int:
    """Exit 0 when the config is good here (warnings aside), 2 when it is not, 1 when it is but this host
    cannot run it: the GPUs cannot be read (NVML does not start, or a GPU the config names is unreadable),
    so every GPU would count as busy and nothing would ever run."""
    config = _load(args)
    warnings = list(config.warnings) + host_warnings(config)
    backend, source = base.backend(args)
    reading = backend.read()
    backend.close()
    errors: List[str] = []
    host: List[str] = []  # the host cannot run it (exit 1)
    if reading.error:
        host.append(f"{reading.error}: no GPU can be read, so every GPU would count as busy and nothing run")
    else:
        plan = policy.resolve(config, reading.gpus)
        errors.extend(f"{config.path}:{p}" for p in plan.problems)
        host.extend(unreadable_gpus(config, reading, plan))
        _targets, node_errors = holders.device_targets(reading.gpus)
        made = _made_by_the_daemon(reading.gpus) if base.sim_path(args) else set()
        for uuid, why in node_errors.items():
            if uuid in plan.rules and uuid not in made:
                warnings.append(
                    f"GPU {plan.index_of.get(uuid)} ({uuid}): {why}: it will always count as busy"
                )
    errors.extend(metrics_problems(config))
    slurm_errors, slurm_warnings = slurm_problems(config)
    errors.extend(slurm_errors)
    warnings.extend(slurm_warnings)
    _state_file_problem(config, errors, warnings)
    for w in warnings:
        say(f"warning: {w}", 4)
    for e in errors + host:
        say(e, 3)
    if errors:
        return base.EXIT_USAGE
    if host:
        return base.EXIT_FAILURE
    print(f"read {len(config.files)} file(s): {', '.join(config.files)}")
    print("\n".join(queue_lines(config)))
    print(
        f"{config.path}: OK: {len(config.gpu_sections)} [gpu-*] and {len(config.processes)} [process-*] "
        f"section(s); {len(reading.gpus)} GPU(s) seen ({source}); {len(warnings)} warning(s)"
    )
    return base.EXIT_OK
