"""The simulated GPU backend (tests and demos): a JSON file in place of NVML, re-read on every look.

    {"gpus": [{"uuid": "GPU-5a1c...", "name": "Simulated H100", "memory_total_mib": 81559,
               "memory_used_mib": 0, "utilization_pct": 0, "device": "dev/nvidia0",
               "processes": [{"pid": 4242, "used_memory_mib": 1024, "utilization_pct": 35}]}]}

GPU index = position in the list. `device` is a regular file standing in for /dev/nvidiaN (created if
missing; relative to the sim file). A field set to null reads as unreadable, and `"error": "GPU is lost"`
makes the whole GPU unreadable, so tests can exercise the fail-closed paths. A process's `utilization_pct` is
its SM utilization as NVML's per-process samples would report it; absent means unknown.
`energy_mj` (NVML's total energy counter: millijoules since the driver loaded; lower than before means the
driver reloaded) and `power_mw` (the power draw, milliwatts) are optional: absent or null means the GPU
does not report it (NVML's NOT_SUPPORTED), never 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
from typing import Any, List, Optional, Tuple

from gpu_mon.api.model import Gpu, GpuProcess, GpuReading

MAX_SIM_BYTES = 1 << 20
# GPU-/MIG- and then printable ASCII without blanks or commas: a comma or blank would split
# CUDA_VISIBLE_DEVICES, a control character would garble the log. ("GPU-5a1c..." as in DESIGN.md is fine.)
_UUID_RE = re.compile(r"^(GPU|MIG)-[!-+\--~]+$")


_GPU_KEYS = frozenset(("uuid", "name", "memory_total_mib", "memory_used_mib", "utilization_pct", "device"))
_GPU_KEYS |= {"processes", "error", "energy_mj", "power_mw"}


class SimError(Exception):
    """The sim file is unusable; str() is one line naming the file and the field."""


def _int(value: Any, where: str, minimum: int = 0) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < minimum:
        raise SimError(f"{where}: expected a number >= {minimum}, got {json.dumps(value)}")
    if value > 1 << 53:
        raise SimError(f"{where}: number too large")
    return int(value)


def _unsampled(gpu: Gpu) -> Gpu:
    """The GPU with every process's utilization unknown."""
    if not gpu.processes:
        return gpu
    procs = tuple(dataclasses.replace(p, utilization_pct=None) for p in gpu.processes)
    return dataclasses.replace(gpu, processes=procs)


def _read_regular(path: str, limit: int) -> bytes:
    """Read up to `limit` bytes of a regular file; a FIFO or a device is refused, never waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise SimError(f"{path}: {err.strerror or err}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SimError(f"{path}: not a regular file")
        chunks, size = [], 0
        while size < limit:
            chunk = os.read(fd, limit - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    except OSError as err:
        raise SimError(f"{path}: {err.strerror or err}") from None
    finally:
        os.close(fd)


class SimBackend:
    """Reads GPUs from a JSON file each look; same interface as NvmlBackend."""

    def __init__(self, path: str, create_devices: bool = True):
        self.path = os.path.abspath(path)
        # Only the daemon makes missing stand-in files: `check` and `status` only look, and must not write
        # into the sim file's directory (a read-only or packaged one, say).
        self.create_devices = create_devices
        self._base = os.path.dirname(self.path)

    def load(self) -> Tuple[Gpu, ...]:
        """Parse the file; raise SimError with a one-line reason."""
        data = _read_regular(self.path, MAX_SIM_BYTES + 1)
        if len(data) > MAX_SIM_BYTES:
            raise SimError(f"{self.path}: too large (at most {MAX_SIM_BYTES} bytes)")
        try:
            doc = json.loads(data.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise SimError(f"{self.path}: not UTF-8 text (bad byte at offset {err.start})") from None
        except ValueError as err:
            raise SimError(f"{self.path}: not valid JSON: {err}") from None
        except RecursionError:
            raise SimError(f"{self.path}: not valid JSON: nested too deeply") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("gpus"), list):
            raise SimError(f'{self.path}: expected an object with a "gpus" list')
        unknown = set(doc) - {"gpus"}
        if unknown:
            raise SimError(f"{self.path}: unknown top-level key {sorted(unknown)[0]!r}")
        gpus = tuple(self._gpu(i, g) for i, g in enumerate(doc["gpus"]))
        seen: List[str] = []
        for gpu in gpus:
            if gpu.uuid in seen:
                raise SimError(f"{self.path}: gpus[{gpu.index}].uuid: {gpu.uuid!r} is used twice")
            seen.append(str(gpu.uuid))
        return gpus

    def _gpu(self, index: int, g: Any) -> Gpu:
        where = f"{self.path}: gpus[{index}]"
        if not isinstance(g, dict):
            raise SimError(f"{where}: expected an object")
        unknown = set(g) - _GPU_KEYS
        if unknown:
            raise SimError(f"{where}: unknown key {sorted(unknown)[0]!r}")
        uuid = g.get("uuid")
        if not isinstance(uuid, str) or not _UUID_RE.match(uuid):
            raise SimError(f'{where}.uuid: expected a string like "GPU-5a1c..."')
        name = g.get("name", "Simulated GPU")
        if name is not None and not isinstance(name, str):
            raise SimError(f"{where}.name: expected a string")
        device = g.get("device", f"dev/nvidia{index}")
        if not isinstance(device, str) or not device:
            raise SimError(f"{where}.device: expected a path")
        device = os.path.normpath(os.path.join(self._base, device))
        error = g.get("error")
        if error is not None and not isinstance(error, str):
            raise SimError(f"{where}.error: expected a string")
        errors: List[str] = [] if name is not None else ["name: unreadable (simulated)"]
        total = _int(g.get("memory_total_mib", 81559), f"{where}.memory_total_mib")
        used = _int(g.get("memory_used_mib", 0), f"{where}.memory_used_mib")
        util = _int(g.get("utilization_pct", 0), f"{where}.utilization_pct")
        if util is not None and util > 100:
            raise SimError(f"{where}.utilization_pct: at most 100")
        for key, value in (("memory", used), ("memory", total), ("utilization", util)):
            if value is None and f"{key}: unreadable (simulated)" not in errors:
                errors.append(f"{key}: unreadable (simulated)")
        energy = _int(g.get("energy_mj"), f"{where}.energy_mj")
        power = _int(g.get("power_mw"), f"{where}.power_mw")
        procs = self._processes(g.get("processes", []), where)
        if procs is None:
            errors.append("compute processes: unreadable (simulated)")
        if error:  # the whole GPU unreadable, as NVML_ERROR_GPU_IS_LOST would make it
            total = used = util = procs = energy = power = None
            errors = [f"gpu: {error}"]
        return Gpu(
            index=index,
            uuid=uuid,
            name=name,
            minor=index,
            device=device,
            memory_total_mib=total,
            memory_used_mib=used,
            utilization_pct=util,
            processes=procs,
            errors=tuple(errors),
            energy_mj=energy,
            power_mw=power,
        )

    def _processes(self, procs: Any, where: str) -> Optional[Tuple[GpuProcess, ...]]:
        if procs is None:
            return None
        if not isinstance(procs, list):
            raise SimError(f"{where}.processes: expected a list")
        out = []
        for j, p in enumerate(procs):
            pw = f"{where}.processes[{j}]"
            if not isinstance(p, dict) or set(p) - {"pid", "used_memory_mib", "utilization_pct"}:
                raise SimError(f'{pw}: expected {{"pid": N, "used_memory_mib": M, "utilization_pct": U}}')
            pid = _int(p.get("pid"), f"{pw}.pid", minimum=1)
            if pid is None:
                raise SimError(f"{pw}.pid: missing")
            util = _int(p.get("utilization_pct"), f"{pw}.utilization_pct")
            if util is not None and util > 100:
                raise SimError(f"{pw}.utilization_pct: at most 100")
            used = _int(p.get("used_memory_mib"), f"{pw}.used_memory_mib")
            out.append(GpuProcess(pid=pid, used_memory_mib=used, utilization_pct=util))
        return tuple(out)

    def _ensure_devices(self, gpus: Tuple[Gpu, ...]) -> None:
        for gpu in gpus:
            if gpu.device and not os.path.lexists(gpu.device):
                try:
                    os.makedirs(os.path.dirname(gpu.device), exist_ok=True)
                    os.close(os.open(gpu.device, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
                except OSError as err:
                    raise SimError(
                        f"{gpu.device}: cannot create the simulated device: {err.strerror or err}"
                    ) from None

    def read(self, process_utilization: bool = True) -> GpuReading:
        """One look at the simulated GPUs; never raises. Without `process_utilization`, every process's
        utilization is unknown (None), as NvmlBackend leaves it when it does not ask for the samples."""
        try:
            gpus = self.load()
            if self.create_devices:
                self._ensure_devices(gpus)
        except SimError as err:
            return GpuReading(gpus=(), error=str(err))
        if process_utilization:
            gpus = tuple(self.sample_processes(g) for g in gpus)
        else:
            gpus = tuple(_unsampled(g) for g in gpus)
        return GpuReading(gpus=gpus)

    def sample_processes(self, gpu: Gpu) -> Gpu:
        """The per-process utilization samples, as the file gives them (NvmlBackend's costly call; a
        test's stand-in counts it)."""
        return gpu

    def close(self) -> None:
        """Nothing to release."""
