"""Stage 3's prefetch rule: which unit is gathered ahead, within which limits, and what is whole at backward's start.

After a unit is needed, the unit that followed it on the first step
(`following`), past those whole already (`next_to_gather`), starts its
gather early if it has at most `stage3_prefetch_bucket_size` elements and the
gathered elements stay within `stage3_max_live_parameters` (`may_prefetch`);
a gather that forward or backward needs now always proceeds. The engine
(stage3/schedule.py) applies these rules to the orders it recorded;
`gathered_numel` to the order a model of blocks runs in, for the estimate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from zeroshard.plan.defaults import MAX_LIVE_NUMEL, MAX_REUSE_DISTANCE, PREFETCH_NUMEL
from zeroshard.plan.flats import PERSISTENT, Flat, padded_numel
from zeroshard.plan.reuse import kept_units


def following(order: Sequence[int]) -> dict[int, int]:
    """Unit -> the unit that followed its first appearance in `order`."""
    after: dict[int, int] = {}
    for a, b in zip(order, order[1:]):
        if a != b:
            after.setdefault(a, b)
    return after


def next_to_gather(unit: int, after: Mapping[int, int], whole: Callable[[int], bool]) -> int | None:
    """The unit to prefetch once `unit` is needed: the one after it in `after` (`following`), past those
    `whole` already (kept from the forward); None at the end of the order."""
    j = after.get(unit)
    for _ in after:  # `after` may cycle (a module called twice): each unit at most once
        if j is None or not whole(j):
            break
        j = after.get(j)
    return j


def may_prefetch(numel: int, live_numel: int, max_prefetch_numel: int, max_live_numel: int) -> bool:
    """Whether a unit of `numel` gathered elements is prefetched while `live_numel` are gathered or gathering."""
    return numel <= max_prefetch_numel and live_numel + numel <= max_live_numel


def gathered_numel(units: Sequence[Sequence[Flat]], world_size: int, max_live_numel: int = MAX_LIVE_NUMEL,
                   prefetch_numel: int = PREFETCH_NUMEL, max_reuse_distance: int = MAX_REUSE_DISTANCE) -> int:
    """Elements whole beyond the shards once backward's second unit is gathered, for a model of blocks.

    `units`: each unit's flats in forward order, the root unit first. Forwards end block by block, then
    the root unit; backward needs the root unit, then the blocks from the last. Whole then: the units kept
    from forward to backward (`kept_units`), then each of backward's first two units and the prefetch of
    the next unit not kept after each (none if that one is gathering already), within the limits. The root
    unit holds the embedding, so it stays whole to the backward's end. Each flat is padded; persistent
    flats are whole all along (not counted here).
    """
    sizes = [sum(padded_numel(f.numel, world_size) for f in unit if f.kind != PERSISTENT) for unit in units]
    if not sizes:
        return 0
    needed = [0, *range(len(sizes) - 1, 0, -1)]
    kept = kept_units([*range(1, len(sizes)), 0], needed, sizes, max_reuse_distance, max_live_numel)
    after, live = following(needed), set(kept)
    for unit in needed[:2]:
        live.add(unit)
        j = next_to_gather(unit, after, lambda u: u in kept)
        if j is not None and j not in live and may_prefetch(sizes[j], sum(sizes[u] for u in live), prefetch_numel,
                                                            max_live_numel):
            live.add(j)
    return sum(sizes[u] for u in live)
