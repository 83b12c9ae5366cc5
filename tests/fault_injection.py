"""Fault injection for the file storages' tests (``test_storage_faults.py``): where each group of an applied
handle is stored, copies of the weights to compare with, byte flips, and running a scenario in a forked child so
that a signal (SIGBUS from a truncated mapping) fails the test instead of killing pytest.

Imported by the child processes that those tests spawn too, so it imports nothing heavier than torch.
"""

from __future__ import annotations

import os
import pickle
import selectors
import signal
import subprocess
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

# -- what an applied handle stored where -------------------------------------------------------------


@dataclass
class StoredGroup:
    """One offloaded group of a handle: its key, its files (one per part), where the data starts in
    each, and the tensor objects (parameters and buffers) it swaps."""

    key: str
    paths: list[Path] = field(default_factory=list)
    layouts: list[Any] = field(default_factory=list)
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    @property
    def path(self) -> Path:
        assert len(self.paths) == 1, f"group {self.key} has {len(self.paths)} parts"
        return self.paths[0]

    @property
    def layout(self) -> Any:
        return self.layouts[0]


def stored_groups(handle) -> dict[str, StoredGroup]:
    """Every group of ``handle`` kept in a group file (disk, mmap), by group key."""
    runtime = handle.runtime
    files = runtime.session.files
    out = {}
    for group in runtime.groups:
        if not group.parts:
            continue
        stored = StoredGroup(group.key, tensors=[(slot.name, slot.tensor) for slot in group.slots])
        for part in group.parts:
            stored.paths.append(Path(files[part.key].path))
            stored.layouts.append(files[part.key].layout)
        out[group.key] = stored
    return out


def all_groups(handle) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Every group of ``handle`` (whatever the storage) -> the tensor objects it swaps."""
    return {g.key: [(slot.name, slot.tensor) for slot in g.slots] for g in handle.runtime.groups}


def copy_by_identity(components: dict[str, nn.Module]) -> dict[int, torch.Tensor]:
    """A copy of every parameter and buffer, keyed by the identity of the tensor object (memmode
    swaps ``.data`` of these same objects, so this survives apply and remove)."""
    out = {}
    for module in components.values():
        for _, t in module.named_parameters(remove_duplicate=False):
            out[id(t)] = t.detach().clone()
        for _, t in module.named_buffers(remove_duplicate=False):
            out[id(t)] = t.detach().clone()
    return out


def differing(groups: dict[str, list[tuple[str, torch.Tensor]]], snap: dict[int, torch.Tensor]) -> dict[str, list[str]]:
    """Group key -> names of its tensors that no longer equal the copy bit for bit (NaN never equals)."""
    out = {}
    for key, tensors in groups.items():
        bad = [name for name, t in tensors if t.data.device.type != "cpu" or not _bit_equal(t.data, snap[id(t)])]
        if bad:
            out[key] = bad
    return out


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    if a.is_floating_point():
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


# -- damaging files ------------------------------------------------------------------------------------


def data_offset(layout) -> int:
    """A byte inside the data part of a group file: the most significant byte of a float in the
    middle of its largest tensor (flipping a bit of it scales that weight by a power of two)."""
    entry = max(layout.entries, key=lambda e: e.end - e.start)
    middle = entry.start + ((entry.end - entry.start) // 2) // 4 * 4
    return layout.data_start + middle + 3


def flip_byte(path: Path, offset: int, mask: int = 0x01) -> None:
    """XOR one byte of the file in place (open r+b, seek, write): a real in-place modification."""
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        assert len(byte) == 1, f"{path} has no byte {offset}"
        file.seek(offset)
        file.write(bytes([byte[0] ^ mask]))
        file.flush()
        os.fsync(file.fileno())


def modify_in_place(path: Path, offset: int, *, keep_mtime: bool) -> None:
    """Flip a byte; with ``keep_mtime`` put the modification time back exactly as it was (what
    ``rsync -t``, ``cp -p`` or a careless tool can do), so only the content tells."""
    before = os.stat(path)
    if not keep_mtime:
        time.sleep(0.03)  # past the filesystem's timestamp granularity: the write gives a new mtime
    flip_byte(path, offset)
    if not keep_mtime and os.stat(path).st_mtime_ns == before.st_mtime_ns:
        time.sleep(1.05)  # a filesystem with coarse timestamps: write the (flipped) byte once more, later
        with open(path, "r+b") as file:
            file.seek(offset)
            byte = file.read(1)
            file.seek(offset)
            file.write(byte)
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert os.stat(path).st_mtime_ns == before.st_mtime_ns
    else:
        assert os.stat(path).st_mtime_ns != before.st_mtime_ns, "the in-place write did not change the mtime"
    assert os.stat(path).st_size == before.st_size


# -- child processes ------------------------------------------------------------------------------------


def describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"killed by signal {sig} ({signal.Signals(sig).name})"
    return f"exit code {os.WEXITSTATUS(status)}"


def in_forked_child(fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> Any:
    """Run ``fn(*args)`` in a forked copy of this process and return what it returns (pickled back).

    An exception in the child (a failed assert included) is raised here as an ``AssertionError``
    carrying the child's traceback; a child killed by a signal (SIGBUS when a mapping runs past the
    end of a truncated file) is an ``AssertionError`` saying so — pytest keeps running either way.
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(read_fd)
            try:
                payload = ("ok", fn(*args))
            except BaseException:  # noqa: BLE001 - everything goes back to the parent
                payload = ("raised", traceback.format_exc())
            try:
                data = pickle.dumps(payload)
            except Exception:  # noqa: BLE001
                data = pickle.dumps(("raised", "the child's result cannot be pickled:\n" + traceback.format_exc()))
            with os.fdopen(write_fd, "wb") as pipe:
                pipe.write(data)
        except BaseException:  # noqa: BLE001
            code = 3
        finally:
            os._exit(code)
    os.close(write_fd)
    chunks = []
    deadline = time.monotonic() + timeout
    with os.fdopen(read_fd, "rb") as pipe, selectors.DefaultSelector() as sel:
        sel.register(pipe, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError(f"the child process did not finish in {timeout:.0f} s (a hang or a deadlock)")
            chunk = os.read(pipe.fileno(), 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    data = b"".join(chunks)
    if not data:
        raise AssertionError(f"the child process died without a result: {describe_status(status)}")
    kind, value = pickle.loads(data)
    if kind == "raised":
        raise AssertionError("in the child process:\n" + value)
    return value


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The next line the child prints on stdout (opened binary, unbuffered: ``bufsize=0``), or an
    ``AssertionError`` with its stderr if it exits or says nothing for ``timeout`` seconds."""
    buffer = proc.__dict__.setdefault("_fault_lines", bytearray())
    deadline = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while b"\n" not in buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                proc.kill()
                proc.wait()
                raise AssertionError(f"child {proc.pid} printed no line for {timeout:.0f} s; stderr:\n{_stderr(proc)}")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                proc.wait()
                raise AssertionError(
                    f"child {proc.pid} ended ({describe_status_code(proc.returncode)}) "
                    f"before printing a line; stderr:\n{_stderr(proc)}"
                )
            buffer += chunk
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return line.decode().strip()


def describe_status_code(returncode: int | None) -> str:
    """A ``Popen.returncode`` in words (negative: the signal that killed it)."""
    if returncode is not None and returncode < 0:
        return f"killed by signal {-returncode} ({signal.Signals(-returncode).name})"
    return f"exit code {returncode}"


def _stderr(proc: subprocess.Popen) -> str:
    try:
        return proc.stderr.read().decode(errors="replace")[-4000:] if proc.stderr else ""
    except (OSError, ValueError):
        return ""
