"""The staging pool's rules, by sizes: how large a block is, which free block serves a request, how many
reductions are in flight, and the blocks one backward makes.

Staging blocks are kept for the engine's lifetime (core/staging.py holds
their tensors): what a backward made once is what `memory_stats()["staging"]`
reports after it. Stages 2-3 stage each bucket's (a unit's buckets')
gradients in a block of its padded size from its first gradient on
(core/bucket.py); a reduce-scatter done as gloo's all-to-all takes a scratch
block of the same size while in flight; a reduction into an fp32 sum takes a
shard-sized block for its result. `MAX_IN_FLIGHT` reductions are in flight
while the next bucket fills (core/reducer.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from zeroshard.plan.flats import Flat, padded_numel, shard_numel

# One reduction in flight overlaps the next unit's backward (double buffering);
# more would only hold more staging and scratch buffers, and on CPU they
# contend with backward for the same cores.
MAX_IN_FLIGHT = 1


def block_numel(padded: Iterable[int], per_unit: bool) -> int:
    """The least elements of a staging block, from the buckets' padded sizes.

    Stages 0-2: the largest bucket, so any free block serves any request and
    the pool holds one block per buffer in use. Stage 3 (`per_unit`) stages
    each bucket of a unit at once, small ones (biases, norms) too: blocks of
    exactly the size asked for (0), reused by the next unit of the same shape.
    """
    return 0 if per_unit else max(padded, default=0)


class Blocks:
    """The pool's choice, by sizes: a request takes the smallest free block that holds it (the first of
    equals, in the order they were given back), else a new block of max(request, `block_numel`) elements.
    Blocks are numbered in the order they were made."""

    def __init__(self, block_numel: int = 0) -> None:
        self.block_numel = block_numel
        self.sizes: list[int] = []  # elements of each block made
        self._free: list[int] = []  # blocks given back, in that order

    def acquire(self, numel: int) -> int:
        """The block that serves `numel` elements: a free one, or the next number (a block to make)."""
        fits = [b for b in self._free if self.sizes[b] >= numel]
        if fits:
            best = min(fits, key=lambda b: self.sizes[b])
            self._free.remove(best)
            return best
        self.sizes.append(max(numel, self.block_numel))
        return len(self.sizes) - 1

    def release(self, block: int) -> None:
        if not 0 <= block < len(self.sizes):
            raise ValueError("released a tensor this pool did not hand out")
        if block in self._free:
            raise ValueError("released a buffer twice; two holders would share it")
        self._free.append(block)

    def is_free(self, block: int) -> bool:
        """Whether block `block` is given back (its contents belong to no one)."""
        return block in self._free

    @property
    def made(self) -> int:
        """Elements of every block made."""
        return sum(self.sizes)


def staging_numel(targets: Sequence[Sequence[Flat]], stage: int, world_size: int, scratch: bool, out: bool) -> int:
    """Elements the staging pool holds after one backward.

    `targets`: what is reduced as one, in backward order (a bucket; at stage 3 a unit's flats, the root
    unit last: its gradients are complete only when the embedding's backward ends, but the final norm's,
    which it also holds, come first, so its staging is taken at the start and held throughout);
    `scratch`: each flat's reduce-scatter takes a padded-size scratch block; `out`: stages 2-3 reduce
    into a shard-sized block first (a later micro-step's, added to the window's sum; every one's when the
    gradient shard is in another dtype or memory: core/bucket.py's `direct`).
    Stage 0 all-reduces in place; stage 1 reduces the whole buckets at the window's end.
    """
    if stage == 0:
        return 0
    pool = Blocks(block_numel((padded_numel(f.numel, world_size) for t in targets for f in t), stage == 3))
    staged = [[] for _ in targets]
    if stage == 3 and targets:
        staged[-1] = [pool.acquire(padded_numel(f.numel, world_size)) for f in targets[-1]]
    in_flight: list[list[int]] = []
    for target, taken in zip(targets, staged):
        if stage >= 2 and not taken:
            taken = [pool.acquire(padded_numel(f.numel, world_size)) for f in target]
        while len(in_flight) >= MAX_IN_FLIGHT:  # the previous reduction lands and gives its blocks back
            for block in in_flight.pop(0):
                pool.release(block)
        taken += [pool.acquire(padded_numel(f.numel, world_size)) for f in target if scratch]
        taken += [pool.acquire(shard_numel(f.numel, world_size)) for f in target if out and stage >= 2]
        in_flight.append(taken)
    return pool.made
