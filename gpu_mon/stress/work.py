"""The compute workload: preallocated buffers and one step's kernels (torch is passed in, not imported)."""

from __future__ import annotations

from typing import Any, Optional

# Verify tolerance relative to the largest |reference| value: two units in the last place of the result type
# (bf16 keeps 8 significant bits, fp16 11). fp32/tf32 results can differ only by summation order, if at all.
REL_TOLERANCE = {"bf16": 2.0**-6, "fp16": 2.0**-9, "tf32": 2.0**-12, "fp32": 2.0**-14}


class Fault(Exception):
    """A verify window whose results differ from the reference by more than the tolerance."""


class Work:
    """Preallocated buffers and one step of a compute workload; a step allocates nothing."""

    def __init__(self, torch: Any, device: Any, kind: str, dtype: str, size: int) -> None:
        self.torch, self.kind, self.dtype, self.size = torch, kind, dtype, size
        self.scalar = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
        gen = torch.Generator(device=device).manual_seed(1234)
        self.a = torch.randn((size, size), generator=gen, device=device, dtype=self.scalar)
        self.b = torch.randn((size, size), generator=gen, device=device, dtype=self.scalar)
        if kind == "matmul":  # entries of a@b come out ~N(0, 1): no overflow in fp16
            self.a.mul_(size**-0.25)
            self.b.mul_(size**-0.25)
        self.out = torch.empty_like(self.a)
        self.flops = 2.0 * size**3 if kind == "matmul" else 2.0 * size**2
        self.bytes_moved = 3.0 * size * size * self.a.element_size()
        self.ref: Any = None

    @staticmethod
    def workspace_bytes(kind: str, dtype: str, size: int, verify: bool) -> int:
        """Bytes of the buffers a workload of this kind, type and size allocates."""
        element = 2 if dtype in ("bf16", "fp16") else 4
        return (3 + verify) * size * size * element + (4 * size * element if verify else 0)

    def nbytes(self) -> int:
        """Bytes held by this workload's own tensors."""
        tensors = [self.a, self.b, self.out] + (
            [self.ref, self.rows, self.acc] if self.ref is not None else []
        )
        return sum(t.numel() * t.element_size() for t in tensors)

    def step(self) -> None:
        """One unit of work into the preallocated output."""
        if self.kind == "matmul":
            self.torch.mm(self.a, self.b, out=self.out)
        else:
            self.torch.addcmul(self.a, self.a, self.b, out=self.out)

    def enable_verify(self) -> None:
        """Keep the current output as the reference and set up the error buffers (setup time, allocates)."""
        torch, n = self.torch, self.size
        self.step()
        self.ref = self.out.clone()
        scale = float(self.ref.abs().max())
        self.tolerance = REL_TOLERANCE[self.dtype] * max(scale, 1e-3)
        self.fault = 4.0 * max(scale, 1.0)
        self.rows = torch.empty((2, n), device=self.out.device, dtype=self.scalar)  # per row: -min, max
        self.acc = torch.zeros((2, n), device=self.out.device, dtype=self.scalar)
        pin = self.out.device.type == "cuda"
        self.host = [torch.zeros((2, n), dtype=self.scalar, pin_memory=pin) for _ in range(2)]

    def accumulate_error(self) -> None:
        """Fold max|out - ref| per row into the window's error buffer (NaN propagates).

        Two kernels over the output (subtract; min and max in one reduction) move 4 n*n elements, where
        sub/abs/amax would move 6: on an H100 (bf16, n=8192) --verify runs ~12% below the rate without.
        """
        self.out.sub_(self.ref)
        self.torch.aminmax(self.out, dim=1, out=(self.rows[0], self.rows[1]))
        self.rows[0].neg_()
        self.torch.maximum(self.acc, self.rows, out=self.acc)

    def flush_error(self, slot: int) -> None:
        """Queue the window's error buffer to host buffer `slot` and reset it."""
        self.host[slot].copy_(self.acc, non_blocking=True)
        self.acc.zero_()

    def window_error(self, slot: int) -> float:
        """The largest error of a finished window (read after its event completed)."""
        return float(self.host[slot].max())

    def corrupt(self, amount: Optional[float] = None) -> None:
        """Add a wrong value to one element of the output, as a silent hardware error would."""
        self.out.view(-1)[0].add_(self.fault if amount is None else amount)
