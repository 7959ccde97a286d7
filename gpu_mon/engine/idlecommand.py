"""[gpu-*] idle_holder_command: a command run once when an idle-holder episode starts (to mail the user,
say). It runs as the daemon's user, without a shell, with the holder in its environment (GPU_MON_IDLE_USER,
_PID, _GPU, _MEMORY_MIB, _SECONDS), beside the loop: spawned as a helper and waited for in a thread, killed
after `timeout` seconds. How it ended is one log line. The idle holder itself is never signalled: the only
process this module may signal is the command it started.
"""

from __future__ import annotations

import logging
import subprocess
import threading
from typing import Callable, Dict, List, Sequence

from gpu_mon.engine.idle import ACTION_PATH, outcome, resolve
from gpu_mon.policy.idleholders import IdleHolder

log = logging.getLogger("gpu_mon")
TIMEOUT_SECONDS = 60.0
MAX_RUNNING = 8  # at once; more episodes starting while these run are logged, not run

Spawn = Callable[[List[str], Dict[str, str]], subprocess.Popen]


def command_env(holder: IdleHolder, now: float) -> Dict[str, str]:
    """The command's whole environment: a plain PATH and the idle holder."""
    return {
        "PATH": ACTION_PATH,
        "LANG": "C.UTF-8",
        "GPU_MON_IDLE_USER": holder.user,
        "GPU_MON_IDLE_PID": str(holder.pid),
        "GPU_MON_IDLE_GPU": holder.uuid,
        "GPU_MON_IDLE_MEMORY_MIB": str(holder.memory_mib),
        "GPU_MON_IDLE_SECONDS": str(int(holder.idle_seconds(now))),
    }


class IdleCommands:
    """Runs idle_holder_command for each episode that starts, never waiting for it on the caller's thread."""

    def __init__(self, spawn: Spawn, timeout: float = TIMEOUT_SECONDS):
        self.spawn, self.timeout = spawn, timeout
        self.running: List[threading.Thread] = []

    def start(self, argv: Sequence[str], holder: IdleHolder, now: float, label: str) -> None:
        """Start the command for one idle holder (`label` names it in the log)."""
        self.running = [t for t in self.running if t.is_alive()]
        if len(self.running) >= MAX_RUNNING:
            log.warning("idle_holder_command for %s not run: %d still running", label, MAX_RUNNING)
            return
        env = command_env(holder, now)
        found = resolve(list(argv), env)
        if found is None:
            log.warning("idle_holder_command for %s: %s: command not found", label, argv[0])
            return
        try:
            popen = self.spawn(found, env)
        except OSError as err:
            log.warning("idle_holder_command for %s: %s: %s", label, argv[0], err.strerror or err)
            return
        worker = threading.Thread(
            target=self._wait, args=(list(argv), popen, label), name="idle-holder-command", daemon=True
        )
        worker.start()
        self.running.append(worker)

    def _wait(self, argv: List[str], popen: subprocess.Popen, label: str) -> None:
        """In a thread: wait for the command (killing it after the timeout) and say how it went."""
        try:
            _out, err = popen.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.communicate()
            log.warning(
                "idle_holder_command for %s: %s still running after %g s: killed",
                label,
                " ".join(argv),
                self.timeout,
            )
            return
        ok, said = outcome(argv, popen.returncode, err or b"")
        log.log(logging.INFO if ok else logging.WARNING, "idle_holder_command for %s: %s", label, said)
