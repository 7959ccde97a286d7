"""The stressor's only contact with torch: imported here, lazily, so every other command works without it."""

from __future__ import annotations

import os
import warnings
from typing import Any, Tuple

from gpu_mon.stress.plan import UsageError


def import_torch() -> Any:
    """torch, imported now (not at module load) so that gpu-mon works without it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Failed to initialize NumPy" on installs without numpy
            import torch
    except ImportError as exc:
        raise UsageError(
            f"cannot import torch ({exc}); the stressor needs the stress extra: "
            "pip install 'gpu-mon[stress]' (with the torch build that matches your CUDA driver)"
        ) from None
    return torch


def open_device(torch: Any, spec: str) -> Any:
    """The torch.device for 'cpu' or 'cuda:N', made current; UsageError when it is not visible."""
    if spec == "cpu":
        return torch.device("cpu")
    index = int(spec.split(":")[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a broken driver warns once; our line below says it all
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        why = (
            f"this torch {torch.__version__} has no CUDA support"
            if torch.version.cuda is None
            else "none found"
        )
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        raise UsageError(f"--device {spec}: no CUDA device visible ({why}; CUDA_VISIBLE_DEVICES={visible})")
    if index >= count:
        raise UsageError(f"--device {spec}: only {count} CUDA device(s) visible (cuda:0..cuda:{count - 1})")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def is_oom(exc: BaseException) -> bool:
    """Whether an allocation or launch failed for lack of memory (CUDA or CPU allocator)."""
    return (
        isinstance(exc, MemoryError)
        or type(exc).__name__ == "OutOfMemoryError"
        or (
            isinstance(exc, RuntimeError)
            and ("out of memory" in str(exc) or "can't allocate memory" in str(exc))
        )
    )


def identity(torch: Any, device: Any) -> Tuple[str, str]:
    """(name, UUID) of a CUDA device; ('', '') on cpu."""
    if device.type != "cuda":
        return "", ""
    props = torch.cuda.get_device_properties(device)
    uuid = str(getattr(props, "uuid", ""))
    return props.name, (uuid if not uuid or uuid.startswith("GPU-") else f"GPU-{uuid}")


def cpu_available() -> int:
    """Bytes of memory the kernel reports available (psutil)."""
    import psutil

    return int(psutil.virtual_memory().available)
