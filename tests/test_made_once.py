"""Files the ranks of one machine make once (``memmode_core.files.made_once``), under real faults: two threads and
two processes asking at once, a writer killed with SIGKILL mid-write, a made file cut short or with a byte
flipped. What must hold: one file per recipe, made once; a file is read as valid only if its bytes hash to its
name; whatever dies mid-write leaves nothing the others read; a bad file is said, deleted and made again."""

from __future__ import annotations

import logging
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

from memmode_core.contracts.errors import StagingError
from memmode_core.files.file_layout import FileLayout
from memmode_core.files.made_once import PREFIX, MadeOnce, recipe_of
from memmode_core.files.streamed import write_pieces

VALUES = {"a": torch.arange(4096, dtype=torch.float32), "b": torch.full((3, 5), 7, dtype=torch.int8)}
SPECS = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in VALUES.items()}
LAYOUT = FileLayout.of(SPECS)
RECIPE = recipe_of("a test", 1)


def make(delay: float = 0.0):
    """A maker that writes VALUES, a piece at a time, ``delay`` seconds apart; it records each call."""
    calls = []

    def write(into):
        calls.append(into)

        def pieces():
            for name, tensor in VALUES.items():
                time.sleep(delay)
                yield {name: tensor}

        return write_pieces(SPECS, pieces(), into=into)

    write.calls = calls
    return write


def assert_values(mapped) -> None:
    for name, tensor in VALUES.items():
        assert torch.equal(mapped[name], tensor), name


def made_files(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"{PREFIX}*"))


def test_the_first_makes_the_file_and_the_next_finds_it(tmp_path):
    first, second = MadeOnce(tmp_path / "shared"), MadeOnce(tmp_path / "shared")
    writer, reader = make(), make()
    kept = first.mapped(RECIPE, LAYOUT, writer)  # the lease lasts while its mapping lives
    assert_values(kept)
    assert_values(second.mapped(RECIPE, LAYOUT, reader))
    assert (first.made, first.found, second.made, second.found) == (1, 0, 0, 1)
    assert len(writer.calls) == 1 and not reader.calls
    assert len(made_files(tmp_path / "shared")) == 1
    assert not list((tmp_path / "shared").glob(".memmode-*.tmp")), "no temporary file left"


def test_two_threads_asking_at_once_make_it_once(tmp_path):
    makers = [MadeOnce(tmp_path / "shared") for _ in range(2)]
    writers = [make(delay=0.05) for _ in range(2)]
    results: list = [None, None]

    def ask(i):
        results[i] = makers[i].mapped(RECIPE, LAYOUT, writers[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for mapped in results:
        assert_values(mapped)
    assert sum(len(w.calls) for w in writers) == 1 and sum(m.found for m in makers) == 1
    assert len(made_files(tmp_path / "shared")) == 1


_CHILD = textwrap.dedent(
    """
    import sys, time, torch
    from pathlib import Path
    from memmode_core.files.file_layout import FileLayout
    from memmode_core.files.made_once import MadeOnce, recipe_of
    from memmode_core.files.streamed import write_pieces

    folder, ready, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    values = {"a": torch.arange(4096, dtype=torch.float32), "b": torch.full((3, 5), 7, dtype=torch.int8)}
    specs = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in values.items()}

    def pieces():
        yield {"a": values["a"]}
        ready.touch()
        if mode == "hang":
            time.sleep(600)
        yield {"b": values["b"]}

    made = MadeOnce(folder)
    write = lambda into: write_pieces(specs, pieces(), into=into)
    kept = made.mapped(recipe_of("a test", 1), FileLayout.of(specs), write)
    print(made.made, made.found, flush=True)
    sys.stdin.read()  # a rank keeps its mapping while it runs its model
    """
)


def _child(folder: Path, ready: Path, mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(folder), str(ready), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _wait_for(path: Path, child: subprocess.Popen) -> None:
    for _ in range(600):
        if path.exists():
            return
        assert child.poll() is None, "the child ended before it was ready"
        time.sleep(0.1)
    pytest.fail(f"{path} never appeared")


def test_a_writer_killed_mid_write_leaves_nothing_read_and_the_next_makes_the_file(tmp_path):
    folder = tmp_path / "shared"
    child = _child(folder, tmp_path / "ready", "hang")
    _wait_for(tmp_path / "ready", child)
    assert list(folder.glob(".memmode-*.tmp")), "the child is writing its temporary file"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    survivor = MadeOnce(folder)
    writer = make()
    kept = survivor.mapped(RECIPE, LAYOUT, writer)
    assert_values(kept)
    assert survivor.made == 1 and len(writer.calls) == 1, "the half-written file was never read as made"
    assert len(made_files(folder)) == 1
    assert not list(folder.glob(".memmode-*.tmp")), "the dead writer's temporary file was swept"


def test_a_process_waits_for_the_one_writing_and_finds_its_file(tmp_path):
    folder = tmp_path / "shared"
    child = _child(folder, tmp_path / "ready", "finish")
    _wait_for(tmp_path / "ready", child)
    waiting = MadeOnce(folder)
    writer = make()
    assert_values(waiting.mapped(RECIPE, LAYOUT, writer))
    out, _ = child.communicate("", timeout=120)
    made_by_child = out.split() == ["1", "0"]
    assert made_by_child and waiting.found == 1 and not writer.calls, (out, waiting.made, waiting.found)


@pytest.mark.parametrize("fault", ["truncate", "flip", "replace"])
def test_a_made_file_cut_short_or_changed_is_said_deleted_and_made_again(tmp_path, fault, caplog):
    folder = tmp_path / "shared"
    kept = MadeOnce(folder).mapped(RECIPE, LAYOUT, make())
    (victim,) = made_files(folder)
    if fault == "truncate":
        os.truncate(victim, victim.stat().st_size - 10)
    elif fault == "flip":
        with open(victim, "r+b") as file:
            file.seek(LAYOUT.data_start + 5)
            byte = file.read(1)
            file.seek(LAYOUT.data_start + 5)
            file.write(bytes([byte[0] ^ 0xFF]))
    else:
        victim.unlink()
        victim.write_bytes(b"\0" * LAYOUT.file_size)
    later = MadeOnce(folder)
    writer = make()
    with caplog.at_level(logging.WARNING, logger="memmode"):
        again = later.mapped(RECIPE, LAYOUT, writer)
    assert_values(again)
    del kept  # the first mapping saw the change to its file's pages (a private mapping shares the page cache)
    assert later.made == 1 and len(writer.calls) == 1
    assert victim.name in caplog.text and "making it again" in caplog.text
    assert len(made_files(folder)) == 1


def test_another_recipe_is_another_file(tmp_path):
    made = MadeOnce(tmp_path / "shared")
    kept = [made.mapped(RECIPE, LAYOUT, make()), made.mapped(recipe_of("a test", 2), LAYOUT, make())]
    assert kept and made.made == 2 and len(made_files(tmp_path / "shared")) == 2


def test_a_folder_that_cannot_be_made_is_a_typed_error(tmp_path):
    (tmp_path / "taken").write_text("a file, not a folder")
    with pytest.raises(StagingError, match="taken"):
        MadeOnce(tmp_path / "taken" / "shared")


def test_the_lease_lasts_while_a_mapping_lives_then_the_last_removes_the_folder(tmp_path):
    folder = tmp_path / "shared"
    made = MadeOnce(folder)
    mapped = made.mapped(RECIPE, LAYOUT, make())
    del made
    assert len(made_files(folder)) == 1, "kept while this process maps it"
    del mapped
    import gc

    gc.collect()
    assert not folder.exists(), "its last user gone, the folder went with its files"


def test_folders_whose_every_user_died_are_removed_and_those_in_use_kept(tmp_path):
    """What ``shared_folder`` does before it makes a new one: an earlier job's folder whose ranks were all killed
    (in /dev/shm it would hold memory until a restart) goes; one a live process uses stays."""
    from memmode_core.files.folder import remove_abandoned

    live = MadeOnce(tmp_path / "memmode-loading-live")
    kept = live.mapped(RECIPE, LAYOUT, make())
    dead = tmp_path / "memmode-loading-dead"
    writer = _child(dead, tmp_path / "ready", "hang")
    _wait_for(tmp_path / "ready", writer)
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    assert list(dead.iterdir()), "a killed writer leaves its lease and temporary file"
    assert remove_abandoned(tmp_path, "memmode-loading-*") == [], "a folder that just changed may be a rank's newest"
    assert remove_abandoned(tmp_path, "memmode-loading-*", min_age=0) == [dead]
    assert not dead.exists() and made_files(tmp_path / "memmode-loading-live") and kept
