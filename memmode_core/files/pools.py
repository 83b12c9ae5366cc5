"""The small thread pools that write and hash group files while the engine goes on.

Two jobs run beside the caller's thread when a model is stored to files: writing each group to its file
(:mod:`memmode_core.files.writers`) and hashing what was written, for the file's content name
(:mod:`memmode_core.files.naming`). Both spend their time in calls that release the GIL (``write``, BLAKE3's
``update``), so threads run them on every core. A pool is started on first use, and a
forked child starts its own: the parent's threads do not exist in it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class LazyPool:
    """A ``ThreadPoolExecutor`` of ``workers`` threads (a number, or a function of the core count), made on
    first use and forgotten in a forked child."""

    def __init__(self, name: str, workers: Callable[[int], int]) -> None:
        self.name = name
        self._workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget)

    def submit(self, fn: Callable, *args) -> Future:
        """``fn(*args)`` on the pool; run here, its outcome in the future, while the interpreter shuts down (a
        pool then takes no new work)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self._workers(os.cpu_count() or 1), thread_name_prefix=self.name
                )
            pool = self._pool
        try:
            return pool.submit(fn, *args)
        except RuntimeError:
            done: Future = Future()
            try:
                done.set_result(fn(*args))
            except Exception as exc:  # noqa: BLE001 - handed to the caller, as a pool's failure would be
                done.set_exception(exc)
            return done

    def _forget(self) -> None:
        self._pool = None
        self._lock = threading.Lock()
