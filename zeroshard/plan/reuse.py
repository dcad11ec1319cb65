"""Which stage-3 units stay whole from their forward to their backward: DeepSpeed's reuse distance.

After a unit's forward, the units whose parameters the step uses before it
needs this one again (the rest of the forward, then the backward up to it)
hold some number of elements: its reuse distance. A unit whose distance is
under `stage3_max_reuse_distance` is not released after its forward, so its
backward gathers nothing (DeepSpeed's `stage3_max_reuse_distance`); the
units kept are those reused soonest, while together they hold at most
`stage3_max_live_parameters` elements. 0, the default, releases every unit
after its forward (ZeRO's 3Ψ a step; FSDP's reshard_after_forward); 1 keeps
only the units with no other unit's parameters used between their forward's
end and their backward (a root unit; the last block too when the root unit
gathers nothing); DeepSpeed's default, 1e9, keeps every unit of a smaller
model.

The engine (stage3/schedule.py) applies this to the order it recorded on the
first step; the plan (prefetch.py's `gathered_numel`, which the estimate
prices) to the order a model of blocks runs in.
"""

from __future__ import annotations

from collections.abc import Sequence


def kept_units(released: Sequence[int], needed: Sequence[int], numel: Sequence[int], max_reuse_distance: int,
               max_live: int) -> set[int]:
    """The units kept whole from forward to backward.

    `released`: unit indices in the order their forwards end; `needed`: in the order backward first needs
    them; `numel`: each unit's gathered elements (a unit with none is never kept: there is nothing to keep).
    """
    distance = {}
    for at, unit in enumerate(released):
        if not numel[unit] or unit not in needed:
            continue
        back = needed.index(unit)
        between = set(released[at + 1:]) | set(needed[:back])
        between.discard(unit)
        distance[unit] = sum(numel[u] for u in between)
    kept, live = set(), 0
    for unit in sorted(distance, key=lambda u: (distance[u], u)):
        if distance[unit] < max_reuse_distance and live + numel[unit] <= max_live:
            kept.add(unit)
            live += numel[unit]
    return kept
