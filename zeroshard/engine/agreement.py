"""Checks that every rank is about to train the same thing, before any collective depends on it.

A collective that raises can leave the group out of step, so each rank
sends a description of its model, optimizer layout and config once, and
every rank compares all of them and raises the same error.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from zeroshard.comm import Comm, all_gather_object
from zeroshard.core.optim import hyperparams
from zeroshard.errors import ZeroshardError


class RankMismatchError(ZeroshardError, RuntimeError):
    """Ranks hold different models, optimizer layouts or configs."""


def describe(model: nn.Module, optimizer: torch.optim.Optimizer, config: dict) -> dict:
    names = {id(p): name for name, p in model.named_parameters()}
    return {
        "buffers": [(name, tuple(b.shape), str(b.dtype)) for name, b in model.named_buffers()],
        "hyperparams": [sorted((k, repr(v)) for k, v in hyperparams(optimizer, g).items())
                        for g in optimizer.param_groups],
        "parameters": [
            (name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in model.named_parameters()
        ],
        "param_groups": [[names.get(id(p), "?") for p in g["params"]] for g in optimizer.param_groups],
        "optimizer": type(optimizer).__name__,
        "config": config,
    }


def first_difference(ref: dict, other: dict) -> str | None:
    """A sentence naming the first way `other` differs from `ref`, or None."""
    ref_params = {p[0]: p[1:] for p in ref["parameters"]}
    other_params = {p[0]: p[1:] for p in other["parameters"]}
    for name, (shape, dtype, trainable) in ref_params.items():
        if name not in other_params:
            return f"it has no parameter '{name}'"
        o_shape, o_dtype, o_trainable = other_params[name]
        if o_shape != shape:
            return f"parameter '{name}' has shape {list(o_shape)} there but {list(shape)} on rank 0"
        if o_dtype != dtype:
            return f"parameter '{name}' has dtype {o_dtype} there but {dtype} on rank 0"
        if o_trainable != trainable:
            return f"parameter '{name}' has requires_grad={o_trainable} there but {trainable} on rank 0"
    extra = [n for n in other_params if n not in ref_params]
    if extra:
        return f"it has parameter '{extra[0]}' that rank 0 lacks"
    if [p[0] for p in ref["parameters"]] != [p[0] for p in other["parameters"]]:
        return "its parameters are registered in a different order"
    if ref["optimizer"] != other["optimizer"]:
        return f"its optimizer is {other['optimizer']}, rank 0's is {ref['optimizer']}"
    if ref["param_groups"] != other["param_groups"]:
        return "its optimizer param groups hold different parameters"
    for i, (mine, theirs) in enumerate(zip(ref["hyperparams"], other["hyperparams"])):
        if mine != theirs:
            keys = sorted({k for k, _ in set(mine) ^ set(theirs)})
            return f"its optimizer param group {i} has other {', '.join(keys)}"
    if ref["buffers"] != other["buffers"]:
        return "its module buffers differ in names, shapes or dtypes"
    if ref["config"] != other["config"]:
        keys = sorted(k for k in set(ref["config"]) | set(other["config"])
                      if ref["config"].get(k) != other["config"].get(k))
        return f"its config differs in {', '.join(keys)}"
    return None


def check_ranks_agree(comm: Comm, model: nn.Module, optimizer: torch.optim.Optimizer, config: dict) -> None:
    """Raise RankMismatchError on every rank if any rank differs from rank 0."""
    everyone = all_gather_object(comm, describe(model, optimizer, config))
    for rank, theirs in enumerate(everyone[1:], start=1):
        why = first_difference(everyone[0], theirs)
        if why is not None:
            raise RankMismatchError(
                f"rank {rank} differs from rank 0: {why}. Every rank must build the same model "
                "(same code, same config) and the same optimizer before zeroshard.initialize"
            )
