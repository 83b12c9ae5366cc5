"""The pages of a kept private file mapping: whether the process wrote any, and dropping them.

The ``disk`` storage keeps a group file's private mapping from one onload to the next on a CPU
(:meth:`~memmode_core.files.groupfile.GroupFile.onload_views`): mapping anew and faulting the pages in at every
onload cost more than a small layer's forward. The pages it only read are the page cache's, shared with every
reader and reclaimed by the kernel like any other; what must not outlive the onload is a page the process
wrote, a copy-on-write copy of its own. :func:`holds_own_pages` finds any with one read of
``/proc/self/pagemap`` (Linux), and :func:`drop_pages` empties the mapping (``MADV_DONTNEED``) so that the next
access reads the file again, as a fresh mapping would. Where ``/proc/self/pagemap`` cannot be read, every
mapping is taken to hold pages of its own.
"""

from __future__ import annotations

import mmap
import os

import torch

#: ``madvise`` advice that empties a range of a private file mapping: it reads the file again when touched
DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
#: the top byte of a ``/proc/<pid>/pagemap`` entry -> 1 where the page is the process's own memory: present
#: (bit 63) and not a file page (bit 61), or swapped (bit 62); in a private file mapping, a copy-on-write copy
_OWN_PAGE = bytes(int(b & 0x40 != 0 or b & 0xA0 == 0x80) for b in range(256))
_PAGE = mmap.PAGESIZE


class _Pagemap:
    """This process's ``/proc/self/pagemap``, opened on first use (a forked child opens its own: the
    parent's file describes the parent's pages)."""

    fd: int | None = None

    @classmethod
    def open(cls) -> int | None:
        if cls.fd is None:
            try:
                cls.fd = os.open("/proc/self/pagemap", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError:  # not Linux, or /proc not mounted
                return None
        return cls.fd

    @classmethod
    def forget(cls) -> None:
        if cls.fd is not None:
            os.close(cls.fd)
        cls.fd = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_Pagemap.forget)


def page_range(tensor: torch.Tensor) -> tuple[int, int]:
    """Where the ``/proc/self/pagemap`` entries of the pages under ``tensor``'s bytes are: ``(offset, length)``
    in bytes, for :func:`holds_own_pages`."""
    start = tensor.data_ptr()
    first = start // _PAGE
    return first * 8, (-(-(start + tensor.numel() * tensor.element_size()) // _PAGE) - first) * 8


def holds_own_pages(entries_at: tuple[int, int]) -> bool:
    """Whether any of the pages whose entries are at ``entries_at`` (:func:`page_range` of a view of a private
    file mapping) is the process's own memory: a copy-on-write copy of a page it wrote. Pages it only read
    are the page cache's: those are not. One ``pread`` of ``/proc/self/pagemap`` (8 bytes per page); True
    where that cannot be read. Runs at every offload of a ``disk`` group on a CPU: kept to one call."""
    fd = _Pagemap.fd if _Pagemap.fd is not None else _Pagemap.open()
    if fd is None:
        return True
    offset, length = entries_at
    try:
        entries = os.pread(fd, length, offset)
    except OSError:
        return True
    return len(entries) != length or b"\x01" in entries[7::8].translate(_OWN_PAGE)


def drop_pages(mapping: mmap.mmap) -> bool:
    """Take every page of a private file mapping out of the process (``MADV_DONTNEED``): pages it only read
    go back to being the page cache's alone, pages it wrote (copy-on-write copies) are discarded, and the
    next access reads the file again, exactly as a fresh mapping would. False where the system cannot."""
    if DONTNEED is None:
        return False
    try:
        mapping.madvise(DONTNEED)
    except (OSError, ValueError):
        return False
    return True
