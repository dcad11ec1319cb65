"""ShardedUnit: one group of parameters whose gradients and values are communicated together.

At stages 0-2 a unit is a size bucket of one optimizer param group. What it
holds depends on two of the stage's switches:

- `shard_optimizer` (stage >= 1): the optimizer sees only this rank's shard of
  the flat buffer (`master`), and the updated shards are all-gathered.
- `shard_grads` (stage >= 2): only this rank's gradient shard persists; each
  micro-step's full gradients are staged in a pooled buffer just long enough
  to be reduce-scattered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroshard.buffers import BufferPool
from zeroshard.comm import Comm, Pending, all_gather, all_reduce, reduce_scatter
from zeroshard.flat import FlatParams


@dataclass(frozen=True)
class StageSwitches:
    """The three switches a ZeRO stage is made of (DESIGN.md section 3)."""

    shard_optimizer: bool
    shard_grads: bool
    shard_params: bool

    @classmethod
    def for_stage(cls, stage: int) -> "StageSwitches":
        return cls(stage >= 1, stage >= 2, stage >= 3)


class ShardedUnit:
    """A bucket of parameters: flat values, gradient storage, and its collectives."""

    def __init__(self, flat: FlatParams, switches: StageSwitches, reduce_scatter: bool, param_group: int):
        self.flat = flat
        self.param_group = param_group  # index of the optimizer param group its parameters belong to
        self.switches = switches
        self.use_reduce_scatter = reduce_scatter
        if switches.shard_grads:
            self.grad = None  # full gradient: only staged during a micro-step's backward
            self.grad_shard = torch.zeros(flat.shard_numel, dtype=flat.dtype, device=flat.device)
        else:
            self.grad = torch.zeros(flat.padded_numel, dtype=flat.dtype, device=flat.device)
            self.grad_shard = flat.shard(self.grad) if switches.shard_optimizer else self.grad
        # What the optimizer updates: in fp32 the parameters' own storage, no copy.
        self.master = flat.shard(flat.data) if switches.shard_optimizer else flat.data
        self.master.grad = self.grad_shard
        self._written = [False] * len(flat.params)  # stage 2: which slots of the staging buffer hold this micro-step's gradient
        self._accumulated = False  # stage 2: grad_shard already holds part of this window

    @property
    def params(self):
        return self.flat.params

    def attach_grads(self) -> None:
        """Point each parameter's `.grad` at its view of the flat gradient (stages 0-1).

        Autograd then accumulates in place into the flat buffer, micro-step
        after micro-step; re-attached before every backward in case the user
        set `.grad` to None.
        """
        if self.switches.shard_grads:
            return
        for p, view in zip(self.params, self.flat.views(self.grad)):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view

    def stage_grad(self, index: int, pool: BufferPool) -> None:
        """Copy parameter `index`'s fresh gradient into the staging buffer and free it (stage 2)."""
        if self.grad is None:
            self.grad = pool.acquire(self.flat.padded_numel, self.flat.dtype, self.flat.device)
        p, slot = self.params[index], self.flat.slot(index, self.grad)
        if self._written[index]:  # a second gradient in one backward (reentrant checkpointing)
            slot.add_(p.grad.reshape(-1))
        else:
            slot.copy_(p.grad.reshape(-1))
        self._written[index] = True
        p.grad = None

    def reduce_grad(self, comm: Comm, pool: BufferPool, scale: float) -> Pending:
        """Reduce this micro-step's gradients; afterwards `grad_shard` holds the running mean.

        `scale` is 1 / (N x accumulation steps): applied once per reduction,
        the sum over the window comes out as the mean over the global batch.
        """
        if self.switches.shard_grads:
            return self._reduce_staged(comm, pool, scale)
        if not self.switches.shard_optimizer:
            return all_reduce(comm, self.grad).then(lambda: self.grad.mul_(scale))
        if self.use_reduce_scatter:
            scratch = self._scratch(comm, pool)
            pending = reduce_scatter(comm, self.grad_shard, self.grad, scratch)
            pending.then(lambda: self._release(pool, scratch))
        else:
            pending = all_reduce(comm, self.grad)
        return pending.then(lambda: self.grad_shard.mul_(scale))

    def _reduce_staged(self, comm: Comm, pool: BufferPool, scale: float) -> Pending:
        staging = self._staging_with_zeros(pool)
        first = not self._accumulated
        out = self.grad_shard if first else pool.acquire(self.flat.shard_numel, staging.dtype, staging.device)
        if self.use_reduce_scatter:
            scratch = self._scratch(comm, pool)
            pending = reduce_scatter(comm, out, staging, scratch)
            pending.then(lambda: self._release(pool, scratch))
        else:
            pending = all_reduce(comm, staging).then(lambda: out.copy_(self.flat.shard(staging)))

        def accumulate():
            if first:
                out.mul_(scale)
            else:
                self.grad_shard.add_(out, alpha=scale)
                pool.release(out)
            pool.release(staging)

        self.grad = None
        self._accumulated = True
        self._written = [False] * len(self.params)
        return pending.then(accumulate)

    def _staging_with_zeros(self, pool: BufferPool) -> torch.Tensor:
        """The staging buffer, with every slot no gradient reached (unused parameters) zeroed."""
        if self.grad is None:
            self.grad = pool.acquire(self.flat.padded_numel, self.flat.dtype, self.flat.device)
        for i, written in enumerate(self._written):
            if not written:
                self.flat.slot(i, self.grad).zero_()
        self.flat.padding(self.grad).zero_()
        return self.grad

    def _scratch(self, comm: Comm, pool: BufferPool) -> torch.Tensor | None:
        if comm.world_size == 1 or comm.algorithms.reduce_scatter != "all_to_all":
            return None
        return pool.acquire(self.flat.padded_numel, self.flat.dtype, self.flat.device)

    @staticmethod
    def _release(pool: BufferPool, scratch: torch.Tensor | None) -> None:
        if scratch is not None:
            pool.release(scratch)

    def gather_params(self, comm: Comm) -> Pending:
        """All-gather the updated shards into the full flat buffer (stages 1-2)."""
        return all_gather(comm, self.flat.data)

    def zero_grad(self) -> None:
        """Start a new accumulation window."""
        if self.switches.shard_grads:
            self.grad_shard.zero_()
            self._accumulated = False
        else:
            self.grad.zero_()
