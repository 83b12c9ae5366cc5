"""Files the ranks of one machine make once: the first to ask writes one, the others find it and map it.

N ranks loading one checkpoint into a quantized mode would each pack every layer — minutes of CPU for a 14B
model, N times over, on the same cores — and each keep the packed bytes: N copies. What a file holds depends
only on how it is made — which checkpoint files (as ``stat`` names them), read in which dtype, which layers,
which quantizer and version, packed where — so a digest of that, the **recipe**, names the result before it
exists, and the ranks agree on it without packing anything first:

- the ranks use one folder, given by ``torch.distributed`` (:func:`~memmode_core.files.node.shared_folder`);
- a rank holds the folder's lock (``flock``) while it looks for a recipe's file and, finding none, writes it
  under a temporary name, hashes it and renames it to ``memmode-made-<recipe>-<digest>.safetensors``; a rank
  that asks meanwhile waits for the lock, then finds the file;
- a file is used only if its bytes hash to the digest in its name (BLAKE3, seconds for a 14B model's packed
  bytes against minutes to pack them): one cut short, changed, or put in its place is said, deleted and made
  again, never read as weights;
- a rank killed mid-write leaves only its temporary file, which carries no recipe's name and which the next
  rank's sweep deletes (the kernel dropped its writer's lock), and it releases the folder's lock by dying: the
  next rank makes the file.

Leases are the offload folder's (:mod:`memmode_core.files.folder`): a rank holds its lease while it maps any
file it made or found, so no rank deletes a file another rank may still look for; the last to leave removes
the folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path

import blake3
import torch

from memmode_core.contracts.errors import StagingError
from memmode_core.files.file_layout import FileLayout
from memmode_core.files.folder import OffloadFolder
from memmode_core.files.naming import file_digest_name
from memmode_core.files.node import shared_folder
from memmode_core.files.streamed import MappedTensors, map_file

logger = logging.getLogger("memmode")

PREFIX, SUFFIX = "memmode-made-", ".safetensors"
#: an open temporary file to write, and its path
Into = tuple[int, str]


def recipe_of(*parts: object) -> str:
    """The name of what ``parts`` describe (strings, numbers, tuples of them): a digest of their ``repr``."""
    return blake3.blake3(repr(parts).encode()).hexdigest()[:32]


class MadeOnce:
    """The files this rank makes or finds in the folder the ranks of this machine share (see the module
    docstring). ``made`` and ``found`` count them."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self._folder = OffloadFolder(folder, keep_files=False, remove_when_empty=True)
        try:
            self._folder.open()
        except OSError as exc:
            raise StagingError(f"cannot use {folder} for the files the ranks of this machine share: {exc}") from None
        self.path = self._folder.path
        self.made = 0
        self.found = 0
        #: mapped windows still alive; the lease ends with the last (see :meth:`_hold`)
        self._alive = 0

    @classmethod
    def for_ranks(cls, under: str | os.PathLike | None = None) -> MadeOnce | None:
        """The ranks' shared maker, or None when this process is not one of several ranks on a machine."""
        folder = shared_folder("loading", under=under)
        return None if folder is None else cls(folder)

    def mapped(
        self, recipe: str, layout: FileLayout, make: Callable[[tuple[int, str]], MappedTensors]
    ) -> MappedTensors:
        """The file ``recipe`` names, mapped privately: found and verified, or made here by ``make(into)``, which
        writes the open temporary file ``into = (fd, path)`` laid out as ``layout`` and returns its mapping."""
        with self._folder.locked():
            self._folder.sweep_temporaries()
            path = self._verified(recipe, layout)
            if path is not None:
                mapped = map_file(path, layout)
                self.found += 1
            else:
                mapped = self._make(recipe, layout, make)
                self.made += 1
        self._hold(mapped.flats)
        return mapped

    def _verified(self, recipe: str, layout: FileLayout) -> Path | None:
        """The recipe's file if one is there whose bytes hash to its name (claimed, so no closing rank deletes it);
        one that does not is said and deleted."""
        for path in self.path.glob(f"{PREFIX}{recipe}-*{SUFFIX}"):
            digest = path.name[len(PREFIX) + len(recipe) + 1 : -len(SUFFIX)]
            self._folder.claim(path.name)
            try:
                intact = path.stat().st_size == layout.file_size and file_digest_name(path, layout) == digest
            except (OSError, ValueError):
                intact = False
            if intact:
                return path
            logger.warning(
                "memmode: %s does not hold the bytes its name promises (cut short or changed); making it again", path
            )
            with contextlib.suppress(OSError):
                path.unlink()
        return None

    def _make(self, recipe: str, layout: FileLayout, make) -> MappedTensors:
        fd, temporary = self._folder.temporary_file()
        try:
            mapped = make((fd, temporary))  # closes fd; deletes the temporary file if it fails
            self._folder.publish(temporary, f"{PREFIX}{recipe}-{file_digest_name(temporary, layout)}{SUFFIX}")
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise StagingError(f"cannot write {temporary} in {self.path}: {exc.strerror or exc}") from None
        return mapped

    def _hold(self, flats: Iterable[torch.Tensor]) -> None:
        """Keep the lease while any of these mappings lives: a rank still starting may look for the files."""
        for flat in flats:
            self._alive += 1
            weakref.finalize(flat.untyped_storage(), self._unmapped)

    def _unmapped(self) -> None:
        self._alive -= 1
        if self._alive == 0:
            self._folder.close()
