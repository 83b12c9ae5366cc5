"""What the two file storages (``disk``, ``mmap``) share: every offloading placement with them equals full load,
call after call, on the tiny pipelines; a bad ``offload_dir`` is refused with the model or pipeline intact;
files are cleaned up, or kept and reused on request. On the accelerator (CUDA, else the CPU under the strict model
of asynchronous copies) they upload through the staging ring, and ``pinned`` joins them.

What the placement x storage matrix covers (``_covered``; 18 cases, about 7 s on two CPU cores):

* ``model_group_offload`` at block level, with ``disk`` and ``mmap``, on all five families: every tensor
  of every family goes through the files;
* the other placements (leaf level and sequential, which write a file per leaf module, text-encoder
  offload and ``model_cpu_offload``) with ``disk`` and ``mmap`` on a rotation: the ``j``-th of those
  eight combinations on the ``j % 5``-th family, so each combination runs on one family and each family
  on one or two combinations.  ``model_cpu_offload`` with both file storages also runs below (a refused
  full folder, ``keep_files``, files deleted at ``remove()``).

``ram`` and ``poison`` run every placement on every family in ``test_placements``, and ``test_pipeline_sweep``
runs every storage with every placement over all the suite's pipeline families.  ``MEMMODE_TEST_FULL_MATRIX=1``
runs all 50 cases here.
"""

from __future__ import annotations

import os
import re
import shutil
from collections import namedtuple

import pytest

import memmode_core as memmode
from helpers import (
    ACCELERATOR,
    FILE_STORAGES,
    OFFLOADING_PLACEMENTS,
    assert_bit_equal,
    assert_refused,
    assert_same_outputs,
    assert_same_tensors,
    files_under,
    full_matrix,
    module_components,
    on_accelerator,
    placement_id,
    state_of,
)
from memmode_core import InvalidOptionError, MemmodeError, StorageUnavailableError
from memmode_core.files import readwrite
from memmode_core.files.groupfile import FILE_PREFIX
from tiny_models import make_blocks
from tiny_pipelines import FAMILIES, full_load_outputs, make_pipeline, run, two_calls

PLACEMENTS = OFFLOADING_PLACEMENTS
PLACEMENT_IDS = [placement_id(p) for p in PLACEMENTS]

#: The placements the file storages run on a rotation (see ``_covered``), the slowest first.
_ROTATED = [
    "model_group_offload-offload_type=leaf_level",
    "sequential_cpu_offload",
    "text_encoder_offload",
    "model_cpu_offload",
]


def _covered(index: int, placement: str, storage: str) -> bool:
    """Whether the default matrix runs ``placement`` x ``storage`` on the ``index``-th family (sorted).

    Block-level ``model_group_offload`` runs on every family; the ``j``-th of the eight combinations of
    ``_ROTATED`` x ``FILE_STORAGES`` on family ``j % len(FAMILIES)`` only.
    ``MEMMODE_TEST_FULL_MATRIX=1`` runs all of it.
    """
    if placement not in _ROTATED or full_matrix():
        return True
    rotation = [(p, s) for p in _ROTATED for s in FILE_STORAGES]
    return rotation.index((placement, storage)) % len(FAMILIES) == index


def _cases() -> list:
    return [
        pytest.param(family, mode, options, storage, id=f"{family}-{placement_id((mode, options))}-{storage}")
        for index, family in enumerate(sorted(FAMILIES))
        for mode, options in PLACEMENTS
        for storage in FILE_STORAGES
        if _covered(index, placement_id((mode, options)), storage)
    ]


def test_the_rotation_runs_every_combination_somewhere():
    cases = [case.values for case in _cases()]
    for mode, options in PLACEMENTS:
        for storage in FILE_STORAGES:
            families = {f for f, m, o, s in cases if (m, o, s) == (mode, options, storage)}
            assert families, f"{placement_id((mode, options))} x {storage} runs on no family"
    assert {family for family, *_ in cases} == set(FAMILIES), "every family runs"


@pytest.mark.parametrize("family, mode, options, storage", _cases())
def test_every_placement_equals_full_load(family, mode, options, storage, private_tmp):
    pipe = make_pipeline(family)
    handle = memmode.apply(pipe, mode, device="cpu", storage=storage, **options)
    assert_same_outputs(two_calls(pipe, family), full_load_outputs(family))
    assert handle.report().storage_bytes["disk_bytes"] > 0 and files_under(private_tmp)
    handle.remove()
    assert files_under(private_tmp) == [], "remove() leaves no file behind"
    assert_same_outputs(two_calls(pipe, family), full_load_outputs(family))


# -- a bad offload_dir: refused before anything is released ---------------------------------------


def assert_untouched(pipe, family):
    assert memmode.remove(pipe) is False, "no mode may be left applied"
    assert_same_outputs(two_calls(pipe, family), full_load_outputs(family))


@pytest.mark.parametrize("storage", FILE_STORAGES)
def test_an_unwritable_offload_dir_is_refused_with_the_pipeline_intact(storage, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("a regular file cannot hold a folder")
    pipe = make_pipeline("flux")
    weights = state_of(pipe.transformer)
    with pytest.raises(StorageUnavailableError, match="cannot use"):
        memmode.apply(pipe, "model_group_offload", device="cpu", storage=storage, offload_dir=blocker / "offload")
    assert_same_tensors(state_of(pipe.transformer), weights)
    assert_untouched(pipe, "flux")


@pytest.mark.parametrize("storage", FILE_STORAGES)
def test_a_full_offload_dir_is_refused_with_the_pipeline_intact(storage, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, (1 << 30) - 4096, 4096))
    pipe = make_pipeline("flux")
    with pytest.raises(StorageUnavailableError, match="free"):
        memmode.apply(pipe, "model_cpu_offload", device="cpu", storage=storage, offload_dir=tmp_path / "offload")
    assert files_under(tmp_path) == []
    assert_untouched(pipe, "flux")


@pytest.mark.parametrize("storage", FILE_STORAGES)
def test_a_write_failing_midway_is_refused_with_the_pipeline_intact(storage, tmp_path, monkeypatch):
    real_write, calls = readwrite.write, []

    def fails_on_third_group(file, layout, tensors, namer=None):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real_write(file, layout, tensors, namer)

    monkeypatch.setattr(readwrite, "write", fails_on_third_group)
    pipe = make_pipeline("flux")
    with pytest.raises(StorageUnavailableError, match="No space left"):
        memmode.apply(pipe, "model_group_offload", device="cpu", storage=storage, offload_dir=tmp_path / "offload")
    assert files_under(tmp_path) == [], "the files of the first groups are removed too"
    assert_untouched(pipe, "flux")


@pytest.mark.parametrize("storage", FILE_STORAGES)
def test_an_empty_offload_dir_is_refused(storage, tmp_path, monkeypatch):
    """offload_dir="" (which would write into the current directory) is an InvalidOptionError;
    nothing is written in the current directory."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert_refused(make_blocks(0), InvalidOptionError, storage=storage, offload_dir="")
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("storage", FILE_STORAGES)
def test_an_offload_dir_with_a_nul_byte_is_a_memmode_error(storage, tmp_path):
    """an offload_dir containing "\\0" is a MemmodeError (not the bare ValueError of os calls),
    with nothing written."""
    err = assert_refused(make_blocks(0), MemmodeError, storage=storage, offload_dir=str(tmp_path / "off\0load"))
    assert type(err) is not ValueError
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("storage", FILE_STORAGES)
def test_an_offload_dir_that_is_a_regular_file_says_so(storage, tmp_path):
    """offload_dir naming an existing regular file is a StorageUnavailableError whose message
    says it is a file, not a folder (not only "[Errno 17] File exists"); the file is left as it was."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a regular file")
    err = assert_refused(make_blocks(0), StorageUnavailableError, storage=storage, offload_dir=blocker)
    message = str(err)
    assert re.search(r"is a (regular )?file|not a (folder|directory)", message, re.I), message
    assert blocker.read_text() == "a regular file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not-a-folder"]


@pytest.mark.parametrize("storage", FILE_STORAGES)
def test_keep_files_needs_an_offload_dir(storage):
    pipe = make_pipeline("flux")
    with pytest.raises(InvalidOptionError, match="keep_files=True needs offload_dir"):
        memmode.apply(pipe, "model_cpu_offload", device="cpu", storage=storage, keep_files=True)
    assert_untouched(pipe, "flux")


def test_offload_dir_belongs_to_the_file_storages():
    with pytest.raises(InvalidOptionError, match="offload_dir"):
        memmode.apply(make_pipeline("flux"), "model_cpu_offload", device="cpu", storage="ram", offload_dir="x")


# -- files in a given folder: deleted by default, kept and reused on request --------------------------


@pytest.mark.parametrize("storage", FILE_STORAGES)
def test_kept_files_are_reused_by_the_next_apply(storage, tmp_path):
    folder = tmp_path / "offload"
    pipe = make_pipeline("wan22")
    handle = memmode.apply(
        pipe, "model_group_offload", device="cpu", storage=storage, offload_dir=folder, keep_files=True
    )
    run(pipe, "wan22")
    handle.remove()
    kept = {p: p.stat().st_ino for p in files_under(folder)}
    assert kept and all(p.name.startswith(FILE_PREFIX) for p in kept)

    again = make_pipeline("wan22")
    handle = memmode.apply(again, "model_group_offload", device="cpu", storage=storage, offload_dir=folder)
    assert {p: p.stat().st_ino for p in files_under(folder) if p.suffix != ".lease"} == kept, "reused, not rewritten"
    assert_same_outputs(two_calls(again, "wan22"), full_load_outputs("wan22"))
    handle.remove()
    assert set(files_under(folder)) == set(kept), "files this session did not write are not its to delete"


@pytest.mark.parametrize("storage", FILE_STORAGES)
def test_files_written_in_a_given_folder_are_deleted_at_remove(storage, tmp_path):
    folder = tmp_path / "offload"
    pipe = make_pipeline("flux")
    handle = memmode.apply(pipe, "model_cpu_offload", device="cpu", storage=storage, offload_dir=folder)
    assert files_under(folder)
    handle.remove()
    assert folder.is_dir() and files_under(folder) == []


# -- what is on disk: the group files, and the streamed files the groups lie in -------------------------------


def on_disk(folder, streamed_sizes: dict[int, int]) -> int:
    """What is on disk now, measured on the files: the group files in ``folder``, and the streamed files among
    ``streamed_sizes`` (inode -> size; unlinked when written) that this process still maps (``/proc/self/maps``)."""
    with open("/proc/self/maps") as maps:
        inodes = {int(fields[4]) for fields in (line.split(maxsplit=5) for line in maps) if len(fields) == 6}
    streamed = sum(size for inode, size in streamed_sizes.items() if inode in inodes)
    return sum(p.stat().st_size for p in folder.glob(f"{FILE_PREFIX}*.safetensors")) + streamed


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads which files are mapped from /proc")
@pytest.mark.parametrize("keep_files", [False, True], ids=["in-place", "keep_files"])
@pytest.mark.parametrize("storage", FILE_STORAGES)
def test_the_storage_counts_on_disk_the_streamed_files_the_groups_lie_in(storage, keep_files, tmp_path, monkeypatch):
    """A quantizer packs the layers into a streamed file (unlinked at once, on disk until its last mapping goes).
    The storage keeps the groups in place in it (nothing written: borrowed), or, with ``keep_files``, writes them to
    group files while their scales, kept readable at rest, still view it: either way the file is on disk, and
    ``staged_bytes`` counts it beside the group files' ``disk_bytes``, as measured on the files; qfloat4 less than
    qfloat8."""
    from memmode_core.files import streamed

    sizes, finish = {}, streamed.StreamedFile.finish

    def measuring_finish(self):
        status = os.fstat(self._fd)
        sizes[status.st_ino] = status.st_size
        return finish(self)

    monkeypatch.setattr(streamed.StreamedFile, "finish", measuring_finish)
    totals = {}
    for quantizer in ("qfloat8", "qfloat4"):
        sizes.clear()  # the streamed files of this apply only
        folder = tmp_path / quantizer
        model = make_blocks(0, width=128)
        handle = memmode.apply(
            model,
            f"model_group_offload_and_{quantizer}",
            device="cpu",
            storage=storage,
            offload_dir=folder,
            **({"keep_files": True} if keep_files else {}),
        )
        stats = handle.report().storage_bytes
        assert stats["staged_bytes"] > 0 and (stats["borrowed_groups"] > 0) is not keep_files, stats
        totals[quantizer] = stats["disk_bytes"] + stats["staged_bytes"]
        assert totals[quantizer] == on_disk(folder, sizes), stats
        handle.remove()
        assert handle.report().storage_bytes.get("staged_bytes", 0) == 0
    assert totals["qfloat4"] < totals["qfloat8"]


# -- the accelerator: the staging ring and the pinned storage (CUDA, else the strict model on the CPU) ---------

_ACCELERATOR_FULL_LOAD: dict[str, tuple] = {}


def accelerator_full_load(family: str) -> tuple:
    """Calls 1 and 2 of the family's pipeline under model_full_load on ``ACCELERATOR``, computed once."""
    if family not in _ACCELERATOR_FULL_LOAD:
        reference = make_pipeline(family)
        handle = memmode.apply(reference, "model_full_load", device=ACCELERATOR)
        _ACCELERATOR_FULL_LOAD[family] = two_calls(reference, family)
        handle.remove()
    return _ACCELERATOR_FULL_LOAD[family]


@on_accelerator
@pytest.mark.parametrize("storage", ["pinned", *FILE_STORAGES])
@pytest.mark.parametrize("mode, options", PLACEMENTS, ids=PLACEMENT_IDS)
def test_on_the_accelerator_every_placement_equals_full_load(mode, options, storage, strict_streams):
    family = "wan22"
    expected = accelerator_full_load(family)
    pipe = make_pipeline(family)
    handle = memmode.apply(pipe, mode, device=ACCELERATOR, storage=storage, **options)
    for _ in range(2):
        for index, (got, want) in enumerate(zip(two_calls(pipe, family), expected), start=1):
            assert_bit_equal(got, want, f"call {index}")
    if strict_streams is not None:
        # from page-locked memory: the pinned storage's slabs, or the file storages' staging ring
        assert strict_streams.counts["pinned_copies"] > 0
        if mode == "model_group_offload":  # the placement that prefetches on a side stream
            assert strict_streams.counts["async_copies"] > 0
    handle.remove()
    assert all(
        p.device.type == "cpu" and not p.is_pinned() for m in module_components(pipe).values() for p in m.parameters()
    ), "weights back in ordinary CPU memory"
