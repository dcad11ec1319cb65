"""The resident memory of a training step on the CPU, measured: the process's RSS high-water mark.

On a GPU the allocator reports its peak (`torch.cuda.max_memory_allocated`);
on the CPU tensors come from glibc's malloc, so the honest measure is the
kernel's: `VmHWM` in /proc/self/status, the largest resident set the process
reached, which writing "5" to /proc/self/clear_refs resets to the present
RSS (Linux 4.0 and later). `ResidentMeter` takes the RSS once before the
model is built (the interpreter, torch, the process group: not the step's)
and reports a step's peak above it.

Two things would blur the measure, and `release_freed` removes both: glibc
keeps freed blocks in its heap (a tensor freed in the step would stay
resident, and one allocated later reuse it unseen), so freed blocks of 64
KiB and more are handed back at once (`return_freed_blocks`: the mmap
threshold fixed at 64 KiB, for the rest of the process) and the heap is
trimmed before each reading. The first forward and backward of a process
also fault in code and kernel tables (file-backed and anonymous pages of
torch's libraries) that stay: a warm-up step before the baseline keeps
them out of the step's figure (`rss()` by kind lets a caller check that
the file-backed part did not move).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

from zeroshard.offload.memory import return_freed_blocks

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def status_bytes(*fields: str) -> dict[str, int]:
    """Fields of /proc/self/status in bytes (VmRSS, VmHWM, RssAnon, RssFile, ...)."""
    out = {}
    for line in _STATUS.read_text().splitlines():
        key, _, value = line.partition(":")
        if key in fields:
            out[key] = int(value.split()[0]) * 1024  # the kernel writes kB (KiB)
    missing = set(fields) - out.keys()
    if missing:
        raise RuntimeError(f"/proc/self/status has no {', '.join(sorted(missing))}: the resident peak is measured "
                           "on Linux only")
    return out


def reset_high_water() -> None:
    """Start a new resident high-water mark: VmHWM := VmRSS (Linux 4.0 and later)."""
    _CLEAR_REFS.write_text("5")


def release_freed() -> None:
    """Hand freed memory back to the system now and from now on (glibc; elsewhere nothing changes)."""
    return_freed_blocks()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class ResidentMeter:
    """A step's resident peak above the RSS this process had when the meter was made (before the model)."""

    def __init__(self) -> None:
        release_freed()
        self.base = status_bytes("VmRSS", "RssFile")  # bytes: the interpreter, torch, the process group

    def peak_of(self, work: Callable[[], object]) -> dict[str, int]:
        """Run `work()` and return {"peak": the RSS high-water mark during it minus the base RSS,
        "file_moved": how many bytes of file-backed pages (code, libraries) it brought in}, bytes."""
        release_freed()
        reset_high_water()
        before = status_bytes("RssFile")["RssFile"]
        work()
        after = status_bytes("VmHWM", "RssFile")
        return {"peak": after["VmHWM"] - self.base["VmRSS"], "file_moved": after["RssFile"] - before}
