"""Storage faults and concurrency: lose nothing, never crash, never compute with a wrong file.

Fault injection through real files — ``os.truncate``, deletion, a file renamed over another, bytes
flipped in place, a child process killed with SIGKILL — on the ``disk`` and ``mmap`` storages, and
two threads calling one model under every storage:

1. ``remove()`` after lost or short files restores every group it can, then raises ``RestoreError``
   naming exactly the groups it could not restore; the handle is gone, no hook is left.
2. A file truncated after ``apply`` is a ``StorageUnavailableError`` naming it at the next call, never
   a SIGBUS (run in a child process, so that a signal fails the test instead of killing pytest).
3. ``verify=``: ``"size"`` (default: size, inode and mtime at each onload), ``"hash"`` (the content
   too), ``"none"``; a bad value is an ``InvalidOptionError``.
4. A later session collects the files and lease of a process killed with ``kill -9``, never those of a
   live peer, never files a dead session asked to keep.
5. Two threads, one model, 300 calls per storage, every output exact.
6. The ``keep_files`` rule for sessions sharing a folder: a file outlives its writer while any session that
   used it asked to keep it.

Scenarios that may touch a truncated mapping run in a forked child (:func:`fault_injection.in_forked_child`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import memmode_core as memmode
from fault_injection import (
    all_groups,
    copy_by_identity,
    data_offset,
    describe_status_code,
    differing,
    in_forked_child,
    modify_in_place,
    read_line,
    stored_groups,
)
from helpers import FILE_STORAGES, assert_refused, hook_count, module_components
from memmode_core import InvalidOptionError, MemmodeError, StorageUnavailableError
from tiny_models import BLOCK_KEY, BLOCKS, make_blocks, make_inputs
from tiny_pipelines import make_pipeline, run

TESTS_DIR = Path(__file__).resolve().parent
GROUP_FILES = "memmode-*.safetensors"
LEASES = ".memmode-*.lease"


def restore_error() -> type:
    """``memmode_core.RestoreError`` (looked up at call time: without it, each test that needs it fails, not the
    module's import)."""
    error = getattr(memmode, "RestoreError", None)
    if error is None:
        pytest.fail("memmode_core has no RestoreError (remove() must name the groups it could not restore)")
    assert issubclass(error, MemmodeError)
    return error


def apply_blocks(model, storage: str, folder: Path | None, **options):
    kwargs = {"offload_dir": folder} if folder is not None else {}
    return memmode.apply(
        model, "model_group_offload", device="cpu", storage=storage, offload_type="block_level", **kwargs, **options
    )


def names_in(folder: Path, pattern: str = "*") -> set[str]:
    return {p.name for p in Path(folder).glob(pattern)} if Path(folder).exists() else set()


def folder_lock_free_within(folder: Path, timeout: float) -> bool:
    """Whether the folder's lock (``flock``) could be taken, without blocking, at some moment within ``timeout``
    seconds (a live session takes it for moments at a time)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.01)
            else:
                fcntl.flock(fd, fcntl.LOCK_UN)
                return True
    finally:
        os.close(fd)


def assert_removed_after_failures(handle, target, groups, snap, *, must: set[str], maybe: set[str] = frozenset()):
    """``handle.remove()`` raises ``RestoreError`` whose ``.failed`` names every group of ``must``, perhaps
    some of ``maybe``, and no other; the message names them; afterwards the handle is removed, no hook
    is left, every other group holds its original weights bit for bit, and a second remove() is a no-op."""
    components = dict(getattr(target, "components", None) or {"module": target})
    with pytest.raises(restore_error()) as info:
        handle.remove()
    err = info.value
    assert isinstance(err, MemmodeError)
    failed = err.failed
    assert isinstance(failed, dict), f".failed is {type(failed).__name__}, not a dict"
    assert must <= set(failed) <= must | maybe, f"failed groups {sorted(failed)}, expected {sorted(must)}" + (
        f" (and perhaps {sorted(maybe)})" if maybe else ""
    )
    for key, why in failed.items():
        assert isinstance(why, str) and why.strip(), f"no reason given for {key}: {why!r}"
        assert key in str(err), f"the message does not name {key}: {err}"
    assert not handle.active
    assert hook_count(target) == 0, "a memmode wrapper or hook is left"
    for obj in [target, *components.values()]:
        assert getattr(obj, "_memmode_handle", None) is None, f"{type(obj).__name__} still points to the handle"
    intact = {key: tensors for key, tensors in groups.items() if key not in failed}
    assert differing(intact, snap) == {}, "groups reported as restored do not hold their original weights"
    handle.remove()  # the second time: nothing to do, no error
    assert not handle.active
    return err


# -- 1. remove() after lost or short files --------------------------------------------------------------


def _damage(path: Path, fault: str) -> None:
    if fault == "delete":
        os.unlink(path)
    elif fault == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    else:
        raise AssertionError(fault)


@pytest.mark.parametrize("fault", ["delete", "truncate"])
@pytest.mark.parametrize("storage", FILE_STORAGES)
def test_remove_restores_every_group_it_can_then_names_the_lost_ones(storage, fault, tmp_path):
    """Case 1: two group files deleted / truncated after apply; remove() restores the four intact groups
    bit for bit, then raises RestoreError whose .failed names exactly the two lost groups (mmap+delete:
    the mapping still holds them, so they may be restored instead); handle removed, no hook left,
    a second remove() does nothing. Runs in a forked child: a truncated mapping must not kill pytest."""
    in_forked_child(_remove_after_lost_files, storage, fault, tmp_path / "offload")


def _remove_after_lost_files(storage: str, fault: str, folder: Path) -> None:
    model = make_blocks(0)
    snap = copy_by_identity({"module": model})
    (x,) = make_inputs(0)
    with torch.no_grad():
        expected = model(x)
        handle = apply_blocks(model, storage, folder)
        assert torch.equal(model(x), expected), "before the fault the output equals the model without memmode"
    groups = stored_groups(handle)
    every = all_groups(handle)
    assert sorted(groups) == sorted(BLOCK_KEY.format(i) for i in range(BLOCKS))
    victims = {BLOCK_KEY.format(1), BLOCK_KEY.format(4)}
    for key in victims:
        _damage(groups[key].path, fault)
    # an mmap session maps its files at apply: a deleted file is still readable through the mapping,
    # so restoring that group from it is as right as reporting it lost
    maybe = victims if (storage == "mmap" and fault == "delete") else set()
    assert_removed_after_failures(handle, model, every, snap, must=victims - maybe, maybe=maybe)


def test_remove_on_a_pipeline_names_the_lost_groups_by_component(tmp_path):
    """Case 1 on a real pipeline (flux, disk, block level): the files of one transformer block and one
    text-encoder layer deleted; remove() restores every other group of every component, raises
    RestoreError naming exactly "transformer/transformer_blocks.0" and "text_encoder/encoder.layers.1",
    and leaves the pipeline without handle or hooks."""
    pipe = make_pipeline("flux")
    snap = copy_by_identity(module_components(pipe))
    expected = run(make_pipeline("flux"), "flux", 0)
    handle = memmode.apply(pipe, "model_group_offload", device="cpu", storage="disk", offload_dir=tmp_path / "off")
    assert torch.equal(run(pipe, "flux", 0), expected), "before the fault the output equals full load"
    groups = stored_groups(handle)
    every = all_groups(handle)
    victims = {"transformer/transformer_blocks.0", "text_encoder/encoder.layers.1"}
    assert victims <= set(groups), sorted(groups)
    for key in victims:
        for path in groups[key].paths:
            path.unlink()
    assert_removed_after_failures(handle, pipe, every, snap, must=victims)
    assert memmode.remove(pipe) is False


# -- 2. a file truncated after apply: a clear error at the next call, never SIGBUS ---------------------

_TRUNCATED_CALL = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    torch.set_num_threads(1)
    import memmode_core as memmode
    from fault_injection import stored_groups
    from tiny_models import make_blocks, make_inputs

    root = sys.argv[2]
    for storage in sys.argv[3:]:
        result = {"storage": storage}
        model = make_blocks(0)
        (x,) = make_inputs(0)
        with torch.no_grad():
            expected = model(x)
            handle = memmode.apply(model, "model_group_offload", device="cpu", storage=storage,
                                   offload_dir=os.path.join(root, storage))
            result["exact_before"] = torch.equal(model(x), expected)
            path = stored_groups(handle)["module/blocks.2"].path
            result["file"] = path.name
            os.truncate(path, path.stat().st_size // 2)
            print(json.dumps({"storage": storage, "calling": True}), flush=True)
            try:
                model(x)
            except memmode.StorageUnavailableError as exc:
                result["outcome"] = "StorageUnavailableError"
                result["message"] = str(exc)
            except BaseException as exc:
                result["outcome"] = type(exc).__name__
                result["message"] = str(exc)
            else:
                result["outcome"] = "no error"
        print(json.dumps(result), flush=True)
        try:  # not this case's subject (case 1 is), but it must not kill the process either
            handle.remove()
        except BaseException as exc:
            pass
        print(json.dumps({"storage": storage, "removed": True}), flush=True)
""")


@pytest.fixture(scope="module")
def truncated_calls(tmp_path_factory):
    """One child process runs the truncation scenario under disk, then mmap, and reports each."""
    root = tmp_path_factory.mktemp("truncated")
    done = subprocess.run(
        [sys.executable, "-c", _TRUNCATED_CALL, str(TESTS_DIR), str(root), *FILE_STORAGES],
        capture_output=True,
        text=True,
        timeout=180,
    )
    results = {}
    for line in done.stdout.splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            results.setdefault(entry["storage"], {}).update(entry)
    return done, results


@pytest.mark.parametrize("storage", FILE_STORAGES)
def test_a_file_truncated_after_apply_is_a_clear_error_not_a_signal(storage, truncated_calls):
    """Case 2: a group file truncated to half after apply; the next call of the model (CPU) raises
    StorageUnavailableError naming the file, in a child process that must exit normally (a SIGBUS,
    exit -7 / 135, fails the test instead of killing pytest)."""
    done, results = truncated_calls
    result = results.get(storage, {})
    if "outcome" not in result:
        pytest.fail(
            f"the child process never finished the {storage} scenario "
            f"({'it had started the call' if result.get('calling') else 'before the call'}): "
            f"{describe_status_code(done.returncode)}\n{done.stderr[-3000:]}"
        )
    assert result["exact_before"], "before the fault the output equals the model without memmode"
    assert result["outcome"] == "StorageUnavailableError", f"{result['outcome']}: {result['message']}"
    assert result["file"] in result["message"], f"the error does not name the file: {result['message']}"
    assert result.get("removed"), (
        f"the child died in remove() after the error: {describe_status_code(done.returncode)}\n{done.stderr[-3000:]}"
    )
    assert done.returncode == 0, f"{describe_status_code(done.returncode)}\n{done.stderr[-3000:]}"


# -- 3. verification: truncated, replaced, modified files -----------------------------------------------


def _fault_at_next_call(storage: str, fault: str, folder: Path, verify: str | None) -> None:
    model = make_blocks(0)
    snap = copy_by_identity({"module": model})
    (x,) = make_inputs(0)
    options = {} if verify is None else {"verify": verify}
    with torch.no_grad():
        expected = model(x)
        handle = apply_blocks(model, storage, folder, **options)
        assert torch.equal(model(x), expected), "before the fault the output equals the model without memmode"
        assert torch.equal(model(x), expected)
    groups = stored_groups(handle)
    every = all_groups(handle)
    victim, source = groups[BLOCK_KEY.format(2)], groups[BLOCK_KEY.format(4)]
    assert victim.path != source.path and victim.path.stat().st_size == source.path.stat().st_size
    maybe: set[str] = set()
    must = {victim.key}
    if fault == "truncate":
        os.truncate(victim.path, victim.path.stat().st_size // 2)
    elif fault == "replace":  # same size, another group's bytes: only the file's identity tells
        os.replace(source.path, victim.path)
        # the source's file is gone: disk cannot restore it; mmap still has it mapped
        (maybe if storage == "mmap" else must).add(source.key)
    elif fault == "modify":  # a byte flipped in place: the mtime changes
        modify_in_place(victim.path, data_offset(victim.layout), keep_mtime=False)
    elif fault == "modify-keep-mtime":  # only the content tells
        modify_in_place(victim.path, data_offset(victim.layout), keep_mtime=True)
    else:
        raise AssertionError(fault)
    with torch.no_grad(), pytest.raises(StorageUnavailableError) as info:
        model(x)
    assert victim.path.name in str(info.value), f"the error does not name the file: {info.value}"
    assert_removed_after_failures(handle, model, every, snap, must=must, maybe=maybe)


@pytest.mark.parametrize("fault", ["truncate", "replace", "modify"])
@pytest.mark.parametrize("storage", FILE_STORAGES)
def test_default_verification_detects_a_changed_file_at_the_next_call(storage, fault, tmp_path):
    """Case 3, verify="size" (the default): a file truncated, another group's file renamed over it
    (os.replace: same size, other inode), or a byte flipped in place (new mtime) after apply; the next
    call raises StorageUnavailableError naming the file; then remove() raises RestoreError naming the
    damaged group and restores the others bit for bit."""
    in_forked_child(_fault_at_next_call, storage, fault, tmp_path / "offload", None)


@pytest.mark.parametrize("storage", FILE_STORAGES)
def test_hash_verification_detects_flipped_bytes_with_the_mtime_put_back(storage, tmp_path):
    """Case 3, verify="hash": a byte flipped in place and the mtime restored with os.utime(ns=...);
    the content digest catches it at the next call (StorageUnavailableError naming the file), and
    remove() raises RestoreError naming the group, with every other group intact."""
    in_forked_child(_fault_at_next_call, storage, "modify-keep-mtime", tmp_path / "offload", "hash")


def _flip_unseen_by_metadata(storage: str, folder: Path) -> None:
    model = make_blocks(0)
    (x,) = make_inputs(0)
    with torch.no_grad():
        expected = model(x)
        handle = apply_blocks(model, storage, folder)
        assert torch.equal(model(x), expected)
        victim = stored_groups(handle)[BLOCK_KEY.format(2)]
        modify_in_place(victim.path, data_offset(victim.layout), keep_mtime=True)
        got = model(x)  # size, inode and mtime unchanged: the default check costs one stat and reads no byte
    assert not torch.equal(got, expected), "the flipped byte is in a weight the model uses"
    with contextlib.suppress(MemmodeError):
        handle.remove()


@pytest.mark.parametrize("storage", FILE_STORAGES)
def test_default_verification_is_metadata_only(storage, tmp_path):
    """Case 3, the documented cost of the default: verify="size" checks size, inode and mtime (one
    stat per onload) and reads no content, so a flip with the mtime put back goes through — that is
    what verify="hash" is for (previous test)."""
    in_forked_child(_flip_unseen_by_metadata, storage, tmp_path / "offload")


@pytest.mark.parametrize("verify", ["size", "hash", "none"])
@pytest.mark.parametrize("storage", FILE_STORAGES)
def test_every_verify_value_computes_exactly(storage, verify, tmp_path):
    """Case 3: verify="size" | "hash" | "none" are accepted by disk and mmap and, on intact files, give
    exactly the output of the model without memmode, call after call; remove() gives the weights back."""
    model = make_blocks(0)
    snap = copy_by_identity({"module": model})
    inputs = make_inputs(1, count=3)
    with torch.no_grad():
        expected = [model(x) for x in inputs]
        handle = apply_blocks(model, storage, tmp_path / "offload", verify=verify)
        groups = all_groups(handle)
        for _ in range(2):
            assert all(torch.equal(model(x), e) for x, e in zip(inputs, expected))
    handle.remove()
    assert differing(groups, snap) == {}


@pytest.mark.parametrize("value", ["sha256", "", True, None])
@pytest.mark.parametrize("storage", FILE_STORAGES)
def test_an_invalid_verify_value_is_refused_before_anything_is_touched(storage, value, tmp_path):
    """Case 3: verify= other than "size", "hash", "none" is an InvalidOptionError from apply, with the
    model untouched and no file written."""
    folder = tmp_path / "offload"
    assert_refused(
        make_blocks(0),
        InvalidOptionError,
        match="verify",
        storage=storage,
        offload_type="block_level",
        offload_dir=folder,
        verify=value,
    )
    assert names_in(folder, GROUP_FILES) == set()


# -- 4. collecting what a crashed process left ----------------------------------------------------------

_SESSION_CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    import torch
    torch.set_num_threads(1)
    import memmode_core as memmode
    from tiny_models import make_blocks, make_inputs

    folder, seed, keep = sys.argv[2], int(sys.argv[3]), sys.argv[4] == "keep"
    model = make_blocks(seed)
    (x,) = make_inputs(seed)

    def pause(module, args, output):  # inside block 3's forward: its group is onloaded
        print("ready", flush=True)
        time.sleep(300)

    print("imported", flush=True)
    sys.stdin.readline()
    handle = memmode.apply(model, "model_group_offload", device="cpu", storage="disk", offload_dir=folder,
                           keep_files=keep)
    model.blocks[3][0].register_forward_hook(pause)
    with torch.no_grad():
        model(x)
""")


class _Scene:
    """What the crash-collection scenario saw (see the ``crash_scene`` fixture)."""

    def __init__(self) -> None:
        self.children: dict[str, subprocess.Popen] = {}
        self.files: dict[str, set[str]] = {}
        self.leases: dict[str, set[str]] = {}
        self.before_parent: set[str] = set()
        self.after_parent: set[str] = set()
        self.parent_files: set[str] = set()
        self.error: str | None = None
        self.folder: Path | None = None


@pytest.fixture(scope="module")
def crash_scene(tmp_path_factory):
    """Three child processes apply disk storage in one folder D (different weights each) and stop in
    the middle of a forward: "dead" and "dead_keep" (keep_files=True) are killed with SIGKILL, "live"
    stays; then this process applies another model in D. Records the folder before and after that apply."""
    folder = tmp_path_factory.mktemp("crash") / "D"
    folder.mkdir()
    scene = _Scene()
    scene.folder = folder
    roles = [("dead", 1, "no"), ("dead_keep", 2, "keep"), ("live", 3, "no")]
    handle = None
    try:
        for role, seed, keep in roles:  # all import at once (the slow part)...
            scene.children[role] = subprocess.Popen(
                [sys.executable, "-c", _SESSION_CHILD, str(TESTS_DIR), str(folder), str(seed), keep],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                bufsize=0,
            )
        for role, _, _ in roles:  # ...and apply one after the other, to tell whose files are whose
            child = scene.children[role]
            assert read_line(child, 120) == "imported"
            listed = names_in(folder)
            child.stdin.write(b"go\n")
            child.stdin.flush()
            assert read_line(child, 60) == "ready"
            new = names_in(folder) - listed
            scene.files[role] = {n for n in new if Path(n).match(GROUP_FILES)}
            scene.leases[role] = {n for n in new if Path(n).match(LEASES)}
            assert len(scene.files[role]) == BLOCKS and len(scene.leases[role]) == 1, (role, sorted(new))
        for role in ("dead", "dead_keep"):
            scene.children[role].send_signal(signal.SIGKILL)
            assert scene.children[role].wait(30) == -signal.SIGKILL
        scene.before_parent = names_in(folder)
        model = make_blocks(0)
        handle = apply_blocks(model, "disk", folder)
        scene.parent_files = {p.name for g in stored_groups(handle).values() for p in g.paths}
        scene.after_parent = names_in(folder)
    except AssertionError as exc:
        scene.error = str(exc)
    yield scene
    if handle is not None:
        with contextlib.suppress(Exception):
            handle.remove()
    for child in scene.children.values():
        if child.poll() is None:
            child.kill()
        child.wait()
        for stream in (child.stdin, child.stdout, child.stderr):
            stream.close()


def _scene(crash_scene: _Scene) -> _Scene:
    if crash_scene.error:
        pytest.fail(f"the crash scenario could not be set up: {crash_scene.error}")
    return crash_scene


def test_a_killed_sessions_files_and_lease_are_collected_by_the_next_apply(crash_scene):
    """Case 4: a child applies disk storage in D and is killed with SIGKILL mid-forward; its group files
    and lease stay in D. The next apply (another model, same D) removes them, and writes its own."""
    scene = _scene(crash_scene)
    dead = scene.files["dead"] | scene.leases["dead"]
    assert dead <= scene.before_parent, "SIGKILL leaves the files and the lease (the scenario's premise)"
    assert not dead & scene.after_parent, f"left after the next apply: {sorted(dead & scene.after_parent)}"
    assert len(scene.parent_files) == BLOCKS and scene.parent_files <= scene.after_parent


def test_a_live_peers_files_and_lease_are_never_collected(crash_scene):
    """Case 4: a child that is alive (sleeping mid-forward) in D keeps its files and lease through
    another session's apply in D, and can still be killed at the end."""
    scene = _scene(crash_scene)
    live = scene.files["live"] | scene.leases["live"]
    assert scene.children["live"].poll() is None, "the live peer died"
    assert live <= scene.after_parent, f"a live peer lost {sorted(live - scene.after_parent)}"
    assert live <= names_in(scene.folder), "a live peer's files vanished later"


def test_a_killed_sessions_kept_files_are_not_collected(crash_scene):
    """Case 4: a child that applied with keep_files=True and was killed with SIGKILL keeps its group
    files through the next apply in the same folder (they are not collected)."""
    scene = _scene(crash_scene)
    assert scene.files["dead_keep"] <= scene.before_parent
    assert scene.files["dead_keep"] <= scene.after_parent, (
        f"kept files collected: {sorted(scene.files['dead_keep'] - scene.after_parent)}"
    )


_WRITING_CHILD = textwrap.dedent("""
    import sys, threading
    sys.path.insert(0, sys.argv[1])
    import torch
    torch.set_num_threads(1)
    import memmode_core as memmode
    from memmode_core.files import readwrite
    from tiny_models import make_blocks, make_inputs

    folder, seed = sys.argv[2], int(sys.argv[3])
    model = make_blocks(seed)
    (x,) = make_inputs(seed)
    with torch.no_grad():
        expected = model(x)
    real, started, lock = readwrite.write, [], threading.Lock()

    def held(file, layout, tensors, namer=None):  # the second group's write waits for a line
        with lock:
            started.append(1)
            second = len(started) == 2
        if second:
            print("writing", flush=True)
            sys.stdin.readline()
        real(file, layout, tensors, namer)

    readwrite.write = held
    print("imported", flush=True)
    sys.stdin.readline()
    memmode.apply(model, "model_group_offload", device="cpu", storage="disk", offload_dir=folder)
    with torch.no_grad():
        print("exact" if torch.equal(model(x), expected) else "differs", flush=True)
""")
TEMPORARIES = ".memmode-*.tmp"


def test_a_writer_killed_mid_write_leaves_nothing_and_a_live_ones_files_are_never_swept(tmp_path):
    """Groups are written to temporary files in the background, without the folder lock, each file locked by
    its writer. Two processes apply disk storage in one folder and stop inside the write of their second
    group: one is killed with SIGKILL, and the next session's reserve deletes its temporary files (the kernel
    dropped its locks); the other is alive, and this process's apply in the folder leaves its files alone:
    released, it finishes and computes exactly."""
    folder = tmp_path / "D"
    folder.mkdir()
    children = {
        role: subprocess.Popen(
            [sys.executable, "-c", _WRITING_CHILD, str(TESTS_DIR), str(folder), str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            bufsize=0,
        )
        for role, seed in (("dead", 1), ("live", 2))
    }
    handle = None
    try:
        temporaries = {}
        for role, child in children.items():
            assert read_line(child, 120) == "imported"
            before = names_in(folder, TEMPORARIES)
            child.stdin.write(b"go\n")
            assert read_line(child, 60) == "writing"
            temporaries[role] = names_in(folder, TEMPORARIES) - before
            assert temporaries[role], f"{role}: no temporary file while a group is written"
            if role == "dead":
                child.send_signal(signal.SIGKILL)
                assert child.wait(30) == -signal.SIGKILL
                # the file of the group held mid-write stays (the one before it may have been named meanwhile)
                assert temporaries["dead"] & names_in(folder, TEMPORARIES), "left behind by the kill"
        assert not temporaries["dead"] & names_in(folder, TEMPORARIES), "the killed writer's files were not swept"
        # a writer held under the folder lock would block this process's apply for good: say so instead
        assert folder_lock_free_within(folder, 60), "the live writer holds the folder lock while it writes"
        handle = apply_blocks(make_blocks(0), "disk", folder)
        # the live writer's held file is still there, and it finishes: renaming a swept file would have failed it
        assert temporaries["live"] & names_in(folder, TEMPORARIES), "a live writer's file was swept"
        live = children["live"]
        live.stdin.write(b"go\n")
        assert read_line(live, 60) == "exact"
        assert live.wait(60) == 0
        handle.remove()
        handle = None
        assert names_in(folder, TEMPORARIES) == set()
    finally:
        if handle is not None:
            with contextlib.suppress(Exception):
                handle.remove()
        for child in children.values():
            if child.poll() is None:
                child.kill()
            child.wait()
            for stream in (child.stdin, child.stdout, child.stderr):
                stream.close()


_KILLED_AFTER_NAMING_CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    torch.set_num_threads(1)
    import memmode_core as memmode
    from tiny_models import make_blocks

    real = os.replace

    def replace_then_die(source, target, *args, **kwargs):  # killed the instant a group file has its name
        real(source, target, *args, **kwargs)
        if os.path.basename(target).startswith("memmode-"):
            os.kill(os.getpid(), signal.SIGKILL)

    os.replace = replace_then_die
    memmode.apply(make_blocks(7), "model_group_offload", device="cpu", storage="disk", offload_dir=sys.argv[2])
""")


@pytest.mark.parametrize("road", ["written-in-the-background", "written-under-the-lock"])
def test_a_writer_killed_the_instant_it_names_a_file_leaves_nothing_behind(road, tmp_path):
    """A group file is named by a rename; the lease must say whose it is before that. A child is killed right
    after its first rename, on both writing roads (the background writer of an empty folder, and the writer
    under the folder lock when the folder already holds a live session's files), and the next session's
    reserve collects the file with the dead lease: nothing the dead one named stays, a live session's files
    do. (Recorded after the rename, a kill in between left a file nobody owned, forever.)"""
    folder = tmp_path / "D"
    folder.mkdir()
    live = apply_blocks(make_blocks(0), "disk", folder) if road == "written-under-the-lock" else None
    try:
        before = names_in(folder, GROUP_FILES)
        child = subprocess.run(
            [sys.executable, "-c", _KILLED_AFTER_NAMING_CHILD, str(TESTS_DIR), str(folder)],
            capture_output=True,
            timeout=300,
        )
        assert child.returncode == -signal.SIGKILL, child.stderr.decode()
        named = names_in(folder, GROUP_FILES) - before
        assert len(named) == 1, "the premise: the child died having named one group file"
        following = apply_blocks(make_blocks(0), "disk", folder)
        assert not named & names_in(folder, GROUP_FILES), "the dead writer's named file was not collected"
        assert before <= names_in(folder, GROUP_FILES), "a live session's files were collected"
        following.remove()
    finally:
        if live is not None:
            live.remove()
    assert names_in(folder, GROUP_FILES) == set()


# -- 5. two threads, one model ---------------------------------------------------------------------------

CALLS_PER_THREAD = 150


@pytest.mark.usefixtures("poison_storage")
@pytest.mark.parametrize("storage", ["ram", "disk", "mmap", "poison"])
def test_two_threads_calling_one_model_get_exact_outputs(storage, tmp_path):
    """Case 5: two threads call the same model (6 blocks of Linear 64x64, block-level group offload),
    150 calls each with their own inputs, under ram, disk, mmap and poison (NaN placeholders at rest);
    every output equals the model without memmode for that input, no exception, nothing left resident
    on the device at the end (ledger), and remove() gives back the weights intact."""
    model = make_blocks(5)
    snap = copy_by_identity({"module": model})
    inputs = [make_inputs(100 + t, count=CALLS_PER_THREAD) for t in range(2)]
    with torch.no_grad():
        expected = [[model(x) for x in xs] for xs in inputs]
    folder = tmp_path / "offload" if storage in FILE_STORAGES else None
    handle = apply_blocks(model, storage, folder)
    groups = all_groups(handle)
    barrier = threading.Barrier(2)
    errors: list[str] = []
    wrong: list[tuple[int, int]] = []

    def work(t: int) -> None:
        with torch.no_grad():
            barrier.wait(timeout=30)
            for i, x in enumerate(inputs[t]):
                try:
                    out = model(x)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(f"thread {t} call {i}: {type(exc).__name__}: {exc}")
                    continue
                if not torch.equal(out, expected[t][i]):
                    wrong.append((t, i))

    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "the threads did not finish (a deadlock?)"
    assert errors == [], f"{len(errors)} calls raised, first: {errors[:3]}"
    assert wrong == [], f"{len(wrong)} of {2 * CALLS_PER_THREAD} outputs differ, first: {wrong[:5]}"
    assert handle.report().resident_device_bytes == 0
    handle.remove()
    assert differing(groups, snap) == {}


# -- 6. the keep_files rule for sessions sharing a folder -------------------------------------------------


def _files_of(handle) -> set[str]:
    return {p.name for g in stored_groups(handle).values() for p in g.paths}


@pytest.mark.parametrize("first_to_remove", ["writer", "reuser"])
@pytest.mark.parametrize("writer_keeps", [True, False], ids=["writer-keeps", "reuser-keeps"])
@pytest.mark.parametrize("storage", FILE_STORAGES)
def test_a_file_survives_if_any_session_that_used_it_kept_files(storage, writer_keeps, first_to_remove, tmp_path):
    """Case 6, the keep_files rule: two sessions share one offload_dir and the same weights (the first
    writes the files, the second reuses them), one with keep_files=True and one with False; whichever
    removes first, the files are there after both removed, and no lease is left."""
    folder = tmp_path / "shared"
    writer = apply_blocks(make_blocks(0), storage, folder, keep_files=writer_keeps)
    reuser = apply_blocks(make_blocks(0), storage, folder, keep_files=not writer_keeps)
    files = _files_of(writer)
    assert len(files) == BLOCKS and _files_of(reuser) == files
    first, second = (writer, reuser) if first_to_remove == "writer" else (reuser, writer)
    first.remove()
    assert files <= names_in(folder, GROUP_FILES), "deleted while another session uses them"
    second.remove()
    assert files <= names_in(folder, GROUP_FILES), "a session asked to keep these files"
    assert names_in(folder, LEASES) == set()


@pytest.mark.parametrize("storage", FILE_STORAGES)
def test_files_nobody_kept_are_gone_after_the_last_session(storage, tmp_path):
    """Case 6, the keep_files rule: two sessions sharing a folder and the same weights, both
    keep_files=False: the files outlive the first remove() and are gone after the second."""
    folder = tmp_path / "shared"
    first = apply_blocks(make_blocks(0), storage, folder)
    second = apply_blocks(make_blocks(0), storage, folder)
    files = _files_of(first)
    first.remove()
    assert files <= names_in(folder, GROUP_FILES)
    second.remove()
    assert names_in(folder, GROUP_FILES) == set() and names_in(folder, LEASES) == set()
