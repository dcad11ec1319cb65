"""Ties: one parameter held by several pipeline stages (a tied embedding on the first and last stage).

Each stage that holds a copy names it: `tied={"embedding": "wte.weight"}` on
the first stage, `{"embedding": "head.weight"}` on the last. At construction
the copies start from the lowest stage's values; before each reduction the
copies' gradients are summed over the stages that hold them (one all-reduce
per tie, Megatron's embedding group), so every copy takes the same update.
The gradient norm counts a tie once: on its lowest stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from zeroshard.comm import Comm, CommRecorder, all_gather_object, all_reduce, broadcast
from zeroshard.core.local import local, local_grad, set_local_grad
from zeroshard.errors import ZeroshardError
from zeroshard.parallel.mesh import Mesh


class TieError(ZeroshardError, ValueError):
    """Tied parameters declared inconsistently across pipeline stages."""


@dataclass
class Tie:
    name: str
    param: nn.Parameter
    comm: Comm  # the stages holding this tie, at this rank's dp and tp coordinates
    counted: bool  # whether this copy counts in the gradient norm (the lowest stage's)


def build_ties(model: nn.Module, mesh: Mesh, tied: dict[str, str], world: Comm, recorder: CommRecorder,
               timeout_s: float) -> list[Tie]:
    """This rank's ties, with a process group per tie and (dp, tp) coordinate; every rank calls it."""
    params = dict(model.named_parameters())
    missing = sorted(set(tied.values()) - set(params))
    if missing:
        raise TieError(f"tied names parameters {missing} that this stage's model does not have; name them as "
                       f"model.named_parameters() does (it has {sorted(params)[:8]} ...)")
    mine = {tie: (tuple(params[name].shape), str(params[name].dtype)) for tie, name in tied.items()}
    rows = all_gather_object(world, (mesh.coordinate, mine))
    ties = []
    for tie in sorted({t for _, held in rows for t in held}):
        holders = _holders(rows, tie)
        ranks_here = None
        for coordinate, ranks in holders.items():  # every rank creates every group, in the same order
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if (mesh.rank("dp"), mesh.rank("tp")) == coordinate and tie in tied:
                ranks_here = (ranks, group)
        if ranks_here is None:
            continue
        ranks, group = ranks_here
        if group is None:
            raise TieError(f"tie '{tie}' is declared on one pipeline stage only ({mesh.model_part}); declare "
                           "it on every stage that holds a copy, or drop it")
        comm = Comm.create(group, recorder, timeout_s)
        param = params[tied[tie]]
        with torch.no_grad():
            broadcast(comm, local(param).data, src=0)
        ties.append(Tie(tie, param, comm, counted=comm.rank == 0))
    return ties


def _holders(rows: list, tie: str) -> dict[tuple[int, int], list[int]]:
    """(dp, tp) coordinate -> the global ranks (one per stage holding `tie`), checked to agree on its shape."""
    shapes = {held[tie] for _, held in rows if tie in held}
    if len(shapes) > 1:
        raise TieError(f"tie '{tie}' names parameters of different shapes or dtypes on different stages: "
                       f"{sorted(shapes)}; a tie must be one parameter's copies")
    holders: dict[tuple[int, int], list[int]] = {}
    for rank, (coordinate, held) in enumerate(rows):
        if tie in held:
            holders.setdefault((coordinate["dp"], coordinate["tp"]), []).append(rank)
    return holders


def reduce_tied_grads(ties: list[Tie]) -> None:
    """Sum each tie's gradient over the stages that hold it (before the data-parallel reduction).

    A copy that received no gradient joins with zeros, so the stages never wait on each other.
    """
    for tie in ties:
        grad = local_grad(tie.param)
        if grad is None:
            grad = torch.zeros_like(local(tie.param))
            set_local_grad(tie.param, grad)
        all_reduce(tie.comm, grad, what=f"tie '{tie.name}'").wait()
