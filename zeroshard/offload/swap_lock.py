"""A rank's swap directory at start: its exclusive lock, a crashed run's leftovers, the O_DIRECT probe.

The lock is an flock on `<rank dir>/.lock`, held for the SwapDir's life, and
the file holds the holder's pid. flock locks belong to an open file, so a
second SwapDir on the same root and rank fails even in the same process, and
the kernel drops the lock when a process dies however it dies: a lock file
nobody holds means its run ended, and whatever else is in the directory is
that run's leftovers, removed before this run allocates its own files.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
from pathlib import Path

from zeroshard.offload.errors import OffloadError, errno_name, io_error
from zeroshard.offload.memory import ALIGN, aligned_empty

log = logging.getLogger(__name__)

LOCK = ".lock"
PROBE = ".probe"
_ATTEMPTS = 20  # a lock file removed by its previous holder between our open and our flock: try again


def lock(directory: Path) -> tuple[int, int | None]:
    """Create `directory` (and its parents) and lock it: (the lock file's fd, the previous holder's pid or None).

    Raises OffloadError naming the other run's pid when another SwapDir holds it.
    """
    path = directory / LOCK
    for _ in range(_ATTEMPTS):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            continue  # the previous holder removed the directory just now
        except OSError as exc:
            raise io_error("creating the swap directory", directory, exc) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _pid_in(fd)
            os.close(fd)
            raise _held(directory, holder) from None
        try:
            if _same_file(path, fd):
                previous = _pid_in(fd)
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return fd, previous
        except OSError as exc:
            os.close(fd)
            raise io_error("writing the lock file", path, exc) from exc
        os.close(fd)  # we locked a file its holder unlinked at close: lock the new one
    raise OffloadError(f"could not lock the swap directory {directory}: its lock file keeps being removed by "
                       "another process; make sure no other run uses this nvme_path and rank", path=directory)


def _held(directory: Path, holder: int | None) -> OffloadError:
    who = "an unknown pid" if holder is None else f"pid {holder}"
    if holder == os.getpid():
        who += " (this process: a SwapDir on this root and rank is already open; close it first)"
    return OffloadError(f"the swap directory {directory} is in use by another run ({who}): two runs on one nvme_path "
                        "would overwrite each other's swap files; wait for that run to end, or point nvme_path "
                        "elsewhere", path=directory, errno=errno.EWOULDBLOCK)


def _pid_in(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


def _same_file(path: Path, fd: int) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def remove_leftovers(directory: Path, previous: int | None) -> None:
    """Remove everything but the lock file from a directory we hold the lock of (a crashed run's files)."""
    found = [entry for entry in directory.iterdir() if entry.name != LOCK]
    if not found:
        return
    size = 0
    for entry in found:
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                size += entry.lstat().st_size
                entry.unlink()
        except OSError as exc:
            raise io_error("removing the leftover swap file", entry, exc) from exc
    who = "" if previous is None else f" (pid {previous})"
    log.info("offload: removed %d leftover swap files (%d bytes) under %s, left by a run%s that ended without "
             "removing them", len(found), size, directory, who)


def probe_direct(directory: Path) -> str | None:
    """Write and read back ALIGN bytes with O_DIRECT in `directory`: None if that works, else why it does not.

    An error other than O_DIRECT's refusal (EINVAL) is raised as OffloadError:
    this is also the check that the directory is writable and has room.
    """
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    path = directory / PROBE
    out = aligned_empty(ALIGN)
    out.fill_(0x5A)
    back = aligned_empty(ALIGN)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return "the filesystem refuses O_DIRECT (EINVAL at open)"
        raise io_error("creating the O_DIRECT probe file", path, exc) from exc
    try:
        os.pwritev(fd, [memoryview(out.numpy())], 0)
        os.preadv(fd, [memoryview(back.numpy())], 0)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return f"the filesystem refuses O_DIRECT requests ({errno_name(exc.errno)} at the first write or read)"
        raise io_error("writing the O_DIRECT probe file", path, exc) from exc
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    if not bool((back == out).all()):
        return "an O_DIRECT write read back different bytes"
    return None


def unlock(directory: Path, fd: int) -> None:
    """Remove the lock file and the directory (and its parent when empty), then release the lock."""
    try:
        (directory / LOCK).unlink(missing_ok=True)
        for d in (directory, directory.parent):
            try:
                d.rmdir()
            except OSError:
                break  # not empty: other ranks' directories, or files we did not make
    finally:
        os.close(fd)
