"""`client_state` as plain data: the script's own values stored beside the training state.

state.pt is read with `torch.load(weights_only=True)`, so that a checkpoint
never runs pickled code: it holds only tensors, numbers, strings, None, and
lists, tuples and dicts of them. Two types that DeepSpeed scripts put in
`client_state` are stored as tagged dicts of plain data and given back as the
same types: `pathlib.Path` (its string) and `argparse.Namespace` (its
attributes, each stored by these rules). A subclass of int, float or str
other than an enum (`engine.gradient_accumulation_steps`) is stored as its
value. Anything else is refused before a save writes anything, naming its
key path.
"""

from __future__ import annotations

from argparse import Namespace
from enum import Enum
from pathlib import Path

import torch

from zeroshard.errors import ZeroshardError

_TYPE = "__zeroshard_type__"  # marks a tagged dict; a user dict may not use this key
_SCALARS = (bool, int, float, str)  # bool first: it is an int


class NotPlain(ZeroshardError, ValueError):
    """Where in a value the first part that cannot be stored as plain data is, with its type."""


def to_plain(value, where: str = "client_state"):
    """`value` with paths and namespaces as tagged dicts; raises NotPlain naming the first other object."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    scalar = next((t for t in _SCALARS if isinstance(value, t)), None)
    if scalar is not None and not isinstance(value, Enum):  # an int subclass (engine.gradient_accumulation_steps)
        return scalar(value)                                # is stored as its int; an enum member is refused
    if isinstance(value, Path):
        return {_TYPE: "pathlib.Path", "value": str(value)}
    if isinstance(value, Namespace):
        return {_TYPE: "argparse.Namespace",
                "value": {k: to_plain(v, f"{where}.{k}") for k, v in vars(value).items()}}
    if isinstance(value, dict):
        if _TYPE in value:
            raise NotPlain(f"{where} (a dict with the key '{_TYPE}', which zeroshard reserves)")
        bad = next((k for k in value if k is not None and not isinstance(k, (bool, int, float, str))), None)
        if bad is not None:
            raise NotPlain(f"a key of {where} (a {type(bad).__qualname__})")
        return {k: to_plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if type(value) in (list, tuple):  # not subclasses (a namedtuple would come back as a plain tuple)
        return type(value)(to_plain(v, f"{where}[{i}]") for i, v in enumerate(value))
    raise NotPlain(f"{where} (a {type(value).__module__}.{type(value).__qualname__})")


def from_plain(value):
    """The inverse of `to_plain`: tagged dicts become paths and namespaces again."""
    if isinstance(value, dict):
        if value.get(_TYPE) == "pathlib.Path":
            return Path(value["value"])
        if value.get(_TYPE) == "argparse.Namespace":
            return Namespace(**{k: from_plain(v) for k, v in value["value"].items()})
        return {k: from_plain(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(from_plain(v) for v in value)
    return value
