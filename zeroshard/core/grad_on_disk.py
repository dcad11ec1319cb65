"""GradOnDisk: a bucket's fp32 gradient shard kept in a swap file between the reductions that add to it.

Stages 2-3 with the master on disk (ZeRO-Infinity's gradients on NVMe): host
memory then holds no part of the gradient that grows with the model, beyond
`buffer_count` shards whose writes are in flight (`WriteBehind`). A window's
first reduction replaces the shard without reading it; later ones read it
back (unless it is in memory still), add and write it behind. Its L2 norm,
taken before each write, stands in for it in the step check, and the step
reads it back with its sub-group. In the window's last micro-step the shards
of the sub-groups the step takes first are `held`: kept in memory for it,
never written (the step's staging has room for them: `OptimizerTiers`).

A read or write that fails inside a reduction is kept, not raised there (the
other ranks would wait in their next reduction for this one), and `raise_fault`
raises it at the step, where every rank agrees (`engine.step`).
"""

from __future__ import annotations

from typing import Callable

import torch

from zeroshard.core.swapped import Swapped, WriteBehind


class GradOnDisk:
    """`shard` (the bucket's `grad_shard`, 1-D fp32) backed by `swap`, which shares its identity."""

    def __init__(self, shard: torch.Tensor, swap: Swapped, write_behind: WriteBehind):
        self.shard, self.swap, self.write_behind = shard, swap, write_behind
        self.norm = 0.0  # of the shard as last written; a float, so no tensor outlives the step
        self.held = False  # the window's last micro-step: the shard stays in memory for the step, unwritten
        self._fault: BaseException | None = None
        swap.finish()  # zeros until now: the window's first reduction replaces them without a read

    def add(self, add: Callable[[], None], first: bool) -> None:
        """Make the shard resident (claimed whole and zeroed at a window's `first` reduction, else read back
        unless in memory), run `add()` into it, take its norm and write it behind (unless `held`)."""
        if self._fault is not None:  # this window's gradient is lost already: the step raises
            return
        try:
            if first:
                self.swap.finish()
                self.swap.claim()
                self.shard.zero_()
            else:
                self.swap.wait()  # its last write landed (the values may change now), or it is read back
            add()
            self.norm = torch._foreach_norm([self.shard])[0].item()
            if self.held:  # in memory until the step: its last write (landed) must not be finished meanwhile
                self.write_behind.discard(self.swap)
                return
            self.swap.write()
            self.write_behind.add(self.swap)
        except OSError as exc:  # OffloadError: this disk failed here (or another shard's write behind)
            self._fault = exc

    def raise_fault(self) -> None:
        """Raise the swap-file error this window met in backward, if any."""
        if self._fault is not None:
            raise self._fault

    def reset(self) -> None:
        """A new window: the last write waited for (its error was raised at the step already), nothing kept."""
        try:
            self.swap.finish()
        except OSError:
            pass
        self._fault, self.held = None, False
