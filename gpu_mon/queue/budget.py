"""What the queue's server gives its clients, counted per user.

Bytes it holds (Budget), per user and in all, against two limits: what one user's connections can make the
root daemon hold, and what all of them together can. The server keeps two: the request bytes it has
received of frames not yet complete, and the answer bytes it has made and not yet handed to the kernel.

Its thread's time (Share): how much of it one user's requests may take, so that one user's clients asking
again and again (issue 46: three looping `jobs --all --json` held the daemon at 92 % of a core) slow only
that user's answers.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple


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


class Share:
    """A thread's CPU time, per uid: each user may take `rate` of it (0.1: a tenth of a core) over time,
    `burst` seconds at once. What a user takes past that is owed: the user's next turn comes once it is
    paid back (`turn`). Only users who owe or have taken some of their burst are kept."""

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = rate, burst
        self.left: Dict[int, Tuple[float, float]] = {}  # uid -> (seconds left of the burst, as of when)

    def _left(self, uid: int, now: float) -> float:
        seconds, at = self.left.get(uid, (self.burst, now))
        return min(self.burst, seconds + (now - at) * self.rate)

    def spend(self, uid: int, seconds: float, now: float) -> None:
        """uid's requests took `seconds` of the thread's CPU time."""
        left = self._left(uid, now) - seconds
        if left < self.burst:
            self.left[uid] = (left, now)
        if len(self.left) > 1000:  # (forget those whose burst has come back)
            self.left = {u: v for u, v in self.left.items() if self._left(u, now) < self.burst}

    def turn(self, uid: int, now: float) -> float:
        """When uid's requests may take the thread again (now, or when what it owes is paid back)."""
        left = self._left(uid, now)
        return now if left >= 0 else now - left / self.rate
