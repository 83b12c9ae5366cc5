"""The group files that the disk and mmap storages share: format, naming, reuse, crash safety, sharing
a folder between sessions and processes, refusal of a bad folder, cleanup, and how uploads to a GPU
are cut into staging chunks."""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fault_injection import in_forked_child
from helpers import ACCELERATOR, on_accelerator
from memmode_core import StorageUnavailableError
from memmode_core.contracts import packing
from memmode_core.engine import streams
from memmode_core.engine.staging import StagingRing, chunks_of
from memmode_core.files import folder as offload_folder
from memmode_core.files import naming, readwrite
from memmode_core.files.file_layout import DATA_ALIGNMENT, PADDING_PREFIX, FileLayout, byte_view, host_tensors
from memmode_core.files.groupfile import FILE_PREFIX, FILE_SUFFIX, FileStamp
from memmode_core.files.mapping import map_private
from memmode_core.files.store import GroupFileStore


def group(seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors of every kind a group can hold: mixed dtypes and sizes, a scalar, an empty tensor."""
    g = torch.Generator().manual_seed(seed)
    return {
        "blocks.0.attn.to_q.weight": torch.randn(24, 16, generator=g),
        "blocks.0.norm.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "blocks.0.scale": torch.randn((), generator=g, dtype=torch.float64),
        "blocks.0.index": torch.randint(0, 100, (3,), generator=g),
        "blocks.0.mask": torch.rand(7, generator=g) > 0.5,
        "blocks.0.codes": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
        "blocks.0.empty": torch.empty(0, 4),
        "blocks.0.half": torch.randn(3, 3, generator=g).half(),
    }


def files_in(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"{FILE_PREFIX}*{FILE_SUFFIX}"))


@pytest.fixture
def store(tmp_path):
    s = GroupFileStore(tmp_path / "offload", keep_files=False, owner="test")
    s.reserve({"g": 10_000})
    yield s
    s.close()


# -- the format -----------------------------------------------------------------------------------


def test_files_are_safetensors_with_aligned_typed_data(store):
    tensors = group()
    stored = store.store(tensors)
    with safe_open(str(stored.path), framework="pt") as f:
        padding = {k for k in f.keys() if k.startswith(PADDING_PREFIX)}
        assert set(f.keys()) - padding == set(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(f.get_tensor(name), tensor), name
        assert padding and all(not f.get_tensor(k).any() for k in padding), "alignment padding is named zeros"
    layout = stored.layout
    assert layout.data_start % DATA_ALIGNMENT == 0
    assert stored.path.stat().st_size == layout.file_size
    for entry in layout.entries:  # every tensor where a fresh CPU allocation would put it (BLAS picks kernels by it)
        assert entry.start % DATA_ALIGNMENT == 0, entry


def test_mapped_views_and_reads_give_back_the_bytes(store):
    tensors = group()
    stored = store.store(tensors)
    layout = stored.layout
    mapped = packing.views(map_private(stored.path), layout.entries, layout.data_start)
    read = readwrite.read(stored.path, layout)
    for name, tensor in tensors.items():
        assert mapped[name].dtype == read[name].dtype == tensor.dtype
        assert torch.equal(mapped[name], tensor) and torch.equal(read[name], tensor), name


def test_a_write_to_a_mapped_view_never_reaches_the_file(store):
    stored = store.store(group())
    before = stored.path.read_bytes()
    layout = stored.layout
    mapped = packing.views(map_private(stored.path), layout.entries, layout.data_start)
    mapped["blocks.0.attn.to_q.weight"].add_(1.0)  # copy-on-write: the page becomes the process's own
    assert stored.path.read_bytes() == before


def test_the_name_is_a_digest_of_names_shapes_and_every_byte():
    def name_of(tensors):
        host = host_tensors(tensors)
        return naming.content_name(FileLayout.of(host), host)

    base = group()
    assert name_of(base) == name_of(group())
    one_bit = {**base, "blocks.0.codes": base["blocks.0.codes"] ^ torch.tensor(1, dtype=torch.uint8)}
    renamed = {("other." + k): v for k, v in base.items()}
    reshaped = {**base, "blocks.0.attn.to_q.weight": base["blocks.0.attn.to_q.weight"].reshape(16, 24)}
    assert len({name_of(base), name_of(one_bit), name_of(renamed), name_of(reshaped), name_of(group(1))}) == 5


def test_a_large_group_is_named_by_a_hash_list_of_its_pieces_hashed_in_parallel(monkeypatch):
    """A group of many pieces is hashed by the pool's threads: the name is still the digest of the header and
    of each piece's digest in order (so it cannot depend on which thread finishes first), and a byte changed
    in any piece changes it."""
    import blake3

    monkeypatch.setattr(naming, "HASH_PIECE", 1024)
    monkeypatch.setattr(naming, "HASH_TASK", 2048)
    host = host_tensors({"a": torch.randn(3000), "b": torch.randn(700), "c": torch.zeros(0)})
    layout = FileLayout.of(host)
    expected = blake3.blake3(layout.header)
    for entry in layout.entries:
        data = byte_view(host[entry.name])
        for start in range(0, len(data), 1024):
            expected.update(blake3.blake3(data[start : start + 1024]).digest())
    assert naming.content_name(layout, host) == expected.hexdigest()[: naming.NAME_DIGITS]
    names = {naming.content_name(layout, host)}
    for name, index in (("a", 0), ("a", 2999), ("b", 350)):
        changed = {**host, name: host[name].clone()}
        changed[name][index] += 1.0
        names.add(naming.content_name(layout, changed))
    assert len(names) == 4


def test_unsupported_dtypes_are_refused_before_writing(store):
    with pytest.raises(StorageUnavailableError, match="complex128"):
        store.store({"w": torch.zeros(2, dtype=torch.complex128)})
    assert files_in(store.folder) == []


# -- reuse, and what is never reused --------------------------------------------------------------


def test_unchanged_weights_reuse_the_file_without_writing(tmp_path):
    folder = tmp_path / "offload"
    first = GroupFileStore(folder, keep_files=True, owner="test")
    path = first.store(group()).path
    first.close()
    inode = path.stat().st_ino
    second = GroupFileStore(folder, keep_files=True, owner="test")
    assert second.store(group()).path == path
    assert path.stat().st_ino == inode
    second.close()


def test_a_truncated_file_under_the_expected_name_is_rewritten(store, caplog):
    path = store.store(group()).path
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # what a crash mid-copy, or a full disk, leaves
    assert store.store(group()).path == path
    assert path.read_bytes() == data
    assert "rewriting" in caplog.text


def test_a_stale_file_under_the_expected_name_is_rewritten(store):
    """Another valid file with the same header (same model, other weights) put under the name."""
    path = store.store(group(0)).path
    stale = store.store(group(1)).path
    shutil.copyfile(stale, path)
    with safe_open(str(path), framework="pt") as f:  # a perfectly valid file, just not these weights
        assert not torch.equal(f.get_tensor("blocks.0.attn.to_q.weight"), group(0)["blocks.0.attn.to_q.weight"])
    store.store(group(0))
    with safe_open(str(path), framework="pt") as f:
        for name, tensor in group(0).items():
            assert torch.equal(f.get_tensor(name), tensor), name


def test_writes_leave_no_temporary_files_and_stale_ones_are_swept(tmp_path):
    folder = tmp_path / "offload"
    folder.mkdir()
    (folder / ".memmode-crashed.tmp").write_bytes(b"half a file")  # left by a writer that died
    s = GroupFileStore(folder, keep_files=False, owner="test")
    s.reserve({"g": 100})
    s.store(group())
    assert [p.name for p in folder.iterdir() if p.name.endswith(".tmp")] == []
    s.close()


def temporaries(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_in_a_new_folder_a_group_is_named_by_its_content_without_a_second_pass(tmp_path, monkeypatch):
    """A folder with no group file when reserved has no file to reuse: the group is hashed along its write to a
    temporary file, then renamed to its content name; the name is computed once, from the write."""
    monkeypatch.setattr(naming, "content_name", lambda *a: pytest.fail("hashed a second time"))
    s = GroupFileStore(tmp_path / "offload", keep_files=False, owner="test")
    s.reserve({"g": 10_000})
    tensors = group()
    path = s.store(tensors).path
    host = host_tensors(tensors)
    layout = FileLayout.of(host)
    monkeypatch.undo()
    assert path.name == FILE_PREFIX + naming.content_name(layout, host) + FILE_SUFFIX
    assert naming.matches(path, layout, host)
    assert temporaries(s.folder) == []
    s.close()


@pytest.mark.parametrize("piece,step", [(1024, 256), (1024, 4096), (4096, 1024)], ids=["steps", "pieces", "both"])
def test_a_group_is_written_in_steps_each_hashed_just_before_it_is_written(monkeypatch, piece, step):
    """Writing along the name (ContentNamer.write): no write is larger than WRITE_STEP, no step is cut across a
    piece, each step is hashed by the writing thread right before the file receives it (never a byte further),
    and the name equals content_name's."""
    monkeypatch.setattr(naming, "HASH_PIECE", piece)
    monkeypatch.setattr(readwrite, "WRITE_STEP", step)
    host = host_tensors({"a": torch.randn(3000), "b": torch.randn(700), "c": torch.ones(5)})
    layout = FileLayout.of(host)
    received = [0]  # bytes the file received so far
    events = []

    class File:
        def write(self, data):
            events.append(("write", ctypes.addressof(data.obj) if isinstance(data, memoryview) else None, len(data)))
            received[0] += len(data)
            return len(data)

    real = naming.HASH

    class Recorded:
        def __init__(self, *data):
            self.digest_ = real(*data)

        def update(self, data):
            events.append(("hash", ctypes.addressof(data.obj), len(data)))
            self.digest_.update(data)

        def digest(self):
            return self.digest_.digest()

    monkeypatch.setattr(naming, "HASH", Recorded)
    namer = naming.ContentNamer(layout)
    readwrite.write(File(), layout, host, namer)
    monkeypatch.setattr(naming, "HASH", real)
    assert namer.name() == naming.content_name(layout, host)
    data_writes = [e for e in events if e[0] == "write" and e[1] is not None]
    assert data_writes and max(n for _, _, n in data_writes) <= min(step, piece)
    for before, after in zip(events, events[1:], strict=False):
        if after[0] == "write" and after[1] is not None:
            assert before == ("hash", after[1], after[2]), (before, after)  # hashed right before, the same bytes


def test_identical_groups_written_in_one_session_share_one_file(store):
    """The second copy is written to a temporary file (the name is not known before the hash), found equal
    to the file already under its name, and dropped: one file, the first one, and no temporary left."""
    first = store.store(group())
    inode = first.path.stat().st_ino
    second = store.store(group())
    assert second.path == first.path and first.path.stat().st_ino == inode
    assert files_in(store.folder) == [first.path]
    assert temporaries(store.folder) == []


def test_a_folder_with_group_files_hashes_first_and_writes_nothing_it_can_reuse(tmp_path, monkeypatch):
    """Where files may be reused (the folder held group files when reserved), the name comes first: a file
    with the right content is reused without writing a byte."""
    folder = tmp_path / "offload"
    first = GroupFileStore(folder, keep_files=True, owner="test")
    first.reserve({"g": 10_000})
    path = first.store(group()).path
    first.close()
    second = GroupFileStore(folder, keep_files=True, owner="test")
    second.reserve({"g": 10_000})
    monkeypatch.setattr(GroupFileStore, "_write_temporary", lambda *a: pytest.fail("a reusable file was written"))
    assert second.store(group()).path == path
    second.close()


def test_a_hash_that_fails_while_writing_leaves_no_temporary_file(store, monkeypatch):
    class Broken:
        def __init__(self, *data):
            pass

        def update(self, data):
            raise RuntimeError("hash failed")

    monkeypatch.setattr(naming, "HASH", Broken)
    with pytest.raises(RuntimeError, match="hash failed"):
        store.store(group())
    assert temporaries(store.folder) == [] and files_in(store.folder) == []


# -- writing in the background ----------------------------------------------------------------------


class GatedWrites:
    """``readwrite.write`` held at a gate: each write says it started, then waits for :meth:`open`; counts
    how many ran at once."""

    def __init__(self, monkeypatch) -> None:
        self.real = readwrite.write
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.started = 0
        self.running = 0
        self.most_at_once = 0
        monkeypatch.setattr(readwrite, "write", self)

    def __call__(self, file, layout, tensors, namer=None):
        with self.lock:
            self.started += 1
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            assert self.gate.wait(30), "the gate was never opened"
            self.real(file, layout, tensors, namer)
        finally:
            with self.lock:
                self.running -= 1

    def wait_started(self, count: int) -> None:
        deadline = time.monotonic() + 30
        while self.started < count:
            assert time.monotonic() < deadline, f"{self.started} writes started, expected {count}"
            time.sleep(0.005)

    def open(self) -> None:
        self.gate.set()


def test_groups_are_written_two_at_once_and_named_in_order_at_flush(store, monkeypatch):
    """In a new folder, store(wait=False) returns while the group is written by a writer thread: two groups
    are written at once, to temporary files that already have their final size (the mmap storage maps them
    on return); a third waits until the oldest is named; flush() names them all by content."""
    writes = GatedWrites(monkeypatch)
    groups = [group(seed) for seed in range(3)]
    first = [store.store(tensors, wait=False) for tensors in groups[:2]]
    writes.wait_started(2)
    assert writes.most_at_once == 2
    assert files_in(store.folder) == [] and len(temporaries(store.folder)) == 2
    assert all(f.path.stat().st_size == f.layout.file_size for f in first)

    third = []
    blocked = threading.Thread(target=lambda: third.append(store.store(groups[2], wait=False)))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive(), "a third group was taken on while two were in flight"
    writes.open()
    blocked.join(30)
    store.flush()
    for tensors, stored in zip(groups, [*first, *third], strict=True):
        host = host_tensors(tensors)
        layout = FileLayout.of(host)
        assert stored.path.name == FILE_PREFIX + naming.content_name(layout, host) + FILE_SUFFIX
        assert naming.matches(stored.path, layout, host)
        assert stored.stamp == FileStamp.of(stored.path)
        stored.check()
    assert temporaries(store.folder) == []


def test_identical_groups_in_flight_at_once_share_one_file(store, monkeypatch):
    writes = GatedWrites(monkeypatch)
    a, b = store.store(group(), wait=False), store.store(group(), wait=False)
    writes.wait_started(2)
    writes.open()
    store.flush()
    assert a.path == b.path and files_in(store.folder) == [a.path]
    assert a.stamp == b.stamp == FileStamp.of(a.path), "the second is the first file, reused, not written over it"
    assert temporaries(store.folder) == []


def test_a_background_write_that_fails_is_refused_at_flush_and_its_peers_dropped(store, monkeypatch):
    """The second of three groups in flight hits a full disk: flush() names the first, then raises the typed
    refusal, after deleting every temporary file and waiting for every thread (nothing reads the tensors
    after it returns). The tensors are untouched."""
    real = readwrite.write
    groups = [group(seed) for seed in range(3)]
    second = groups[1]["blocks.0.attn.to_q.weight"].data_ptr()  # known by its bytes: two writers start in any order

    def full_on_second(file, layout, tensors, namer=None):
        if tensors["blocks.0.attn.to_q.weight"].data_ptr() == second:
            file.write(layout.header)
            raise OSError(28, "No space left on device")
        real(file, layout, tensors, namer)

    monkeypatch.setattr(readwrite, "write", full_on_second)
    copies = [{k: v.clone() for k, v in g.items()} for g in groups]
    stored = []
    with pytest.raises(StorageUnavailableError, match="No space left") as caught:
        for tensors in groups:
            stored.append(store.store(tensors, wait=False))
        store.flush()
    assert str(store.folder) in str(caught.value)
    assert temporaries(store.folder) == []
    assert files_in(store.folder) == [stored[0].path]
    for tensors, before in zip(groups, copies, strict=True):
        assert all(torch.equal(tensors[k], v) for k, v in before.items())
    store.close()
    assert not store.folder.exists() or files_in(store.folder) == []


def test_close_waits_for_the_writers_and_leaves_no_file(tmp_path, monkeypatch):
    writes = GatedWrites(monkeypatch)
    s = GroupFileStore(tmp_path / "offload", keep_files=False, owner="test")
    s.reserve({"g": 10_000})
    s.store(group(0), wait=False)
    s.store(group(1), wait=False)
    writes.wait_started(2)
    closing = threading.Thread(target=s.close)
    closing.start()
    closing.join(0.3)
    assert closing.is_alive(), "close() returned while writer threads still read the tensors"
    writes.open()
    closing.join(30)
    assert writes.running == 0
    assert list((tmp_path / "offload").iterdir()) == []


def test_a_sweep_removes_dead_writers_temporary_files_and_never_a_live_ones(tmp_path):
    """A writer holds its temporary file's lock while it writes in the background, without the folder lock; a
    peer's reserve sweeps only temporary files nobody holds (a process that died lost its lock)."""
    folder = tmp_path / "offload"
    live = offload_folder.OffloadFolder(folder, keep_files=False)
    live.open()
    with live.locked():
        fd, writing = live.temporary_file()
    (folder / ".memmode-crashed.tmp").write_bytes(b"half a file")
    peer = GroupFileStore(folder, keep_files=False, owner="test")
    peer.reserve({"g": 100})
    assert temporaries(folder) == [Path(writing).name]
    os.close(fd)  # the writer is gone: its file is an orphan now
    peer.reserve({"g": 100})
    assert temporaries(folder) == []
    peer.close()
    live.close()


# -- refusing a bad folder, before anything is written ----------------------------------------------


def test_a_folder_under_a_regular_file_is_refused(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    s = GroupFileStore(blocker / "offload", keep_files=False, owner="disk")
    with pytest.raises(StorageUnavailableError, match="storage 'disk'.*cannot use"):
        s.reserve({"g": 100})
    s.close()


def test_a_full_filesystem_is_refused(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 30, 10 << 30, 1 << 20))
    s = GroupFileStore(tmp_path / "offload", keep_files=False, owner="disk")
    with pytest.raises(StorageUnavailableError, match="GiB free"):
        s.reserve({"a": 600 << 10, "b": 600 << 10})
    s.close()


def test_a_write_that_fails_midway_is_an_error_and_leaves_nothing(store, monkeypatch):
    def full_disk(file, layout, tensors, namer=None):
        file.write(layout.header)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(readwrite, "write", full_disk)
    with pytest.raises(StorageUnavailableError, match="No space left"):
        store.store(group())
    assert list(store.folder.iterdir()) == [p for p in store.folder.iterdir() if p.suffix == ".lease"]


def test_the_filesystem_type_comes_from_the_mount_table():
    assert offload_folder.filesystem_type(Path("/proc/self")) == "proc"


# -- cleanup ----------------------------------------------------------------------------------------


def test_the_private_folder_is_removed_at_close(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    s = GroupFileStore(None, keep_files=False, owner="test")
    s.reserve({"g": 100})
    s.store(group())
    assert s.folder.parent == tmp_path and files_in(s.folder)
    s.close()
    assert list(tmp_path.iterdir()) == []


def test_a_given_folder_loses_what_the_session_wrote_and_keeps_the_rest(tmp_path):
    folder = tmp_path / "offload"
    keeper = GroupFileStore(folder, keep_files=True, owner="test")
    kept = keeper.store(group(0)).path  # written earlier by a run that kept its files
    keeper.close()
    s = GroupFileStore(folder, keep_files=False, owner="test")
    s.store(group(0))  # reused: not this session's to delete
    written = s.store(group(1)).path
    s.close()
    assert kept.exists() and not written.exists()
    assert [p.name for p in folder.iterdir()] == [kept.name]  # no lease or temporary file left


def test_a_file_another_live_session_uses_outlives_its_writer(tmp_path):
    folder = tmp_path / "offload"
    writer = GroupFileStore(folder, keep_files=False, owner="test")
    path = writer.store(group()).path
    reader = GroupFileStore(folder, keep_files=False, owner="test")
    reader.store(group())
    writer.close()
    assert path.exists(), "deleted while another session reads it"
    reader.close()
    assert not path.exists(), "the last user deletes a file handed over to it"


def test_a_lease_left_by_a_dead_process_is_ignored_and_removed(tmp_path):
    folder = tmp_path / "offload"
    folder.mkdir()
    s = GroupFileStore(folder, keep_files=False, owner="test")
    path = s.store(group()).path
    dead = folder / ".memmode-1-deadbeef.lease"
    dead.write_text(f"use {path.name}\n")  # nobody holds its lock
    s.close()
    assert not path.exists() and not dead.exists()


_CLOSED_INSIDE_ANOTHER_SESSIONS_LOCK = textwrap.dedent("""
    import gc, sys
    from memmode_core.files.folder import OffloadFolder
    folder = sys.argv[1]
    first = OffloadFolder(folder, keep_files=False)
    first.open()
    second = OffloadFolder(folder, keep_files=False)
    second.open()
    with second.locked():
        # what the garbage collector did to two ranks: the last mapping of one session's file dies while
        # another session of this process holds the folder's lock, and its finalizer closes its session
        del first
        gc.collect()
        print("inside", flush=True)
    print(sorted(p.name for p in __import__("pathlib").Path(folder).iterdir()), flush=True)
    second.close()
""")


def test_a_session_closed_by_the_garbage_collector_inside_another_sessions_lock_closes_after_it(tmp_path):
    folder = tmp_path / "shared"
    done = subprocess.run(
        [sys.executable, "-c", _CLOSED_INSIDE_ANOTHER_SESSIONS_LOCK, str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    inside, leases = done.stdout.splitlines()
    assert inside == "inside"
    assert len(eval(leases)) == 1, "the first session's lease outlived it"  # only the second one's
    assert list(folder.iterdir()) == []


def _collected_while_locking(path: str, moment: str) -> list[str]:
    """In a forked child: a session is closed by the garbage collector at ``moment`` of another session's taking
    the folder's lock — inside the record of who holds it (``bookkeeping``), right after the ``flock`` (``flock``),
    or inside a cleanup that holds the lock itself (``cleanup``). Returns what is left in the folder."""
    from memmode_core.files import folder as folder_module
    from memmode_core.files import folder_holders
    from memmode_core.files.folder import OffloadFolder

    gc.disable()  # the collector runs where this function says, not before (in the child's own process)

    def session():
        opened = OffloadFolder(path, keep_files=False)
        opened.open()
        return opened

    armed = []  # what to drop at the chosen moment: the last reference to a session, whose cleanup then runs

    def drop():
        while armed:
            armed.pop()
            gc.collect()

    if moment == "bookkeeping":

        class DroppingHold(folder_holders._Hold):
            def __init__(self, *args, **kwargs):
                drop()
                super().__init__(*args, **kwargs)

        folder_holders._Hold = DroppingHold
    else:
        fcntl = folder_module.fcntl

        class DroppingFcntl:
            def __getattr__(self, name):
                return getattr(fcntl, name)

            def flock(self, fd, op):
                fcntl.flock(fd, op)
                if op == fcntl.LOCK_EX:
                    drop()

        folder_module.fcntl = DroppingFcntl()

    keeper = session()
    if moment == "cleanup":
        # the first orphan's cleanup takes the lock; the second is dropped while it holds it
        first = [session()]
        first.append(first)  # a cycle: only the collector closes it
        armed.append(session())
        del first
        gc.collect()
    else:
        armed.append(session())
        with keeper.locked():
            pass
    keeper.close()
    return sorted(p.name for p in Path(path).iterdir())


@pytest.mark.parametrize("moment", ["bookkeeping", "flock", "cleanup"])
def test_a_session_the_collector_closes_while_the_lock_is_being_taken_waits_for_it(moment, tmp_path):
    """The garbage collector can run anywhere: inside the record of who holds a folder's lock, right after the
    ``flock`` and before that record, or inside a cleanup that holds the lock itself. A session it closes there runs
    its cleanup once the lock is let go (its own thread holds or is taking it): nothing waits on itself, and every
    lease is gone at the end."""
    left = in_forked_child(_collected_while_locking, str(tmp_path / "shared"), moment, timeout=30)
    assert left == [], "a lease outlived its session"


_AT_EXIT = textwrap.dedent("""
    import sys, torch
    from memmode_core.files.store import GroupFileStore
    store = GroupFileStore(None, keep_files=False, owner="test")
    store.reserve({"g": 1024})
    store.store({"w": torch.ones(16)})
    print(store.folder, flush=True)
    # no close(): the interpreter exits with the store alive
""")


def test_the_private_folder_is_removed_at_interpreter_exit(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _AT_EXIT],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    folder = Path(done.stdout.strip())
    assert folder.parent == tmp_path
    assert not folder.exists()


# -- two processes, one folder ----------------------------------------------------------------------


def _numbered_group(i: int) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(1 << 20, generator=torch.Generator().manual_seed(i)), "b": torch.full((7,), float(i))}


def _write_eight_groups(folder: str, go) -> None:
    """One writer process: reserve, wait for the other, then store the eight groups both store."""
    store = GroupFileStore(folder, keep_files=True, owner="test")
    store.reserve({str(i): 4 << 20 for i in range(8)})
    assert go.wait(120), "the other writer never started"
    for i in range(8):
        store.store(_numbered_group(i))
    store.close()


def test_two_processes_writing_one_folder_at_once_leave_valid_files(tmp_path):
    # Forked, not started afresh: two processes all the same (their own pid, locks and leases), without
    # the seconds each new interpreter takes to import torch.
    folder = tmp_path / "shared"
    context = multiprocessing.get_context("fork")
    go = context.Event()
    procs = [context.Process(target=_write_eight_groups, args=(str(folder), go)) for _ in range(2)]
    for p in procs:
        p.start()
    go.set()  # start together
    for p in procs:
        p.join(180)
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0, 0], "a writer failed or hung (a traceback is in the captured stderr)"
    files = files_in(folder)
    assert len(files) == 8, "each group written once, under one name"
    assert [p.name for p in folder.iterdir() if not p.name.startswith(FILE_PREFIX)] == []
    expected = {}
    for i in range(8):
        host = host_tensors(_numbered_group(i))
        layout = FileLayout.of(host)
        expected[FILE_PREFIX + naming.content_name(layout, host) + FILE_SUFFIX] = (layout, host)
    assert {p.name for p in files} == set(expected)
    for path in files:
        layout, host = expected[path.name]
        assert naming.matches(path, layout, host), path


# -- uploads to an accelerator: how the staging ring cuts a group into chunks, and the copies -----------


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 4096, 1 << 20])
def test_the_staging_chunks_carry_every_byte_once_in_place(chunk_bytes):
    host = host_tensors(group())
    layout = FileLayout.of(host)
    data = torch.zeros(layout.data_bytes, dtype=torch.uint8)  # the data section, alignment gaps included
    for e in layout.entries:
        data[e.start : e.end] = host[e.name].reshape(-1).view(torch.uint8)
    out = {name: torch.full_like(t.reshape(-1).view(torch.uint8), 0xAB) for name, t in host.items()}
    copied = 0
    for begin, end, pieces in chunks_of(layout, chunk_bytes):
        assert 0 < end - begin <= chunk_bytes
        chunk = data[begin:end]  # what fill() puts in the staging chunk
        for name, lo, hi, at in pieces:
            out[name][lo:hi] = chunk[at : at + hi - lo]
            copied += hi - lo
    assert copied == sum(e.end - e.start for e in layout.entries)
    for name, tensor in host.items():
        assert torch.equal(out[name], tensor.reshape(-1).view(torch.uint8)), name


def test_a_folder_in_ram_is_warned_about_for_a_storage_meant_to_save_memory(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(offload_folder, "filesystem_type", lambda path: "tmpfs")
    quiet = GroupFileStore(tmp_path / "a", keep_files=False, owner="mmap")
    quiet.reserve({"g": 100})
    assert "tmpfs" not in caplog.text
    warned = GroupFileStore(tmp_path / "b", keep_files=False, owner="disk", warn_in_ram=True)
    warned.reserve({"g": 100})
    assert "storage 'disk' writes to" in caplog.text and "tmpfs held in RAM" in caplog.text
    quiet.close()
    warned.close()


def test_a_forked_child_leaves_the_parents_files_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    s = GroupFileStore(None, keep_files=False, owner="test")
    s.reserve({"g": 100})
    s.store(group())
    pid = os.fork()
    if pid == 0:  # what the inherited at-exit finalizer does when a forked child exits normally
        try:
            s.close()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert files_in(s.folder), "the child deleted the parent's files"
    s.close()
    assert not s.folder.exists()


@on_accelerator
@pytest.mark.parametrize("chunk_bytes", [64, 4096, 1 << 20])
def test_staging_ring_uploads_across_chunk_boundaries(chunk_bytes, strict_streams):
    """On the accelerator (CUDA, else the strict model, whose copies land only once waited for)."""
    tensors = group()
    host = host_tensors(tensors)
    layout = FileLayout.of(host)
    data = torch.zeros(layout.data_bytes, dtype=torch.uint8)  # the data section, alignment gaps included
    for e in layout.entries:
        data[e.start : e.end] = host[e.name].reshape(-1).view(torch.uint8)
    device = torch.device(ACCELERATOR)
    backend = streams.active()
    ring = StagingRing(chunk_bytes=chunk_bytes)
    stream = backend.new_stream(device)
    for _ in range(3):  # reused chunks: each refill waits for the copies that read it
        out = ring.upload(
            layout,
            lambda chunk, offset: chunk.copy_(data[offset : offset + chunk.numel()]),
            device,
            stream,
        )
        done = backend.new_event(device)
        backend.record(done, stream)
        backend.wait_host(done)  # the copies finished: the tensors may be read, and released, anywhere
        for name, tensor in tensors.items():
            assert out[name].device == device and torch.equal(out[name].cpu(), tensor), name
    assert ring.pinned_bytes == 2 * chunk_bytes
    ring.close()
    if strict_streams is not None:
        assert strict_streams.counts["async_copies"] > 0 and strict_streams.counts["pinned_copies"] > 0


def test_a_shared_folder_its_last_user_removes_while_another_opens_it_is_made_again(tmp_path, monkeypatch):
    """The folder the ranks of one machine share is removed by the last to leave (``remove_when_empty``); a rank
    opening it just then — after its ``mkdir``, before it holds the folder's lock — makes it again and takes its
    lease there, instead of failing to create a file in a folder that is gone (seen under load, 2 ranks)."""
    shared = tmp_path / "shared"
    real_open = os.open
    removed: list[bool] = []

    def open_then_lose_it(path, flags, *args):
        fd = real_open(path, flags, *args)
        if Path(path) == shared and not removed:  # the last user leaves right after our mkdir
            removed.append(True)
            os.rmdir(shared)
        return fd

    monkeypatch.setattr(offload_folder.os, "open", open_then_lose_it)
    folder = offload_folder.OffloadFolder(shared, keep_files=False, remove_when_empty=True)
    folder.open()
    assert removed and shared.is_dir() and list(shared.glob(".memmode-*.lease"))
    folder.close()
    assert not shared.exists(), "the last user removes the shared folder"


@pytest.mark.parametrize("when", ["inside mkdir", "after mkdir"])
def test_a_shared_folder_removed_while_mkdir_finds_it_is_made_again(tmp_path, monkeypatch, when):
    """The same race one step earlier: ``mkdir(exist_ok=True)`` meets the folder (EEXIST), its last user removes
    it, and mkdir's own check that it is a folder fails with ``FileExistsError``; or it goes between mkdir and
    the open of the folder. Either way the rank makes the folder again (one of four FSDP2 ranks failed with
    "cannot use ... as offload folder: [Errno 17] File exists" under load)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    real_mkdir, real_open, raced = Path.mkdir, os.open, []

    def mkdir_racing(self, *args, **kwargs):
        if self == shared and not raced and when == "inside mkdir":
            raced.append(True)
            os.rmdir(shared)  # removed after mkdir found it there, before mkdir checked it is a folder
            raise FileExistsError(17, "File exists", str(shared))
        return real_mkdir(self, *args, **kwargs)

    def open_racing(path, flags, *args):
        if Path(path) == shared and not raced and when == "after mkdir":
            raced.append(True)
            os.rmdir(shared)
        return real_open(path, flags, *args)

    monkeypatch.setattr(Path, "mkdir", mkdir_racing)
    monkeypatch.setattr(offload_folder.os, "open", open_racing)
    folder = offload_folder.OffloadFolder(shared, keep_files=False, remove_when_empty=True)
    folder.open()
    assert raced and shared.is_dir() and list(shared.glob(".memmode-*.lease"))
    folder.close()
    assert not shared.exists()
