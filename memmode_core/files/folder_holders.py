"""Which thread of this process holds which offload folder's lock, and the cleanups waiting for it to let go.

``flock`` locks taken through two descriptors of one folder conflict even within one process, and a session's
cleanup runs from a ``weakref.finalize`` — wherever the garbage collector runs, which may be inside another
session's critical section on the same folder, in the same thread. Taking the lock there waits forever on
ourselves (two ranks of one machine hung so: the last mapping of one packed file died while the next was being
packed). So :meth:`~memmode_core.files.folder.OffloadFolder.locked` says here who holds a folder, and a cleanup
that finds its own thread holding it is handed back when the outermost hold ends, to run after the unlock.
Another thread's cleanup waits for the lock as another process would.

The collector can run anywhere, this module's own bookkeeping included, so by construction:

- a thread says it holds a folder *before* it takes the ``flock`` (and takes it back if that fails): a cleanup the
  collector runs in between is deferred, never left to wait on a lock its own thread is about to hold;
- the bookkeeping is guarded by a re-entrant lock and allocates nothing while it holds it (a hold is made before):
  a cleanup the collector starts inside it re-enters it instead of waiting on its own thread.

A folder is known by its device and inode: two sessions of one folder hold two descriptors of it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Hold:
    thread: int
    depth: int = 0
    waiting: list[Callable[[], None]] = field(default_factory=list)


_guard = threading.RLock()
_holds: dict[tuple[int, int], _Hold] = {}


def _folder(fd: int) -> tuple[int, int]:
    stat = os.fstat(fd)
    return stat.st_dev, stat.st_ino


def enter(fd: int) -> None:
    """This thread is about to take the lock of ``fd``'s folder (or holds it already: holds nest)."""
    key = _folder(fd)
    new = _Hold(threading.get_ident())  # made outside the guard: the collector may run here, and then re-enter it
    with _guard:
        hold = _holds.setdefault(key, new)
        hold.depth += 1


def leave(fd: int) -> list[Callable[[], None]]:
    """This thread is letting go of the lock of ``fd``'s folder: the cleanups that waited for the outermost hold
    to end (to run once the lock is let go), else none."""
    key = _folder(fd)
    with _guard:
        hold = _holds[key]
        hold.depth -= 1
        if hold.depth:
            return []
        del _holds[key]
        return hold.waiting


def defer(fd: int, cleanup: Callable[[], None]) -> bool:
    """Keep ``cleanup`` until the lock is let go if this thread holds the lock of ``fd``'s folder; whether it
    did."""
    key = _folder(fd)
    with _guard:
        hold = _holds.get(key)
        if hold is None or hold.thread != threading.get_ident():
            return False
        hold.waiting.append(cleanup)
        return True
