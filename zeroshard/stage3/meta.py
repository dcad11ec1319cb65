"""What zeroshard records on a model built under `meta_init` (`meta_block.py`), and its own initialisation.

On each module given a meta parameter, a mark (`built_by_meta_init`); on
each meta parameter, its model (the outermost module built in the block)
and the version counter it was left on meta with, so that an in-place
change to a meta tensor, which holds no values, can be named
(`changed_on_meta`); on a parameter edited before `initialize`, its pending
value (`meta_edits.py`), which the materialiser writes after the
initialisation; on a model whose weights come from elsewhere, its `init=`
(`record_init`: `from_pretrained` inside `zero.Init`).

Without `init=`, `zeroshard.initialize` materialises a `meta_init` model
with its own initialisation (`own_init`):

- a `transformers` model: its `_init_weights(module)`, dispatched as
  `PreTrainedModel.initialize_weights` does (a sub-model's own `_init_weights`
  for its modules), under transformers' guard of the `torch.nn.init`
  functions; tied weights are already tied by the model's `post_init`;
- any other module: `reset_parameters()` of each module that has one.
"""

from __future__ import annotations

import sys
import weakref
from contextlib import nullcontext
from typing import Callable

import torch
import torch.nn as nn

_BUILT_ON_META = "_zeroshard_meta_init"  # on each module that meta_init gave a meta parameter
_INIT = "_zeroshard_init"  # on a model whose weights come from elsewhere: the init= that fills them
_MODEL = "_zeroshard_meta_model"  # on each meta parameter: a weak reference to the model built in the block
_VERSION = "_zeroshard_meta_version"  # on each meta parameter: its version counter when it was last left on meta
_PENDING = "_zeroshard_pending"  # on a meta parameter: the values initialize gives it (a CPU tensor)


def mark_built(module: nn.Module) -> None:
    """`meta_init` gave this module a meta parameter."""
    module.__dict__[_BUILT_ON_META] = True


def remember_model(param: nn.Parameter, model: nn.Module) -> None:
    """The meta parameter belongs to `model` (held weakly) and is as `meta_init` left it."""
    param.__dict__[_MODEL] = weakref.ref(model)
    mark_version(param)


def mark_version(param: nn.Parameter) -> None:
    """Remember the meta parameter's version counter: a later in-place change on meta moves it."""
    param.__dict__[_VERSION] = param._version


def model_of(param: nn.Parameter) -> nn.Module | None:
    """The model `meta_init` built this meta parameter in, if it is still alive; else None."""
    ref = param.__dict__.get(_MODEL)
    return ref() if ref is not None else None


def changed_on_meta(model: nn.Module) -> list[str]:
    """Names of the meta parameters changed in place since `meta_init` (or `gathered_parameters`) left them:
    an edit of a meta tensor, which holds no values."""
    return [name for name, p in model.named_parameters()
            if p.is_meta and _VERSION in p.__dict__ and p._version != p.__dict__[_VERSION]]


def pending(param: nn.Parameter) -> torch.Tensor | None:
    """The values `initialize` writes into this meta parameter after its own initialisation; else None."""
    return param.__dict__.get(_PENDING)


def keep_as_pending(param: nn.Parameter, value: torch.Tensor) -> None:
    """Put a real parameter back on the meta device with `value` pending (its shape becomes the parameter's:
    a resize changes it)."""
    to_meta(param, value.shape)
    param.__dict__[_PENDING] = value.detach()


def to_meta(param: nn.Parameter, shape: torch.Size) -> None:
    """The parameter becomes a meta tensor of `shape`, keeping its identity and its attributes."""
    attributes = dict(param.__dict__)
    meta = type(param)(torch.empty(shape, dtype=param.dtype, device="meta"), requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, meta)  # swaps the attributes too: given back
    param.__dict__.update(attributes)
    mark_version(param)


def record_init(model: nn.Module, init) -> None:
    """`initialize` without `init=` materialises this meta model with `init` instead of its own initialisation
    (deepspeed's `zero.Init` + `from_pretrained`: `zeroshard.pretrained(path)`)."""
    model.__dict__[_INIT] = init


def recorded_init(model: nn.Module):
    """The init `record_init` gave this model; else None."""
    return model.__dict__.get(_INIT)


def built_by_meta_init(model: nn.Module) -> bool:
    """Whether every module holding a meta parameter got it from `meta_init`."""
    holders = [m for m in model.modules() if any(p.is_meta for p in m.parameters(recurse=False))]
    return bool(holders) and all(m.__dict__.get(_BUILT_ON_META, False) for m in holders)


def own_init(model: nn.Module) -> Callable[[nn.Module], None]:
    """`init(module)` as the model itself initialises it: transformers' `_init_weights` for what a
    `PreTrainedModel` holds (the model, or one a wrapper holds: a LightningModule's), else `reset_parameters`."""
    transformers = sys.modules.get("transformers")  # a transformers model means it is imported already
    if transformers is not None and any(isinstance(m, transformers.PreTrainedModel) for m in model.modules()):
        return _transformers_init(model, transformers.PreTrainedModel)
    return _reset_parameters


def _reset_parameters(module: nn.Module) -> None:
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _transformers_init(model: nn.Module, pretrained_class: type) -> Callable[[nn.Module], None]:
    """Each module is initialised by the innermost `PreTrainedModel` holding it (transformers' `smart_apply`);
    one outside every `PreTrainedModel` (a wrapper's own layers) by its `reset_parameters`."""
    from transformers import initialization

    dispatch: dict[int, nn.Module | None] = {}

    def assign(module: nn.Module, owner: nn.Module | None) -> None:
        owner = module if isinstance(module, pretrained_class) else owner
        dispatch[id(module)] = owner
        for child in module.children():
            assign(child, owner)

    assign(model, None)
    guard = getattr(initialization, "guard_torch_init_functions", nullcontext)

    def init(module: nn.Module) -> None:
        owner = dispatch[id(module)]
        if owner is None:
            return _reset_parameters(module)
        with torch.no_grad(), guard():
            owner._init_weights(module)

    return init
