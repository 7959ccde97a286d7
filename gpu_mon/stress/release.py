"""Giving the memory back on a stop, as --release asks.

free-then-exit: drop every buffer and hand the allocator's cache back to the driver before the exit line
(all but the CUDA context, which goes with the process). exit: keep everything and exit; the driver frees a
process's memory when it exits (measured alone on an H200: 112 ms to free 126 GB in 245 frees, 208 ms after
SIGKILL), so under contention with a newcomer's context creation one teardown may beat hundreds of frees;
bench/gpu_release.py measures which.
"""

from __future__ import annotations

from typing import Optional

from gpu_mon.stress.fill import Hold
from gpu_mon.stress.loop import Compute


def release(hold: Optional[Hold], compute: Optional[Compute]) -> None:
    """Drop every buffer and give device memory back to the driver (all but the CUDA context)."""
    if hold is not None:
        hold.blocks.clear()
    if compute is not None:
        compute.clear()
    if hold is None or not hold.cuda:
        return
    torch = hold.torch
    try:
        torch.cuda.synchronize(hold.device)
        # cuBLAS keeps its workspace (32 MiB on H100) until exit; this private helper, where present,
        # hands it to the cache so that empty_cache returns it too.
        getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
        torch.cuda.empty_cache()
    except Exception:  # a failed GPU: the driver frees everything when the process exits
        pass


def releases_before_exit(mode: str, reason: str) -> bool:
    """Whether this end frees memory itself: always, but on a stop signal under --release exit."""
    return mode != "exit" or reason not in ("SIGTERM", "SIGINT")
