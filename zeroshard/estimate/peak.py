"""The peak memory of one training step on one rank: model states + activations + buffers, by part.

`step_peak` adds up what a rank holds at the two moments a step can peak
(docs/memory.md, "The anatomy of a step's memory"):

- the start of backward: every activation the forward saved is still held
  (backward frees them as it goes) and the first gradients appear. On top of
  the model states: the activations (`count_saved`'s meta count); the
  staging buffers; one parameter's gradient as autograd makes it, before the
  engine takes it into its bucket; the gradient of the largest activation,
  which backward makes before it frees that activation; at stage 3 the units gathered then (the
  root unit, whose forward spans the whole model, the unit computing and the
  one prefetched behind it); with checkpointing, one block's recompute.
- the optimizer step: activations are gone, and with 16-bit gradients each
  bucket's gradient shard is copied to fp32 for the optimizer (`master_grad`),
  all buckets at once.

The staging blocks and the units whole at backward's start are the plan's
(plan/staging.py's `staging_numel`, plan/prefetch.py's `gathered_numel`: the
rules the engine's staging pool, reducer and gather schedule read); this
module prices them in bytes. The pool keeps every block it made for the
engine's life: what `memory_stats()["staging"]` reports after a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from zeroshard.estimate.formulas import model_state_bytes, shard_numel, state_bytes_per_element
from zeroshard.plan.defaults import MAX_LIVE_NUMEL, MAX_REUSE_DISTANCE, PREFETCH_NUMEL
from zeroshard.plan.flats import FROZEN, PERSISTENT, Flat
from zeroshard.plan.prefetch import gathered_numel
from zeroshard.plan.staging import staging_numel

_FP32 = 4


@dataclass(frozen=True)
class StepPeak:
    """Bytes one rank holds at the step's peak, by part; `phase` says which moment peaks."""

    params: int
    grads: int
    master: int
    optimizer: int
    staging: int  # the staging pool's blocks (held all step, as memory_stats()["staging"])
    activations: int  # what the forward saved for backward
    gathered: int  # stage 3: the units whole at the start of backward, beyond the shards
    param_grad: int  # one parameter's gradient as autograd makes it, before the bucket takes it
    activation_grad: int  # the largest activation's gradient, made while that activation is still held
    recompute: int  # checkpointing: one block's activations while its recompute runs
    step_temporaries: int  # at the optimizer step: fp32 copies of 16-bit gradient shards
    phase: str  # "backward" or "step"

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.master + self.optimizer

    @property
    def held(self) -> int:
        """What is held all step: model states and staging (memory_stats().held() without ZeRO++/codecs)."""
        return self.model_states + self.staging

    @property
    def backward(self) -> int:
        return self.held + self.activations + self.gathered + self.param_grad + self.activation_grad + self.recompute

    @property
    def step(self) -> int:
        return self.held + self.step_temporaries

    @property
    def total(self) -> int:
        """The step's peak: the larger of the two moments."""
        return max(self.backward, self.step)

    def as_dict(self) -> dict:
        return asdict(self) | {"model_states": self.model_states, "backward": self.backward, "step": self.step,
                               "total": self.total}


def step_peak(numel: int, activations: int, stage: int, world_size: int, dtype: str = "bf16", *,
              buckets: Sequence[int] = (), units: Sequence[Sequence[Flat]] = (), recompute: int = 0,
              largest_param: int = 0, activation_grad: int = 0, accumulation: int = 1, scratch: bool = True,
              max_live_numel: int = MAX_LIVE_NUMEL, prefetch_numel: int = PREFETCH_NUMEL,
              max_reuse_distance: int = MAX_REUSE_DISTANCE, shard_apart: bool = False) -> StepPeak:
    """The peak bytes of one training step on one rank, by part (see the module's docstring).

    `numel`: Ψ, trained elements; `activations`: bytes one micro-batch's forward saves (`count_saved`,
    `zeroshard estimate`'s "total"); `dtype`: "fp32", "bf16" or "fp16", also the reduction's;
    `buckets`: stages 0-2, each gradient bucket's elements, in the engine's order (backward's);
    `units`: stage 3, each unit's flat buffers, in forward order with the root unit first
    (`stage3.wrapping.plan_units`' order); `recompute`: with checkpointing, the bytes of one block's
    activations without it; `largest_param`: elements of the largest parameter; `activation_grad`: bytes of
    the largest tensor the forward saves without checkpointing (`ActivationCount.largest`); `accumulation`:
    micro-steps per step; `scratch`: the reduce-scatter runs as an all-to-all into a scratch buffer
    (gloo; NCCL's native one needs none); `max_live_numel`, `prefetch_numel`, `max_reuse_distance`: stage 3's
    stage3_max_live_parameters, stage3_prefetch_bucket_size and stage3_max_reuse_distance; `shard_apart`:
    stages 2-3, the gradient shard is in another dtype or memory than the reduction (offload: an fp32 shard
    on the host beside 16-bit or GPU reductions; a shard on disk), so every reduction lands in a block first.
    """
    per_element = state_bytes_per_element(dtype, None, accumulation, stage)
    tensors = len(buckets) if stage < 3 else sum(f.kind != FROZEN for u in units for f in u)
    # torch's Adam keeps a 4-byte step counter per tensor it updates: one master per bucket or flat
    states = model_state_bytes(numel, world_size, stage, optimizer_scalar_bytes=_FP32 * tensors, **per_element)
    param_bytes, reduce_bytes = per_element["param_bytes"], _reduce_bytes(dtype)
    fp32_sum = per_element["grad_bytes"] != param_bytes  # 16-bit gradients summed in fp32
    if stage == 3:  # persistent flats stay whole on every rank
        persistent = sum(f.numel for u in units for f in u if f.kind == PERSISTENT)
        states["params"] += param_bytes * (persistent - shard_numel(persistent, world_size))
    targets = [[Flat(n)] for n in buckets] if stage < 3 else \
        [[f for f in u if f.kind != FROZEN] for u in [*units[1:][::-1], *units[:1]]]  # backward's order
    # a micro-step after the window's first (or any, with the shard apart) reduces into a shard-sized block,
    # then adds it to the sum
    staging = reduce_bytes * staging_numel(targets, stage, world_size, scratch and world_size > 1,
                                           out=accumulation > 1 or shard_apart)
    gathered = param_bytes * gathered_numel(units, world_size, max_live_numel, prefetch_numel,
                                            max_reuse_distance) if stage == 3 else 0
    temporaries = 0
    if per_element["master_bytes"]:  # 16-bit gradients: an fp32 copy of each gradient shard for the optimizer
        temporaries = 0 if fp32_sum and stage >= 2 else _FP32 * (numel if stage == 0 else shard_numel(numel, world_size))
    parts = dict(staging=staging, activations=activations, gathered=gathered, param_grad=param_bytes * largest_param,
                 activation_grad=activation_grad, recompute=recompute, step_temporaries=temporaries)
    peak = StepPeak(**states, **parts, phase="")
    return StepPeak(**states, **parts, phase="backward" if peak.backward >= peak.step else "step")


def _reduce_bytes(dtype: str) -> int:
    return _FP32 if dtype == "fp32" else 2

