"""Compressed gradient reductions: their bytes on the wire and the memory of their error feedback.

The same arithmetic as comm/compress/reduce.py, in the recorder's convention
(estimate/zeropp.py): a compressed reduce-scatter of a bucket of `numel`
elements over N ranks sends N quantized chunks of S = ceil(numel / N)
elements (one hop), or qgZ's two hops over the nodes; a compressed
all-reduce (stage 0) adds an all-gather of N quantized chunks. Error
feedback holds, per rank, 4 bytes for each element of each message it
quantizes: N x S for the hop inside the node (or the one flat hop), K x S
across the K nodes, S for the all-reduce's gather.
"""

from __future__ import annotations

from zeroshard.estimate.formulas import shard_numel
from zeroshard.estimate.zeropp import quantized_bytes

ERROR_BYTES = 4  # error feedback is fp32


def compressed_reduction_bytes(numel: int, world_size: int, bits: int, block_size: int,
                               all_reduce: bool = False, ranks_per_node: int | None = None) -> dict[str, int]:
    """Logical bytes per rank of one compressed reduction of `numel` elements: {"reduce_scatter": hop bytes
    summed, "all_gather": the all-reduce's gather (0 for a reduce-scatter)}. `ranks_per_node`: None for the
    flat reduction (one hop), else qgZ's two hops."""
    if world_size == 1:
        return {"reduce_scatter": 0, "all_gather": 0}
    message = quantized_bytes(shard_numel(numel, world_size), bits, block_size)
    per_node = world_size if ranks_per_node is None else ranks_per_node
    nodes = world_size // per_node
    hops = (world_size * message if per_node > 1 else 0) + (nodes * message if nodes > 1 else 0)
    return {"reduce_scatter": hops, "all_gather": world_size * message if all_reduce else 0}


def error_feedback_bytes(numel: int, world_size: int, all_reduce: bool = False,
                         ranks_per_node: int | None = None) -> int:
    """Bytes of one bucket's error feedback on each rank (comm/compress/reduce.py's `ErrorFeedback`)."""
    if world_size == 1:
        return 0
    size = shard_numel(numel, world_size)
    per_node = world_size if ranks_per_node is None else ranks_per_node
    nodes = world_size // per_node
    elements = (world_size * size if per_node > 1 else 0) + (nodes * size if nodes > 1 else 0)
    return ERROR_BYTES * (elements + (size if all_reduce else 0))
