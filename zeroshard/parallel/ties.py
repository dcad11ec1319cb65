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
    shape: torch.Size  # its local tensor's, as built (at stage 3 the parameter is empty between uses)


def build_ties(model: nn.Module, mesh: Mesh, tied: dict[str, str], world: Comm, recorder: CommRecorder,
               timeout_s: float) -> list[Tie]:
    """This rank's ties, with a process group per tie and (dp, tp) coordinate; every rank calls it.

    Every verdict is taken from what all ranks declared, so a bad declaration raises on every rank.
    """
    params = dict(model.named_parameters())
    mine = {tie: _described(params.get(name)) for tie, name in tied.items()}
    missing = sorted(name for name in tied.values() if name not in params)
    rows = all_gather_object(world, (mesh.coordinate, mine, missing))
    bad = {rank: m for rank, (_, _, m) in enumerate(rows) if m}
    if bad:
        raise TieError(f"tied names parameters that the stage's model does not have: {bad} (rank: names); name "
                       "them as model.named_parameters() does on that stage")
    ties = []
    for tie in sorted({t for _, held, _ in rows for t in held}):
        groups = {}
        for coordinate, ranks in _holders(rows, tie).items():  # every rank creates every group, in order
            groups[coordinate] = dist.new_group(ranks) if len(ranks) > 1 else None
        here = (mesh.rank("dp"), mesh.rank("tp"))
        if tie not in tied:
            continue
        param = params[tied[tie]]
        comm = Comm.create(groups[here], recorder, timeout_s)
        with torch.no_grad():
            broadcast(comm, local(param).data, src=0)
        ties.append(Tie(tie, param, comm, counted=comm.rank == 0, shape=local(param).shape))
    return ties


def _described(param: nn.Parameter | None):
    """What must agree between a tie's copies: global and local shape, dtype, placements."""
    if param is None:
        return None
    return (tuple(param.shape), tuple(local(param).shape), str(param.dtype), str(getattr(param, "placements", "")))


def _holders(rows: list, tie: str) -> dict[tuple[int, int], list[int]]:
    """(dp, tp) coordinate -> the global ranks (one per stage holding `tie`), checked on every rank."""
    described = {held[tie] for _, held, _ in rows if tie in held}
    if len(described) > 1:
        raise TieError(f"tie '{tie}' names parameters that differ between stages (shape, local shape, dtype, "
                       f"placements): {sorted(described)}; a tie must be copies of one parameter, split alike")
    holders: dict[tuple[int, int], list[int]] = {}
    for rank, (coordinate, held, _) in enumerate(rows):
        if tie in held:
            holders.setdefault((coordinate["dp"], coordinate["tp"]), []).append(rank)
    if any(len(ranks) == 1 for ranks in holders.values()):
        raise TieError(f"tie '{tie}' is declared on one pipeline stage only; declare it on every stage that "
                       "holds a copy (tied={...} of each stage's initialize), or drop it")
    return holders


def reduce_tied_grads(ties: list[Tie]) -> None:
    """Sum each tie's gradient over the stages that hold it (before the data-parallel reduction).

    A copy that received no gradient joins with zeros, so the stages never wait on each other.
    """
    for tie in ties:
        grad = local_grad(tie.param)
        if grad is None:
            grad = torch.zeros(tie.shape, dtype=tie.param.dtype, device=local(tie.param).device)
            set_local_grad(tie.param, grad)
        all_reduce(tie.comm, grad, what=f"tie '{tie.name}'").wait()
