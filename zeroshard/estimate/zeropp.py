"""ZeRO++'s bytes: exact sizes of the quantized collectives (comm/qwz.py, comm/qgz.py), scales included.

Pure arithmetic over element counts, here below `comm/` so that the estimator
and the recorded `comm_stats()` share one formula and agree to the byte.
Sizes are logical, in the recorder's convention (nccl-tests' "size"): the
gathered buffer of an all-gather, the input of each all-to-all, per rank.

A message of m elements travels as ceil(m / block) blocks, each
block * bits / 8 bytes of payload and one fp32 scale. Every message is one
rank's shard, S = ceil(numel / N) elements, padded on its own, so blocks
never straddle two shards (the error bound of a shard then involves only its
own blocks; see comm/qgz.py).
"""

from __future__ import annotations

from zeroshard.estimate.formulas import shard_numel

SCALE_BYTES = 4  # one fp32 scale per block travels with the payload


def quantized_bytes(numel: int, bits: int, block_size: int) -> int:
    """Bytes of one quantized message of `numel` elements: padded payload plus one fp32 scale per block."""
    blocks = -(-numel // block_size)
    return blocks * (block_size * bits // 8 + SCALE_BYTES)


def qwz_all_gather_bytes(numel: int, world_size: int, bits: int = 8, block_size: int = 128) -> int:
    """qwZ: logical bytes of the quantized all-gather of a flat buffer of `numel` elements over N ranks,
    N quantized shards. Its scope is the data-parallel group's: across nodes when it spans several."""
    return world_size * quantized_bytes(shard_numel(numel, world_size), bits, block_size)


def qgz_reduce_scatter_bytes(numel: int, world_size: int, ranks_per_node: int, bits: int = 4,
                             block_size: int = 128) -> dict[str, int]:
    """qgZ: logical bytes per rank of its two hops, by scope, for a buffer of `numel` elements.

    Hop 1 (inside the node, D = `ranks_per_node` ranks) sends all N shards of
    this rank's gradient: N quantized shards. Hop 2 (across the K = N / D
    nodes) sends the K shards this rank reduced inside its node. A hop over
    one rank sends nothing and is skipped: hop 1 when D = 1, hop 2 when K = 1.
    Per rank, hop 2 is about 1/D of a quantized buffer; the node's D ranks
    together send one quantized buffer across (the paper's 0.25M at int4).
    """
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"ranks_per_node must divide world_size {world_size}; got {ranks_per_node}")
    nodes = world_size // ranks_per_node
    message = quantized_bytes(shard_numel(numel, world_size), bits, block_size)
    return {"node": world_size * message if ranks_per_node > 1 else 0,
            "cross_node": nodes * message if nodes > 1 else 0}
