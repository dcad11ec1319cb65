"""Bucket: one group of parameters whose gradients and values are communicated together.

At stages 0-2 a bucket is a size bucket of one optimizer param group; at
stage 3 it is one param group's parameters within a unit (`stage3/unit.py`).
What it holds depends on the stage's switches:

- `shard_optimizer` (stage >= 1): the optimizer sees only this rank's shard of
  the flat buffer (`master`), and the updated shards are all-gathered.
- `shard_grads` (stage >= 2): only this rank's gradient shard persists; each
  micro-step's full gradients are staged in pooled staging memory from the bucket's
  first gradient until its reduce-scatter lands.
- `shard_params` (stage 3): only this rank's shard of the parameters persists
  (`flat.shard_data`, which in fp32 is also the master); the full buffer is
  gathered on demand around forward and backward.

Its `Precision` says the rest: with 16-bit parameters the master is an fp32
tensor of its own, gradients are reduced in the reduce dtype and summed over
micro-steps in fp32; `master_grad` and `cast_master_to_params` are the two
conversions around the optimizer step.
"""

from __future__ import annotations

import torch

from zeroshard.comm import (BlockCodec, Comm, CompressedReduction, Pending, all_gather, all_reduce, qwz_all_gather,
                            reduce_scatter)
from zeroshard.comm.compress.powersgd import PowerSgd
from zeroshard.core.flat import FlatParams
from zeroshard.core.local import is_dtensor, local_grad
from zeroshard.core.precision import Precision
from zeroshard.core.staging import StagingPool
from zeroshard.core.grad_on_disk import GradOnDisk
from zeroshard.core.swapped import Swapped, WriteBehind
from zeroshard.core.switches import StageSwitches

FP32 = Precision(torch.float32, torch.float32)


class Bucket:
    """A bucket of parameters: flat values, gradient storage, and its collectives.

    Gradient tensors, by role:
    - `full_grad` (stages 0-1; 1-D, padded): every parameter's `.grad` is a view
      of it, so autograd accumulates micro-steps in place;
    - `staging` (stage 2; 1-D, padded, pooled): this micro-step's gradients,
      alive from the bucket's first gradient until its reduction lands;
    - `grad_acc` (stages 0-1, 16-bit parameters only; 1-D, padded, fp32): the
      sum of the window's micro-steps, when there are several, and the reduction
      buffer when the reduce dtype is fp32;
    - `grad_shard` (1-D, shard): this rank's reduced, averaged gradient (at
      stage 0 the whole reduced buffer, at stage 1 a view of it); with 16-bit
      parameters it is 16-bit for one micro-step per window (fp32 with several,
      or with an fp32 reduction), and the optimizer sees it in fp32 (`master_grad`).

    `master` (1-D) is what the optimizer updates: this rank's shard (stage >= 1)
    or the whole buffer (stage 0). In fp32 it is the parameters' own storage;
    with 16-bit parameters it is a separate fp32 tensor, cast into the
    parameters after each step (`cast_master_to_params`).
    """

    def __init__(self, flat: FlatParams, switches: StageSwitches, use_reduce_scatter: bool, param_group: int,
                 name: str = "", precision: Precision = FP32, accumulation: int = 1,
                 compressed: CompressedReduction | None = None, weights: BlockCodec | None = None,
                 offload: bool = False, own_master: bool = False, powersgd: PowerSgd | None = None):
        """`offload`: the master, its fp32 gradient and the optimizer state live in host memory (or, moved
        there by `OptimizerTiers`, on disk): the master is an fp32 tensor of its own on the CPU even in fp32
        training, and the reduced gradient shard is summed there in fp32 (`host_grad` at stage 1).
        `own_master`: never share the parameters' storage (stage 3's shards offloaded, fp32 master kept).
        `powersgd`: stages 0-1, the low-rank reduction of the whole buffer and its state."""
        self.flat = flat
        self.compressed = compressed  # gradients travel quantized (communication_compression, ZeRO++'s qgZ)
        self.weights = weights  # stages 1-2: the updated shards travel quantized (communication_compression)
        self.name = name  # for messages: "bucket 3", "unit 'blocks.1', param group 0"
        self.switches = switches
        self.use_reduce_scatter = use_reduce_scatter  # false: all-reduce + slice, for comparison
        self.param_group = param_group  # index of the optimizer param group its parameters belong to
        self.precision = precision
        self.offload, self._own_master = offload, own_master
        self.stepping = False  # the delayed update's CPU step is updating the master on its thread
        if switches.shard_params:
            flat.keep_shard_only()
        self.master = self._init_master()  # before the cast: from the model's own values
        self.stepped = [self.master]  # what the optimizer steps: the master, or views of it (`optim.owned_views`)
        if flat.dtype != precision.param_dtype:
            flat.cast_(precision.param_dtype)
        self.full_grad: torch.Tensor | None = None
        self.grad_acc: torch.Tensor | None = None
        self.staging: torch.Tensor | None = None
        # 16-bit gradients are summed in fp32 across micro-steps, and an fp32 reduction needs an fp32 buffer.
        fp32_sum = precision.mixed and (accumulation > 1 or precision.reduce_dtype == precision.master_dtype)
        # Stage 1 with offload (and stages 2-3 with a delayed update, `copy_grad_for_step`): the fp32 gradient
        # shard on the host that the optimizer step reads, copied from `grad_shard` at the step.
        self.host_grad: torch.Tensor | None = None
        # Offload keeps the shard in fp32 on the host; a window of one micro-step is still rounded as on the
        # device (scaled in the reduce dtype, then widened), so offloading changes no bit.
        self._scale_in_reduce_dtype = offload and not fp32_sum
        if switches.shard_grads:
            dtype = precision.master_dtype if fp32_sum or offload else precision.reduce_dtype
            self.grad_shard = torch.zeros(flat.shard_numel, dtype=dtype, device=self.master.device)
        else:
            self.full_grad = torch.zeros(flat.padded_numel, dtype=flat.dtype, device=flat.device)
            if fp32_sum:
                self.grad_acc = torch.zeros(flat.padded_numel, dtype=precision.master_dtype, device=flat.device)
            reduced = self.grad_acc if self._reduces_in(self.grad_acc) else self.full_grad
            self.grad_shard = flat.shard(reduced) if switches.shard_optimizer else reduced
            if offload:
                self.host_grad = torch.zeros(flat.shard_numel, dtype=precision.master_dtype, device="cpu")
        self._staged = [False] * len(flat.params)  # stage 2: slots of `staging` holding this micro-step
        self._accumulated = False  # stage 2: grad_shard already holds part of this window
        self._aside: torch.Tensor | None = None  # stages 0-1: a reduction of this window set aside (`set_aside`)
        self.feedback = None if compressed is None else compressed.feedback_for(
            flat.padded_numel, all_reduce=not switches.shard_optimizer, device=flat.device)
        self.on_disk: GradOnDisk | None = None  # stages 2-3, the master on disk: grad_shard too (`swap_grads`)
        self.powersgd = powersgd  # stages 0-1: the low-rank reduction and its state

    def _init_master(self) -> torch.Tensor:
        """What the optimizer updates: in fp32 the parameters' own storage, no copy; else an fp32 copy."""
        values = self._own_params()
        if self.offload:
            return values.to(device="cpu", dtype=self.precision.master_dtype, copy=True)
        if self._own_master:
            return values.to(self.precision.master_dtype, copy=True)
        if not self.precision.mixed:
            return values
        if values.dtype == self.precision.master_dtype and (values is self.flat.data or values is self.flat.shard_data):
            return values  # stages 0 and 3 of an fp32 model: that fp32 buffer becomes the master, params get a 16-bit one
        return values.to(self.precision.master_dtype, copy=True)

    def _reduces_in(self, buffer: torch.Tensor | None) -> bool:
        return buffer is not None and buffer.dtype == self.precision.reduce_dtype

    @property
    def params(self):
        return self.flat.params

    def attach_grads(self) -> None:
        """Point each plain parameter's `.grad` at its view of `full_grad` (stages 0-1).

        Re-attached before every backward in case the user set `.grad` to None or to a tensor of its own
        (added in). A DTensor parameter (tensor parallelism) gets no view: `take_grad` adds its gradient.
        """
        if self.full_grad is None:
            return
        for p, view in zip(self.params, self.flat.views(self.full_grad)):
            if is_dtensor(p):
                continue
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                if p.grad is not None:  # a gradient put there first (autograd, the caller) adds up
                    view.add_(p.grad)
                p.grad = view

    def take_grad(self, index: int, pool: StagingPool) -> None:
        """Take parameter `index`'s fresh gradient into this bucket and free `.grad`.

        Stages 2-3 copy it into `staging`; stages 0-1 add it into `full_grad`,
        unless `.grad` already is its view there. No gradient: nothing to take
        (the slot stays zero).
        """
        grad = local_grad(self.params[index])
        if grad is None:
            return
        if self.switches.shard_grads:
            self._stage(index, grad.reshape(-1), pool)
            return
        slot = self.flat.slot(index, self.full_grad)
        if grad.data_ptr() != slot.data_ptr():
            slot.add_(grad.reshape(-1))
            self.params[index].grad = None

    def _stage(self, index: int, grad: torch.Tensor, pool: StagingPool) -> None:
        if self.staging is None:
            self.staging = pool.acquire(self.flat.padded_numel, self.precision.reduce_dtype, self.flat.device)
        slot = self.flat.slot(index, self.staging)
        if self._staged[index]:  # a second gradient before the bucket launched (reentrant checkpointing)
            slot.add_(grad)
        else:
            slot.copy_(grad)
        self._staged[index] = True
        self.params[index].grad = None

    def reduce_grad(self, comm: Comm, pool: StagingPool, scale: float) -> Pending:
        """Reduce this micro-step's gradients in the reduce dtype; afterwards `grad_shard` holds the running mean.

        `scale`, 1 / (N x accumulation steps) for the mean, applies once per reduction: the window's sum is
        the mean over the global batch (engine/grad_sync.py: a divide factor or "sum" changes it)."""
        if self.switches.shard_grads:
            return self._reduce_staged(comm, pool, scale)
        if self._aside is None:
            return self._reduce_whole(comm, pool, scale)
        aside, self._aside = self._aside, None
        return self._reduce_whole(comm, pool, scale).then(lambda: self.grad_shard.add_(aside))

    def set_aside(self) -> None:
        """Stages 0-1, a backward after this window's in-place reduction: its result kept aside (fp32), added to
        the next reduction's (`reduce_grad`)."""
        reduced = self.grad_shard.to(self.precision.master_dtype, copy=True)
        self._aside = reduced if self._aside is None else self._aside.add_(reduced)
        self.full_grad.zero_()
        if self.grad_acc is not None:
            self.grad_acc.zero_()

    def _reduce_whole(self, comm: Comm, pool: StagingPool, scale: float) -> Pending:
        buffer = self._reduce_input()
        if self.powersgd is not None:  # the mean of the whole buffer, in place; stage 1 then reads its shard
            return self.powersgd.reduce(comm, buffer, self.name).then(lambda: buffer.mul_(scale * comm.world_size))
        if self.compressed is not None:
            return self._reduce_compressed(buffer, scale * comm.world_size)
        before, after = self.precision.reduce_factors(comm.world_size, scale)
        if before != 1.0:
            buffer.mul_(before)
        if not self.switches.shard_optimizer:
            return all_reduce(comm, buffer, what=self.name).then(lambda: buffer.mul_(after))
        if self.use_reduce_scatter:
            scratch = self._scratch(comm, pool)
            pending = reduce_scatter(comm, self.grad_shard, buffer, scratch, what=self.name)
            pending.then(lambda: self._release(pool, scratch))
        else:
            pending = all_reduce(comm, buffer, what=self.name)
        return pending.then(lambda: self.grad_shard.mul_(after))

    def _reduce_compressed(self, buffer: torch.Tensor, after: float) -> Pending:
        """Stages 0-1: the mean over the ranks, quantized on the wire (`CompressedReduction`), times `after`."""
        if not self.switches.shard_optimizer:
            pending, result = self.compressed.all_reduce(buffer, self.feedback, self.name), buffer
        else:
            pending = self.compressed.reduce_scatter(self.grad_shard, buffer, self.feedback, self.name)
            result = self.grad_shard
        return pending.then(lambda: result.mul_(after)) if after != 1.0 else pending

    def _reduce_input(self) -> torch.Tensor:
        """Stages 0-1: the window's local gradient sum, in the reduce dtype, in the buffer `grad_shard` views."""
        if self.grad_acc is None:
            return self.full_grad
        self.grad_acc.add_(self.full_grad)
        if self._reduces_in(self.grad_acc):
            return self.grad_acc
        self.full_grad.copy_(self.grad_acc)  # one rounding of the fp32 sum to the reduce dtype
        return self.full_grad

    def accumulate_micro_step(self) -> None:
        """Stages 0-1, after a backward that does not reduce: add its 16-bit gradients to the fp32 sum."""
        if self.grad_acc is not None and self.full_grad is not None:
            self.grad_acc.add_(self.full_grad)
            self.full_grad.zero_()

    def _reduce_staged(self, comm: Comm, pool: StagingPool, scale: float) -> Pending:
        staging = self._staging_with_zeros(pool)
        # A compressed reduction sums in fp32 and returns the mean itself: no pre-scaling, and N x scale after.
        before, after = (1.0, scale * comm.world_size) if self.compressed else self.precision.reduce_factors(
            comm.world_size, scale)
        if before != 1.0:
            staging.mul_(before)
        direct = (self.on_disk is None and not self._accumulated  # reduce straight into grad_shard
                  and self.grad_shard.dtype == staging.dtype and self.grad_shard.device == staging.device)
        out = self.grad_shard if direct else pool.acquire(self.flat.shard_numel, staging.dtype, staging.device)
        if self.compressed is not None:
            pending = self.compressed.reduce_scatter(out, staging, self.feedback, what=self.name)
        elif self.use_reduce_scatter:
            scratch = self._scratch(comm, pool)
            pending = reduce_scatter(comm, out, staging, scratch, what=self.name)
            pending.then(lambda: self._release(pool, scratch))
        else:
            pending = all_reduce(comm, staging, what=self.name).then(lambda: out.copy_(self.flat.shard(staging)))

        first = not self._accumulated

        def add() -> None:
            if first and self._scale_in_reduce_dtype:
                self.grad_shard.copy_(out.mul_(after))
            else:  # in grad_shard's dtype (fp32 when 16-bit gradients accumulate) and place (the host: offload)
                self.grad_shard.add_(out.to(self.grad_shard.device), alpha=after)

        def accumulate():
            if direct:
                out.mul_(after)
            else:
                self.on_disk.add(add, first) if self.on_disk is not None else add()
                pool.release(out)
            pool.release(staging)

        self.staging = None
        self._accumulated = True
        self._staged = [False] * len(self.params)
        return pending.then(accumulate)

    def _staging_with_zeros(self, pool: StagingPool) -> torch.Tensor:
        """`staging`, with every slot no gradient reached (unused parameters) zeroed."""
        if self.staging is None:
            self.staging = pool.acquire(self.flat.padded_numel, self.precision.reduce_dtype, self.flat.device)
        for i, staged in enumerate(self._staged):
            if not staged:
                self.flat.slot(i, self.staging).zero_()
        for gap in self.flat.padding(self.staging):
            gap.zero_()
        return self.staging

    def _scratch(self, comm: Comm, pool: StagingPool) -> torch.Tensor | None:
        if comm.world_size == 1 or comm.algorithms.reduce_scatter != "all_to_all":
            return None
        return pool.acquire(self.flat.padded_numel, self.precision.reduce_dtype, self.flat.device)

    @staticmethod
    def _release(pool: StagingPool, scratch: torch.Tensor | None) -> None:
        if scratch is not None:
            pool.release(scratch)

    @property
    def gathers_after_step(self) -> bool:
        """Whether the step's updated shards are all-gathered into replicated parameters (stages 1-2)."""
        return self.switches.shard_optimizer and not self.switches.shard_params

    def swap_grads(self, swapped: Swapped, write_behind: WriteBehind) -> None:
        """Keep `grad_shard` in `swapped`'s file between reductions (stages 2-3, the master on disk)."""
        self.on_disk = GradOnDisk(self.grad_shard, swapped, write_behind)

    def copy_grad_for_step(self) -> None:
        """Give the optimizer step a copy of the offloaded gradient shard of its own (`host_grad`, fp32, on
        the host, taken by `master_grad`): the delayed update's CPU step reads it while the next window's
        backward sums into `grad_shard` (stage 1's `host_grad` already is such a copy)."""
        if self.offload and self.host_grad is None:
            self.host_grad = torch.zeros(self.flat.shard_numel, dtype=self.precision.master_dtype, device="cpu")

    def master_grad(self) -> torch.Tensor:
        """`grad_shard` in the master's dtype, for the optimizer (a new tensor when gradients are 16-bit;
        with `host_grad` (offload at stage 1, or `copy_grad_for_step`), copied into it; on disk, the tensor
        its sub-group reads back)."""
        if self.host_grad is not None:
            return self.host_grad.copy_(self.grad_shard)
        if self.on_disk is not None and not self._accumulated:  # no reduction reached it: zeros
            self.on_disk.add(lambda: None, first=True)
        return self.grad_shard.to(self.master.dtype)

    def cast_master_to_params(self) -> None:
        """Write the updated master into this rank's part of the parameters (nothing to do in fp32); a shard
        on disk is written behind (`settle` waits for it)."""
        own, swap = self._own_params(), self.flat.shard_swap
        if own.data_ptr() != self.master.data_ptr():
            if swap is not None:
                swap.claim()  # replaced whole: no read
            with torch.no_grad():
                own.copy_(self.master)
            if swap is not None:
                swap.write()

    def settle(self) -> None:
        """Wait for the shard's write to disk (parameter offload) and give its buffer back."""
        if self.flat.shard_swap is not None:
            self.flat.shard_swap.finish()

    @property
    def master_on_disk(self) -> bool:
        """The master is out in its swap file (offload_optimizer nvme, between steps): an empty tensor here."""
        return self.offload and self.master.numel() == 0 and self.flat.shard_numel > 0

    def take_params_into_master(self) -> None:
        """After the parameters were edited outside training: start the master from them (16-bit:
        the master takes their rounded values; in fp32 they are the master already)."""
        own = self._own_params()
        if self.stepping:
            raise RuntimeError(f"{self.name}: the delayed update (offload_optimizer.delayed_update) is stepping its "
                               "master on another thread, so parameters cannot be edited now; call "
                               "engine.flush_update() on every rank first")
        if self.master.numel() != own.numel():
            raise RuntimeError(f"{self.name}: its master is on disk (offload_optimizer nvme), so parameters "
                               "cannot be edited in place; load them through a checkpoint instead")
        if own.data_ptr() != self.master.data_ptr():
            with torch.no_grad():
                self.master.copy_(own)

    def _own_params(self) -> torch.Tensor:
        """The parameters this rank's master updates: its shard (stage 3: the persistent one) or all."""
        if self.switches.shard_params:
            return self.flat.shard_data
        return self.flat.shard(self.flat.data) if self.switches.shard_optimizer else self.flat.data

    def gather_params(self, comm: Comm) -> Pending:
        """All-gather the updated shards into the full flat buffer (stages 1-2); with `weights`, quantized, and
        every rank (this one too, for its own shard) takes the dequantized values: the master stays exact."""
        if self.weights is not None:
            return qwz_all_gather(comm, self.flat.data, self._own_params(), self.weights, what=self.name)
        return all_gather(comm, self.flat.data, what=self.name)

    def zero_grad(self, pool: StagingPool) -> None:
        """Start a new accumulation window (also after a failed backward)."""
        if self.full_grad is not None:
            self.full_grad.zero_()
            self._aside = None
            if self.grad_acc is not None:
                self.grad_acc.zero_()
            return
        if self.on_disk is not None:
            self.on_disk.reset()  # the next window's first reduction replaces it without a read
        else:
            self.grad_shard.zero_()
        self._accumulated = False
        self._staged = [False] * len(self.params)
        if self.staging is not None:
            pool.release(self.staging)
            self.staging = None
