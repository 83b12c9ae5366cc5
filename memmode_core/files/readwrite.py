"""A group file's bytes written from the tensors' memory, and read back into fresh memory.

Writing goes straight from the tensors' memory (:func:`~memmode_core.files.file_layout.byte_view`), in steps of
:data:`WRITE_STEP` bytes, each hashed for the file's content name just before it is written when the name
is computed along the write (:class:`~memmode_core.files.naming.ContentNamer`): ``safetensors``'
``save_file`` would first copy every tensor into a ``bytes`` object, one extra group in RAM. Where and
under which name a file is written is :mod:`memmode_core.files.store`'s business; the layout of the bytes
is :mod:`memmode_core.files.file_layout`'s.

Reading is the other way of getting the tensors back besides a private mapping
(:mod:`memmode_core.files.mapping`): into fresh memory, or chunk by chunk into staging buffers. A file
found shorter than its layout is an error, never zeros.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from memmode_core.contracts.packing import views
from memmode_core.contracts.storage import Tensors
from memmode_core.files.file_layout import FileLayout, byte_view

if TYPE_CHECKING:
    from memmode_core.files.naming import ContentNamer

#: Group files are written in steps of this many bytes. Where the name is computed along the write, each step is
#: hashed just before it is written, by the writing thread: the bytes are in the core's cache when the write
#: copies them. On the project's 2-core machine (ext4, Linux 6.18), two threads writing 2 GB from a buffer took
#: 0.18-0.20 s in steps of 128-256 KiB and 0.19-1.7 s in steps of 1-4 MiB: large writes vary with the kernel's
#: state (diffusers' ``save_file``, which writes each group at once, took 1.0-3.7 s for the same model within
#: one day). The 22 blocks of a 1.9 GiB bf16 checkpoint, written and hashed by two threads (six alternated
#: rounds): 0.42-0.47 s in steps of 128 KiB hashed as written, 0.43-0.56 s in steps of 256 KiB, 0.53-0.62 s
#: copied by the kernel (``copy_file_range``) and hashed behind by a pool.
WRITE_STEP = 128 << 10


def write(file, layout: FileLayout, tensors: Tensors, namer: ContentNamer | None = None) -> None:
    """Write the group to an open binary file, in steps of at most :data:`WRITE_STEP` bytes (buffered writes
    loop until every byte is written); with ``namer``, each step hashed as it is written
    (:meth:`~memmode_core.files.naming.ContentNamer.write`)."""
    file.write(layout.header)
    end = 0
    for entry in layout.entries:
        if entry.start > end:
            file.write(bytes(entry.start - end))  # alignment padding: zeros
        data = byte_view(tensors[entry.name])
        if namer is not None:
            namer.write(file, data, WRITE_STEP)
        else:
            for at in range(0, len(data), WRITE_STEP):
                file.write(data[at : at + WRITE_STEP])
        end = entry.end


def read(path: str | os.PathLike, layout: FileLayout) -> Tensors:
    """The group read into fresh memory (one allocation, one pass over the file)."""
    buffer = torch.empty(layout.data_bytes, dtype=torch.uint8)
    with open(path, "rb", buffering=0) as file:
        read_into(file.fileno(), byte_view(buffer), layout.data_start)
    return views(buffer, layout.entries)


def read_into(fd: int, target: memoryview, offset: int) -> None:
    """Fill ``target`` from the file at ``offset``; a short file is an error, never zeros."""
    done = 0
    while done < len(target):
        got = os.preadv(fd, [target[done:]], offset + done)
        if got == 0:
            raise OSError(f"group file ended {len(target) - done} bytes early (truncated while in use?)")
        done += got
