"""The ranks of ``torch.distributed`` that share this machine, and the folder they share on it.

N ranks on one node (context parallelism, FSDP2, one pipeline per GPU) each place the same model. Files they
write in one folder are written once and mapped by all — group files are named by their content and the
folder's lock makes concurrent writers of one content write it once (:mod:`memmode_core.files.folder`) — so
their offloaded weights are one copy in the page cache instead of N. A folder each process makes for itself
would undo that: when ranks share a machine and no ``offload_dir`` is given, :func:`shared_folder` gives every
rank of the job on this machine the same one.

Which ranks share a machine is learnt from ``torch.distributed`` itself, never from a protocol of memmode's
own: the first rank of the job on this machine to ask makes the folder and publishes it in the job's
key-value store (the one its ranks met through), under a key naming the machine, with ``compare_set``; every
later rank finds it there. No rank waits for another, so a rank that applies a mode alone (a preview on rank
0) does not hang; it simply is the first. What is published is a folder that exists: it is made before it is
published, and a rank that finds it gone (the last user removed it) makes it again. A folder of an earlier job
that no live process uses any more (every rank killed) is removed by the next job's first rank to ask.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from pathlib import Path

from memmode_core.files.folder import remove_abandoned

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
#: Linux's shared-memory filesystem: a file there is memory that every process mapping it shares
_SHARED_MEMORY = Path("/dev/shm")


def ranks_share_a_machine() -> bool:
    """Whether this process is one of several ranks of an initialized ``torch.distributed`` job."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def machine_key() -> str:
    """What names this machine for the job: its host name, and its boot (a container restarted under the same
    name is not the same page cache)."""
    try:
        boot = _BOOT_ID.read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def shared_memory() -> Path | None:
    """The machine's shared-memory filesystem (``/dev/shm``), where a file is memory every process that maps it
    shares, counted once; None where there is none (not Linux)."""
    return _SHARED_MEMORY if _SHARED_MEMORY.is_dir() and os.access(_SHARED_MEMORY, os.W_OK) else None


def shared_folder(purpose: str, under: str | os.PathLike | None = None) -> Path | None:
    """The folder every rank of this job on this machine uses for ``purpose`` (one name per kind of file:
    ``"offload"``), made under ``under`` (default: the system's temporary folder) by the first rank to ask; None
    when this process is not one of several ranks. See the module docstring."""
    if not ranks_share_a_machine():
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    parent = Path(under) if under is not None else Path(tempfile.gettempdir())
    remove_abandoned(parent, f"memmode-{purpose}-*")  # earlier jobs' folders whose every rank was killed
    candidate = tempfile.mkdtemp(prefix=f"memmode-{purpose}-", dir=parent)
    published = store.compare_set(f"memmode/{purpose}/{machine_key()}", "", candidate).decode()
    if published != candidate:
        with contextlib.suppress(FileNotFoundError):  # another rank's sweep may have taken it already
            os.rmdir(candidate)
    return Path(published)
