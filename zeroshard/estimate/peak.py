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

Staging buffers are replayed from the engine's own rule (core/staging.py,
core/bucket.py, core/reducer.py): stages 2-3 stage each bucket's (unit's)
gradients in a block of its padded size from its first gradient on; a
reduce-scatter done as gloo's all-to-all takes a scratch block of the same
size while in flight; a reduction into an fp32 sum takes a shard-sized block
for its result. One reduction is in flight while the next bucket fills
(`MAX_IN_FLIGHT`), and the pool keeps every block it made for the engine's
life: its peak use is what `memory_stats()["staging"]` reports after a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from zeroshard.estimate.formulas import model_state_bytes, padded_numel, shard_numel, state_bytes_per_element
from zeroshard.estimate.reuse import kept_units
from zeroshard.estimate.zeropp import FROZEN, PERSISTENT, Flat

MAX_IN_FLIGHT = 1  # reductions in flight while the next bucket fills: core/reducer.py's constant
_FP32 = 4
# The config's defaults: stage3_max_live_parameters, stage3_prefetch_bucket_size (elements; DeepSpeed's),
# stage3_max_reuse_distance (zeroshard's: every unit released after its forward; DeepSpeed's is 1e9)
MAX_LIVE_NUMEL = 1_000_000_000
PREFETCH_NUMEL = 50_000_000
MAX_REUSE_DISTANCE = 0


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
              max_reuse_distance: int = MAX_REUSE_DISTANCE) -> StepPeak:
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
    stage3_max_live_parameters, stage3_prefetch_bucket_size and stage3_max_reuse_distance.
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
    # a micro-step after the window's first reduces into a shard-sized block, then adds it to the sum
    staging = reduce_bytes * staging_numel(targets, stage, world_size, scratch and world_size > 1,
                                           out=accumulation > 1)
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


def staging_numel(targets: Sequence[Sequence[Flat]], stage: int, world_size: int, scratch: bool, out: bool) -> int:
    """Elements the staging pool holds after one backward, replayed from the engine's rule.

    `targets`: what is reduced as one, in backward order (a bucket; at stage 3 a unit's flats, the root
    unit last: its gradients are complete only when the embedding's backward ends, but the final norm's,
    which it also holds, come first, so its staging is taken at the start and held throughout);
    `scratch`: each flat's reduce-scatter takes a padded-size scratch block; `out`: stages 2-3 reduce
    into a shard-sized block first (a later micro-step's, added to the window's sum).
    Stage 0 all-reduces in place; stage 1 reduces the whole buckets at the window's end.
    """
    if stage == 0:
        return 0
    block = 0 if stage == 3 else max((padded_numel(f.numel, world_size) for t in targets for f in t), default=0)
    pool = _Pool(block)
    staged = [[] for _ in targets]
    if stage == 3 and targets:
        staged[-1] = [pool.acquire(padded_numel(f.numel, world_size)) for f in targets[-1]]
    in_flight: list[list[int]] = []
    for target, taken in zip(targets, staged):
        if stage >= 2 and not taken:
            taken = [pool.acquire(padded_numel(f.numel, world_size)) for f in target]
        while len(in_flight) >= MAX_IN_FLIGHT:  # the previous reduction lands and gives its blocks back
            pool.release(in_flight.pop(0))
        taken += [pool.acquire(padded_numel(f.numel, world_size)) for f in target if scratch]
        taken += [pool.acquire(shard_numel(f.numel, world_size)) for f in target if out and stage >= 2]
        in_flight.append(taken)
    return pool.made


class _Pool:
    """core/staging.py's StagingPool by sizes only: best-fit reuse of a free block, else a new one of at
    least `block` elements (stages 0-2: the largest bucket; stage 3: exactly the size asked for)."""

    def __init__(self, block: int):
        self.block, self.free, self.made = block, [], 0

    def acquire(self, numel: int) -> int:
        fits = [b for b in self.free if b >= numel]
        if fits:
            self.free.remove(min(fits))
            return min(fits)
        size = max(numel, self.block)
        self.made += size
        return size

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)


def gathered_numel(units: Sequence[Sequence[Flat]], world_size: int, max_live_numel: int = MAX_LIVE_NUMEL,
                   prefetch_numel: int = PREFETCH_NUMEL, max_reuse_distance: int = MAX_REUSE_DISTANCE) -> int:
    """Stage 3: elements whole beyond the shards once backward's second unit is gathered, replayed from
    stage3/schedule.py's rules for a model of blocks (forwards end block by block, then the root unit; backward
    needs the root unit, then the blocks from the last): the units kept from forward to backward
    (estimate/reuse.py), then each of backward's first two units and the prefetch of the next unit not kept
    after each (none if that one is gathering already), within the limits. The root unit holds the embedding, so it stays whole to the backward's end.
    Each flat is padded; persistent flats are whole all along (in `params`)."""
    sizes = [sum(padded_numel(f.numel, world_size) for f in unit if f.kind != PERSISTENT) for unit in units]
    if not sizes:
        return 0
    needed = [0, *range(len(sizes) - 1, 0, -1)]
    kept = kept_units([*range(1, len(sizes)), 0], needed, sizes, max_reuse_distance, max_live_numel)
    live = set(kept)
    for at, unit in enumerate(needed[:2]):
        live.add(unit)
        after = next((u for u in needed[at + 1:] if u not in kept), None)  # a unit gathering already: none
        if after is not None and after not in live and sizes[after] <= prefetch_numel and \
                sum(sizes[u] for u in live) + sizes[after] <= max_live_numel:
            live.add(after)
    return sum(sizes[u] for u in live)
