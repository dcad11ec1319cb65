"""SwapFile: exact round trips (every dtype, odd sizes, aligned or not), O_DIRECT or buffered, damage, misuse."""

from __future__ import annotations

import logging
import os
import shutil
import threading

import pytest
import torch

from zeroshard.offload import ALIGN, OffloadError, Poison, SwapDir, aligned_empty
from zeroshard.errors import ZeroshardError
from zeroshard.offload.pool import Job

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn]
NUMELS = [1, 3, 1000, 4097, 70_001]  # one element, odd, not a multiple of ALIGN bytes, several 16 KiB blocks
BLOCK = 4 * ALIGN  # bytes per request: small, so that files span several chunks


def _values(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, (n,), generator=g).to(dtype)


def _aligned(n: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of n elements at the start of an aligned_empty buffer."""
    nbytes = n * dtype.itemsize
    return aligned_empty(nbytes)[:nbytes].view(dtype)


def _unaligned(n: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of n elements whose address is not a multiple of ALIGN (it starts 16 bytes into a buffer)."""
    nbytes = n * dtype.itemsize
    t = aligned_empty(nbytes + 16)[16 : 16 + nbytes].view(dtype)
    assert t.data_ptr() % ALIGN
    return t


def _round_trip(swap: SwapDir, name: str, values: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    src.copy_(values)
    f = swap.file(name, values.numel() * values.element_size())
    f.write(src).wait()
    f.read(dst).wait()
    assert torch.equal(dst.view(torch.uint8), values.view(torch.uint8)), name  # every byte, NaN patterns too


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_and_odd_size_round_trips_with_o_direct(disk, dtype):
    with SwapDir(disk, 0, block_size=BLOCK) as swap:
        assert swap.direct  # a disk filesystem: O_DIRECT in use
        for n in NUMELS:
            values = _values(n, dtype, seed=n)
            _round_trip(swap, f"aligned{n}", values, _aligned(n, dtype), _aligned(n, dtype))
            _round_trip(swap, f"unaligned{n}", values, _unaligned(n, dtype), _unaligned(n, dtype))
            _round_trip(swap, f"plain{n}", values, values.clone(), torch.empty_like(values))


def test_a_read_touches_nothing_past_nbytes(disk):
    """O_DIRECT reads whole ALIGN pages; the tail page goes through a bounce buffer, not the caller's memory."""
    with SwapDir(disk, 0, block_size=BLOCK) as swap:
        buf = aligned_empty(ALIGN + 10)
        buf.fill_(7)
        values = _values(ALIGN + 3, torch.uint8)
        f = swap.file("tail", ALIGN + 3)
        f.write(values).wait()
        f.read(buf[: ALIGN + 3]).wait()
        assert torch.equal(buf[: ALIGN + 3], values) and (buf[ALIGN + 3 :] == 7).all()


def test_buffered_fallback_where_o_direct_is_refused(ramfs, caplog):
    with caplog.at_level(logging.INFO, logger="zeroshard.offload"):
        swap = SwapDir(ramfs, 0, block_size=BLOCK)
    assert not swap.direct
    assert any("buffered I/O" in r.getMessage() and "O_DIRECT" in r.getMessage() for r in caplog.records)
    for dtype in (torch.bfloat16, torch.float32):
        values = _values(4097, dtype)
        _round_trip(swap, f"x{dtype}".replace("torch.", ""), values, _unaligned(4097, dtype), torch.empty_like(values))
    swap.close()


def test_round_trip_on_tmpfs(tmpfs):
    """tmpfs: O_DIRECT refused before Linux 6.6 (buffered I/O), accepted since; either way the bytes come back."""
    with SwapDir(tmpfs, 0, block_size=BLOCK) as swap:
        values = _values(10_001, torch.float16)
        _round_trip(swap, "half", values, _aligned(10_001, torch.float16), _unaligned(10_001, torch.float16))


def test_o_direct_can_be_turned_off(disk, caplog):
    with caplog.at_level(logging.INFO, logger="zeroshard.offload"), SwapDir(disk, 0, o_direct=False) as swap:
        assert not swap.direct
        values = _values(5000, torch.float32)
        _round_trip(swap, "f", values, values.clone(), torch.empty_like(values))
    assert not caplog.records  # nothing to explain: the caller asked for it


def test_an_empty_file_round_trips(disk):
    with SwapDir(disk, 0) as swap:
        f = swap.file("empty", 0)
        f.write(torch.empty(0)).wait()
        f.read(torch.empty(0)).wait()


def test_a_poisoned_read_shows_nan_until_waited(disk):
    # 1 s: the read is not done yet when checked, however loaded the machine
    with SwapDir(disk, 0, block_size=BLOCK, poison=Poison(1000)) as swap:
        values = _values(3000, torch.bfloat16)
        f = swap.file("p", values.numel() * 2)
        f.write(values).wait()
        dst = torch.zeros_like(values)
        t = f.read(dst)
        assert not t.done() and dst.isnan().all()
        t.wait()
        assert torch.equal(dst, values)


def _written(swap: SwapDir, name: str, n: int = 10_000):
    values = _values(n, torch.float32)
    f = swap.file(name, n * 4)
    f.write(values).wait()
    return f, values


@pytest.mark.parametrize("where", [0, 2 * BLOCK + 123, 39_999])  # first byte, a middle block, the last byte
def test_a_changed_byte_is_damage_named_on_read(disk, where):
    with SwapDir(disk, 0, block_size=BLOCK) as swap:
        f, values = _written(swap, "bucket3.master")
        with open(f.path, "r+b") as raw:
            raw.seek(where)
            byte = raw.read(1)
            raw.seek(where)
            raw.write(bytes([byte[0] ^ 0x01]))
        with pytest.raises(OffloadError, match=r"swap file .*bucket3\.master is damaged.*last checkpoint is intact"):
            f.read(torch.empty_like(values)).wait()


def test_a_truncated_file_is_damage(disk):
    with SwapDir(disk, 0, block_size=BLOCK) as swap:
        f, values = _written(swap, "cut")
        os.truncate(f.path, 12_345)
        with pytest.raises(OffloadError, match=r"cut is damaged: it holds 12345 bytes.*truncated") as info:
            f.read(torch.empty_like(values)).wait()
        assert info.value.path == str(f.path)


def test_a_file_replaced_by_another_files_contents_is_damage(disk):
    with SwapDir(disk, 0, block_size=BLOCK) as swap:
        a, values = _written(swap, "a")
        b = swap.file("b", a.nbytes)
        b.write(_values(10_000, torch.float32, seed=1)).wait()
        shutil.copyfile(b.path, a.path)
        with pytest.raises(OffloadError, match="a is damaged"):
            a.read(torch.empty_like(values)).wait()
        out = torch.empty_like(values)
        b.read(out).wait()  # the other file is untouched
        assert torch.equal(out, _values(10_000, torch.float32, seed=1))


def test_reading_a_file_never_written_is_an_error(disk):
    with SwapDir(disk, 0) as swap:
        f = swap.file("never", 400)
        with pytest.raises(OffloadError, match="never written"):
            f.read(torch.empty(100))


def test_a_failed_write_leaves_the_file_unreadable(disk):
    with SwapDir(disk, 0, block_size=BLOCK) as swap:
        f, values = _written(swap, "w")
        os.close(f._fd)  # the next write meets EBADF in the worker threads
        with pytest.raises(OffloadError, match=r"writing swap file .*w failed: EBADF"):
            f.write(values).wait()
        with pytest.raises(OffloadError, match="never written completely"):
            f.read(torch.empty_like(values))
        f._fd = os.open(f.path, os.O_RDWR)  # for close()


def test_a_transfer_that_races_another_is_refused(disk):
    with SwapDir(disk, 0, threads=1, block_size=BLOCK) as swap:
        f, values = _written(swap, "race")
        gate = threading.Event()
        swap._shared.submit(Job(1, lambda _: gate.wait()))  # holds the only worker: what follows stays in flight
        first = f.read(torch.empty_like(values))
        second = f.read(torch.empty_like(values))  # reads may overlap
        with pytest.raises(RuntimeError, match="a write started while a read .* in flight"):
            f.write(values)
        gate.set()
        first.wait()
        second.wait()
        gate.clear()
        swap._shared.submit(Job(1, lambda _: gate.wait()))
        writing = f.write(values)
        with pytest.raises(RuntimeError, match="a read started while a write"):
            f.read(torch.empty_like(values))
        gate.set()
        writing.wait()


@pytest.mark.parametrize("bad", [torch.empty(9_999), torch.empty(20_000)[::2], torch.empty(10_000, dtype=torch.int16)])
def test_a_wrong_buffer_is_refused(disk, bad):
    with SwapDir(disk, 0) as swap:
        f = swap.file("f", 40_000)
        with pytest.raises(ValueError, match="exactly 40000 bytes"):
            f.write(bad)
        with pytest.raises(ValueError, match="exactly 40000 bytes"):
            f.read(bad)


def test_offload_error_is_a_zeroshard_error_and_an_os_error():
    err = OffloadError("m", path="/p", errno=28)
    assert isinstance(err, ZeroshardError) and isinstance(err, OSError)
    assert str(err) == "m" and err.errno == 28 and err.path == "/p"


def test_many_transfers_in_flight_at_once(disk):
    """Transfers of several files interleave on the shared threads; each one's bytes stay its own."""
    with SwapDir(disk, 0, threads=3, block_size=BLOCK) as swap:
        values = [_values(9_000 + 7 * k, torch.float32, seed=k) for k in range(6)]
        files = [swap.file(f"bucket{k}.master", v.numel() * 4) for k, v in enumerate(values)]
        for t in [f.write(v) for f, v in zip(files, values)]:
            t.wait()
        outs = [torch.empty_like(v) for v in values]
        for t in [f.read(out) for f, out in zip(files, outs)]:
            t.wait()
        assert all(torch.equal(out, v) for out, v in zip(outs, values))
