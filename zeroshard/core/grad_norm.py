"""The reduced gradients' global checks before a step: any non-finite element, the L2 norm, clipping.

Each is one all-reduce of a scalar over the ranks that hold disjoint shards,
so every rank takes the same decision.
"""

from __future__ import annotations

import math

import torch

from zeroshard.comm import Comm, all_reduce


def any_nonfinite(grads: list[torch.Tensor], comm: Comm, device: torch.device) -> bool:
    """Whether any rank's `grads` hold inf or nan (one all-reduce of a flag)."""
    flag = torch.zeros((), device=device)
    for grad in grads:
        flag += torch.isfinite(grad).logical_not().any()
    all_reduce(comm, flag, async_op=False)
    return flag.item() > 0


def clip_grad_norm_(grads: list[torch.Tensor], max_norm: float, comm: Comm, sharded: bool) -> float:
    """Scale `grads` so that their global L2 norm is at most `max_norm`; returns the norm before.

    `sharded`: each rank holds a disjoint shard, so the squares are summed over ranks.
    """
    if not grads:
        return 0.0
    squares = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]).square().sum()
    if sharded:
        all_reduce(comm, squares, async_op=False)
    norm = math.sqrt(squares.item())
    coef = min(1.0, max_norm / (norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)
    return norm
