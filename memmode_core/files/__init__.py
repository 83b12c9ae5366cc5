"""Offloaded groups as files: what the ``disk`` and ``mmap`` storages share, and the checkpoints a load maps.

One group file, one safetensors file per group:

- :mod:`.file_layout` — where each tensor of a group lies in its file and the exact header
  (:class:`~.file_layout.FileLayout`), laid out so that a mapping can be viewed as typed tensors;
- :mod:`.readwrite` — a group's bytes written straight from the tensors' memory, and read back;
- :mod:`.naming` — the file's name, a digest of its content (BLAKE3, hashed in pieces or along the write),
  and the byte-for-byte comparison that verifies a file before it is reused;
- :mod:`.mapping` — files mapped privately (copy-on-write) or read-only, large ones in windows;
- :mod:`.pages` — whether a kept private mapping holds pages the process wrote, and dropping them;
- :mod:`.groupfile` — one stored group's file: where it is, its layout, the stamp it was last known right by.

The files of a session, in a folder:

- :mod:`.store` — :class:`~.store.GroupFileStore`: named by content, written atomically, verified on reuse,
  room and writability checked (``reserve``) before anything is released;
- :mod:`.writers` — the writer threads that write groups in the background, and the groups in flight until
  they are named;
- :mod:`.folder` — the offload folder: private or given, locked while files are written, leases so
  that processes sharing it never delete what another one reads, cleanup at close and at exit;
- :mod:`.pools` — the lazily started thread pools that write and hash;
- :mod:`.file_options` — the storages' options (``keep_files``, ``verify``) and the check of ``offload_dir``;
- :mod:`.sessions` — the storage and session base classes the ``disk`` and ``mmap`` plugins subclass.

Checkpoints and loads:

- :mod:`.checkpoint` — safetensors checkpoints read header first, tensors as views of private mappings;
- :mod:`.streamed` — converted weights written to a file piece by piece, then mapped;
- :mod:`.borrowed` — groups stored by reference in the pages a load lends, nothing written.

Ranks of ``torch.distributed`` on one machine:

- :mod:`.node` — which ranks share this machine, and the folder they share (learnt from ``torch.distributed``'s
  store), and the machine's shared memory (``/dev/shm``);
- :mod:`.made_once` — files the ranks make once between them, named before they exist by how they are made
  (packed layers: one rank packs, the others map its file).
"""

from memmode_core.files.borrowed import lending, source_of_mapping
from memmode_core.files.checkpoint import Checkpoint
from memmode_core.files.made_once import MadeOnce
from memmode_core.files.node import ranks_share_a_machine
from memmode_core.files.streamed import check_room, file_size, give_back_freed_memory, staging_folder, write_pieces

#: what the layers above use of the files (the packing stage, ``load``): everything else here is the storages'
__all__ = [
    "Checkpoint",
    "MadeOnce",
    "check_room",
    "file_size",
    "give_back_freed_memory",
    "lending",
    "ranks_share_a_machine",
    "source_of_mapping",
    "staging_folder",
    "write_pieces",
]
