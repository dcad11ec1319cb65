"""Offload's faults, agreed: disk work that fails on one rank makes every rank raise the same OffloadError.

A swap file's read or write can fail on one rank alone (a damaged file, a
disk error, a full disk at construction). If that rank raised on its own,
the others would go on into the next collective (the post-step all-gather,
a unit's gather) and wait there for a rank that never comes. So each piece
of such work is followed, on every rank, by the agreement of
comm/agreement.py (`Agreement`): one all-gather of an int64 flag per rank
(`fault_check`), the step check's pattern. When a flag is set, the ranks
exchange their errors (`all_gather_object`, only then) and every rank
raises one OffloadError naming each failed rank and its error (the file,
the errno name, the fix); the failed rank chains its own error as the
cause. No rank runs another collective of that work first.

Where it runs: at construction (opening and filling the swap files), after
an optimizer step with swap files (before the stages 1-2 all-gather), and at
stage 3 with each gather of a unit whose parameter shards are on disk (after
their reads). There the check is in flight beside the gather (`offload_agreement`),
not a wait before it: a rank whose read failed joins the gather with NaN in
place of its shard, and every rank raises when it waits for the gather,
before anything uses it. Nothing is checked without swap files.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from zeroshard.comm import Comm
from zeroshard.comm.agreement import Agreement, Failure, Word
from zeroshard.offload import OffloadError

T = TypeVar("T")


def agreed(comm: Comm, work: Callable[[], T], what: str, device: torch.device,
           undo: Callable[[T], object] | None = None) -> T:
    """`work()` on this rank, then agree on how it went: its result, or OffloadError on every rank.

    `undo(result)` runs on a rank whose work succeeded when another rank's failed (closing what it opened).
    """
    result, problem = None, None
    try:
        result = work()
    except Exception as exc:  # any failure: the other ranks must hear of it before their next collective
        problem = exc
    try:
        offload_agreement(comm, problem, what, device).settle()
    except OffloadError:
        if problem is None and undo is not None:
            undo(result)
        raise
    return result


def offload_agreement(comm: Comm, problem: Exception | None, what: str, device: torch.device) -> Agreement:
    """The agreement on `what` (`problem`: this rank's error, or None), in flight: `settle()` raises one
    OffloadError on every rank naming each failed rank, the failed rank's own error as its cause."""
    return Agreement(comm, problem, what, device, word=_offload_error(what), chain=True)


def _offload_error(what: str) -> Word:
    def word(failed: list[Failure], world: int, rank: int) -> OffloadError:
        which = f"rank {failed[0].rank}" if len(failed) == 1 else f"ranks {', '.join(str(f.rank) for f in failed)}"
        said = "; ".join(f"rank {f.rank}: {_text(f)}" for f in failed)
        return OffloadError(f"{what} failed on {which}, and every rank stops there: {said}",
                            path=failed[0].path, errno=failed[0].errno)
    return word


def _text(failure: Failure) -> str:
    """A rank's error in the others' words: an OffloadError's own (file, errno, fix), another with its class."""
    return failure.message if issubclass(failure.kind, OffloadError) else f"{failure.name}: {failure.message}"
