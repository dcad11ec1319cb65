"""`initialize`, step 6: every rank agrees it is about to train the same thing, in one exchange.

A collective that raises can leave the group out of step, so each rank
sends once, before any tensor is made, a description of its model,
optimizer layout and config, and what its model states need of the memory
it lives under (`memory_fit.py`); every rank compares all of them and
raises the same error.

A rank whose config cannot even be loaded (a typo in its file), or whose
model fails a check of its own (an edit of a meta parameter on that rank
only), sends its `ConfigError` or `ModelError` instead, in the same
exchange: it joined the group all the same (`join.py`), so the others do
not wait for it, and every rank raises that error, naming the rank.
"""

from __future__ import annotations

import reprlib

import torch
import torch.nn as nn

from zeroshard.comm.agreement import Failure
from zeroshard.comm.agreement import agree as agree_or_raise
from zeroshard.config import ConfigError
from zeroshard.core.local import local
from zeroshard.core.optim import hyperparams
from zeroshard.core.optimizers import member_of, optimizer_name
from zeroshard.engine.checks import Checked
from zeroshard.engine.join import Joined
from zeroshard.engine.load import Loaded
from zeroshard.engine.memory_fit import check_states_fit, memory_rows
from zeroshard.errors import ModelError, ZeroshardError

_MEMORY = "memory"  # the key of a rank's memory need beside its description


class RankMismatchError(ZeroshardError, RuntimeError):
    """Ranks hold different models, optimizer layouts or configs."""


def describe(model: nn.Module, optimizer: torch.optim.Optimizer, config: dict) -> dict:
    names = {id(p): name for name, p in model.named_parameters()}
    return {
        "buffers": [(name, tuple(b.shape), str(b.dtype)) for name, b in model.named_buffers()],
        "hyperparams": [sorted((k, repr(v)) for k, v in hyperparams(member_of(optimizer, g), g).items())
                        for g in optimizer.param_groups],
        "parameters": [
            (name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in model.named_parameters()
        ],
        "param_groups": [[names.get(id(p), "?") for p in g["params"]] for g in optimizer.param_groups],
        "optimizer": optimizer_name(optimizer),
        "config": _shared(config),
    }


def _shared(config: dict) -> dict:
    """The config every rank must hold alike: all of it but the offload blocks' nvme_path, which names this
    rank's own disk (one NVMe drive per GPU is common) and changes nothing the ranks compute."""
    zero = dict(config.get("zero_optimization", {}))
    for block in ("offload_optimizer", "offload_param"):
        if isinstance(zero.get(block), dict):
            zero[block] = {k: v for k, v in zero[block].items() if k != "nvme_path"}
    return config | {"zero_optimization": zero} if "zero_optimization" in config else config


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
        differences = _config_differences(ref["config"], other["config"])
        keys = [f"{key} ({reprlib.repr(theirs)} there, {reprlib.repr(mine)} on rank 0)"
                for key, mine, theirs in differences[:5]]
        more = f" and {len(differences) - 5} more keys" if len(differences) > 5 else ""
        return f"its config differs in {'; '.join(keys)}{more}"
    return None


def _config_differences(mine, theirs, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, rank 0's value, the other's) for every leaf where two configs differ."""
    if not (isinstance(mine, dict) or isinstance(theirs, dict)):
        return [(prefix, mine, theirs)] if mine != theirs else []
    mine, theirs = (side if isinstance(side, dict) else {} for side in (mine, theirs))
    out = []
    for key in sorted(set(mine) | set(theirs), key=str):
        out += _config_differences(mine.get(key), theirs.get(key), f"{prefix}.{key}" if prefix else str(key))
    return out


def agree(joined: Joined, loaded: Loaded, checked: Checked) -> bool:
    """The one exchange of construction: every rank sends its description and its memory need
    (`memory_fit.memory_rows`), or the failure of its own load or checks; every rank raises the same error if
    any rank failed (`ConfigError`, `ModelError`), differs from rank 0 (`RankMismatchError`) or a memory limit
    cannot hold its ranks' states (`OutOfMemoryError`). Returns whether host memory is short
    (`memory_fit.check_states_fit`)."""
    comm, failure, mine = joined.comm, checked.failure, None
    if failure is None:  # in one process `join` raised a failed load; a failed check is raised here
        mine = describe(loaded.model, loaded.optimizer, loaded.config.to_dict())
        mine[_MEMORY] = memory_rows(comm, loaded.config, loaded.optimizer, joined.device,
                                    [local(p) for g in checked.groups for p in g])
    everyone = agree_or_raise(comm, failure, value=mine, word=_local_error, default=ConfigError)
    for rank, theirs in enumerate(everyone[1:], start=1):
        why = first_difference(everyone[0], theirs)
        if why is not None:
            raise RankMismatchError(
                f"rank {rank} differs from rank 0: {why}. Every rank must build the same model "
                "(same code, same config) and the same optimizer before zeroshard.initialize"
            )
    return check_states_fit([row for theirs in everyone for row in theirs[_MEMORY]])


def _local_error(failed: list[Failure], world: int, me: int) -> ConfigError | ModelError:
    """The error of the ranks whose own load or check failed, as rank `me` raises it (with no cause: the
    message says it, and a cause would print this rank's own first)."""
    first = failed[0]
    if len(failed) == world and len({(f.name, f.message) for f in failed}) == 1:
        if issubclass(first.kind, ModelError):  # the same model on every rank: each says it as one rank alone would
            return first.kind(first.message)
        # The same mistake on every rank (one config file): rank 0 says it as one rank alone would, the others
        # in one line, so that a launcher printing every rank's error shows the message once.
        if me == 0:
            return first.kind(first.message)
        return first.kind("the config cannot be used (the same on every rank): rank 0's ConfigError names every "
                          "problem")
    what = "model" if issubclass(first.kind, ModelError) else "config"
    others = f" (the {what}s of ranks {', '.join(str(f.rank) for f in failed[1:])} failed too)" if failed[1:] else ""
    return first.kind(f"the {what} of rank {first.rank} cannot be used{others}; every rank stops: {first.message}")
