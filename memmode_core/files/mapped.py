"""Which file a weight's bytes are mapped from: this process's file mappings, as ``/proc/self/maps`` lists them.

After ``from_pretrained`` a model's weights are views of its safetensors files, mapped privately. When such a
group is written to a group file, copying its bytes from that file by the kernel (``copy_file_range``) is
cheaper than writing them from the mapping (:func:`~memmode_core.files.format.write`). The mapping table
says which file, at which offset, lies under an address: after ``load`` (its windows of a checkpoint) as after
any other loader.

A tensor is copied from its file only where the file still holds its exact bytes: its pages are not the
process's own (a copy-on-write copy of a page something wrote), and the file is the one that was mapped (the
same device and inode as the mapping, checked at open; the same size and modification time after the copy
as at open, :meth:`~memmode_core.files.store.GroupFileStore._write_temporary`). The table is read at each call,
while the caller holds the tensors (so their mappings, and the addresses, cannot go away meanwhile).
"""

from __future__ import annotations

import bisect
import os
from pathlib import Path

from memmode_core.contracts.storage import Tensors
from memmode_core.files.format import holds_own_pages, page_range

#: a group smaller than this is written from memory: reading the table costs about half a millisecond
COPY_MIN_BYTES = 4 << 20


def file_ranges(tensors: Tensors) -> dict[str, tuple[Path, int, tuple[int, int]]]:
    """``name -> (file, offset in it, (device, inode))`` for the tensors that are contiguous views of a private
    or shared mapping of a regular file, with none of their pages the process's own."""
    starts, ends, lines = _file_mappings()
    places = {}
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if tensor.device.type != "cpu" or size == 0 or not tensor.is_contiguous():
            continue
        address = tensor.data_ptr()
        index = bisect.bisect_right(starts, address) - 1
        if index < 0 or address + size > ends[index] or holds_own_pages(page_range(tensor)):
            continue
        _, _, offset, device, inode, path = lines[index].split(maxsplit=5)
        major, minor = (int(x, 16) for x in device.split(":"))
        places[name] = (Path(path), int(offset, 16) + address - starts[index], (os.makedev(major, minor), int(inode)))
    return places


def _file_mappings() -> tuple[list[int], list[int], list[str]]:
    """The start and end addresses, and the line, of each mapping of a file still linked, in address order
    (the order the kernel lists them in). Only what a lookup needs is parsed: this runs once per group
    written, and a tuple per line set off the garbage collector during ``apply``."""
    try:
        with open("/proc/self/maps") as maps:
            text = maps.read()
    except OSError:  # not Linux, or /proc not mounted
        return [], [], []
    starts, ends, lines = [], [], []
    for line in text.splitlines():
        if " /" not in line or line.endswith(" (deleted)"):
            continue
        span = line[: line.index(" ")]
        dash = span.index("-")
        starts.append(int(span[:dash], 16))
        ends.append(int(span[dash + 1 :], 16))
        lines.append(line)
    return starts, ends, lines
