"""Host buffers for offload: aligned (for O_DIRECT) and, where CUDA is present, pinned (for async copies)."""

from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger(__name__)

ALIGN = 4096  # bytes: O_DIRECT's alignment of buffer addresses, file offsets and lengths (a page, >= any sector)
_warned: set[str] = set()  # the reasons a pinned buffer fell back to pageable memory, logged once each


def round_up(nbytes: int, align: int = ALIGN) -> int:
    """`nbytes` rounded up to a multiple of `align` (bytes)."""
    return -(-nbytes // align) * align


def is_aligned(t: torch.Tensor, align: int = ALIGN) -> bool:
    """Whether the first byte of `t` sits at an address that is a multiple of `align`."""
    return t.data_ptr() % align == 0


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """An uninitialised 1-D uint8 CPU tensor of round_up(nbytes, ALIGN) bytes at an address aligned to ALIGN.

    It is a slice of a buffer ALIGN bytes larger (the slack is never used).
    With `pin`, the buffer is page-locked when CUDA is available, so host<->device
    copies from it run asynchronously; without CUDA, or when the pinned allocation
    fails (a locked-memory limit), it is pageable and one warning says why.
    """
    if nbytes < 0:
        raise ValueError(f"aligned_empty: nbytes must be >= 0, got {nbytes}")
    size = round_up(nbytes)
    raw = _allocate(size + ALIGN, pin)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip : skip + size]


def _allocate(nbytes: int, pin: bool) -> torch.Tensor:
    if pin and not torch.cuda.is_available():
        _warn_once("no cuda", "torch.cuda.is_available() is False (pinned memory needs CUDA)")
    elif pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:  # cudaHostAlloc refused: often `ulimit -l`, or a container's cap
            _warn_once("pin failed", f"pinning {nbytes} bytes failed ({exc}); raise the locked-memory limit "
                                     "(ulimit -l)")
    return torch.empty(nbytes, dtype=torch.uint8)


def _warn_once(key: str, reason: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning("offload: host buffers are pageable, not pinned: %s; host<->device copies from them "
                    "are synchronous", reason)


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD = 64 << 10  # bytes: blocks from this size up are mapped apart and unmapped when freed


def return_freed_blocks() -> bool:
    """Make glibc's malloc hand freed blocks of MMAP_THRESHOLD bytes and more back to the OS at once.

    glibc raises its mmap threshold each time a mapped block is freed (up to 32
    MiB), after which blocks that size come from the heap and stay in the
    process when freed: training with a disk tier, which frees and allocates
    a unit's and a sub-group's tensors all step long, then grows its resident
    memory by a multiple of what it holds (measured: 1.5 GiB instead of 0.67
    GiB for an 85M-parameter model on one rank). A fixed threshold stops that.
    64 KiB, not 1 MiB: with 1 MiB, blocks of 64 KiB to 1 MiB freed during a
    unit-by-unit build left 0.4-0.7 GiB in the heap of one rank in most runs
    (a 510M-parameter GPT on 2 ranks, 72 units: 0.25 GiB after the build on
    the other rank, and on both with 64 KiB), enough to end a run capped at
    2.5 GiB. Returns False where the C library is not glibc (nothing changed).
    """
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):  # no mallopt: not glibc
        return False
