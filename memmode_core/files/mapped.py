"""Which file a weight's bytes are mapped from: this process's file mappings, as ``/proc/self/maps`` lists them.

After ``from_pretrained`` a model's weights are views of its safetensors files, mapped privately. When such a
group is written to a group file, copying its bytes from that file by the kernel (``copy_file_range``) is
cheaper than writing them from the mapping (:func:`~memmode_core.files.format.write`). ``load`` knows the
files it mapped (:func:`~memmode_core.files.borrowed.lent_ranges`); after any other loader, the mapping table
says which file, at which offset, lies under an address.

A tensor is copied from its file only where the file still holds its exact bytes: its pages are not the
process's own (a copy-on-write copy of a page something wrote), and the file is the one that was mapped (the
same device and inode as the mapping, checked at open; the same size and modification time before and after
the copy, :meth:`~memmode_core.files.store.GroupFileStore._write_temporary`). The table is read at each call,
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
    table = _file_mappings()
    if not table:
        return {}
    starts = [entry[0] for entry in table]
    places = {}
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if tensor.device.type != "cpu" or size == 0 or not tensor.is_contiguous():
            continue
        address = tensor.data_ptr()
        index = bisect.bisect_right(starts, address) - 1
        if index < 0:
            continue
        start, end, offset, identity, path = table[index]
        if address + size <= end and not holds_own_pages(page_range(tensor)):
            places[name] = (path, offset + address - start, identity)
    return places


def _file_mappings() -> list[tuple[int, int, int, tuple[int, int], Path]]:
    """``(start, end, file offset, (device, inode), path)`` of each mapping of a file, by address."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:  # not Linux, or /proc not mounted
        return []
    table = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith("/") or fields[5].endswith(" (deleted)"):
            continue
        span, _, offset, device, inode, path = fields
        if inode == "0":
            continue
        start, end = (int(x, 16) for x in span.split("-"))
        major, minor = (int(x, 16) for x in device.split(":"))
        table.append((start, end, int(offset, 16), (os.makedev(major, minor), int(inode)), Path(path)))
    table.sort()
    return table
