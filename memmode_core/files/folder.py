"""The offload folder: where a session's group files live, who may delete them, and when.

Kept apart from the files themselves (:mod:`memmode_core.files.store`) because it is about
processes, not bytes:

- a folder is either **private** — ``mkdtemp``, nobody else's, removed with everything in it at
  ``close()`` and at interpreter exit — or **given** by the caller, shared with whoever else uses it;
- a given folder is shared safely: a session takes an ``flock`` of the folder while it checks or
  writes files (so concurrent writers of the same content write it once and end up mapping the same
  file), and holds a **lease** for its whole life, a small locked file listing the files it uses,
  so that no session deletes a file that another live session still reads. A file its writer may
  not delete yet is handed over, and the last user deletes it; a file survives if any session that
  used it asked for ``keep_files=True``;
- what a process killed mid-run left (its files, its lease: its lock is gone) is collected by the
  next session that reserves room in the folder, unless that process asked to keep its files;
- cleanup runs from a ``weakref.finalize``, so it also happens at interpreter exit, and never in a
  process forked from the one that made the folder; a cleanup the garbage collector starts while its
  own thread holds (or is taking) the folder's lock through another session, or another cleanup, runs when
  that thread lets go of it (:func:`holding`, :mod:`~memmode_core.files.folder_holders`: otherwise it waits
  forever on its own thread).

POSIX only (``fcntl.flock``).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

from memmode_core.files import folder_holders

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

#: times :meth:`OffloadFolder.open` makes a shared folder again that its last user removed meanwhile
_OPEN_ATTEMPTS = 8
#: memmode's bookkeeping files start with a dot: leases, and temporary files being written
LEASE_PATTERN = ".memmode-*.lease"
#: a lease being created: locked first, then renamed to its ``.lease`` name
PENDING_LEASE_SUFFIX = ".newlease"
TEMP_PREFIX, TEMP_SUFFIX = ".memmode-", ".tmp"


class OffloadFolder:
    """One session's use of a folder (see the module docstring). :meth:`open` it before use."""

    def __init__(self, path: str | os.PathLike | None, *, keep_files: bool, remove_when_empty: bool = False) -> None:
        self.private = path is None
        self.path: Path | None = None if path is None else Path(os.fsdecode(path)).absolute()
        self._cleanup = _Cleanup(keep_files)
        #: a folder made for the ranks of one machine (:mod:`memmode_core.files.node`): the last to leave removes it
        self._cleanup.remove_when_empty = remove_when_empty
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
            self._cleanup.folder_fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            return
        for _ in range(_OPEN_ATTEMPTS):
            try:
                self.path.mkdir(parents=True, exist_ok=True)
                self._cleanup.folder_fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            except (FileExistsError, FileNotFoundError):
                # its last user removed it between mkdir's "exists" and mkdir's own check that it is a folder
                # (FileExistsError), or between mkdir and open (FileNotFoundError): make it again
                continue
            with self.locked():  # a scan (lock held) never meets a lease being created
                if self._still_there():
                    self._cleanup.lease = _Lease.create(self.path, keep=self._cleanup.keep_files)
                    return
            # the folder the ranks of this machine share was removed by its last user between our mkdir and our
            # lock (``remove_when_empty``): make it again
            os.close(self._cleanup.folder_fd)
            self._cleanup.folder_fd = None
        raise OSError(f"{self.path} kept disappearing while it was opened")

    def _still_there(self) -> bool:
        """Whether the folder we opened is still the one at our path (its last user may have removed it)."""
        try:
            return os.stat(self.path).st_ino == os.fstat(self._cleanup.folder_fd).st_ino
        except FileNotFoundError:
            return False

    def locked(self) -> contextlib.AbstractContextManager[None]:
        """Hold the folder's lock: one session at a time checks, writes or deletes files in it."""
        return holding(self._cleanup.folder_fd)

    def temporary_file(self) -> tuple[int, str]:
        """A new temporary file in the folder (same filesystem, so it can be renamed into place), locked
        (``flock``) through the returned descriptor until it is closed: the mark of a live writer, which
        :meth:`sweep_temporaries` leaves alone. Call with the folder lock held, so that no sweep meets the file
        between its creation and its lock."""
        fd, path = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        return fd, path

    def sweep_temporaries(self) -> None:
        """Delete temporary files whose writer died. Call with the folder lock held. A live writer holds
        its file's own lock until the file is renamed into place or deleted (a group may be written in the
        background while the folder is unlocked); the kernel drops the lock of a process that died, so
        every temporary file that can be locked is an orphan."""
        for stale in self.path.glob(f"{TEMP_PREFIX}*{TEMP_SUFFIX}"):
            if _writer_alive(stale) is False:  # nobody locks a dead writer's file again: its name is unique
                stale.unlink(missing_ok=True)

    def collect_dead(self) -> list[str]:
        """Remove what sessions killed mid-run left here (see :func:`collect_dead`). Call with the
        lock held."""
        if self.private:
            return []
        return collect_dead(self.path)

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

    def publish(self, temporary: str, name: str) -> Path:
        """Put a written temporary file under ``name`` (a rename: the name only ever points at a complete file) as
        this session's, recorded in the lease before the rename: a process killed anywhere in between leaves a
        temporary file nobody locks (swept) or a file its dead lease owns (collected), never a file nobody owns.
        Call with the lock held. Raises ``OSError``; the temporary file is then still there."""
        self.wrote(name)
        path = self.path / name
        os.replace(temporary, path)
        return path

    def close(self) -> None:
        """Remove a private folder; in a given one, delete what this session may (see the module
        docstring) and drop the lease. Idempotent; also runs at interpreter exit."""
        self._finalizer()


@contextlib.contextmanager
def holding(fd: int) -> Iterator[None]:
    """Hold the lock (``flock``) of the folder open as ``fd``, this thread's hold known to
    :mod:`~memmode_core.files.folder_holders` from before the lock is taken until after it is let go: a session's
    cleanup the garbage collector runs meanwhile in this thread is deferred until then, never left waiting on a lock
    its own thread holds. Every blocking lock of a folder in this module is taken here."""
    folder_holders.enter(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        for cleanup in folder_holders.leave(fd):
            cleanup()
        raise
    try:
        yield
    finally:
        waited = folder_holders.leave(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        for cleanup in waited:
            cleanup()


class _Cleanup:
    """What a session leaves in its folder and must undo: kept apart from :class:`OffloadFolder`
    so that the finalizer that runs it at exit does not keep the folder object alive."""

    def __init__(self, keep_files: bool) -> None:
        self.keep_files = keep_files
        self.private_folder: Path | None = None
        self.folder_fd: int | None = None
        self.lease: _Lease | None = None
        self.remove_when_empty = False
        #: a child forked from this process inherits the finalizer, not the files: it must not clean up
        self.pid = os.getpid()

    def __call__(self) -> None:
        if os.getpid() != self.pid:
            return
        if self.lease is not None and self.folder_fd is not None and folder_holders.defer(self.folder_fd, self):
            return  # this thread holds the folder's lock through another session: run when it lets go
        try:
            if self.private_folder is not None:
                shutil.rmtree(self.private_folder, ignore_errors=True)
            elif self.lease is not None:
                with holding(self.folder_fd):
                    self.lease.finish(keep=self.keep_files)
                    if self.remove_when_empty:
                        with contextlib.suppress(OSError):  # not empty: another session still uses it
                            os.rmdir(self.lease.path.parent)
        finally:
            if self.folder_fd is not None:
                os.close(self.folder_fd)
                self.folder_fd = None


class _Lease:
    """A session's claim on files of a shared folder: ``.memmode-<pid>-<token>.lease``.

    The session holds an exclusive ``flock`` on it for its whole life, so others can tell a live
    lease (the lock is taken) from one left by a process that died (the kernel dropped the lock —
    unlike a pid, which the system reuses, a lock cannot outlive its process). The lease is created
    under another name, locked, and only then renamed into place, so no other session ever sees
    it unlocked while its process lives.

    Lines are ``use <name>`` (the session reads the file), ``own <name>`` (the session, or one
    that handed it over, wrote it and it should be deleted once nobody uses it), ``keep`` (the
    session was opened with ``keep_files=True``: its files outlive it, even if it crashes) and
    ``keep <name>`` (a session that asked to keep files used this one: its owner must not delete it).
    Every method runs with the folder lock held.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    def create(cls, folder: Path, keep: bool = False) -> _Lease:
        stem = f".memmode-{os.getpid()}-{secrets.token_hex(6)}"
        pending = folder / f"{stem}{PENDING_LEASE_SUFFIX}"
        fd = os.open(pending, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if keep:
                os.write(fd, b"keep\n")
            path = folder / f"{stem}.lease"
            os.rename(pending, path)
        except BaseException:
            os.close(fd)
            pending.unlink(missing_ok=True)
            raise
        return cls(path, fd)

    def record(self, what: str, name: str) -> None:
        os.write(self.fd, f"{what} {name}\n".encode())

    def finish(self, keep: bool) -> None:
        """Drop the lease. Unless ``keep``, delete the owned files nobody else uses or keeps and hand
        the others over to a session that uses them; with ``keep``, make sure the owners of files
        this session used do not delete them either (a file survives if any user asked to keep it)."""
        mine = _read_lease(self.path)
        live, dead = _scan(self.path.parent, self.path)
        if keep:
            for other, entries in {**live, **dead}.items():
                for name in sorted(entries["own"] & (mine["use"] | mine["own"])):
                    _append(other, f"keep {name}")
        else:
            _dispose(self.path.parent, mine, live)
        collect_dead(self.path.parent, live, dead)
        self.path.unlink(missing_ok=True)
        os.close(self.fd)


def _scan(folder: Path, own: Path | None = None) -> tuple[dict[Path, dict], dict[Path, dict]]:
    """Every other lease in ``folder``, split into live ones and ones whose process died."""
    live: dict[Path, dict] = {}
    dead: dict[Path, dict] = {}
    for path in [*folder.glob(LEASE_PATTERN), *folder.glob(f".memmode-*{PENDING_LEASE_SUFFIX}")]:
        if path == own:
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            live[path] = _read_lease(path)
        else:
            dead[path] = _read_lease(path)
        finally:
            os.close(fd)
    return live, dead


#: seconds a folder is left alone by :func:`remove_abandoned` after it last changed: one a rank has just made may
#: not have its first lease yet
ABANDONED_AFTER = 60.0


def remove_abandoned(parent: Path, pattern: str, *, min_age: float = ABANDONED_AFTER) -> list[Path]:
    """Remove, with everything in them, the folders under ``parent`` matching ``pattern`` that no live session uses:
    the folders ranks of earlier jobs shared (:mod:`memmode_core.files.node`), left behind when every rank was
    killed — in ``/dev/shm`` they hold memory until the machine restarts. A folder is judged and removed holding
    its lock, so a session opening it meanwhile finds it gone and makes it again (:meth:`OffloadFolder.open`); one
    whose lock is held, or with a live lease or a temporary file still being written, or that changed in the last
    ``min_age`` seconds, is left. Returns the removed."""
    removed = []
    now = time.time()
    for folder in parent.glob(pattern):
        try:
            if now - folder.stat().st_mtime < min_age:
                continue
            fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            live, _ = _scan(folder)
            if not live and not _being_written(folder):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
        except OSError:  # locked: in use
            pass
        finally:
            os.close(fd)
    return removed


def _being_written(folder: Path) -> bool:
    """Whether a temporary file of ``folder`` is locked by its writer."""
    return any(_writer_alive(path) for path in folder.glob(f"{TEMP_PREFIX}*{TEMP_SUFFIX}"))


def _writer_alive(path: Path) -> bool | None:
    """Whether the temporary file at ``path`` is locked by its writer (None: it is gone). The kernel drops the lock
    of a process that died, so a file that can be locked is an orphan."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def collect_dead(folder: Path, live: dict[Path, dict] | None = None, dead: dict[Path, dict] | None = None) -> list[str]:
    """Clean up after sessions whose process died (a crash, ``kill -9``): delete the files they
    owned that no live session uses and nobody asked to keep, hand the others over to a live user,
    and remove their leases. Never touches a live session's files. Call with the folder lock held.
    Returns the names of the files deleted."""
    if live is None or dead is None:
        live, dead = _scan(folder)
    deleted: list[str] = []
    for path, entries in dead.items():
        if not entries["keep_all"]:
            deleted += _dispose(folder, entries, live)
        path.unlink(missing_ok=True)
    return deleted


def _dispose(folder: Path, entries: dict, live: dict[Path, dict]) -> list[str]:
    """Delete or hand over the files a finished (or dead) session owned."""
    deleted = []
    for name in sorted(entries["own"] - entries["kept"]):
        if any(name in other["kept"] or (other["keep_all"] and name in other["use"]) for other in live.values()):
            continue  # a live session that keeps its files uses it: it stays, whoever ends first
        users = [lease for lease, other in live.items() if name in other["use"]]
        if users:
            _append(users[0], f"own {name}")
            live[users[0]]["own"].add(name)
        else:
            (folder / name).unlink(missing_ok=True)
            deleted.append(name)
    return deleted


def _append(lease: Path, line: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        with open(lease, "a") as file:
            file.write(line + "\n")


def _read_lease(path: Path) -> dict:
    entries: dict = {"use": set(), "own": set(), "kept": set(), "keep_all": False}
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            what, _, name = line.partition(" ")
            if what == "keep":
                if name:
                    entries["kept"].add(name)
                else:
                    entries["keep_all"] = True
            elif what in ("use", "own") and name:
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
