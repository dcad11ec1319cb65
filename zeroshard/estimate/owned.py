"""The optimizer state of a mix of optimizers, per rank, where some need tensors whole.

An element-wise optimizer's state splits evenly: K bytes for each element of
the rank's shard. An optimizer that needs tensors whole keeps each tensor's
state on the one rank that owns it (plan/owners.py), so a rank's bytes are
the sum over its own tensors of that optimizer's state for one tensor; the
ranks' owned elements differ by at most the largest tensor's (the
longest-processing-time rule's bound), their state by what those elements
keep. Each flat buffer also costs all its
ranks the padding of its largest rank's segment, in the masters and on the
wire: N x S elements per reduce-scatter and all-gather, S the largest
rank's elements of the buffer.
"""

from __future__ import annotations

import math
from typing import Callable

from zeroshard.plan.flats import shard_numel
from zeroshard.plan.owners import Owners, owned_layout

_FP32 = 4


def _adafactor(shape: tuple[int, ...]) -> int:
    """Adafactor (Shazeer and Stern 2018): a matrix keeps its row and column second moments (torch's shapes:
    shape[:-1] + (1,) and shape[:-2] + (1, shape[-1])), a vector its own; and a step count."""
    if len(shape) >= 2:
        rows, cols = math.prod(shape[:-1]), math.prod(shape[:-2]) * shape[-1]
        return _FP32 * (rows + cols) + _FP32
    return _FP32 * math.prod(shape) + _FP32


# Bytes of optimizer state for one tensor of `shape`, fp32, by optimizer, as torch's optimizers keep it.
STATE_BYTES: dict[str, Callable[[tuple[int, ...]], int]] = {
    "adamw": lambda shape: 2 * _FP32 * math.prod(shape),  # exp_avg, exp_avg_sq (the step: per buffer)
    "sgd": lambda shape: _FP32 * math.prod(shape),  # momentum_buffer
    "muon": lambda shape: _FP32 * math.prod(shape),  # momentum_buffer
    "lamb": lambda shape: 2 * _FP32 * math.prod(shape),
    "adafactor": _adafactor,
}
WHOLE = frozenset({"muon", "lamb", "adafactor"})  # the optimizers above whose update needs a tensor whole


def owned_bytes(flats: list[list[tuple[int, ...]]], optimizer: str, world_size: int) -> list[int]:
    """Optimizer state bytes per rank of the tensors (by shape, flat buffer by flat buffer, in build order)
    an optimizer that needs them whole steps; tensors owned as the engine owns them."""
    owners, per_rank = Owners(world_size), [0] * world_size
    for shapes in flats:
        for shape, owner in zip(shapes, owners.assign([math.prod(s) for s in shapes])):
            per_rank[owner] += STATE_BYTES[optimizer](shape)
    return per_rank


def sharded_bytes(flats: list[list[tuple[int, ...]]], optimizer: str, world_size: int) -> int:
    """Optimizer state bytes of each rank for an element-wise optimizer over the flat buffers (its shard of
    each, padding included)."""
    per_element = STATE_BYTES[optimizer]((1,))
    return sum(per_element * shard_numel(sum(math.prod(s) for s in shapes), world_size) for shapes in flats)


def segment_numel(flats: list[list[tuple[int, ...]]], world_size: int) -> list[int]:
    """S of each flat buffer of tensors owned whole: the elements of its largest rank's segment, which every
    rank's shard is padded to (the reduce-scatter and all-gather move N x S elements)."""
    owners, segments = Owners(world_size), []
    for shapes in flats:
        numels = [math.prod(s) for s in shapes]
        segments.append(owned_layout(numels, owners.assign(numels), world_size)[1])
    return segments
