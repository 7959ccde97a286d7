"""`gpu-mon run`: the daemon in the foreground, holding the lock of its state file for its whole life."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from gpu_mon.commands import base, statedir
from gpu_mon.config import ConfigError, trusted_uid_for_this_process

if TYPE_CHECKING:
    from gpu_mon.engine.lock import DaemonLock
    from gpu_mon.outputs.metrics import Metrics


def cmd_run(args: argparse.Namespace) -> int:
    """Run until SIGTERM; exit 1 if another daemon has the state file, 2 on a bad config."""
    from gpu_mon.engine.daemon import Daemon
    from gpu_mon.engine.lock import DaemonLock, LockError, PlaceError
    from gpu_mon.engine.workloads.cgroups import ContainmentError
    from gpu_mon.outputs.notify import Notifier
    from gpu_mon.outputs.statefile import StateFile
    from gpu_mon.queue.tier import QueueTier
    from gpu_mon.slurm.tier import SlurmTier

    config = base.load_config(args, required=True)
    assert config is not None
    # The loop is what yields: a thread of ours (the history writer, a metrics scrape) that holds the
    # interpreter's lock must hand it over within 1 ms, not the default 5 ms.
    sys.setswitchinterval(0.001)
    backend, source = base.backend(args, writes=True)
    trusted = trusted_uid_for_this_process()
    listeners: list = [StateFile(config.defaults.state_file), Notifier()]
    if config.history.enabled:
        from gpu_mon.outputs.history import History

        listeners.append(History(config.history))
    metrics = None
    if config.metrics is not None:
        from gpu_mon.outputs.metrics import Metrics

        metrics = Metrics(config.metrics)
        listeners.append(metrics)
    daemon = Daemon(
        config,
        backend,
        trusted_uid=trusted,
        source="" if source == "NVML" else source,
        listeners=listeners,
        tiers=(QueueTier, SlurmTier),
    )
    # Signals are the loop's before the lock is: whoever sees a daemon holding the lock may stop it.
    daemon.catch_signals()
    lock = DaemonLock(config.defaults.state_file)
    try:
        lock.acquire()
    except PlaceError as err:  # the config's problem (exit 2), said as `check` says it
        raise ConfigError([statedir.refusal(config, str(err), err.denied)]) from None
    except LockError as err:
        raise base.CliError(str(err), base.EXIT_FAILURE) from None
    if metrics is not None and config.metrics is not None:
        _open_metrics(metrics, f"{config.path}:{config.metrics.line}", lock)
    if os.geteuid() != 0:
        logging.getLogger("gpu_mon").warning(
            "not running as root: processes of other users cannot be inspected (GPUs count as busy while "
            "any runs) and workloads run as %s",
            os.environ.get("USER", "this user"),
        )
    try:
        return daemon.run()
    except ContainmentError as err:
        raise base.CliError(str(err), base.EXIT_USAGE) from None
    finally:
        lock.release()


def _open_metrics(metrics: Metrics, where: str, lock: DaemonLock) -> None:
    """Bind the endpoint, check the textfile's directory: with the lock held (a second daemon is told about
    the first, not about a port in use), before anything runs. A problem is a config error (exit 2)."""
    from gpu_mon.outputs.metrics import MetricsError

    try:
        metrics.open()
    except MetricsError as err:
        lock.release()
        raise base.CliError(f"{where}: {err}", base.EXIT_USAGE) from None
