"""The user's torch optimizer, run over the buckets' master tensors instead of the parameters.

The optimizer object is kept (LR schedulers already attached to it keep
working); only each param group's "params" list is replaced by the master
tensors (this rank's shards at stage >= 1) of the buckets built from that
group. Each param group's optimizer is probed first: one that works element
by element steps the masters themselves; one that needs tensors whole steps
views of them shaped as the tensors this rank owns (plan/owners.py); one that
couples tensors is refused.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from zeroshard.core.bucket import Bucket
from zeroshard.core.optimizers import Optimizers, member_of, members
from zeroshard.errors import ZeroshardError

# Group keys torch (or an LR scheduler) adds that are not constructor arguments.
_NOT_HYPERPARAMS = {"params", "initial_lr", "param_names"}


class OptimizerError(ZeroshardError, TypeError):
    """The optimizer runs neither on flat shards nor on whole tensors (it couples tensors), a parameter is in two
    optimizers, or the optimizer does not match the model."""


def one_optimizer(model: nn.Module, optimizer) -> torch.optim.Optimizer | None:
    """The optimizer passed, or several over disjoint parameters as one `Optimizers`."""
    several = isinstance(optimizer, (list, tuple))
    for member in optimizer if several else [optimizer]:
        if member is not None and not isinstance(member, torch.optim.Optimizer) or several and member is None:
            raise OptimizerError(f"optimizer must be a torch.optim.Optimizer built on the model's parameters, a "
                                 f"list of them over disjoint parameters (or None, with an \"optimizer\" block in "
                                 f"the config); got {type(member).__name__}")
    if not several:
        return optimizer
    if not optimizer or any(isinstance(member, Optimizers) for member in optimizer):
        raise OptimizerError("optimizer as a list takes one or more torch optimizers, each over its own parameters "
                             f"(not an empty list, nor a zeroshard.Optimizers); got {optimizer!r:.80}")
    names = {id(p): name for name, p in model.named_parameters()}
    owner: dict[int, int] = {}
    for i, member in enumerate(optimizer):
        for p in (p for g in member.param_groups for p in g["params"]):
            if id(p) in owner and owner[id(p)] != i:
                raise OptimizerError(f"parameter '{names.get(id(p), list(p.shape))}' is in optimizers {owner[id(p)]} "
                                     f"({type(optimizer[owner[id(p)]]).__name__}) and {i} ({type(member).__name__}) "
                                     "of the list; give each parameter to one optimizer")
            owner[id(p)] = i
    return optimizer[0] if len(optimizer) == 1 else Optimizers(list(optimizer))


def hyperparams(optimizer: torch.optim.Optimizer, group: dict) -> dict:
    """The group's settings that the optimizer's constructor accepts."""
    signature = inspect.signature(type(optimizer).__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.values())
    return {
        k: v for k, v in group.items()
        if k in optimizer.defaults and k not in _NOT_HYPERPARAMS and (takes_any or k in signature)
    }


def _probe_hyperparams(optimizer: torch.optim.Optimizer, group: dict) -> dict:
    hp = hyperparams(optimizer, group)
    hp.pop("fused", None)  # probe the reference implementation, on the CPU
    hp.pop("capturable", None)
    return hp


def _steps(cls, hp: dict, tensors: list[torch.Tensor], grads: list[list[torch.Tensor]], together: bool) -> list:
    """Steps of `cls` on `tensors` (leaves, moved in place), one per item of `grads`: one optimizer for all,
    or one each; the optimizers."""
    opts = [cls(tensors, **hp)] if together else [cls([t], **hp) for t in tensors]
    for step_grads in grads:
        for t, g in zip(tensors, step_grads):
            t.grad = g.clone()
        for opt in opts:
            opt.step()
    return opts


def is_elementwise(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """Whether the optimizer's update is the same however a tensor's elements are split.

    Two steps on one (6, 5) tensor must equal two steps of two separate
    optimizers on its 30 elements split as 7 + 23 (as ranks hold shards), and
    every state tensor must be a scalar or the parameter's size. Factored,
    per-tensor or per-matrix optimizers (Adafactor's row/column moments,
    LAMB's trust ratio, Muon's orthogonalisation) are not: they get each
    tensor whole (`check_per_tensor`).
    """
    cls, hp = type(optimizer), _probe_hyperparams(optimizer, group)
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(6, 5, generator=gen)
    grads = [torch.randn(6, 5, generator=gen) for _ in range(2)]
    whole = start.clone().requires_grad_()
    pieces = [t.clone().requires_grad_() for t in start.reshape(-1).split([7, 23])]
    try:
        [opt_whole] = _steps(cls, hp, [whole], [[g] for g in grads], together=True)
        _steps(cls, hp, pieces, [list(g.reshape(-1).split([7, 23])) for g in grads], together=False)
    except Exception:  # it cannot run on a piece of a tensor: it needs tensors whole
        return False
    moved_whole = (whole.detach() - start).reshape(-1)
    moved_pieces = torch.cat([p.detach().reshape(-1) for p in pieces]) - start.reshape(-1)
    shapes_ok = all(not torch.is_tensor(v) or v.numel() <= 1 or v.shape == whole.shape
                    for state in opt_whole.state.values() for v in state.values())
    return shapes_ok and torch.allclose(moved_whole, moved_pieces, rtol=1e-4, atol=1e-7)


def check_per_tensor(optimizer: torch.optim.Optimizer, group: dict) -> None:
    """Raise OptimizerError unless the optimizer updates each tensor from that tensor alone.

    An optimizer that needs tensors whole gets each tensor on one rank: two
    steps over two tensors of the group's shapes (each dimension at most 6)
    in one optimizer must equal two steps of one optimizer per tensor. An
    update that couples tensors (a global norm, LBFGS's history) is refused.
    """
    cls, hp = type(optimizer), _probe_hyperparams(optimizer, group)
    shapes = [tuple(min(d, 6) for d in p.shape) or (1,) for p in group["params"][:2]] or [(6, 5)]
    shapes = (shapes * 2)[:2]
    shapes[1] = tuple(max(d - 1, 1) for d in shapes[1]) if shapes[0] == shapes[1] else shapes[1]
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
    together, apart = ([t.clone().requires_grad_() for t in start] for _ in range(2))
    try:
        _steps(cls, hp, together, grads, together=True)
        _steps(cls, hp, apart, grads, together=False)
    except Exception as exc:  # any failure to run plainly on tensors is disqualifying
        raise OptimizerError(
            f"{cls.__name__} could not be run on tensors of its param group's shapes ({type(exc).__name__}: "
            f"{exc}); zeroshard runs an optimizer on flat shards (element-wise ones: Adam, SGD, ...) or on "
            "whole tensors owned by one rank each (Muon, Adafactor, LAMB, ...)"
        ) from exc
    if not all(torch.allclose(a.detach(), b.detach(), rtol=1e-4, atol=1e-7) for a, b in zip(together, apart)):
        raise OptimizerError(
            f"{cls.__name__}'s update of a tensor depends on other tensors (a global norm, a shared history), "
            "so it cannot run on tensors spread over the ranks; use an optimizer whose update is element-wise "
            "(AdamW, SGD) or per tensor (Muon, Adafactor, LAMB), or stage 0 with plain DDP"
        )


def fresh_state(optimizer: torch.optim.Optimizer) -> dict:
    """The state a new optimizer of this class and these settings holds before any step, by parameter.

    Most torch optimizers create their state lazily, in the first step; Adagrad creates
    `sum` and `step` for every parameter in its constructor.
    """
    state = {}
    for member in members(optimizer):
        groups = [{**hyperparams(member, g), "params": g["params"]} for g in member.param_groups if g["params"]]
        if groups:
            state.update(type(member)(groups).state)
    return state


def is_fresh(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's state is only what its constructor created (it has never stepped)."""
    if not optimizer.state:
        return True
    fresh = fresh_state(optimizer)
    return fresh.keys() == optimizer.state.keys() and all(
        state.keys() == fresh[p].keys() and all(
            torch.equal(v, fresh[p][k]) if torch.is_tensor(v) else v == fresh[p][k] for k, v in state.items())
        for p, state in optimizer.state.items())


def shard_optimizer(optimizer: torch.optim.Optimizer, buckets_of_group: list[list[Bucket]], whole: list[bool],
                    fuse: bool) -> None:
    """Point each param group at its buckets' master tensors: the masters themselves for an element-wise
    optimizer, views of the master shaped as the tensors this rank owns (`Bucket.stepped`) where the group's
    optimizer needs tensors whole (`whole`).

    `fuse`: switch element-wise groups left at `fused=None` to torch's fused kernel where the
    class has one (same math, one kernel over few large tensors).
    """
    built_state = bool(optimizer.state)  # by the constructor (Adagrad): the masters need theirs
    for group, buckets, needs_whole in zip(optimizer.param_groups, buckets_of_group, whole):
        if needs_whole:
            for bucket in buckets:
                bucket.stepped = owned_views(bucket)
        group["params"] = [t for bucket in buckets for t in bucket.stepped]
        member = member_of(optimizer, group)
        if fuse and not needs_whole and "fused" in member.defaults and group.get("fused") is None:
            group["fused"] = True
            if group.get("foreach"):
                group["foreach"] = False
    optimizer.state.clear()
    if built_state:
        optimizer.state.update(fresh_state(optimizer))


def owned_views(bucket: Bucket) -> list[torch.Tensor]:
    """Views of the bucket's master, one per tensor this rank steps (the tensors it owns; at stage 0 all), in
    the tensors' shapes: what an optimizer that needs tensors whole is given."""
    flat, owners = bucket.flat, bucket.flat.owners
    sharded = bucket.switches.shard_optimizer
    base = flat.rank * flat.shard_numel if sharded else 0
    return [bucket.master[off - base : off - base + n].view(shape)
            for i, (off, n, shape) in enumerate(zip(flat.offsets, flat.numels, flat.shapes))
            if not sharded or owners[i] == flat.rank]


def steps_whole(bucket: Bucket) -> bool:
    """Whether the optimizer steps the bucket's tensors whole (views of the master, maybe none on this rank)."""
    return not (len(bucket.stepped) == 1 and bucket.stepped[0] is bucket.master)


def set_step_grads(bucket: Bucket, grad: torch.Tensor | None) -> None:
    """Give the tensors the optimizer steps for this bucket their part of `grad` (laid out like the master), or
    take it away (None)."""
    if not steps_whole(bucket):
        bucket.master.grad = grad
        return
    base = bucket.master.storage_offset()
    for t in bucket.stepped:
        at = t.storage_offset() - base
        t.grad = None if grad is None else grad[at : at + t.numel()].view(t.shape)


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
