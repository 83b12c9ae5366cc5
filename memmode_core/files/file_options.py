"""The options of the storages that keep groups in group files (``disk``, ``mmap``), and the check of their folder.

``keep_files`` and ``verify`` are typed options (:mod:`memmode_core.contracts.options`) that both storages
take (see docs/storages.md). An ``offload_dir`` that can never be a folder
(no path, an empty one, a NUL character, an existing file) is refused by :func:`check_offload_dir` when the
storage opens, before anything is created or touched; one that cannot be created or written is refused by
:meth:`GroupFileStore.reserve <memmode_core.files.store.GroupFileStore.reserve>`, before any weight is
released.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from memmode_core.contracts.errors import InvalidOptionError, StorageUnavailableError
from memmode_core.contracts.options import Options, boolean, one_of, option

#: how much a group file is checked before each onload and before remove() reads it back
VERIFY_LEVELS = ("size", "hash", "none")


@dataclass(frozen=True)
class GroupFileOptions(Options):
    """The options of the storages that write group files (``disk``, ``mmap``)."""

    keep_files: bool = option(
        False,
        "leave the group files this session wrote in offload_dir after remove() and at exit, so that the next "
        "apply of the same weights reuses them instead of writing (needs offload_dir)",
        boolean,
    )
    verify: str = option(
        "size",
        "check each group file before it is read back: 'size' (one stat: size, identity and modification time; a "
        "changed file is then hashed, so a truncated, replaced or edited file is an error), 'hash' (also the "
        "content digest at every onload, ~0.1 s per GB read on 2 cores), 'none'",
        one_of(*VERIFY_LEVELS),
    )


def check_offload_dir(offload_dir) -> None:
    """Refuse an ``offload_dir`` that cannot be a folder, before anything is created or touched."""
    try:
        path = os.fsdecode(offload_dir)
    except TypeError:
        raise InvalidOptionError(f"offload_dir={offload_dir!r} is not a path") from None
    if not path.strip():
        raise InvalidOptionError(
            "offload_dir='' names no folder (it would write into the current directory); give a folder, or leave "
            "it out for a private temporary one"
        )
    if "\0" in path:
        raise InvalidOptionError(f"offload_dir={path!r} contains a NUL character, which no path may hold")
    if os.path.exists(path) and not os.path.isdir(path):
        raise StorageUnavailableError(
            f"offload_dir={path!r} is a file, not a folder; give a folder for the group files"
        )
