"""The user's torch optimizer, run over the buckets' master tensors instead of the parameters.

The optimizer object is kept (LR schedulers already attached to it keep
working); only each param group's "params" list is replaced by the master
tensors (this rank's shards at stage >= 1) of the buckets built from that group.
That is sound only for optimizers that work element by element, so each
param group's optimizer is probed first.
"""

from __future__ import annotations

import inspect

import torch

from zeroshard.core.bucket import Bucket
from zeroshard.errors import ZeroshardError

# Group keys torch (or an LR scheduler) adds that are not constructor arguments.
_NOT_HYPERPARAMS = {"params", "initial_lr", "param_names"}


class OptimizerError(ZeroshardError, TypeError):
    """The optimizer cannot run on flat shards, or does not match the model."""


def hyperparams(optimizer: torch.optim.Optimizer, group: dict) -> dict:
    """The group's settings that the optimizer's constructor accepts."""
    signature = inspect.signature(type(optimizer).__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.values())
    return {
        k: v for k, v in group.items()
        if k in optimizer.defaults and k not in _NOT_HYPERPARAMS and (takes_any or k in signature)
    }


def check_elementwise(optimizer: torch.optim.Optimizer, group: dict) -> None:
    """Raise OptimizerError unless the optimizer's update is the same however elements are split.

    Two steps on one (6, 5) tensor must equal two steps of two separate
    optimizers on its 30 elements split as 7 + 23 (as ranks hold shards), and
    every state tensor must be a scalar or the parameter's size. This rejects
    factored, per-tensor or global-norm optimizers (Adafactor's row/column
    moments, LAMB's trust ratio, LBFGS's history).
    """
    cls, hp = type(optimizer), hyperparams(optimizer, group)
    hp.pop("fused", None)  # probe the reference implementation, on the CPU
    hp.pop("capturable", None)
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(6, 5, generator=gen)
    grads = [torch.randn(6, 5, generator=gen) for _ in range(2)]
    whole = start.clone().requires_grad_()
    pieces = [t.clone().requires_grad_() for t in start.reshape(-1).split([7, 23])]
    try:
        opt_whole, opts_pieces = cls([whole], **hp), [cls([piece], **hp) for piece in pieces]
        for g in grads:
            whole.grad = g.clone()
            for piece, gp in zip(pieces, g.reshape(-1).split([7, 23])):
                piece.grad = gp.clone()
            opt_whole.step()
            for opt in opts_pieces:
                opt.step()
    except Exception as exc:  # any failure to run plainly on tensors is disqualifying
        raise OptimizerError(
            f"{cls.__name__} could not be run on flat shards ({type(exc).__name__}: {exc}); "
            "zeroshard needs an optimizer whose step works element by element "
            "(Adam, AdamW, SGD, Adagrad, RMSprop, ...)"
        ) from exc
    moved_whole = (whole.detach() - start).reshape(-1)
    moved_pieces = torch.cat([p.detach().reshape(-1) for p in pieces]) - start.reshape(-1)
    shapes_ok = all(
        not torch.is_tensor(v) or v.numel() <= 1 or v.shape == whole.shape
        for state in opt_whole.state.values() for v in state.values()
    )
    if not shapes_ok or not torch.allclose(moved_whole, moved_pieces, rtol=1e-4, atol=1e-7):
        raise OptimizerError(
            f"{cls.__name__} does not update parameters element by element (its update or state "
            "depends on tensor shapes), so it would give different results on flat shards; "
            "use an element-wise optimizer such as AdamW, or stage 0 with plain DDP"
        )


def fresh_state(optimizer: torch.optim.Optimizer) -> dict:
    """The state a new optimizer of this class and these settings holds before any step, by parameter.

    Most torch optimizers create their state lazily, in the first step; Adagrad creates
    `sum` and `step` for every parameter in its constructor.
    """
    groups = [{**hyperparams(optimizer, g), "params": g["params"]} for g in optimizer.param_groups if g["params"]]
    return dict(type(optimizer)(groups).state) if groups else {}


def is_fresh(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's state is only what its constructor created (it has never stepped)."""
    if not optimizer.state:
        return True
    fresh = fresh_state(optimizer)
    return fresh.keys() == optimizer.state.keys() and all(
        state.keys() == fresh[p].keys() and all(
            torch.equal(v, fresh[p][k]) if torch.is_tensor(v) else v == fresh[p][k] for k, v in state.items())
        for p, state in optimizer.state.items())


def shard_optimizer(
    optimizer: torch.optim.Optimizer, buckets_of_group: list[list[Bucket]], fuse: bool
) -> None:
    """Point each param group at its buckets' master tensors.

    `fuse`: switch groups left at `fused=None` to torch's fused kernel where the
    class has one (same math, one kernel over few large tensors).
    """
    built_state = bool(optimizer.state)  # by the constructor (Adagrad): the masters need theirs
    for group, buckets in zip(optimizer.param_groups, buckets_of_group):
        group["params"] = [bucket.master for bucket in buckets]
        if fuse and "fused" in optimizer.defaults and group.get("fused") is None:
            group["fused"] = True
            if group.get("foreach"):
                group["foreach"] = False
    optimizer.state.clear()
    if built_state:
        optimizer.state.update(fresh_state(optimizer))


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
