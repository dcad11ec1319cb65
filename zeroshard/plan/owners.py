"""Whole-tensor ownership: which rank updates each tensor of an optimizer that needs tensors whole.

Muon, Adafactor, LAMB and their kind update a tensor from the tensor whole (an
orthogonalisation, row and column moments, a trust ratio), so a flat shard may
not cut one. For their param groups each tensor is owned by one rank, chosen
largest first to the rank that owns the fewest elements so far (Graham's
longest-processing-time rule; one `Owners` per param group, its count carried
over from bucket to bucket, so the group's state evens out over the model). A flat buffer of owned
tensors is laid out owner by owner: rank r's tensors fill its segment
[r S, (r + 1) S), S the largest rank's elements, and the rest of a segment is
padding. The reduce-scatter and all-gather of the flat buffer are then the
usual ones over N segments of S, and each rank's shard holds its tensors whole.
"""

from __future__ import annotations


class Owners:
    """The running count of owned elements per rank, and the owner of each new tensor."""

    def __init__(self, world_size: int):
        self.owned = [0] * world_size  # elements owned so far, by rank

    def assign(self, numels: list[int]) -> list[int]:
        """The owning rank of each of a flat buffer's tensors (`numels`, in the buffer's order)."""
        owners = [0] * len(numels)
        for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
            rank = min(range(len(self.owned)), key=lambda r: (self.owned[r], r))
            owners[i] = rank
            self.owned[rank] += numels[i]
        return owners


def owned_layout(numels: list[int], owners: list[int], world_size: int) -> tuple[list[int], int]:
    """(each tensor's offset in the flat buffer, S: elements per rank's segment) for tensors laid out owner by
    owner, each rank's in their order."""
    loads = [0] * world_size
    for numel, owner in zip(numels, owners):
        loads[owner] += numel
    segment = max(max(loads), 1)
    cursor = [r * segment for r in range(world_size)]
    offsets = []
    for numel, owner in zip(numels, owners):
        offsets.append(cursor[owner])
        cursor[owner] += numel
    return offsets, segment
