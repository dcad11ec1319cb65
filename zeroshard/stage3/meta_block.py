"""`meta_init()`: build a model with its parameters on the meta device and its buffers real.

Under `torch.device("meta")` everything a module's `__init__` computes is
lost: a Llama's rotary `inv_freq`, BERT's `position_ids`. `meta_init` moves
only the parameters to the meta device, as they are registered (as
`accelerate.init_empty_weights(include_buffers=False)` does), so buffers keep
the values eager construction gives them. Each module given a meta parameter
is marked, and `zeroshard.initialize(model, ...)` without `init=` then
materialises the model with its own initialisation (`meta.py`'s `own_init`).
`meta_init(dtype=torch.bfloat16)` gives every floating-point parameter that
dtype as it goes to meta (DeepSpeed's `zero.Init(dtype=...)`): the model is
materialised, initialised or read from files, in it; buffers keep theirs.

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
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_module_registration_hook

from zeroshard.dtypes import DTYPES
from zeroshard.errors import ModelError
from zeroshard.stage3.meta import mark_built, remember_model
from zeroshard.stage3.resize import resize_on_materialised


@contextmanager
def meta_init(enabled: bool = True, dtype: torch.dtype | None = None) -> Iterator[None]:
    """Parameters registered inside the block are put on the meta device; buffers stay real.

    `enabled=False` makes the block do nothing (DeepSpeed's `zero.Init(enabled=...)`). `dtype` (torch.float32,
    torch.bfloat16 or torch.float16): the dtype of every floating-point parameter built in the block; None keeps
    the one each is created in.
    """
    if dtype is not None and dtype not in DTYPES.values():
        raise ModelError(f"meta_init(dtype={dtype}) is not a training dtype: give torch.float32, torch.bfloat16 "
                         f"or torch.float16, or None to keep the dtype each parameter is created in")
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
            cast = dtype if dtype is not None and param.is_floating_point() else param.dtype
            meta = type(param)(param.detach().to("meta", cast), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            module._parameters[name] = meta
            params.append(meta)
        mark_built(module)
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
                remember_model(p, root)
        resize_on_materialised(root)


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
