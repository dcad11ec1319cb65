"""`meta_init()`: build a model with its parameters on the meta device and its buffers real.

Under `torch.device("meta")` everything a module's `__init__` computes is
lost: a Llama's rotary `inv_freq`, BERT's `position_ids`. `meta_init` moves
only the parameters to the meta device, as they are registered (as
`accelerate.init_empty_weights(include_buffers=False)` does), so buffers keep
the values eager construction gives them. Each module given a meta parameter
is marked, and `zeroshard.initialize(model, ...)` without `init=` then
materialises the model with its own initialisation (`own_init`):

- a `transformers` model: its `_init_weights(module)`, dispatched as
  `PreTrainedModel.initialize_weights` does (a sub-model's own `_init_weights`
  for its modules), under transformers' guard of the `torch.nn.init`
  functions; tied weights are already tied by the model's `post_init`;
- any other module: `reset_parameters()` of each module that has one.

Parameters are created on the CPU first and moved to meta one by one, so
construction holds at most one parameter in memory. The patch of
`nn.Module.register_parameter` is process-wide while the block runs: build
one model at a time.

Edits between the block and `initialize` (`stage3/meta_edits.py`): each
meta parameter knows its model (the outermost module built in the block)
and the version counter it left the block with, so that
`gathered_parameters` can materialise it for a block and an in-place change
to a meta tensor (lost: it holds no values) is named by `initialize`. A
parameter replaced inside the block by a new real one would lose its values
the same way, so that is an error at the assignment.
"""

from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_module_registration_hook

from zeroshard.errors import ModelError
from zeroshard.stage3.resize import resize_on_materialised

_BUILT_ON_META = "_zeroshard_meta_init"  # on each module that meta_init gave a meta parameter
_INIT = "_zeroshard_init"  # on a model whose weights come from elsewhere: the init= that fills them
_MODEL = "_zeroshard_meta_model"  # on each meta parameter: a weak reference to the model built in the block
_VERSION = "_zeroshard_meta_version"  # on each meta parameter: its version counter when it was last left on meta


@contextmanager
def meta_init(enabled: bool = True) -> Iterator[None]:
    """Parameters registered inside the block are put on the meta device; buffers stay real.

    `enabled=False` makes the block do nothing (DeepSpeed's `zero.Init(enabled=...)`).
    """
    if not enabled:
        yield
        return
    register = nn.Module.register_parameter
    params: list[nn.Parameter] = []
    children: set[int] = set()
    parents: dict[int, nn.Module] = {}

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        _refuse_real_replacement(module, name, param)
        register(module, name, param)
        if param is None:
            return
        if param.device.type != "meta":  # one already on meta (a tied weight) keeps its identity
            meta = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            module._parameters[name] = meta
            params.append(meta)
        module.__dict__[_BUILT_ON_META] = True
        parents[id(module)] = module

    def child_registered(module: nn.Module, name: str, child: nn.Module | None) -> None:
        parents[id(module)] = module
        if child is not None:
            children.add(id(child))

    nn.Module.register_parameter = register_on_meta
    hook = register_module_module_registration_hook(child_registered)
    try:
        with _refusing_from_pretrained():
            yield
    finally:
        nn.Module.register_parameter = register
        hook.remove()
    _mark_built([m for i, m in parents.items() if i not in children], params)


def _refuse_real_replacement(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    """A new real parameter in place of one the module holds already: its values would go to meta, lost."""
    old = module._parameters.get(name)
    if old is None or param is None or param is old or param.is_meta:
        return
    raise ModelError(
        f"the parameter {name!r} of a {type(module).__name__} was replaced inside zeroshard.meta_init() "
        f"(deepspeed.zero.Init) by a new nn.Parameter: inside the block every parameter goes to the meta device "
        f"and the new one's values would be lost. Assign it after the block (a real parameter among meta ones "
        f"keeps its values at initialize), or change the values after the block inside "
        f"zeroshard.gathered_parameters(param, modifier_rank=0) (deepspeed.zero.GatheredParameters)")


def _mark_built(roots: list[nn.Module], params: list[nn.Parameter]) -> None:
    """Each meta parameter made in the block learns its model and its version counter (`meta_edits.py`); a
    transformers model's `resize_token_embeddings` runs on materialised embeddings (`stage3/resize.py`)."""
    made = {id(p) for p in params}
    for root in roots:
        for p in root.parameters():
            if id(p) in made and p.is_meta:
                p.__dict__[_MODEL] = weakref.ref(root)
                mark_version(p)
        resize_on_materialised(root)


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


@contextmanager
def _refusing_from_pretrained() -> Iterator[None]:
    """`from_pretrained` under meta_init would load weights into parameters that go to meta: lost, silently."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        yield
        return
    model_class = transformers.PreTrainedModel
    original = model_class.__dict__["from_pretrained"]

    def refuse(cls, path, *args, **kwargs):
        raise ModelError(f"{cls.__name__}.from_pretrained inside zeroshard.meta_init() would put the loaded "
                         f"weights on the meta device, where they are lost; build the model from its config "
                         f"(AutoConfig.from_pretrained(path), then from_config) under meta_init and pass "
                         f"init=zeroshard.pretrained(path) to zeroshard.initialize")

    model_class.from_pretrained = classmethod(refuse)
    try:
        yield
    finally:
        model_class.from_pretrained = original


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
    """`init(module)` as the model itself initialises it: transformers' `_init_weights`, else `reset_parameters`."""
    transformers = sys.modules.get("transformers")  # a transformers model means it is imported already
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        return _transformers_init(model, transformers.PreTrainedModel)
    return _reset_parameters


def _reset_parameters(module: nn.Module) -> None:
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _transformers_init(model: nn.Module, pretrained_class: type) -> Callable[[nn.Module], None]:
    """Each module is initialised by the innermost `PreTrainedModel` holding it (transformers' `smart_apply`)."""
    from transformers import initialization

    dispatch: dict[int, nn.Module] = {}

    def assign(module: nn.Module, owner: nn.Module) -> None:
        owner = module if isinstance(module, pretrained_class) else owner
        dispatch[id(module)] = owner
        for child in module.children():
            assign(child, owner)

    assign(model, model)
    guard = getattr(initialization, "guard_torch_init_functions", nullcontext)

    def init(module: nn.Module) -> None:
        with torch.no_grad(), guard():
            dispatch[id(module)]._init_weights(module)

    return init
