"""`deepspeed.utils` for DeepSpeed scripts: the stage-3 leaf modules (`set_z3_leaf_modules` and its kin).

A leaf module is gathered whole, with everything that runs inside it, as one
unit (`zeroshard/stage3/wrapping.py`): mark the modules before `initialize`,
as DeepSpeed's scripts do. The mark is DeepSpeed's own attribute
(`_z3_leaf`). The other utilities are not provided (`UTILS_NOT_PROVIDED`).
"""

from __future__ import annotations

import torch.nn as nn

from zeroshard.deepspeed.unsupported import UTILS_NOT_PROVIDED, missing
from zeroshard.errors import ModelError


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: list) -> list[nn.Module]:
    """Mark every module of `model` whose class is one of `leaf_module_classes` (classes, or their names) a
    leaf; returns the modules marked. A class that matches no module is a `ModelError`."""
    return _mark(model, leaf_module_classes, True)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: list) -> list[nn.Module]:
    return _mark(model, leaf_module_classes, False)


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether `model` itself is marked a leaf."""
    return getattr(model, "_z3_leaf", False)


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]


def _mark(model: nn.Module, classes: list, leaf: bool) -> list[nn.Module]:
    wanted = [c if isinstance(c, str) else c.__name__ for c in classes]
    if not wanted:
        raise ModelError("set_z3_leaf_modules: give at least one module class")
    marked = [m for m in model.modules() if type(m).__name__ in wanted or _path(type(m)) in wanted]
    found = {n for m in marked for n in (type(m).__name__, _path(type(m)))}
    unknown = [c for c in wanted if c not in found]
    if unknown:
        present = ", ".join(sorted({type(m).__name__ for m in model.modules()}))
        raise ModelError(f"set_z3_leaf_modules: the classes {unknown} match no module of the model; classes "
                         f"present: {present}")
    for module in marked:
        module._z3_leaf = leaf
    return marked


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def __getattr__(name: str):
    raise missing("zeroshard.deepspeed.utils", name, UTILS_NOT_PROVIDED)
