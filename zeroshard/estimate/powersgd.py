"""PowerSGD's sizes: which tensors of a bucket it compresses, the bytes it sends, the state it keeps.

Pure arithmetic over shapes, here below `comm/` so that the low-rank
reduction (comm/compress/powersgd.py), `memory_stats()` and the estimator share one
plan and agree to the byte. The plan is torch's `powerSGD_hook`'s: each
tensor is viewed as a matrix (n, m), n its first dimension and m the product
of the others, and compressed to rank r = min(n, m, rank) when
(n + m) x r x MIN_COMPRESSION_RATE < n x m; every other tensor (biases, norms,
small matrices, 0-d tensors) is all-reduced exactly. Everything travels and
is kept in fp32 (4 bytes an element).

Bytes of one bucket, per rank and optimizer step, in the recorder's
convention (an all-reduce counts its buffer): after the warm-up, one
all-reduce of P (sum of n x r), one of Q (sum of m x r), one of the exact
part (sum of its numel); a part with no element is not sent. During the
warm-up (`start_step` steps), one exact all-reduce of the bucket's numel in
the reduce dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

# torch's PowerSGDState default: compressing a matrix pays only if it at least halves what it sends.
MIN_COMPRESSION_RATE = 2
FP32_BYTES = 4


class LowRank(NamedTuple):
    """One compressed tensor: the matrix (n, m) it is viewed as, and its rank r."""

    n: int
    m: int
    r: int


def low_rank_plan(shapes: Sequence[Sequence[int]], rank: int) -> list[LowRank | None]:
    """For each tensor of a bucket, in order: its `LowRank` if PowerSGD compresses it, else None (exact)."""
    plan: list[LowRank | None] = []
    for shape in shapes:
        numel = math.prod(shape)
        if len(shape) < 2 or numel == 0:  # torch's test never passes for a vector (m = 1); 0-d has no rows
            plan.append(None)
            continue
        n, m = shape[0], numel // shape[0]
        r = min(n, m, rank)
        plan.append(LowRank(n, m, r) if (n + m) * r * MIN_COMPRESSION_RATE < n * m else None)
    return plan


class Sizes(NamedTuple):
    """Elements of one bucket's PowerSGD messages: P, Q, and the exact part."""

    p: int
    q: int
    exact: int


def powersgd_sizes(shapes: Sequence[Sequence[int]], rank: int) -> Sizes:
    """The elements of P, Q and the exact part of a bucket whose tensors have `shapes`."""
    plan = low_rank_plan(shapes, rank)
    exact = sum(math.prod(s) for s, lr in zip(shapes, plan) if lr is None)
    return Sizes(sum(lr.n * lr.r for lr in plan if lr), sum(lr.m * lr.r for lr in plan if lr), exact)


def powersgd_bytes(shapes: Sequence[Sequence[int]], rank: int) -> int:
    """Logical all-reduce bytes of one bucket per optimizer step once compression has started (fp32 P, Q and
    exact part; the warm-up sends the bucket's numel x the reduce dtype's bytes instead)."""
    return FP32_BYTES * sum(powersgd_sizes(shapes, rank))


def powersgd_state_bytes(shapes: Sequence[Sequence[int]], rank: int, error_feedback: bool = True) -> int:
    """Bytes one rank keeps for one bucket between steps (memory_stats()['compression']): P and Q (fp32, Q
    for the warm start), and with error feedback the bucket's error (fp32, one per element, no padding)."""
    sizes = powersgd_sizes(shapes, rank)
    numel = sum(math.prod(s) for s in shapes)
    return FP32_BYTES * (sizes.p + sizes.q + (numel if error_feedback else 0))
