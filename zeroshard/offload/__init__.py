"""Offload's I/O layer: host buffers, asynchronous host<->device copies, swap files on disk, and their waits.

ZeRO-Offload keeps a rank's fp32 master shard and optimizer state in host
memory; ZeRO-Infinity moves them on to disk (nvme_path) and streams them
through host buffers a few buckets at a time. This package owns the memory
and the copies of that, and nothing else: it knows no collective, engine or
config class (settings come in as plain arguments), and imports only the
leaves `zeroshard.errors` and `zeroshard.dtypes`. `core/` decides what lives
where; `engine/` only orders the work.

The one rule every caller keeps: each asynchronous copy returns a Transfer,
and until its `wait()` returns, the copy's source must not be modified and
its destination not read. ZEROSHARD_OFFLOAD_POISON=<ms> (`Poison.from_env`)
turns a broken rule into NaNs a test sees.

- memory.py     ALIGN, aligned_empty (aligned, optionally pinned host buffers)
- transfer.py   Transfer, completed, Poison, unreadable
- pool.py       the worker threads: transfers cut into chunks, round robin
- copier.py     Copier: host<->device copies (a CUDA side stream and events, or a CPU thread)
- swap_dir.py   SwapDir: one rank's swap files (lock, O_DIRECT probe, allocation, cleanup)
- swap_lock.py  the rank directory's lock, a crashed run's leftovers, the O_DIRECT probe
- swap_file.py  SwapFile: chunked pwritev/preadv, O_DIRECT alignment, per-chunk crc32
- bandwidth.py  measure_bandwidth, through SwapDir and SwapFile
- errors.py     OffloadError and its wording (path, errno name, fix)
"""

from zeroshard.offload.bandwidth import measure_bandwidth
from zeroshard.offload.copier import Copier
from zeroshard.offload.errors import OffloadError
from zeroshard.offload.memory import ALIGN, aligned_empty, round_up
from zeroshard.offload.swap_dir import SwapDir
from zeroshard.offload.swap_file import SwapFile
from zeroshard.offload.transfer import Poison, Transfer, completed, unreadable

__all__ = ["ALIGN", "Copier", "OffloadError", "Poison", "SwapDir", "SwapFile", "Transfer", "aligned_empty",
           "completed", "measure_bandwidth", "round_up", "unreadable"]
