"""Group files written in the background: writer threads, and the groups in flight until they are named.

In a folder that held no group file when reserved, :meth:`GroupFileStore.store
<memmode_core.files.store.GroupFileStore.store>` hands each group to a writer thread, which writes it to a
temporary file, and returns while the engine goes on; the group is put under its content name later, oldest
first (:meth:`GroupFileStore.flush <memmode_core.files.store.GroupFileStore.flush>`, or when more than
:data:`WRITES_AHEAD` groups are in flight). There, the name is only needed to find a file to reuse, and there
is none to find: so the name is computed along the write, each step hashed by the writer just before it is
written (:meth:`~memmode_core.files.naming.ContentNamer.write`). The engine stores a component group by group
and releases nothing until every group is stored, so writing a group while the next is prepared and written
holds no memory the model does not hold anyway.

Why two writers (:data:`WRITES_AHEAD`): two groups written at once, to two files, measured 0.53-0.55 s for the
22 blocks of a 1.9 GiB bf16 checkpoint against 0.63-1.23 s one after the other (five alternated rounds, copied
by the kernel and hashed behind, as memmode wrote them then; three or four writers did no better on 2 cores).

A temporary file is locked by its writer until the group is named or dropped (see
:meth:`~memmode_core.files.folder.OffloadFolder.temporary_file`), so a peer's sweep of orphans leaves it.
This module keeps the groups in flight, in order, and drops them all (waiting for their threads, deleting
their temporary files) when one fails or the store closes; naming a group, with the guarantees of a file
written in the foreground, is the store's.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

from memmode_core.contracts.storage import Tensors
from memmode_core.files.groupfile import FileStamp, GroupFile
from memmode_core.files.naming import ContentNamer
from memmode_core.files.pools import LazyPool

#: groups written to their files at once while the engine goes on (:meth:`GroupFileStore.store
#: <memmode_core.files.store.GroupFileStore.store>` with ``wait=False``): two writers keep both cores of the
#: project's machine busy writing and hashing
WRITES_AHEAD = 2
_WRITERS = LazyPool("memmode-write", lambda cores: WRITES_AHEAD)


@dataclass(eq=False)
class Unnamed:
    """A group being written to a temporary file in the background, not yet under its content name."""

    group_file: GroupFile
    #: the tensors the writer and the hash read, held until the group is named
    host: Tensors | None
    #: the temporary file (None once renamed to its name or deleted), and its descriptor, which holds the
    #: file's lock (see :meth:`~memmode_core.files.folder.OffloadFolder.temporary_file`)
    temporary: str | None
    fd: int | None
    namer: ContentNamer
    #: the writer's future: the file's stamp once every byte is in, or its failure
    written: Future | None = None

    def finish(self) -> FileStamp:
        """The file's stamp once written; raises the write's failure. Returns, or raises, only once no thread
        reads the tensors any more."""
        try:
            return self.written.result()
        finally:
            self.namer.wait()

    def drop(self) -> None:
        """Wait for the threads, delete the temporary file if it is still there, release its lock."""
        if self.written is not None:
            with contextlib.suppress(BaseException):
                self.finish()
        if self.temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.temporary)
            self.temporary = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.host = None


#: puts a written group under its content name (the store's): waits for its write, renames its file or
#: reuses an equal one, and drops it
Namer = Callable[[Unnamed], None]


class InFlight:
    """The groups written in the background, oldest first, not yet under their names.

    The store names them through the ``name`` it passes (not kept here: the store holds this queue, and a
    queue holding the store would keep a store its owner dropped alive until a garbage collection)."""

    def __init__(self) -> None:
        self._unnamed: deque[Unnamed] = deque()

    def __iter__(self) -> Iterator[Unnamed]:
        return iter(self._unnamed)

    def start(self, unnamed: Unnamed, write: Callable[..., FileStamp], *args) -> None:
        """``write(*args)`` on a writer thread, its outcome in ``unnamed.written``; ``unnamed`` joins the queue."""
        unnamed.written = _WRITERS.submit(write, *args)
        self._unnamed.append(unnamed)

    def make_way(self, name: Namer) -> None:
        """Name the oldest groups until fewer than :data:`WRITES_AHEAD` are in flight."""
        while len(self._unnamed) >= WRITES_AHEAD:
            self._name_oldest(name)

    def flush(self, name: Namer) -> None:
        """Name every group in flight, in order. On a failure the groups still in flight are dropped, and the
        failure raised."""
        while self._unnamed:
            self._name_oldest(name)

    def _name_oldest(self, name: Namer) -> None:
        unnamed = self._unnamed.popleft()
        try:
            name(unnamed)
        except BaseException:
            self.drop()
            raise

    def drop(self) -> None:
        """Drop every group in flight (:meth:`Unnamed.drop`: waits for its threads, deletes its temporary file)."""
        while self._unnamed:
            self._unnamed.popleft().drop()
