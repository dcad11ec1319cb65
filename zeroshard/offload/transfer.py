"""Transfer: one asynchronous copy and its wait; Poison: the test mode that catches a missing wait.

A Transfer is what every asynchronous copy of offload returns (host<->device
copies, swap-file reads and writes). Until `wait()` returns, its source must
not be modified and its destination not read. The poison mode makes a
forgotten wait visible instead of a rare race: the destination reads NaN
until the copy completes, and completion is held back by a delay.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from zeroshard.offload.pool import Job

POISON_ENV = "ZEROSHARD_OFFLOAD_POISON"


class Transfer:
    """One asynchronous copy, a read or a write: `wait()` blocks until it is done.

    Done when its worker job (if any) has finished and then its CUDA event (if
    any) has completed. `wait()` raises the copy's error (an OffloadError for
    disk I/O, the copy's own error otherwise), the same error at every call;
    once it returned, it returns at once.
    """

    def __init__(self, job: Job | None = None, event: torch.cuda.Event | None = None):
        self._job = job
        self._event = event  # recorded on the copy's side stream (by the job, when there is one)

    def done(self) -> bool:
        """Whether the copy has completed (or failed); never blocks."""
        if self._job is not None and not self._job.done():
            return False
        if self._job is not None and self._job.error is not None:
            return True
        return self._event is None or self._event.query()

    def wait(self) -> None:
        """Block until the copy has completed; raise its error if it failed. Idempotent."""
        if self._job is not None:
            self._job.wait()
        if self._event is not None:
            self._event.synchronize()


def completed() -> Transfer:
    """A Transfer that is already done (for data that needed no copy)."""
    return Transfer()


@dataclass(frozen=True)
class Poison:
    """The copy-discipline test mode: destinations read NaN until the copy completes, `delay_ms` later.

    Every asynchronous copy or read first fills its destination with NaN
    (0xFF bytes in a non-float tensor: a uint8 buffer of 0xFF reads as NaN in
    any float dtype), then completes no sooner than `delay_ms` milliseconds
    after it was started. A reader that skipped `wait()` sees NaN; one that
    waited sees the data. Writes to disk are delayed the same way.
    """

    delay_ms: float

    def __post_init__(self):
        if not (self.delay_ms > 0 and math.isfinite(self.delay_ms)):
            raise ValueError(f"Poison.delay_ms must be a positive number of milliseconds, got {self.delay_ms}")

    @staticmethod
    def from_env() -> Poison | None:
        """ZEROSHARD_OFFLOAD_POISON=<delay_ms> ("20"): on; unset, empty or "0": off."""
        value = os.environ.get(POISON_ENV, "").strip()
        try:
            delay = float(value or 0)
        except ValueError:
            delay = -1.0
        if delay == 0:
            return None
        if not (delay > 0 and math.isfinite(delay)):
            raise ValueError(f"{POISON_ENV}={value!r}: expected a delay in milliseconds such as 20, "
                             f"or 0 (or unset) for off")
        return Poison(delay)

    @property
    def seconds(self) -> float:
        return self.delay_ms / 1000

    def fill(self, t: torch.Tensor) -> None:
        """Fill `t` with NaN (float dtypes) or 0xFF bytes (the others), on `t`'s device and current stream."""
        unreadable(t)


def unreadable(t: torch.Tensor) -> None:
    """Fill `t` with NaN (float dtypes) or 0xFF bytes (the others): values nobody may take for data."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.is_contiguous() and t.dtype != torch.bool:
        t.reshape(-1).view(torch.uint8).fill_(0xFF)  # all bits set, in place (a view of t's bytes)
    else:
        t.fill_(True if t.dtype == torch.bool else -1 if t.dtype.is_signed else torch.iinfo(t.dtype).max)
