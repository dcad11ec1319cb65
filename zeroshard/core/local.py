"""A parameter's local tensor: what this rank stores of it.

With tensor parallelism a parameter is a DTensor: its `_local_tensor` is
this rank's part over `tp`, and that part is what ZeRO flattens, shards over
`dp`, reduces and updates. A plain parameter is its own local tensor.

`torch.distributed.tensor` is not imported here: it costs about 0.7 s of a
process's start (`import zeroshard` stays free of it), and a tensor can only
be a DTensor once something has imported it (`is_dtensor`).
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn


def is_dtensor(t: object) -> bool:
    """Whether `t` is a DTensor (tensor parallelism), without importing torch.distributed.tensor."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local part, or `t` itself."""
    return t._local_tensor if is_dtensor(t) else t


def _from_local(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A DTensor over `t` placed as the DTensor `like` (whose module is imported, so its class is at hand)."""
    return type(like).from_local(t, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                                 stride=like.stride())


def point_at(param: torch.Tensor, view: torch.Tensor) -> None:
    """Make `param` (its local part, for a DTensor) a view of `view`'s memory, keeping the Parameter object.

    A DTensor carries its dtype apart from its local tensor's: cast (mixed precision), it is swapped for
    a DTensor of the new dtype over `view`, in the same Parameter object.
    """
    if is_dtensor(param) and param.dtype != view.dtype:
        cast = _from_local(view, param)
        torch.utils.swap_tensors(param, nn.Parameter(cast, requires_grad=param.requires_grad))
        return
    local(param).data = view


def local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """`param.grad` as this rank's local tensor, dense.

    A DTensor gradient must already have its parameter's placements: the
    mesh's `CrossParallel.settle` brings it there (a sequence-parallel
    LayerNorm's gradient is `Partial` over `tp` until summed).
    """
    grad = param.grad
    if grad is None:
        return None
    if is_dtensor(grad):
        if grad.placements != param.placements:
            raise ValueError(f"a gradient placed {grad.placements} for a parameter placed {param.placements}: "
                             "settle it first (parallel.CrossParallel.settle)")
        grad = grad._local_tensor
    return grad.to_dense() if grad.is_sparse else grad


def set_local_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Give `param` the gradient whose local tensor is `grad` (a DTensor in the parameter's placements)."""
    if is_dtensor(param):
        grad = _from_local(grad, param)
    param.grad = grad
