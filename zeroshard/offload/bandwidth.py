"""measure_bandwidth: the swap path's own read and write speed on a disk, through SwapDir and SwapFile."""

from __future__ import annotations

import os
import time

import torch

from zeroshard.offload.memory import aligned_empty
from zeroshard.offload.swap_dir import SwapDir


def measure_bandwidth(root: str | os.PathLike, block_size: int = 1 << 20, nbytes: int = 256 << 20, *,
                      threads: int = 2, rounds: int = 3, rank: int = 0) -> dict:
    """Write and read one swap file of `nbytes` bytes under `root`; the best of `rounds`, in bytes per second.

    It runs the engine's own path: a SwapDir (O_DIRECT where the filesystem
    allows it, so the page cache is out of the way; else buffered, with the
    file's pages dropped before each read) with `threads` workers and
    `block_size`-byte requests, checksums included. One untimed write first
    (the first write into fallocated space costs extra, the steady state
    overwrites). It uses `root`/zeroshard-swap/rank`rank`/, so not while a run
    of that rank uses the same root.

    Returns {"path" (root), "direct", "block_size", "nbytes", "threads", "rounds",
    "write_bytes_per_s", "read_bytes_per_s", "write_s", "read_s"} (seconds: each round's).
    """
    buf = aligned_empty(nbytes)
    data = buf[:nbytes]
    pattern = torch.arange(nbytes // 8, dtype=torch.int64).mul_(0x9E3779B97F4A7C15 % 2**63)
    data[: pattern.numel() * 8].copy_(pattern.view(torch.uint8))  # not all zeros: nothing compresses it
    back = aligned_empty(nbytes)[:nbytes]
    write_s, read_s = [], []
    with SwapDir(root, rank, threads=threads, block_size=block_size) as swap:
        f = swap.file("bandwidth.probe", nbytes)
        f.write(data).wait()
        for _ in range(rounds):
            write_s.append(_timed(lambda: f.write(data).wait()))
            f.drop_cache()
            read_s.append(_timed(lambda: f.read(back).wait()))
        direct = swap.direct
    if not torch.equal(back, data):
        raise RuntimeError("measure_bandwidth: the file read back differs from what was written")
    return {"path": str(root), "direct": direct, "block_size": block_size, "nbytes": nbytes, "threads": threads,
            "rounds": rounds, "write_bytes_per_s": nbytes / min(write_s), "read_bytes_per_s": nbytes / min(read_s),
            "write_s": write_s, "read_s": read_s}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
