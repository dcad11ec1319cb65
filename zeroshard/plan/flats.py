"""A flat buffer by its sizes: how it splits over N ranks, and how stage 3 treats it.

A flat buffer of Ψ elements is padded to N shards of ceil(Ψ / N): rank r
owns elements [r S, (r + 1) S) (core/flat.py allocates it; the estimator
counts it).
"""

from __future__ import annotations

from typing import NamedTuple

SHARDED, FROZEN, PERSISTENT = "sharded", "frozen", "persistent"
KINDS = (SHARDED, FROZEN, PERSISTENT)


def shard_numel(numel: int, world_size: int) -> int:
    """Elements of one rank's shard: ceil(Ψ / N), as the padded flat buffers split."""
    return -(-numel // world_size)


def padded_numel(numel: int, world_size: int) -> int:
    """Elements of a flat buffer padded to split evenly over the ranks: N shards of ceil(Ψ / N)."""
    return shard_numel(numel, world_size) * world_size


class Flat(NamedTuple):
    """One stage-3 flat buffer: its unpadded elements and how stage 3 treats it.

    "sharded": trainable, gathered on demand and reduced; "frozen": sharded
    but requires_grad False, gathered and never reduced; "persistent":
    trainable, under stage3_param_persistence_threshold, whole on every rank,
    reduced as at stage 2 and all-gathered after the step.
    """

    numel: int
    kind: str = SHARDED
