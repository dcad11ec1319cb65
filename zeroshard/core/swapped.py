"""Swapped: a tensor whose values live in a swap file on disk between uses, keeping its identity.

The optimizer holds its master and state tensors by identity (`optimizer.state[master]`),
and a stage-3 flat holds `shard_data`; offloading them to disk must not replace
those objects. So a swapped tensor is re-pointed (`Tensor.set_`) at a region of
an aligned host buffer while it is resident, and at empty storage while it is
out: a read of it between uses sees an empty tensor, never stale values.

States, in order: OUT (on disk only) -> READING (a read in flight into a buffer)
-> RESIDENT (the tensor holds the values) -> WRITING (a write in flight from the
buffer; the tensor may still be read) -> OUT once the write landed and the buffer
went back. A tensor that has never been written (the optimizer's state before
its first step) starts RESIDENT in memory the optimizer allocated.
"""

from __future__ import annotations

import threading
from collections import deque
from enum import Enum

import torch

from zeroshard.offload import ALIGN, SwapDir, SwapFile, Transfer, aligned_empty, completed, unreadable


class SwapState(Enum):
    OUT = "out"
    READING = "reading"
    RESIDENT = "resident"
    WRITING = "writing"


class BufferPool:
    """Aligned host buffers for swapped tensors, reused by size; their bytes are declared host memory.

    Thread-safe: the delayed update's CPU step swaps the optimizer's state on its own thread while the
    forward reads stage 3's parameter shards through the same pool."""

    def __init__(self, pin: bool = False):
        self.pin = pin
        self._free: dict[int, list[torch.Tensor]] = {}
        self._all: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 buffer of at least `nbytes` bytes (rounded up to ALIGN), aligned for direct I/O."""
        size = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
            buffer = aligned_empty(size, pin=self.pin)
            self._all.append(buffer)
            return buffer

    def release(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(buffer.numel(), []).append(buffer)

    def tensors(self) -> list[torch.Tensor]:
        with self._lock:
            return list(self._all)

    def in_use(self) -> int:
        """Bytes of its buffers acquired and not released: the values they hold now."""
        with self._lock:
            return sum(b.numel() for b in self._all) - sum(b.numel() for free in self._free.values() for b in free)


def _empty(tensor: torch.Tensor) -> None:
    with torch.no_grad():
        tensor.set_(torch.empty(0, dtype=tensor.dtype, device=tensor.device).untyped_storage(), 0, (0,), (1,))


class Swapped:
    """One 1-D tensor of `numel` elements of `dtype` backed by one swap file.

    `tensor` None: nothing holds these values yet (the optimizer creates its state in its first
    step); `bind` names the tensor once it exists, and `write` sends it out.
    """

    def __init__(self, swap: SwapDir, name: str, numel: int, dtype: torch.dtype, pool: BufferPool,
                 tensor: torch.Tensor | None = None):
        self.numel, self.dtype, self.pool = numel, dtype, pool
        self.nbytes = numel * dtype.itemsize
        self.file: SwapFile = swap.file(name, self.nbytes)  # pre-allocated: a full disk fails here
        self.tensor = tensor
        self.state = SwapState.RESIDENT
        self._buffer: torch.Tensor | None = None  # the pool's buffer the tensor points into, if any
        self._transfer: Transfer = completed()

    @property
    def bound(self) -> bool:
        return self.tensor is not None

    def read(self) -> None:
        """OUT -> READING: start reading the values back (the tensor must not be used before `wait`)."""
        if self.state is not SwapState.OUT:
            return
        self._buffer = self.pool.acquire(self.nbytes)
        self._point_at_buffer()
        self._transfer = self.file.read(self._buffer[: self.nbytes])
        self.state = SwapState.READING

    def wait(self) -> None:
        """Make the values usable, to read or to change: read them if out, and wait for a transfer in flight
        (a write's source must not change before it lands)."""
        self.read()
        if self.state in (SwapState.READING, SwapState.WRITING):
            self._transfer.wait()
            self.state = SwapState.RESIDENT

    def stand_in(self) -> None:
        """After its transfer failed (`wait` raised), resident all the same, so that this rank can still take
        part in a collective every rank has posted; the caller raises the error once that landed. A failed
        read leaves NaN in its place; a failed write the values it was writing (the file is not theirs: a
        read of it raises). `finish` then lets go of them."""
        if self._buffer is None:  # the read failed before it had a buffer
            self._buffer = self.pool.acquire(self.nbytes)
            self._point_at_buffer()
        if self.state is not SwapState.WRITING:
            unreadable(self.tensor)
        self._transfer = completed()
        self.state = SwapState.RESIDENT

    def bind(self, tensor: torch.Tensor) -> None:
        """Follow a new tensor object holding these values in memory (the optimizer's state after its
        first step, or after a load); the old one is let go."""
        if tensor.numel() != self.numel or tensor.dtype != self.dtype:
            raise ValueError(f"swap file {self.file.name} holds {self.numel} {self.dtype} elements, "
                             f"not {tensor.numel()} {tensor.dtype}")
        self._transfer.wait()
        if self._buffer is not None:
            self.pool.release(self._buffer)
            self._buffer = None
        self.tensor = tensor
        self.state = SwapState.RESIDENT

    def write(self) -> None:
        """RESIDENT -> WRITING: start writing the values out; the tensor stays readable until `finish`."""
        self.wait()
        if self._buffer is None:  # memory the optimizer allocated (its first step): into an aligned buffer
            buffer = self.pool.acquire(self.nbytes)
            buffer[: self.nbytes].view(self.dtype).copy_(self.tensor.reshape(-1))
            self._buffer = buffer
            self._point_at_buffer()
        self._transfer = self.file.write(self._buffer[: self.nbytes])
        self.state = SwapState.WRITING

    def claim(self) -> None:
        """Make the tensor writable in full without reading the file (its values are about to be replaced)."""
        if self.state is SwapState.OUT:
            self._buffer = self.pool.acquire(self.nbytes)
            self._point_at_buffer()
            self.state = SwapState.RESIDENT
        else:
            self.wait()

    def finish(self) -> None:
        """-> OUT: wait for a write in flight (or a read: its values are the file's), give the buffer back,
        leave the tensor empty. Only for values the file holds: a changed tensor must be written first."""
        if self.state is SwapState.OUT:
            return
        self._transfer.wait()
        if self._buffer is not None:
            self.pool.release(self._buffer)
            self._buffer = None
        _empty(self.tensor)
        self.state = SwapState.OUT

    def swap_out(self) -> None:
        """Write and finish (blocking): used at construction and after a load."""
        self.write()
        self.finish()

    def _point_at_buffer(self) -> None:
        # The aligned buffer is a byte view into a larger allocation: its offset there, in elements.
        offset = self._buffer.storage_offset() // self.dtype.itemsize
        with torch.no_grad():
            self.tensor.set_(self._buffer.untyped_storage(), offset, (self.numel,), (1,))


class WriteBehind:
    """Swapped tensors whose writes are in flight, at most `limit` at once: the oldest is finished (its
    write waited for, its buffer given back) before another starts, so host memory holds `limit` buffers
    however many tensors go out (the gradient shards written as backward reduces them)."""

    def __init__(self, limit: int):
        self.limit = max(1, limit)
        self._flying: deque[Swapped] = deque()

    def add(self, swapped: Swapped) -> None:
        """`swapped` has just started its write."""
        if swapped in self._flying:  # its previous write was finished already; one entry per tensor
            self._flying.remove(swapped)
        self._flying.append(swapped)
        while len(self._flying) > self.limit:
            self._flying.popleft().finish()

    def discard(self, swapped: Swapped) -> None:
        """Forget `swapped` (its write waited for already): it stays in memory, changed, for its owner."""
        if swapped in self._flying:
            self._flying.remove(swapped)

    def drain(self) -> None:
        """Finish every write in flight."""
        while self._flying:
            self._flying.popleft().finish()
