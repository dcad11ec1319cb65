"""Offload's faults, agreed: disk work that fails on one rank makes every rank raise the same OffloadError.

A swap file's read or write can fail on one rank alone (a damaged file, a
disk error, a full disk at construction). If that rank raised on its own,
the others would go on into the next collective (the post-step all-gather,
a unit's gather) and wait there for a rank that never comes. So each piece
of such work is followed, on every rank, by a `fault_check` (comm/): one
all-gather of an int64 flag per rank, the step check's pattern. When a flag
is set, the ranks exchange their errors (`all_gather_object`, only then)
and every rank raises one OffloadError naming each failed rank and its
error (the file, the errno name, the fix); the failed rank chains its own
error as the cause. No rank runs another collective of that work first.

Where it runs: at construction (opening and filling the swap files), after
an optimizer step with swap files (before the stages 1-2 all-gather), and at
stage 3 with each gather of a unit whose parameter shards are on disk (after
their reads). There the check is in flight beside the gather (`Agreement`),
not a wait before it: a rank whose read failed joins the gather with NaN in
place of its shard, and every rank raises when it waits for the gather,
before anything uses it. Nothing is checked without swap files.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from zeroshard.comm import Comm, FaultFlags, all_gather_object
from zeroshard.offload import OffloadError

T = TypeVar("T")


def agreed(comm: Comm, work: Callable[[], T], what: str, device: torch.device,
           undo: Callable[[T], object] | None = None) -> T:
    """`work()` on this rank, then `agree` on how it went: its result, or OffloadError on every rank.

    `undo(result)` runs on a rank whose work succeeded when another rank's failed (closing what it opened).
    """
    result, problem = None, None
    try:
        result = work()
    except Exception as exc:  # any failure: the other ranks must hear of it before their next collective
        problem = exc
    try:
        agree(comm, problem, what, device)
    except OffloadError:
        if problem is None and undo is not None:
            undo(result)
        raise
    return result


def agree(comm: Comm, problem: Exception | None, what: str, device: torch.device) -> None:
    """Raise OffloadError on every rank if `what` failed on any rank (`problem`: this rank's error, or None)."""
    Agreement(comm, problem, what, device).settle()


class Agreement:
    """`agree` in two halves: every rank's flag is sent now, and `settle()` raises on every rank if any was set.
    Collectives every rank posts in between run meanwhile; wait for them before `settle()`."""

    def __init__(self, comm: Comm, problem: Exception | None, what: str, device: torch.device):
        self.comm, self.problem, self.what = comm, problem, what
        self._flags = FaultFlags(comm, problem is not None, device, what)

    def settle(self) -> None:
        failed = self._flags.failed()
        if not failed:
            return
        reports = all_gather_object(self.comm, None if self.problem is None else _report(self.problem))
        which = f"rank {failed[0]}" if len(failed) == 1 else f"ranks {', '.join(map(str, failed))}"
        said = "; ".join(f"rank {r}: {reports[r]['text']}" for r in failed)
        first = reports[failed[0]]
        raise OffloadError(f"{self.what} failed on {which}, and every rank stops there: {said}",
                           path=first["path"], errno=first["errno"]) from self.problem


def _report(error: Exception) -> dict:
    """What the other ranks are told of this rank's error: its words, and the file and errno if any."""
    text = str(error) if isinstance(error, OffloadError) else f"{type(error).__name__}: {error}"
    return {"text": text, "path": getattr(error, "filename", None), "errno": getattr(error, "errno", None)}
