"""SwapDir: one rank's swap files under nvme_path (ZeRO-Infinity's disk pool), their threads and their lifetime.

```
<root>/zeroshard-swap/rank<rank>/
  .lock            flock'd for the SwapDir's life; holds the owner's pid
  <name>           one pre-allocated file per SwapDir.file(name, nbytes)
```

Everything that can fail before training does fails at construction, on
every rank: a missing or unwritable root, another run on the same root and
rank, a full disk (each file is fallocated when it is made, so a step never
meets ENOSPC halfway). O_DIRECT is probed once: with it, transfers bypass the
page cache (the host memory the offload is freeing stays free); where the
filesystem refuses it (ramfs; tmpfs before Linux 6.6), I/O is buffered and
one INFO line says so. Nothing is fsync'd: swap files never outlive the
process (a restart reads a checkpoint, never a swap file), and `close()`,
a finalizer and interpreter exit delete them; a crashed run's files are
deleted by the next SwapDir on that root and rank.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import threading
import weakref
from pathlib import Path

import torch

from zeroshard.offload import swap_lock
from zeroshard.offload.errors import OffloadError, errno_name, fix_for, io_error
from zeroshard.offload.memory import ALIGN, aligned_empty, round_up
from zeroshard.offload.pool import Job, WorkerPool
from zeroshard.offload.swap_file import SwapFile
from zeroshard.offload.transfer import Poison

log = logging.getLogger(__name__)

SWAP_DIR = "zeroshard-swap"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # no path separators, nothing hidden (the lock, the probe)


class _Shared:
    """What a SwapDir's files share, and what its finalizer releases.

    The files point here, not at the SwapDir, and nothing here points at the
    SwapDir: so a SwapDir nobody holds is collected, and its finalizer deletes
    the files (a SwapFile kept beyond it then refuses to work).
    """

    def __init__(self, path: Path, lock_fd: int, pool: WorkerPool, block_size: int, direct: bool,
                 poison: Poison | None):
        self.path = path
        self.lock_fd = lock_fd
        self.pool = pool
        self.block_size = block_size  # bytes per I/O request, a multiple of ALIGN
        self.direct = direct
        self.poison = poison
        self.files: dict[str, SwapFile] = {}
        self.closed = False
        self._bounce = threading.local()  # each worker thread's aligned bounce buffer (up to block_size bytes)
        self.bounces: list[torch.Tensor] = []  # every bounce buffer, for the host pool's report

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"the SwapDir {self.path} is closed (its files are deleted): create another")

    def submit(self, job: Job) -> Job:
        return self.pool.submit(job)

    def bounce(self, nbytes: int) -> torch.Tensor:
        """This worker thread's bounce buffer: its first round_up(nbytes, ALIGN) bytes (nbytes <= block_size)."""
        buf = getattr(self._bounce, "buf", None)
        if buf is None or buf.numel() < round_up(nbytes):  # as large as needed: a tail needs only ALIGN bytes
            self.bounces = [b for b in self.bounces if b is not buf] + [aligned_empty(nbytes)]
            buf = self._bounce.buf = self.bounces[-1]
        return buf[: round_up(nbytes)]


def _release(shared: _Shared) -> None:
    """Wait for the transfers in flight, delete the files and the directory, unlock. Runs once."""
    shared.closed = True
    shared.pool.close()
    try:
        for f in shared.files.values():
            f.close_fd()
            f.path.unlink(missing_ok=True)
    finally:
        swap_lock.unlock(shared.path, shared.lock_fd)


class SwapDir:
    """One rank's swap files under `root`/zeroshard-swap/rank`rank`/, and the threads that move them.

    `threads`: worker threads shared by all its files' transfers. `block_size`:
    bytes per I/O request (a multiple of ALIGN); a transfer is split into such
    chunks, served round robin with the other transfers in flight. `poison`:
    the copy-discipline test mode (`Poison.from_env()`). `o_direct=False` turns
    O_DIRECT off even where the filesystem allows it. Keep the SwapDir as long
    as its files are used: `close()`, or its collection, deletes them.
    """

    def __init__(self, root: str | os.PathLike, rank: int, *, threads: int = 2, block_size: int = 1 << 20,
                 poison: Poison | None = None, o_direct: bool = True):
        if block_size <= 0 or block_size % ALIGN:
            raise ValueError(f"SwapDir: block_size must be a positive multiple of {ALIGN} bytes, got {block_size}")
        self.root = Path(root)
        self.rank = rank
        self.block_size = block_size
        self.poison = poison
        self.path = self.root / SWAP_DIR / f"rank{rank}"
        _check_root(self.root)
        lock_fd, previous = swap_lock.lock(self.path)
        try:
            swap_lock.remove_leftovers(self.path, previous)
            refused = swap_lock.probe_direct(self.path) if o_direct else "O_DIRECT was turned off (o_direct=False)"
        except BaseException:
            swap_lock.unlock(self.path, lock_fd)
            raise
        self.direct = refused is None  # whether the files are opened with O_DIRECT
        if refused is not None and o_direct:
            log.info("offload: swap files under %s use buffered I/O through the page cache: %s (no fsync: swap "
                     "files never outlive the process)", self.path, refused)
        pool = WorkerPool(threads, f"zeroshard-swap-rank{rank}")
        self._shared = _Shared(self.path, lock_fd, pool, block_size, self.direct, poison)
        self._finalizer = weakref.finalize(self, _release, self._shared)  # also runs at interpreter exit

    def file(self, name: str, nbytes: int) -> SwapFile:
        """A new swap file of `nbytes` bytes, pre-allocated (round_up(nbytes, ALIGN) bytes on disk).

        `name` is a stable name chosen by the caller ("bucket3.master"), unique in
        this SwapDir. A disk without room raises OffloadError (ENOSPC) here.
        """
        self._shared.check_open()
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"swap file name {name!r}: use letters, digits, '_', '.' and '-', not starting with "
                             "'.' or '-' (a stable name such as 'bucket3.master')")
        if name in self._shared.files:
            raise ValueError(f"swap file name {name!r} is already taken in {self.path}: each file needs its own name")
        if nbytes < 0:
            raise ValueError(f"swap file {name!r}: nbytes must be >= 0, got {nbytes}")
        path = self.path / name
        fd = self._allocate(path, round_up(nbytes))
        f = SwapFile(self._shared, name, nbytes, path, fd)
        self._shared.files[name] = f
        return f

    def _allocate(self, path: Path, size: int) -> int:
        """Create `path` with `size` bytes allocated on disk; then switch it to O_DIRECT if in use."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise io_error("creating swap file", path, exc) from exc
        try:
            if size:
                os.posix_fallocate(fd, 0, size)  # unaligned fallbacks of glibc need a buffered fd: O_DIRECT after
            if self.direct:
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise self._allocation_error(path, size, exc) from exc
        return fd

    def _allocation_error(self, path: Path, size: int, exc: OSError) -> OffloadError:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            return io_error("allocating swap file", path, exc)
        try:
            st = os.statvfs(self.path)
            free = f"{st.f_bavail * st.f_frsize} bytes are free there"
        except OSError:
            free = "the free space is unknown"
        return OffloadError(f"no room on nvme_path {self.root} for rank {self.rank}'s swap file {path}: it needs "
                            f"{size} bytes, besides the {self.nbytes()} bytes of this rank's swap files already "
                            f"allocated; {free} ({errno_name(exc.errno)}); {fix_for(exc.errno)}", path=path,
                            errno=exc.errno)

    def buffers(self) -> list[torch.Tensor]:
        """The worker threads' bounce buffers: host memory of this SwapDir (declared staging of the host pool)."""
        return list(self._shared.bounces)

    def nbytes(self) -> int:
        """Bytes on disk of the files this SwapDir holds (the disk pool of this rank): each nbytes rounded to ALIGN."""
        return sum(f.file_bytes() for f in self._shared.files.values())

    def close(self) -> None:
        """Wait for the transfers in flight, delete the files and the rank directory, release the lock. Idempotent."""
        self._finalizer()

    def __enter__(self) -> SwapDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"SwapDir({str(self.path)!r}, files={len(self._shared.files)}, nbytes={self.nbytes()}, "
                f"direct={self.direct})")


def _check_root(root: Path) -> None:
    """nvme_path must be an existing directory (a typo should not create a tree somewhere unexpected)."""
    if not root.exists():
        raise OffloadError(f"nvme_path {root} does not exist (ENOENT); {fix_for(errno.ENOENT)}", path=root,
                           errno=errno.ENOENT)
    if not root.is_dir():
        raise OffloadError(f"nvme_path {root} is not a directory (ENOTDIR); {fix_for(errno.ENOTDIR)}", path=root,
                           errno=errno.ENOTDIR)
