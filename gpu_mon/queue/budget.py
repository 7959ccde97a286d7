"""Bytes the queue's server holds for its clients, counted per user and in all, against two limits: what
one user's connections can make the root daemon hold, and what all of them together can.

The server keeps two: the request bytes it has received of frames not yet complete, and the answer bytes
it has made and not yet handed to the kernel.
"""

from __future__ import annotations

from typing import Dict, Optional


class Budget:
    """Bytes held, per uid and in all; `per_user` and `total` are the limits (checked by the caller)."""

    def __init__(self, per_user: int, total: int):
        self.per_user, self.total = per_user, total
        self.held: Dict[int, int] = {}
        self.sum = 0

    def take(self, uid: int, n: int) -> None:
        """Count n more bytes for uid."""
        self.held[uid] = self.held.get(uid, 0) + n
        self.sum += n

    def give(self, uid: int, n: int) -> None:
        """Count n bytes less for uid."""
        left = self.held.get(uid, 0) - n
        if left > 0:
            self.held[uid] = left
        else:
            self.held.pop(uid, None)
        self.sum -= n

    def of(self, uid: int) -> int:
        """Bytes held for uid."""
        return self.held.get(uid, 0)

    def fits(self, uid: int, n: int) -> bool:
        """Whether n more bytes for uid stay within both limits."""
        return self.of(uid) + n <= self.per_user and self.sum + n <= self.total

    def biggest(self) -> Optional[int]:
        """The uid holding the most (None: nobody holds anything)."""
        return max(self.held, key=lambda u: self.held[u]) if self.held else None
