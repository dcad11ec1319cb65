"""One agreement: work that can fail on one rank alone ends, on every rank, in the same error.

A rank that raised alone would leave the others in their next collective,
waiting for a rank that never comes. So each rank contributes how its part
went, ok (None) or its error, and when any rank failed every rank raises
the error of the lowest rank that did: its class and its message, with its
rank in front when the group has others (`first`). A site that words the
failures itself passes `word` (offload names every failed rank, the
start-up check says a mistake made on every rank once).

- `agree`: one exchange now (`all_gather_object`); each rank's `value`
  travels in it, and the values come back when no rank failed (the ranks'
  descriptions at start-up, an asynchronous save's outcome);
- `Agreement`: its asynchronous half, for a check whose result is collected
  later: one int64 flag per rank is all-gathered now (`fault_check`,
  checks.py), collectives posted meanwhile run beside it, and `settle()`
  raises; only when a flag is set do the ranks exchange their errors;
- `raise_agreed`: the rule alone, over reports the ranks exchanged
  elsewhere (entry.py: the process group's store);
- `barrier`: every rank reaches the point `name` before any goes on; a rank
  left waiting there names it in the stall's or the timeout's
  CollectiveError (the flag all-gather is labelled with it).

An error travels as a report (`report`: its class by import path, its
message, an OSError's file and errno), which JSON and pickle both carry; a
class the receiving rank cannot import becomes the site's `default`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from zeroshard.comm.checks import FaultFlags
from zeroshard.comm.collectives import Comm, all_gather_object
from zeroshard.errors import ZeroshardError


@dataclass(frozen=True)
class Failure:
    """One rank's failed part, as every rank receives it."""

    rank: int
    kind: type[BaseException]  # its error's class (the site's default if it cannot be imported here)
    name: str  # that class's name as the failed rank knew it
    message: str
    path: str | None = None  # an OSError's file and errno
    errno: int | None = None


# (the failures, lowest rank first; the group's size; the rank raising) -> the error every rank raises
Word = Callable[[list[Failure], int, int], BaseException]


def first(failed: list[Failure], world: int, rank: int) -> BaseException:
    """The lowest failed rank's error, its rank in front when the group has others."""
    f = failed[0]
    return f.kind(f.message if world == 1 else f"rank {f.rank}: {f.message}")


def first_unless_alike(failed: list[Failure], world: int, rank: int) -> BaseException:
    """As `first`, but a mistake every rank made alike is said as one rank alone would say it."""
    f = failed[0]
    alike = len(failed) == world and len({(x.name, x.message) for x in failed}) == 1
    return f.kind(f.message if alike else f"rank {f.rank}: {f.message}")


def as_said(failed: list[Failure], world: int, rank: int) -> BaseException:
    """The lowest failed rank's error as that rank worded it (its message names the rank)."""
    return failed[0].kind(failed[0].message)


def report(problem: BaseException | None) -> list | None:
    """What a rank sends of its error: [class path, message, file, errno]; None for ok."""
    if problem is None:
        return None
    kind, path = type(problem), getattr(problem, "filename", None)
    errno = getattr(problem, "errno", None)
    return [f"{kind.__module__}:{kind.__qualname__}", str(problem), None if path is None else str(path),
            errno if isinstance(errno, int) else None]


def failures(reports: list[list | None], default: type[BaseException] = ZeroshardError) -> list[Failure]:
    """The failed ranks' reports (rank order, None for ok) as Failures, lowest rank first."""
    return [Failure(rank, _kind(r[0], default), r[0].rpartition(":")[2], r[1], r[2], r[3])
            for rank, r in enumerate(reports) if r is not None]


def raise_agreed(reports: list[list | None], rank: int, problem: BaseException | None = None, *,
                 word: Word = first, default: type[BaseException] = ZeroshardError, chain: bool = False) -> None:
    """Raise on this rank (`rank`, `problem`: its own error or None) the error every rank raises when any
    report is a failure; return when none is. `chain`: the failed rank's own error becomes the cause
    (else none is shown: the message already says it)."""
    failed = failures(reports, default)
    if failed:
        raise word(failed, len(reports), rank) from (problem if chain else None)


def agree(comm: Comm, problem: BaseException | None, *, value=None, word: Word = first,
          default: type[BaseException] = ZeroshardError, chain: bool = False) -> list:
    """Raise the same error on every rank if any rank's `problem` is not None; else every rank's `value`, in
    rank order. One `all_gather_object`, which every rank of the group must call."""
    everyone = all_gather_object(comm, (value, report(problem)))
    raise_agreed([r for _, r in everyone], comm.rank, problem, word=word, default=default, chain=chain)
    return [v for v, _ in everyone]


class Agreement:
    """`agree` in two halves: every rank's flag is sent now, and `settle()` raises on every rank if any was set.

    Collectives every rank posts in between run meanwhile (a failed rank
    joins them all the same); wait for them before `settle()`. `what`
    labels the flag all-gather: a stall in it names `what`.
    """

    def __init__(self, comm: Comm, problem: BaseException | None, what: str, device: torch.device | None = None,
                 *, word: Word = first, chain: bool = False):
        self.comm, self.problem, self._word, self._chain = comm, problem, word, chain
        self._flags = FaultFlags(comm, problem is not None, device or collective_device(comm), what)

    def settle(self) -> None:
        if self._flags.failed():  # then, and only then, the errors themselves
            agree(self.comm, self.problem, word=self._word, chain=self._chain)


def barrier(comm: Comm, name: str, device: torch.device | None = None) -> None:
    """Every rank of `comm` reaches the point `name` before any goes on: an agreement every rank passes."""
    Agreement(comm, None, f"the barrier '{name}'", device).settle()


def collective_device(comm: Comm) -> torch.device:
    """Where the group's collectives run: NCCL's on this rank's current GPU, the others' on the host."""
    if dist.get_backend(comm.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _kind(path: str, default: type[BaseException]) -> type[BaseException]:
    """The class at `path` ("module:qualname"), or `default` if this rank cannot import it."""
    module, _, qualname = path.partition(":")
    try:
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return default
    return found if isinstance(found, type) and issubclass(found, BaseException) else default
