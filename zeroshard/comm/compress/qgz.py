"""qgZ (ZeRO++, Wang et al. 2023, section 3.3): the hierarchical quantized gradient reduce-scatter.

N = K nodes x D ranks; rank r = k*D + d sits on node k at local index d,
and owns chunk r, S = ceil(numel / N) elements of the zero-padded flat
buffer, exactly as the plain reduce-scatter gives it (`collectives.py`), so
qgZ can replace it. Two hops, each an all-to-all of quantized shards
(`messages.py`) and a sum in fp32:

1. inside the node: rank d of node k receives, from each of its node's D
   ranks, the K chunks whose owners have local index d (chunks k'*D + d,
   k' = 0..K-1), and sums them: the node's partial sums of those chunks;
2. across nodes, among the ranks of local index d: node k' receives the
   partial sum of chunk k'*D + d from every node and sums them.

The sum of hop 2 over the K nodes is the sum over all N ranks, and it is
divided by N: the exact mean of every element, for every numel, with no
fallback. A hop over one rank (D = 1 or K = 1) sends nothing and is skipped.

Error bound (asserted in tests/comm/compress/test_zeropp_collectives.py). Each
quantization is off by at most s*g/2 per element (s: its block's scale; g:
the codec's `level_gap`, 1 for int8 and int4), and the mean adds N
quantized messages in hop 1 and K in hop 2, then divides by N. So for each
block of a shard, with s1_j the block's scale in sender j's hop-1 message
and s2_k in node k's hop-2 message (no s1 when D = 1, no s2 when K = 1):
    |error_i| <= g * (sum_j s1_j + sum_k s2_k) / (2N) for every element i;
with the Hadamard rotation the same holds in the rotated basis, hence for
the block's error in L2 with a factor sqrt(block_size). Messages are whole
shards padded on their own, so the blocks of both hops are the shard's.

Recorded on the comm of each hop: one `reduce_scatter` launch per hop, of
the all-to-all's input (N, then K messages of message_bytes(S)), with scope
"node" for hop 1 and "cross_node" for hop 2 (`estimate.qgz_reduce_scatter_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zeroshard.comm.collectives import Comm, Landing, Pending, _launch, _named
from zeroshard.comm.compress.messages import decode_rows, encode_rows, encoding
from zeroshard.comm.compress.quantize import BlockCodec, CodecError
from zeroshard.comm.topology import Topology, TopologyError
from zeroshard.estimate.formulas import shard_numel


@dataclass(frozen=True)
class Hops:
    """The two comms of qgZ for this rank: its node (hop 1) and its peers on the other nodes (hop 2); or
    one hop over the whole group (`flat`: no cross-node comm, K = 1), a flat compressed reduce-scatter."""

    node: Comm  # D ranks, group rank = local index
    cross_node: Comm | None  # K ranks, group rank = node; None: one hop

    @classmethod
    def flat(cls, comm: Comm) -> "Hops":
        """One hop: every rank sends each peer its chunk, quantized, and sums what it receives."""
        return cls(comm, None)

    @classmethod
    def create(cls, comm: Comm, topology: Topology) -> "Hops":
        """Comms over `topology`'s groups, recording into `comm`'s recorder (`comm`: the data-parallel group).

        Raises TopologyError if the group's rank order is not node by node:
        the hops deliver chunk k*D + d to the rank on node k at index d, which
        must be that rank's place in the group, as the plain reduce-scatter has it.
        (`build_topology` gives such layouts: torch.distributed sorts a group's ranks.)
        """
        order = tuple(dist.get_process_group_ranks(comm.group))
        if tuple(r for node in topology.layout for r in node) != order:
            raise TopologyError(f"qgZ needs the data-parallel group's ranks node by node; the group is {list(order)} "
                                f"and its nodes {[list(n) for n in topology.layout]}")
        make = partial(Comm.create, recorder=comm.recorder, timeout_s=comm.timeout_s,
                       rank_check_timeout_s=comm.rank_check_timeout_s)
        node, cross = make(topology.node_group, scope="node"), make(topology.cross_node_group, scope="cross_node")
        node.trace = cross.trace = comm.trace  # one record of the rank's collectives, checked at the step check
        return cls(node, cross)

    @property
    def nodes(self) -> int:
        return 1 if self.cross_node is None else self.cross_node.world_size

    @property
    def world_size(self) -> int:
        return self.node.world_size * self.nodes

    def error_shapes(self, numel: int) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        """The (rows, S) shapes of this rank's messages at hop 1 and hop 2 (None: a hop that sends nothing)
        for a tensor of `numel` elements: what an error feedback per hop holds."""
        n, d, k = self.world_size, self.node.world_size, self.nodes
        size = shard_numel(numel, n)
        return ((n, size) if d > 1 else None), ((k, size) if k > 1 else None)


class HopsPending(Landing):
    """qgZ in flight: hop 1 launched; hop 2 needs hop 1's sums on the CPU, so `wait` launches it."""

    def __init__(self, first: Pending | None, second: Callable[[], Pending | None] | None):
        super().__init__()
        self._first = first
        # None once hop 2 is launched: a wait after a failure waits for the same hop 2, never a second one.
        self._second: Callable[[], Pending | None] | None = second
        self._last: Pending | None = None

    def wait(self) -> None:
        if self._done:
            return
        if self._first is not None:
            self._first.wait()
        if self._second is not None:
            self._last = self._second()
            self._second = None
        if self._last is not None:
            self._last.wait()
        self._landed()  # the shard holds the mean


def qgz_reduce_scatter(hops: Hops, shard: torch.Tensor, full: torch.Tensor, codec: BlockCodec,
                       async_op: bool = True, what: str = "",
                       errors: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)) -> HopsPending:
    """This rank's chunk of the mean over all N ranks of `full` (any shape, floating), into `shard`.

    `full` is read flattened and zero-padded to N x S elements, S =
    ceil(numel / N) = `shard.numel()` (1-D, any floating dtype: the mean is
    computed in fp32 and cast once). `full` is read at the call. `errors`:
    the error feedback of hop 1 and hop 2 (`Hops.error_shapes`), or None.
    """
    n, d, k = hops.world_size, hops.node.world_size, hops.nodes
    size = shard_numel(full.numel(), n)
    if not full.is_floating_point() or shard.dim() != 1 or shard.numel() != size:
        raise CodecError(f"qgZ reduces a floating-point tensor of {full.numel()} elements ({full.dtype}) over "
                         f"{n} ranks into a 1-D shard of {size} elements, not {tuple(shard.shape)}")
    flat = full.reshape(-1)
    rows = F.pad(flat, (0, n * size - flat.numel())).view(k, d, size)
    by_peer = rows.transpose(0, 1).reshape(n, size)  # peer d' first gets the chunks its local index owns

    def finish(total: torch.Tensor) -> None:  # (S,) fp32, the sum over all N ranks; never `full` itself
        shard.copy_(total / n)

    # The exact reduce-scatter's bytes, for the ratio: hop 1's (or the first hop's), not hop 2's too.
    exact = full.numel() * full.element_size()

    def second(partials: torch.Tensor, uncompressed: int = 0) -> Pending | None:  # (K, S) fp32: this node's sums
        if k == 1:
            finish(partials[0])
            return None
        pending, received = _hop(hops.cross_node, partials, codec, what, "qgZ hop 2", errors[1], uncompressed)
        return pending.then(lambda: finish(decode_rows(received, size, codec).sum(0)))

    def node_sums() -> torch.Tensor:  # hop 1 landed: (D senders, K chunks, S) summed over the senders
        return decode_rows(received, size, codec).view(d, k, size).sum(0)

    if d == 1:  # no hop 1: hop 2 starts now, from this rank's own chunks
        result = HopsPending(second(by_peer.float(), exact), None)
    else:
        pending, received = _hop(hops.node, by_peer, codec, what, "qgZ hop 1" if k > 1 else "", errors[0], exact)
        result = HopsPending(pending, lambda: second(node_sums()))
    if not async_op:
        result.wait()
    return result


def _hop(comm: Comm, rows: torch.Tensor, codec: BlockCodec, what: str, hop: str, error: torch.Tensor | None,
         uncompressed: int):
    """Launch the all-to-all of `rows` (W x m rows of `size` values, m for each of the W ranks) as quantized
    messages (`error`: their error feedback); returns its pending and the buffer that receives W x m encoded
    rows, by sender. `hop`: its name in the record ("" for the one hop of a flat reduce-scatter)."""
    sent = encode_rows(rows, codec, error)
    received = torch.empty_like(sent)
    call = partial(dist.all_to_all_single, received, sent, group=comm.group, async_op=True)
    algorithm = _named("all_to_all+sum", encoding(codec)) + (f", {hop}" if hop else "")
    label = f"{what} ({hop})" if hop else what
    return _launch(comm, "reduce_scatter", sent.numel(), algorithm, call, True, label,
                   uncompressed=uncompressed), received
