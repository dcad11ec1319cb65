"""CrossParallel: what crosses mesh dimensions besides ZeRO's own `dp` traffic.

- Partial gradients over `tp`: a parameter replicated over `tp` but used on
  sequence-sharded activations (SequenceParallel's LayerNorm) gets a gradient
  that is a partial sum on each tp rank. It is summed over `tp` before it is
  taken into a bucket, so every tp rank reduces the same gradient.
- Ties across pipeline stages (`ties.py`).
- The step check runs over the whole mesh, so every rank of every stage
  takes the same decision, and the global gradient norm counts each element
  once: a parameter sharded over `tp` on every tp rank, one replicated over
  `tp` on tp rank 0 only, a tie on its lowest stage only.

Each dimension's collectives are recorded apart: `comm_stats("tp")`, `"pp"`,
and `"mesh"` (the step check) beside the data-parallel `"dp"`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from zeroshard.comm import Comm, CommRecorder, all_reduce
from zeroshard.core.flat import FlatParams
from zeroshard.core.local import set_local_grad
from zeroshard.parallel.mesh import Mesh
from zeroshard.parallel.ties import Tie, build_ties, reduce_tied_grads


class CrossParallel:
    """The mesh's reductions outside `dp`, its step-check comm, and which gradient elements each rank counts."""

    def __init__(self, mesh: Mesh, model: nn.Module, tied: dict[str, str], timeout_s: float,
                 rank_check_timeout_s: float):
        self.mesh = mesh
        self.recorders = {dim: CommRecorder() for dim in ("tp", "pp", "mesh")}
        self.world = Comm.create(dist.group.WORLD, self.recorders["mesh"], timeout_s, rank_check_timeout_s)
        self.timeout_s = timeout_s
        self.ties: list[Tie] = build_ties(model, mesh, tied, self.world, self.recorders["pp"], timeout_s)
        self._tp_comms: dict[int, Comm] = {}
        tied_elsewhere = {id(t.param) for t in self.ties if not t.counted}
        self._counts = {id(p): _counts_once(p, mesh) and id(p) not in tied_elsewhere for p in model.parameters()}
        self._ranges: dict[int, list[tuple[int, int]]] = {}

    def dp_groups(self) -> list[list[int]]:
        """The data-parallel groups as lists of world ranks: the ranks that run the same collectives."""
        ranks = self.mesh.device_mesh.mesh  # (pp, dp, tp): each coordinate's world rank
        return ranks.transpose(1, 2).reshape(-1, ranks.shape[1]).tolist()

    def match_placements(self, param: nn.Parameter) -> None:
        """Bring a DTensor gradient to its parameter's placements, in place on `.grad`.

        A gradient partial over `tp` where the parameter is replicated (sequence parallelism) is summed
        by a recorded all-reduce over that dimension; any other difference goes through DTensor's own
        redistribute.
        """
        grad = param.grad
        if not isinstance(grad, DTensor) or grad.placements == param.placements:
            return
        pairs = list(zip(grad.placements, param.placements))
        if not all(have == want or (isinstance(have, Partial) and isinstance(want, Replicate)) for have, want in pairs):
            param.grad = grad.redistribute(param.device_mesh, param.placements)
            return
        part = grad._local_tensor
        for dim, (have, want) in enumerate(pairs):
            if have != want:
                all_reduce(self._tp_comm(grad.device_mesh.get_group(dim)), part, what="partial gradient").wait()
                if have.reduce_op == "avg":
                    part.div_(grad.device_mesh.size(dim))
        set_local_grad(param, part)

    def reduce_ties(self) -> None:
        reduce_tied_grads(self.ties)

    def counted(self, flat: FlatParams, shard: torch.Tensor) -> list[torch.Tensor]:
        """The parts of this rank's shard of `flat` (`shard`, in shard coordinates) that count in the norm."""
        key = id(flat)
        if key not in self._ranges:
            self._ranges[key] = _counted_ranges(flat, [self._counts[id(p)] for p in flat.params])
        return [shard[lo:hi] for lo, hi in self._ranges[key]]

    def tp_comm(self) -> Comm:
        """The comm over this rank's `tp` group, recorded as comm_stats("tp") (partitioned activation checkpoints)."""
        return self._tp_comm(self.mesh.group("tp"))

    def _tp_comm(self, group: dist.ProcessGroup) -> Comm:
        key = id(group)
        if key not in self._tp_comms:
            self._tp_comms[key] = Comm.create(group, self.recorders["tp"], self.timeout_s)
        return self._tp_comms[key]


def _counts_once(param: nn.Parameter, mesh: Mesh) -> bool:
    """Whether this rank's copy of `param` counts in the norm: sharded over `tp`, or on tp rank 0."""
    if isinstance(param, DTensor) and any(isinstance(p, Shard) for p in param.placements):
        return True
    return mesh.rank("tp") == 0


def _counted_ranges(flat: FlatParams, counts: list[bool]) -> list[tuple[int, int]]:
    """Maximal [lo, hi) ranges, in shard coordinates, of this rank's shard that belong to counted parameters."""
    lo_shard = flat.rank * flat.shard_numel
    ranges: list[tuple[int, int]] = []
    for offset, numel, count in zip(flat.offsets, flat.numels, counts):
        lo, hi = max(offset, lo_shard) - lo_shard, min(offset + numel, lo_shard + flat.shard_numel) - lo_shard
        if not count or lo >= hi:
            continue
        if ranges and ranges[-1][1] == lo:
            ranges[-1] = (ranges[-1][0], hi)
        else:
            ranges.append((lo, hi))
    return ranges
