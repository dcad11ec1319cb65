"""OffloadError and the wording of offload's failures: the path, the cause (errno name) and the fix."""

from __future__ import annotations

import errno as errnos
import os

from zeroshard.errors import ZeroshardError

# The fix for each errno a swap file may meet; the others get the generic one.
_FIXES = {
    errnos.ENOSPC: ("free space on that disk, point nvme_path at a larger one (every rank of the machine keeps "
                    "its own swap files there), or offload to the host instead (device \"cpu\") if it has the "
                    "memory; `zeroshard estimate --offload-optimizer nvme` prints each rank's disk pool"),
    errnos.EDQUOT: "raise the disk quota, point nvme_path elsewhere, or offload to the host instead (device \"cpu\")",
    errnos.EACCES: "give this user write permission there, or point nvme_path elsewhere",
    errnos.EPERM: "give this user write permission there, or point nvme_path elsewhere",
    errnos.EROFS: "the filesystem is mounted read-only: point nvme_path at a writable disk",
    errnos.ENOENT: "create the directory or point nvme_path at an existing one",
    errnos.ENOTDIR: "a file stands where a directory is expected: point nvme_path at a directory",
    errnos.EIO: "the disk reported an I/O error: check the device (dmesg, SMART) or point nvme_path elsewhere",
    errnos.EMFILE: "raise the open-file limit (ulimit -n) or use fewer, larger swap files",
}
_GENERIC_FIX = "check the disk and the path, or point nvme_path elsewhere"
DAMAGED_FIX = ("the swap file changed between its write and this read (another process, or the disk): this run's "
               "offloaded state is lost, the last checkpoint is intact: restart from it, and check the disk "
               "(dmesg, SMART)")


class OffloadError(ZeroshardError, OSError):
    """Offload's host memory or swap files failed; the message names the path, the cause and the fix.

    `path` is the file or directory concerned (None when there is none) and
    `errno` the operating system's error number when one caused it.
    """

    def __init__(self, message: str, *, path: str | os.PathLike | None = None, errno: int | None = None):
        super().__init__(message)
        self.path = None if path is None else str(path)
        self.filename = self.path  # OSError's name for it
        self.errno = errno

    def __str__(self) -> str:  # OSError would print "[Errno None] None" once errno is set
        return str(self.args[0]) if self.args else ""


def errno_name(code: int | None) -> str:
    """ENOSPC for 28; "errno N" for a number the platform does not name."""
    return errnos.errorcode.get(code, f"errno {code}") if code is not None else "no errno"


def fix_for(code: int | None) -> str:
    return _FIXES.get(code, _GENERIC_FIX)


def io_error(doing: str, path: str | os.PathLike, exc: OSError) -> OffloadError:
    """An OSError met while `doing` ("writing swap file", ...) on `path`, as an OffloadError.

    An OffloadError passes through unchanged.
    """
    if isinstance(exc, OffloadError):
        return exc
    name = errno_name(exc.errno)
    cause = exc.strerror or str(exc)
    err = OffloadError(f"{doing} {path} failed: {name} ({cause}); {fix_for(exc.errno)}", path=path, errno=exc.errno)
    err.__cause__ = exc
    return err


def damaged(path: str | os.PathLike, detail: str) -> OffloadError:
    """The error a read raises when a swap file no longer holds what was written."""
    return OffloadError(f"swap file {path} is damaged: {detail}; {DAMAGED_FIX}", path=path)
