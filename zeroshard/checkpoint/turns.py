"""The trainer's masters and optimizer state, visited a group of buckets at a time.

With the optimizer state offloaded to disk (ZeRO-Infinity) a bucket's master
and optimizer state are in memory only during its turn of
`Checkpointable.resident_buckets`, a sub-group at a time, the next ones read ahead
as in the optimizer step. A save or a load reads or writes them turn by turn,
so it holds one turn's worth of them (with the read-ahead), never the whole
tier: a model whose optimizer state is larger than host memory saves and
loads as it steps. Without offload every bucket is in memory in one turn,
and a turn costs nothing.

A save goes over the turns twice: `survey` first, before anything is written
(what each bucket holds, and whether it is finite), then `Turns`, as the
writer asks for each tensor's bytes. A load goes over them once, with
`write` (`loading.py`).

Where the optimizer needs tensors whole, the state of each tensor a rank
owns is written whole, by name, in its own shape (`own_tensor`,
`owned_spans`); its shape and scalars reach rank 0's manifest and state.pt in
one gather (`owned_everywhere`).
"""

from __future__ import annotations

from contextlib import closing
from dataclasses import dataclass
from typing import Generator

import torch

from zeroshard.checkpoint.checks import nonfinite
from zeroshard.checkpoint.holdings import Holdings, Span, Trained
from zeroshard.checkpoint.protocol import Checkpointable
from zeroshard.comm import all_gather_object
from zeroshard.core.optim import steps_whole


def master_state(optimizer: torch.optim.Optimizer, master: torch.Tensor) -> dict[str, torch.Tensor]:
    """A master's optimizer state tensors laid out like it (Adam: exp_avg, exp_avg_sq), by key; read during
    its turn (out of it both may be empty)."""
    return {k: v for k, v in optimizer.state.get(master, {}).items() if torch.is_tensor(v) and v.shape == master.shape}


def own_tensors(optimizer: torch.optim.Optimizer, t: Trained) -> dict[str, torch.Tensor]:
    """The rank's own part of a bucket's master ("param") and of each state tensor ("optim.<key>"), 1-D
    (`own_tensor`, by kind)."""
    kinds = ["param", *(f"optim.{k}" for k in master_state(optimizer, t.bucket.master)), *_owned_state(optimizer, t)]
    return {kind: own_tensor(optimizer, t, kind) for kind in kinds}


def own_tensor(optimizer: torch.optim.Optimizer, t: Trained, kind: str) -> torch.Tensor:
    """The rank's own part of one of a bucket's tensors, 1-D: a view of its master ("param") or of a state
    tensor laid out like it; where the optimizer needs tensors whole, a copy of the owned tensors' state
    one after another (`owned_spans` says where each lies)."""
    owned = _owned_state(optimizer, t).get(kind)
    if owned is not None:
        return torch.cat([v.detach().reshape(-1) for _, v in owned])
    master = t.bucket.master
    tensor = master if kind == "param" else master_state(optimizer, master)[kind.removeprefix("optim.")]
    return t.own_part(tensor).detach().reshape(-1)


def owned_spans(optimizer: torch.optim.Optimizer, t: Trained) -> dict[str, Span]:
    """Where each owned tensor's state lies in `own_tensors`' "optim.<key>" tensor, by kind."""
    spans = {}
    for kind, values in _owned_state(optimizer, t).items():
        numels = [v.numel() for _, v in values]
        offsets = [sum(numels[:i]) for i in range(len(numels))]
        spans[kind] = Span(tuple(n for n, _ in values), tuple(offsets), tuple(numels), 0, sum(numels))
    return spans


def owned_shapes(optimizer: torch.optim.Optimizer, t: Trained) -> dict[str, dict[str, list[int]]]:
    """name -> state key -> shape, of the tensors this rank writes whole (scalars left out: `owned_scalars`)."""
    shapes: dict[str, dict[str, list[int]]] = {}
    for kind, values in _owned_state(optimizer, t).items():
        for name, v in values:
            shapes.setdefault(name, {})[kind.removeprefix("optim.")] = list(v.shape)
    return shapes


def owned_scalars(optimizer: torch.optim.Optimizer, t: Trained) -> dict[str, dict]:
    """name -> the state values that are not tensors of one dimension or more (a step count), of the tensors
    this rank writes whole."""
    return {name: {k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                   for k, v in optimizer.state.get(view, {}).items() if not (torch.is_tensor(v) and v.dim() > 0)}
            for name, view in t.owned(writing=True)}


def owned_everywhere(trainer: Checkpointable, held: Holdings) -> tuple[dict[str, dict], str | None]:
    """The optimizer state of the tensors owned whole, from every rank (one gather; only rank 0's
    manifest and state.pt use it): ({"shapes": name -> key -> shape, "scalars": name -> key -> value}, why a
    rank could not describe its own: the same on every rank, so that no manifest leaves a rank's out)."""
    mine: dict = {"shapes": {}, "scalars": {}, "error": None}
    try:
        for t in held.trained:
            mine["shapes"] |= owned_shapes(trainer.optimizer, t)
            mine["scalars"] |= owned_scalars(trainer.optimizer, t)
    except Exception as exc:  # the gather must still happen on every rank
        mine = {"shapes": {}, "scalars": {}, "error": (f"rank {trainer.comm.rank} cannot describe the optimizer "
                                                       f"state it owns ({type(exc).__name__}: {exc}); nothing "
                                                       "was written and earlier checkpoints are intact")}
    everyone = [mine]
    if trainer.comm.world_size > 1 and any(steps_whole(t.bucket) for t in held.trained):
        everyone = all_gather_object(trainer.comm, mine)  # (whether any tensor is owned whole: alike on all)
    merged = {part: {k: v for rank in everyone for k, v in rank[part].items()} for part in ("shapes", "scalars")}
    return merged, next((rank["error"] for rank in everyone if rank["error"]), None)


def _owned_state(optimizer: torch.optim.Optimizer, t: Trained) -> dict[str, list[tuple[str, torch.Tensor]]]:
    by_kind: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, view in t.owned(writing=True):
        for k, v in optimizer.state.get(view, {}).items():
            if torch.is_tensor(v) and v.dim() > 0:
                by_kind.setdefault(f"optim.{k}", []).append((name, v))
    return by_kind


@dataclass(frozen=True)
class Surveyed:
    """A bucket's tensors as its turn showed them."""

    turn: int  # which group of `resident_buckets` holds it
    tensors: dict[str, tuple[torch.dtype, int]]  # kind ("param", "optim.<key>") -> dtype, elements of its own part
    spans: dict[str, Span]  # the kinds laid out by owned tensor, not like the master (`owned_spans`)

    @property
    def state_keys(self) -> list[str]:
        """The keys of the state laid out like the master."""
        return [kind.removeprefix("optim.") for kind in self.tensors if kind != "param" and kind not in self.spans]


def survey(trainer: Checkpointable, held: Holdings) -> tuple[list[Surveyed], str | None]:
    """Every bucket's tensors, one turn at a time: (what each holds, by bucket; why a save must not write
    them: the first non-finite master weight or optimizer state element, else None)."""
    found: list[Surveyed | None] = [None] * len(held.trained)
    error = None
    with closing(trainer.resident_buckets(write=False)) as turns:
        for turn, group in enumerate(turns):
            for i in group:
                tensors = own_tensors(trainer.optimizer, held.trained[i])
                spans = owned_spans(trainer.optimizer, held.trained[i])
                error = error or nonfinite(held.trained[i], tensors, trainer.counters().global_steps, spans)
                found[i] = Surveyed(turn, {kind: (t.dtype, t.numel()) for kind, t in tensors.items()}, spans)
    return found, error


class Turns:
    """The trainer's groups made resident as a reader asks for them by turn (`Surveyed.turn`), in order;
    asked for an earlier turn, it starts a new pass over the groups."""

    def __init__(self, trainer: Checkpointable):
        self._trainer = trainer
        self._turns: Generator[list[int], None, None] | None = None
        self._turn = -1  # the turn in memory now

    def reach(self, turn: int) -> None:
        if self._turns is None or turn < self._turn:
            self.close()
            self._turns, self._turn = self._trainer.resident_buckets(write=False), -1
        while self._turn < turn:
            next(self._turns)
            self._turn += 1

    def close(self) -> None:
        if self._turns is not None:
            self._turns.close()
            self._turns = None
