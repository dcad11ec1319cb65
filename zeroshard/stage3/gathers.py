"""How stage 3 gathers a flat buffer: plainly, or with ZeRO++'s qwZ and hpZ (Wang et al. 2023, sections 3.1-3.2).

- plain: an all-gather over the data-parallel group, in the parameter dtype;
- qwZ (`weights`): the same gather with each shard sent as int8 blocks and an
  fp32 scale per block (comm/compress/qwz.py); every rank dequantizes all shards, so
  forward and backward compute with dequantize(quantize(shard)) of every
  shard, while the shards themselves (the masters, in fp32) stay exact;
- hpZ (`node`): the first gather of a buffer after a step goes over the
  whole group (quantized with qwZ) and leaves each rank a secondary shard,
  its part of the gathered buffer over its node's D ranks; every later
  gather until the step is an all-gather of those parts inside the node,
  so the backward gathers never cross nodes. The parts are copies of the
  gathered (dequantized) values: backward sees exactly the forward's weights.
  `GatherSchedule.shards_changed` ends them after the step (or any change of the shards).

An exact gather (`exact=True`: full state dicts, gathered_parameters,
saving) is always the plain one and neither reads nor leaves a secondary:
what is saved or edited must be the shards' own values.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroshard.comm import Comm, Pending, all_gather, qwz_all_gather
from zeroshard.comm.compress.quantize import BlockCodec
from zeroshard.core.flat import FlatParams


@dataclass(frozen=True)
class Gathers:
    """The groups and codec of stage 3's gathers."""

    comm: Comm  # the data-parallel group
    weights: BlockCodec | None = None  # qwZ: how shards travel in training gathers
    node: Comm | None = None  # hpZ: this rank's node, over which the secondary shards are spread

    def start(self, flat: FlatParams, exact: bool, what: str) -> Pending:
        """Launch the gather of `flat`'s full buffer (memory restored here); it is whole once the result lands."""
        if not exact and flat.secondary is not None:
            flat.restore_full(node=(self.node.rank, self.node.world_size))
            return all_gather(self.node, flat.data, what=f"{what} (hpZ, inside the node)")
        flat.restore_full()
        if exact or self.weights is None:
            pending = all_gather(self.comm, flat.data, what=what)
        else:
            pending = qwz_all_gather(self.comm, flat.data, flat.shard_data, self.weights, what=what)
        if not exact and self.node is not None:
            pending.then(lambda: flat.keep_secondary(self.node.rank, self.node.world_size))
        return pending

    def quantizes(self, exact: bool) -> bool:
        """Whether a gather of this kind leaves dequantized values, not the shards' own, in the buffer."""
        return not exact and self.weights is not None
