"""The offload folder: where a session's group files live, who may delete them, and when.

Kept apart from the files themselves (:mod:`memmode_core.files.store`) because it is about
processes, not bytes:

- a folder is either **private** — ``mkdtemp``, nobody else's, removed with everything in it at
  ``close()`` and at interpreter exit — or **given** by the caller, shared with whoever else uses it;
- a given folder is shared safely: a session takes an ``flock`` of the folder while it checks or
  writes files (so concurrent writers of the same content write it once and end up mapping the same
  file), and holds a **lease** for its whole life, a small locked file listing the files it uses,
  so that no session deletes a file that another live session still reads. A file its writer may
  not delete yet is handed over, and the last user deletes it; a lease whose process died (its lock
  is gone) is ignored and removed;
- cleanup runs from a ``weakref.finalize``, so it also happens at interpreter exit, and never in a
  process forked from the one that made the folder.

POSIX only (``fcntl.flock``).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Iterator

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

#: memmode's bookkeeping files start with a dot: leases, and temporary files being written
LEASE_PATTERN = ".memmode-*.lease"
TEMP_PREFIX, TEMP_SUFFIX = ".memmode-", ".tmp"


class OffloadFolder:
    """One session's use of a folder (see the module docstring). :meth:`open` it before use."""

    def __init__(self, path: str | os.PathLike | None, *, keep_files: bool) -> None:
        self.private = path is None
        self.path: Path | None = None if path is None else Path(os.fsdecode(path)).absolute()
        self._cleanup = _Cleanup(keep_files)
        self._finalizer = weakref.finalize(self, self._cleanup)

    @property
    def opened(self) -> bool:
        return self._cleanup.folder_fd is not None

    def open(self) -> None:
        """Create the folder (a private one, or the given path) and take the lease. Raises ``OSError``."""
        if self.opened:
            return
        if self.private:
            self.path = Path(tempfile.mkdtemp(prefix="memmode-"))
            self._cleanup.private_folder = self.path
        else:
            self.path.mkdir(parents=True, exist_ok=True)
        self._cleanup.folder_fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        if not self.private:
            self._cleanup.lease = _Lease.create(self.path)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the folder's lock: one session at a time checks, writes or deletes files in it."""
        fcntl.flock(self._cleanup.folder_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._cleanup.folder_fd, fcntl.LOCK_UN)

    def temporary_file(self) -> tuple[int, str]:
        """A new temporary file in the folder (same filesystem, so it can be renamed into place)."""
        return tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=self.path)

    def sweep_temporaries(self) -> None:
        """Delete temporary files whose writer died. Call with the lock held: a live writer holds it
        for the whole write, so every temporary file seen then is an orphan."""
        for stale in self.path.glob(f"{TEMP_PREFIX}*{TEMP_SUFFIX}"):
            stale.unlink(missing_ok=True)

    def sync(self) -> None:
        """``fsync`` the folder itself, so that a rename in it survives a crash."""
        os.fsync(self._cleanup.folder_fd)

    def claim(self, name: str) -> None:
        """Record in the lease that this session reads ``name``. Call with the lock held, before
        looking at the file: a session closing meanwhile then sees the claim and keeps the file."""
        if self._cleanup.lease is not None:
            self._cleanup.lease.record("use", name)

    def wrote(self, name: str) -> None:
        """Record in the lease that this session wrote ``name``: it deletes it when done (unless
        ``keep_files``), or hands it over to a session still using it."""
        if self._cleanup.lease is not None:
            self._cleanup.lease.record("own", name)

    def close(self) -> None:
        """Remove a private folder; in a given one, delete what this session may (see the module
        docstring) and drop the lease. Idempotent; also runs at interpreter exit."""
        self._finalizer()


class _Cleanup:
    """What a session leaves in its folder and must undo: kept apart from :class:`OffloadFolder`
    so that the finalizer that runs it at exit does not keep the folder object alive."""

    def __init__(self, keep_files: bool) -> None:
        self.keep_files = keep_files
        self.private_folder: Path | None = None
        self.folder_fd: int | None = None
        self.lease: _Lease | None = None
        #: a child forked from this process inherits the finalizer, not the files: it must not clean up
        self.pid = os.getpid()

    def __call__(self) -> None:
        if os.getpid() != self.pid:
            return
        try:
            if self.private_folder is not None:
                shutil.rmtree(self.private_folder, ignore_errors=True)
            elif self.lease is not None:
                fcntl.flock(self.folder_fd, fcntl.LOCK_EX)
                try:
                    self.lease.finish(keep=self.keep_files)
                finally:
                    fcntl.flock(self.folder_fd, fcntl.LOCK_UN)
        finally:
            if self.folder_fd is not None:
                os.close(self.folder_fd)
                self.folder_fd = None


class _Lease:
    """A session's claim on files of a shared folder: ``.memmode-<pid>-<token>.lease``.

    The session holds an exclusive ``flock`` on it for its whole life, so others can tell a live
    lease (the lock is taken) from one left by a process that died (the kernel dropped the lock).
    Lines are ``use <name>`` (the session reads the file) and ``own <name>`` (the session, or one
    that handed it over, wrote it and it should be deleted once nobody uses it).
    Every method runs with the folder lock held.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    def create(cls, folder: Path) -> "_Lease":
        path = folder / f".memmode-{os.getpid()}-{secrets.token_hex(6)}.lease"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return cls(path, fd)

    def record(self, what: str, name: str) -> None:
        os.write(self.fd, f"{what} {name}\n".encode())

    def finish(self, keep: bool) -> None:
        """Drop the lease; unless ``keep``, delete the owned files nobody else uses and hand the
        others over to a session that uses them."""
        owned = set() if keep else _read_lease(self.path)["own"]  # with files handed over to this one
        others = self._live_others() if owned else {}
        for name in sorted(owned):
            users = [lease for lease, entries in others.items() if name in entries["use"]]
            if users:
                with open(users[0], "a") as handover:
                    handover.write(f"own {name}\n")
            else:
                (self.path.parent / name).unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)
        os.close(self.fd)

    def _live_others(self) -> dict[Path, dict[str, set[str]]]:
        live = {}
        for path in self.path.parent.glob(LEASE_PATTERN):
            if path == self.path:
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                live[path] = _read_lease(path)
            else:  # its process is gone: the lease is stale
                path.unlink(missing_ok=True)
            finally:
                os.close(fd)
        return live


def _read_lease(path: Path) -> dict[str, set[str]]:
    entries: dict[str, set[str]] = {"use": set(), "own": set()}
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            what, _, name = line.partition(" ")
            if what in entries and name:
                entries[what].add(name)
    return entries


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding ``path`` (``"ext4"``, ``"tmpfs"``...), where the OS says."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    resolved = str(path.resolve())
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])  # a space is \040
        if (resolved == mount or resolved.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return kind
