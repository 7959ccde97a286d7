"""SIGHUP: the config is read and checked in a worker thread, so that a huge or slow file (or a user database
behind NSS) never holds up the loop; the loop applies the result when the thread is done."""

from __future__ import annotations

import concurrent.futures
from typing import Callable, Optional

from gpu_mon import config as config_mod
from gpu_mon.config import Config


class Reloader:
    """At most one load at a time; a SIGHUP during a load asks for another one after it."""

    def __init__(self, wake: Callable[[], None]):
        self._wake = wake
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._future: Optional[concurrent.futures.Future] = None
        self._again = False

    def start(self, path: str, trusted_uid: Optional[int]) -> bool:
        """Begin loading `path`; False if a load is under way (it is then repeated once done)."""
        if self._future is not None:
            self._again = True
            return False
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gpu-mon-reload")
        self._future = self._pool.submit(config_mod.load, path, trusted_uid)
        self._future.add_done_callback(lambda _f: self._wake())
        return True

    def result(self) -> Optional[Config]:
        """The loaded config once the load is done (ConfigError if it is bad), else None."""
        if self._future is None or not self._future.done():
            return None
        future, self._future = self._future, None
        return future.result()

    def take_again(self) -> bool:
        """Whether another SIGHUP came during the load (and forget it)."""
        again, self._again = self._again, False
        return again

    def close(self) -> None:
        """Wait for a load under way, then stop the thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
