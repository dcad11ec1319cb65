"""SwapFile: one pre-allocated file of a SwapDir, written and read whole, asynchronously, checked on read.

A transfer is cut into block_size chunks (bytes) that the SwapDir's worker
threads write with os.pwritev / read with os.preadv (the GIL is released
during the system call and during the checksum). Short reads and writes
loop; a read that meets the end of the file means the file was truncated.

O_DIRECT needs the buffer address, the file offset and the length aligned
to ALIGN. Offsets are (block_size is a multiple of ALIGN). A chunk of a
buffer at an aligned address is written and read in place; only its tail
past the last multiple of ALIGN (under ALIGN bytes, once per transfer) goes
through the thread's ALIGN-aligned bounce buffer, so nothing past `nbytes`
of the caller's buffer is touched. A buffer at an unaligned address goes
whole through the bounce buffer: one extra memcpy per chunk (memory runs at
~10 GB/s against the disk's ~1-3 GB/s: a few per cent of the transfer's
time) and block_size bytes of bounce buffer per worker thread. Views at the
start of an `aligned_empty` buffer never pay it.

Damage detection: each write records the crc32 of every chunk (of the
`nbytes` bytes written, never of the padding); each read recomputes it from
what it read into the destination and raises OffloadError naming the file
and the byte range on a mismatch. zlib.crc32 is the fastest candidate the
standard library has: 3.9 GiB/s per thread on 64 MiB on an idle core
(adler32 2.7, sha1 1.6, sha256 1.4, blake2b 0.8, md5 0.6; a torch weighted
sum 1.5; `benchmarks/disk_bandwidth.py --checksums`), a quarter of the time
of a 1 GB/s write, spread over the worker threads beside the I/O. A crc32
per block_size chunk catches any changed byte range (every burst up to 32
bits with certainty, anything else but for 1 in 2^32), a chunk moved, or a
file replaced by another file's contents; truncation is found by the read.
"""

from __future__ import annotations

import errno
import os
import time
import zlib
from pathlib import Path
from typing import Callable, Protocol

import torch

from zeroshard.offload.errors import OffloadError, damaged, io_error
from zeroshard.offload.memory import ALIGN, is_aligned, round_up
from zeroshard.offload.pool import Job
from zeroshard.offload.transfer import Poison, Transfer


class Owner(Protocol):
    """What a SwapFile needs of the state its SwapDir shares with its files (a protocol: no import of swap_dir.py)."""

    block_size: int  # bytes per I/O request, a multiple of ALIGN
    direct: bool
    poison: Poison | None

    def check_open(self) -> None: ...

    def submit(self, job: Job) -> Job: ...

    def bounce(self, nbytes: int) -> torch.Tensor: ...


def _buffer(t: torch.Tensor) -> memoryview:
    """The bytes of a 1-D uint8 CPU tensor as a writable memoryview (no copy)."""
    return memoryview(t.numpy()).cast("B")


def _write_all(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.pwritev(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.ENOSPC, "the disk accepted no bytes")  # what a write of 0 bytes means here
        done += n


def _read_all(fd: int, buf: memoryview, offset: int, need: int, direct: bool, path: Path) -> None:
    """Read at least `need` bytes into `buf` (whose length may be rounded up for O_DIRECT)."""
    done = 0
    while done < need:
        n = os.preadv(fd, [buf[done:]], offset + done)
        done += n
        if n == 0 or (done < need and direct and done % ALIGN):  # the end of the file: O_DIRECT reads stop there
            size = os.fstat(fd).st_size
            raise damaged(path, f"it holds {size} bytes, but bytes up to {offset + need} were written (truncated)")


class SwapFile:
    """One swap file: `nbytes` bytes (exactly what each write and read moves), `path` on disk.

    Made by `SwapDir.file`. One write at a time, and no read while it runs
    (a read or write started while a conflicting one is in flight raises
    RuntimeError: wait() the first). Reads may overlap each other.
    """

    def __init__(self, shared: Owner, name: str, nbytes: int, path: Path, fd: int):
        self.name = name
        self.nbytes = nbytes  # bytes: what write and read move; the file holds round_up(nbytes, ALIGN)
        self.path = path
        self._dir = shared  # the SwapDir's state shared with its files
        self._fd = fd
        self._crcs: list[int | None] | None = None  # per chunk, of the last write; None: never written
        self._inflight: list[tuple[str, Transfer]] = []

    def write(self, src: torch.Tensor) -> Transfer:
        """Start writing `src` (a contiguous CPU tensor of exactly `nbytes` bytes, any dtype) to the file.

        `src` must not be modified until the Transfer's wait(). Best is a view at
        the start of an `aligned_empty` buffer (no bounce copy under O_DIRECT).
        """
        data = self._bytes_of(src, "write")
        self._claim("write")
        crcs: list[int | None] = [None] * self._chunks()
        self._crcs = crcs  # unknown content until every chunk is written
        return self._start("write", lambda i: self._write_chunk(data, i, crcs))

    def read(self, dst: torch.Tensor) -> Transfer:
        """Start reading the file into `dst` (contiguous CPU, exactly `nbytes` bytes, any dtype).

        `dst` must not be read until the Transfer's wait(), which raises
        OffloadError if the file changed since its write. Reading a file that no
        write of this run completed raises OffloadError here.
        """
        data = self._bytes_of(dst, "read")
        self._claim("read")
        crcs = self._crcs
        if crcs is None or None in crcs:
            raise OffloadError(f"swap file {self.path} was never written completely in this run, so there is nothing "
                               "to read: write it (and wait for the write) before reading it", path=self.path)
        if self._dir.poison is not None:
            self._dir.poison.fill(dst)
        return self._start("read", lambda i: self._read_chunk(data, i, crcs))

    # -- the chunks, in the worker threads ---------------------------------------

    def _write_chunk(self, data: torch.Tensor, i: int, crcs: list[int | None]) -> None:
        start, n, in_place = self._span(data, i)
        chunk = data[start : start + n]
        crc = zlib.crc32(_buffer(chunk))
        try:
            if in_place:
                _write_all(self._fd, _buffer(chunk[:in_place]), start)
            if in_place < n:
                bounce = self._dir.bounce(n - in_place)
                bounce[: n - in_place].copy_(chunk[in_place:])
                bounce[n - in_place :].zero_()  # O_DIRECT's padding up to ALIGN: never read back
                _write_all(self._fd, _buffer(bounce), start + in_place)
        except OSError as exc:
            raise io_error("writing swap file", self.path, exc) from exc
        crcs[i] = crc

    def _read_chunk(self, data: torch.Tensor, i: int, crcs: list[int | None]) -> None:
        start, n, in_place = self._span(data, i)
        chunk = data[start : start + n]
        direct = self._dir.direct
        try:
            if in_place:
                _read_all(self._fd, _buffer(chunk[:in_place]), start, in_place, direct, self.path)
            if in_place < n:
                bounce = self._dir.bounce(n - in_place)
                _read_all(self._fd, _buffer(bounce), start + in_place, n - in_place, direct, self.path)
                chunk[in_place:].copy_(bounce[: n - in_place])
        except OSError as exc:
            raise io_error("reading swap file", self.path, exc) from exc
        crc = zlib.crc32(_buffer(chunk))
        if crc != crcs[i]:
            raise damaged(self.path, f"bytes [{start}, {start + n}) read back with crc32 {crc:08x}, "
                                     f"{crcs[i]:08x} was written")

    def _span(self, data: torch.Tensor, i: int) -> tuple[int, int, int]:
        """Chunk i: (start, length, bytes moved in place) in bytes; the rest goes through the bounce buffer."""
        start = i * self._dir.block_size
        n = min(self._dir.block_size, self.nbytes - start)
        if not self._dir.direct:
            return start, n, n
        return start, n, (n - n % ALIGN if is_aligned(data) else 0)

    # -- bookkeeping, in the caller's thread -------------------------------------

    def _chunks(self) -> int:
        return -(-self.nbytes // self._dir.block_size)

    def _bytes_of(self, t: torch.Tensor, verb: str) -> torch.Tensor:
        """`t`'s bytes as a 1-D uint8 view, after checking it can be the source or destination of `verb`."""
        self._dir.check_open()
        size = t.numel() * t.element_size()
        if t.device.type != "cpu" or not t.is_contiguous() or size != self.nbytes:
            raise ValueError(f"SwapFile.{verb} of {self.name}: needs a contiguous CPU tensor of exactly {self.nbytes} "
                             f"bytes, got a {'contiguous' if t.is_contiguous() else 'non-contiguous'} {t.device} "
                             f"tensor of {size} bytes ({t.dtype}, shape {tuple(t.shape)})")
        return t.detach().reshape(-1).view(torch.uint8)

    def _claim(self, verb: str) -> None:
        """Refuse a transfer that would race one in flight: a write with anything, a read with a write."""
        self._inflight = [(kind, t) for kind, t in self._inflight if not t.done()]
        clash = [kind for kind, _ in self._inflight if kind == "write" or verb == "write"]
        if clash:
            raise RuntimeError(f"SwapFile {self.name}: a {verb} started while a {clash[0]} of the same file is in "
                               f"flight; wait() the {clash[0]}'s Transfer first")

    def _start(self, kind: str, run: Callable[[int], None]) -> Transfer:
        poison = self._dir.poison
        job = Job(self._chunks(), run, start_at=0.0 if poison is None else time.monotonic() + poison.seconds,
                  urgent=kind == "read")
        transfer = Transfer(self._dir.submit(job))
        self._inflight.append((kind, transfer))
        return transfer

    def close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def drop_cache(self) -> None:
        """Flush the file and drop its pages from the page cache (buffered I/O: so a measured read hits the disk)."""
        if not self._dir.direct and self._fd >= 0:
            os.fdatasync(self._fd)
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def file_bytes(self) -> int:
        """Bytes the file takes on disk: nbytes rounded up to ALIGN."""
        return round_up(self.nbytes)

    def __repr__(self) -> str:
        return f"SwapFile({self.name!r}, nbytes={self.nbytes}, path={str(self.path)!r})"
