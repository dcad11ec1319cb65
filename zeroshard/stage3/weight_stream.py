"""The model's weights streamed in batches of bytes, each tensor made while the units it reads are whole.

What a generator's weight sync (vLLM) needs of a trainer: every tensor at
its full shape, never the whole model at once. A `Piece` is one tensor to
hand out: its name, the live tensors it is made of (at stage 3 a sharded
parameter is empty between uses, so its full shape comes from its flat
buffer, never from `numel()`), and how to make it once they are whole (a
copy, or a LoRA merge). `batches` groups the pieces in order into batches
of at most `max_bytes`; a piece larger than that is a batch alone.

`stream` makes each batch and hands it out, as a list that it empties when
the next batch is asked for: the usual `for batch in stream: load(batch)`
then holds one batch, not the one it loaded beside the one being made (a
consumer keeps tensors by taking them out: `dict(batch)`, `kept.extend(batch)`). At stage 3 it gathers the units
a batch reads one after the other (`whole_unit`'s rule: a unit whole already,
inside `gathered_parameters`, stays whole), releasing each after the last
piece that reads it, so that the batch is the only thing it holds when the
consumer gets it: a unit whose pieces span several batches is gathered once
per batch. Every rank runs the same gathers in the same order (the pieces
and batches are the same on every rank); a rank that keeps nothing
(`keep=False`, rank 0 only) runs them all at its first `next()`. A consumer
that stops early (a `break`, an exception, `close()`) closes the generator,
which then runs the remaining gathers without copying, so that ranks still
iterating are not left waiting in a collective.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

Batch = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Piece:
    """One tensor of the stream: `name`, its full `shape` and `dtype`, the stage-3 `units` whose
    parameters it reads (empty: whole on every rank), and `make()`, a new tensor of it, called while
    those units are whole."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    make: Callable[[], torch.Tensor] = field(compare=False)
    units: frozenset[int] = frozenset()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def full_shapes(schedule) -> dict[int, tuple[int, torch.Size]]:
    """Stage 3: id(parameter) -> (its unit's index, its full shape) for every sharded parameter."""
    return {id(p): (i, shape) for i, unit in enumerate(schedule.units) for flat in unit.gathered_flats
            for p, shape in zip(flat.params, flat.shapes)}


def copy_piece(name: str, tensor: torch.Tensor, shapes: dict[int, tuple[int, torch.Size]]) -> Piece:
    """The piece that is a copy of `tensor` (a parameter or a buffer), under `name`."""
    unit, shape = shapes.get(id(tensor), (None, tensor.shape))
    return Piece(name, torch.Size(shape), tensor.dtype, lambda: tensor.detach().clone(),
                 frozenset() if unit is None else frozenset({unit}))


def batches(pieces: list[Piece], max_bytes: int | None) -> list[list[Piece]]:
    """The pieces in order, in batches of at most `max_bytes` (None: one piece a batch); a piece larger than
    `max_bytes` is a batch alone."""
    out: list[list[Piece]] = []
    size = 0
    for piece in pieces:
        if not out or max_bytes is None or size + piece.nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].append(piece)
        size += piece.nbytes
    return out


def stream(planned: list[list[Piece]], schedule, keep: bool) -> Iterator[Batch]:
    """Each batch of `planned` as [(name, tensor)], made as the module docstring says; nothing unless `keep`
    (the gathers all the same). `schedule`: stage 3's GatherSchedule, or None (no gathers)."""
    for k, batch in enumerate(planned):
        made = _made(batch, schedule, keep)
        if not keep:
            continue
        try:
            yield made
        except GeneratorExit:  # the consumer stopped: the other ranks may still be gathering
            made.clear()
            for rest in planned[k + 1:] if schedule is not None else []:
                _made(rest, schedule, keep=False)
            raise
        made.clear()  # the next batch is asked for: this one's tensors are the consumer's alone, or freed


def _made(batch: list[Piece], schedule, keep: bool) -> Batch:
    """The batch's tensors (none unless `keep`), each unit whole from the first piece that reads it to the last."""
    last = {i: k for k, piece in enumerate(batch) for i in piece.units}
    was_whole: dict[int, bool] = {}  # the units gathered here so far -> whether they were whole before
    out: Batch = []
    try:
        for k, piece in enumerate(batch):
            for i in sorted(piece.units - was_whole.keys()):
                was_whole[i] = schedule.in_use(i)
                schedule.need(i)
            if keep:
                out.append((piece.name, piece.make()))
            for i in [i for i in was_whole if last[i] == k]:
                if not was_whole.pop(i):
                    schedule.release(i)
    finally:  # a failed gather or make: what this batch gathered is released
        for i, whole in was_whole.items():
            if not whole:
                schedule.release(i)
    return out
