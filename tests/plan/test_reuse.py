"""The reuse-distance rule (plan/reuse.py) and the units whole at backward's start (plan/prefetch.py), by hand.

A model of a root unit and blocks: forwards end block by block, then the
root (it encloses them); backward needs the root (the head), then the blocks
from the last. With root R and blocks B elements, a block's reuse distance is
the root plus the blocks after it; the root's is 0. The engine's own orders
are tests/stage3/test_schedule.py's.
"""

from __future__ import annotations

import pytest

from zeroshard.plan.flats import Flat
from zeroshard.plan.prefetch import gathered_numel
from zeroshard.plan.reuse import kept_units

R, B = 100, 1000
RELEASED, NEEDED, NUMEL = [1, 2, 3, 0], [0, 3, 2, 1], [R, B, B, B]  # root 0, blocks 1-3


@pytest.mark.parametrize("distance, live, kept", [
    (0, 10**9, set()),
    (1, 10**9, {0}),  # the root: nothing gathered between its forward's end and its backward
    (R, 10**9, {0}),  # the last block's distance is R: not under R
    (R + 1, 10**9, {0, 3}),
    (R + B + 1, 10**9, {0, 3, 2}),
    (R + 2 * B + 1, 10**9, {0, 3, 2, 1}),
    (10**9, R + 2 * B, {0, 3, 2}),  # the soonest reused first, within the live limit
    (10**9, R + 2 * B - 1, {0, 3}),
])
def test_units_under_the_distance_are_kept_soonest_first_within_the_live_limit(distance, live, kept):
    assert kept_units(RELEASED, NEEDED, NUMEL, distance, live) == kept


def test_a_unit_with_nothing_to_gather_is_never_kept():
    assert kept_units(RELEASED, NEEDED, [0, B, B, B], 1, 10**9) == {3}  # the last block: only the empty root between


@pytest.mark.parametrize("distance, want", [
    (0, R + 2 * B),  # the root, the last block, the one prefetched behind it: the rule without reuse
    (R + 1, R + 2 * B),  # the root and the last block kept; the block before them prefetched
    (R + B + 1, R + 3 * B),  # three kept, so the first block is prefetched beside them
    (10**9, R + 3 * B),
])
def test_gathered_at_the_start_of_backward_replays_the_kept_units_and_the_prefetch(distance, want):
    units = [[Flat(n)] for n in NUMEL]
    assert gathered_numel(units, 1, max_reuse_distance=distance) == want
