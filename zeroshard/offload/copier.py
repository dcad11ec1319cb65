"""Copier: host<->device copies that overlap the caller's work, each returning a Transfer.

On CUDA a copy runs non_blocking on the Copier's side stream: the side
stream first waits for the caller's current stream (so the copy sees every
kernel queued before it: the producer of `src`, the last reader of `dst`),
then copies and records an event; `Transfer.wait()` synchronizes that event.
The tensors are marked as used on the side stream (`record_stream`), so the
caching allocator does not reuse their memory while the copy may still run.
A host tensor of such a copy should be pinned (`aligned_empty(pin=True)`);
from pageable memory CUDA copies synchronously.

On the CPU (and any other device) the copy runs in a worker thread: torch's
copy releases the GIL, so it overlaps the caller's Python and torch work.

In poison mode the destination is filled with NaN at once (on the current
stream), and the copy is queued only after the delay, from a worker thread.
"""

from __future__ import annotations

import time

import torch

from zeroshard.offload.pool import Job, WorkerPool
from zeroshard.offload.transfer import Poison, Transfer


class Copier:
    """Asynchronous `dst.copy_(src)` between host and `device` (or on the host alone).

    `threads`: worker threads for CPU copies (and for the delayed copies of the
    poison mode). `src` must not be modified and `dst` not read until the
    returned Transfer's `wait()`.
    """

    def __init__(self, device: torch.device | str, poison: Poison | None = None, threads: int = 1):
        self.device = torch.device(device)
        self.poison = poison
        self._cuda = self.device.type == "cuda"
        self._side = torch.cuda.Stream(self.device) if self._cuda else None  # the copies' own stream
        self._pool: WorkerPool | None = WorkerPool(threads, "zeroshard-copier")

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Transfer:
        """Start `dst.copy_(src)`; its errors are raised by the Transfer's `wait()`."""
        if self._pool is None:
            raise RuntimeError("Copier.copy after close(): create another Copier")
        if self.poison is not None:
            self.poison.fill(dst)
        start_at = time.monotonic() + self.poison.seconds if self.poison is not None else 0.0
        if not self._cuda:
            job = Job(1, lambda _: dst.copy_(src), start_at)
            return Transfer(self._pool.submit(job))
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))  # what the caller queued before this copy
        finished = torch.cuda.Event()

        def enqueue(_: int = 0) -> None:
            with torch.cuda.stream(self._side):
                self._side.wait_event(ready)
                for t in (dst, src):
                    if t.is_cuda:
                        t.record_stream(self._side)
                dst.copy_(src, non_blocking=True)
                finished.record(self._side)

        if self.poison is None:
            enqueue()
            return Transfer(event=finished)
        return Transfer(self._pool.submit(Job(1, enqueue, start_at)), finished)

    def close(self) -> None:
        """Wait for the copies started, stop the worker threads; idempotent."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._side is not None:
            self._side.synchronize()
