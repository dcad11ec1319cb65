"""FlatParams: parameters flattened into one padded 1-D buffer.

The buffer's length is padded up to a multiple of the world size N (fewer
than N elements of padding), so that it splits into N equal shards; rank r
owns elements [r * shard_numel, (r + 1) * shard_numel). Shard boundaries may
cut through a parameter: an element-wise optimizer cannot tell. For an
optimizer that needs tensors whole the buffer is laid out owner by owner
instead (`plan/owners.py`): each rank's shard holds its own tensors whole,
padded to the largest rank's.

At stage 3 the full buffer is not kept: `release_full()` gives its memory
back (the storage shrinks to zero bytes) and points the parameters at empty
tensors, so reading one outside forward shows an empty tensor instead of
freed memory; `shard_data`, this rank's copy of its shard, is what persists.
Because the storage object itself survives, tensors autograd saved during
forward see the values again once the buffer is gathered back.

With ZeRO++'s hpZ a flat also keeps a secondary shard between its gathers:
part d of D of the gathered buffer (D ranks per node, d this rank's place
in its node), from which the node alone can gather the buffer again.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from zeroshard.core.local import local, point_at
from zeroshard.errors import StatesOffloadedError
from zeroshard.plan.owners import owned_layout


def give_memory(param: nn.Parameter, tensor: torch.Tensor) -> None:
    """Make a parameter on the meta device a real one backed by `tensor`, keeping its identity.

    `.data` cannot move a tensor off the meta device; swapping keeps the
    Parameter object that the optimizer and the modules already hold.
    """
    torch.utils.swap_tensors(param, nn.Parameter(tensor, requires_grad=param.requires_grad))


class FlatParams:
    """A list of parameters living as views of one padded 1-D buffer.

    After construction every parameter's `.data` is a view into `self.data`,
    so writing the buffer (an all-gather, a broadcast) writes the parameters.
    """

    def __init__(self, params: list[nn.Parameter], world_size: int, rank: int,
                 device: torch.device | None = None, owners: list[int] | None = None):
        """`device`: where the buffer lives, for parameters on the meta device (values left
        uninitialised: the caller initialises them through the views). `owners`: the rank that owns each
        parameter whole (`plan/owners.py`), for an optimizer that needs tensors whole."""
        if not params:
            raise ValueError("FlatParams needs at least one parameter")
        first = params[0]
        for p in params:
            if p.dtype != first.dtype or p.device != first.device:
                raise ValueError("all parameters of one flat buffer must share dtype and device")
        on_meta = first.device.type == "meta"
        self.params = list(params)
        self.shapes = [local(p).shape for p in params]  # a DTensor's local part: what this rank stores
        self.numels = [local(p).numel() for p in params]
        self.numel = sum(self.numels)  # elements, without padding
        self.owners = owners
        if owners is None:
            self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
            self.shard_numel = -(-self.numel // world_size)  # elements per rank
        else:
            self.offsets, self.shard_numel = owned_layout(self.numels, owners, world_size)
        self.padded_numel = self.shard_numel * world_size
        self.rank = rank
        self.data = torch.zeros(self.padded_numel, dtype=first.dtype,
                                device=device if on_meta else first.device)  # 1-D
        with torch.no_grad():
            for p, view in zip(self.params, self.views(self.data)):
                if on_meta:
                    give_memory(p, view)
                else:
                    view.copy_(local(p).data)
                    point_at(p, view)
        self.shard_data: torch.Tensor | None = None  # stage 3: the persistent shard
        # Stage 3 with parameters offloaded to disk: shard_data's swap file (core/swapped.py's Swapped);
        # shard_data is empty except from a read until the gather that copies it, or from the step's cast
        # until its write lands.
        self.shard_swap = None
        self.secondary: torch.Tensor | None = None  # hpZ: this rank's part of the node's copy, until the step

    # -- stage 3: the full buffer exists only while gathered --------------------

    def keep_shard_only(self) -> None:
        """Copy this rank's shard out of the full buffer, then release the full buffer."""
        self.shard_data = self.shard(self.data).clone()
        self.release_full()

    def point_params(self, whole: bool) -> None:
        """Point the parameters at their views of the full buffer, or (`whole=False`) at an empty tensor while
        the buffer keeps its memory."""
        empty = None if whole else self.data.new_empty(0)
        for p, view in zip(self.params, self.views(self.data)):
            point_at(p, view if whole else empty)

    def release_full(self) -> None:
        self.data.untyped_storage().resize_(0)
        empty = self.data.new_empty(0)
        for p in self.params:
            point_at(p, empty)

    def restore_full(self, node: tuple[int, int] | None = None) -> None:
        """Give the full buffer its memory back, this rank's shard in place (the rest undefined).

        `node` = (d, D): put the secondary shard in part d of D instead (hpZ's gather inside the node).
        """
        if self.shard_swap is None and self.shard_data.numel() and not self.shard_data.untyped_storage().nbytes():
            # Read, a zero-byte storage is a crash, not an error: refuse before any gather is launched.
            raise StatesOffloadedError("stage 3's parameter shards are off the device (engine.offload_states()): "
                                       "call engine.reload_states() before gathering parameters")
        storage = self.data.untyped_storage()
        storage.resize_(self.padded_numel * self.data.element_size())
        # Autograd saved views of this buffer in forward; refilling it is not an in-place
        # edit of their values, so their version counter must not move.
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.data):
            if node is None:
                if self.shard_swap is not None:
                    self.shard_swap.wait()
                self.shard(self.data).copy_(self.shard_data)
                if self.shard_swap is not None:
                    self.shard_swap.finish()
            else:
                self.data.view(node[1], -1)[node[0]].copy_(self.secondary)
        for p, view in zip(self.params, self.views(self.data)):
            point_at(p, view)

    def keep_secondary(self, index: int, parts: int) -> None:
        """hpZ: keep a copy of part `index` of `parts` of the gathered full buffer (`parts` divides N)."""
        self.secondary = self.data.view(parts, -1)[index].clone()

    def cast_(self, dtype: torch.dtype) -> None:
        """Hold the parameters in `dtype`: a new buffer (the old one is dropped), parameters re-pointed."""
        if self.shard_data is not None:  # stage 3: the shard persists, the full buffer stays released
            self.shard_data = self.shard_data.to(dtype)
            self.data = torch.empty(self.padded_numel, dtype=dtype, device=self.device)
            self.release_full()
            return
        self.data = self.data.to(dtype)
        with torch.no_grad():
            for p, view in zip(self.params, self.views(self.data)):
                point_at(p, view)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Views of a padded 1-D `buffer`, one per parameter, in the parameters' shapes."""
        return [
            buffer[off : off + n].view(shape)
            for off, n, shape in zip(self.offsets, self.numels, self.shapes)
        ]

    def slot(self, index: int, buffer: torch.Tensor) -> torch.Tensor:
        """The 1-D range of `buffer` that belongs to parameter `index`."""
        return buffer[self.offsets[index] : self.offsets[index] + self.numels[index]]

    def shard(self, buffer: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a padded 1-D `buffer` (a view)."""
        lo = self.rank * self.shard_numel
        return buffer[lo : lo + self.shard_numel]

    def padding(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """The ranges of `buffer` no parameter fills (the tail; with owners, each segment's); kept at zero."""
        ends = sorted(zip(self.offsets, self.numels)) + [(self.padded_numel, 0)]
        gaps, at = [], 0
        for offset, numel in ends:
            if offset > at:
                gaps.append(buffer[at:offset])
            at = max(at, offset + numel)
        return gaps
