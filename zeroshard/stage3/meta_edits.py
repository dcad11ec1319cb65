"""Edits of a `meta_init` model before `initialize`: kept, and applied when the model is materialised.

Under `meta_init` (DeepSpeed's `zero.Init`) a parameter is a meta tensor
until `initialize` gives it memory, so an edit made in between would go
nowhere. `gathered_parameters(params, modifier_rank)` on such parameters
(`whole_before_initialize`) therefore materialises them for the block, as
`initialize` would: real tensors on the CPU, filled by the model's own
initialisation of their modules (or its recorded `init`, such as
`zeroshard.pretrained(path)`'s files), every parameter the modules hold
directly, so the initialisation sees only real tensors. What that
initialisation does not set (a custom `nn.Parameter`) reads NaN, the
materialiser's sentinel: the block may set it, and `initialize` names it if
it is still NaN. Rank 0's values are broadcast first, so every rank reads
the same values. On exit:

- `modifier_rank=r`: rank r's values are broadcast and become the gathered
  parameters' pending values;
- `modifier_rank=None`: the edits are dropped, as DeepSpeed drops them, and
  the values read on entry become the pending values, so what was read is
  what `initialize` gives.

Then the parameters go back to the meta device. A pending value (a CPU
tensor, held on every rank until `initialize`) is what the materialiser
(`materialize.py`) writes after the unit's own initialisation, so that
later blocks see the earlier blocks' edits, in the order they were made.
A parameter assigned after the `meta_init` block (a real one among meta
ones) becomes pending the same way when `initialize` starts.

Before the process group exists no value can be broadcast: on several
ranks (`WORLD_SIZE` > 1) `modifier_rank` must then be 0 or None, since
`initialize` starts every unit from rank 0's values.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from zeroshard.errors import ModelError
from zeroshard.stage3.materialize import Materializer
from zeroshard.stage3.meta import keep_as_pending, model_of, pending, recorded_init, to_meta

@contextmanager
def whole_before_initialize(params: list[nn.Parameter], modifier_rank: int | None) -> Iterator[None]:
    """`gathered_parameters` on parameters of a `meta_init` model before `initialize` (see the module)."""
    world = _world_size()
    _check_modifier(modifier_rank, world)
    wanted = list({id(p): p for p in params}.values())
    materialised = _materialise([p for p in wanted if p.is_meta])
    several = dist.is_initialized() and world > 1
    with torch.no_grad():
        for p in materialised if several else []:  # every rank reads rank 0's values
            dist.broadcast(p.data, src=0)
    kept = {id(p) for p in wanted}
    read = {id(p): p.detach().clone() for p in materialised if modifier_rank is None and id(p) in kept}
    edited = False
    try:
        yield
        with torch.no_grad():
            for p in wanted if modifier_rank is not None and several else []:
                dist.broadcast(p.data, src=modifier_rank)
        edited = modifier_rank is not None
    finally:
        for p in materialised:
            # None: edits dropped, what was read is what initialize gives.
            _put_back(p, read.get(id(p), p.detach() if edited and id(p) in kept else None))


def _put_back(param: nn.Parameter, value: torch.Tensor | None) -> None:
    """A parameter materialised for a block goes back to meta, with `value` pending, else its earlier one."""
    value = pending(param) if value is None else value
    if value is None:
        to_meta(param, param.shape)
    else:
        keep_as_pending(param, value)


def _materialise(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Give `params` and every parameter their modules hold directly real CPU memory, initialised as
    `initialize` would (pending values written last); returns the parameters materialised."""
    by_model: dict[int, tuple[nn.Module, list[nn.Parameter]]] = {}
    for p in params:
        model = model_of(p)
        if model is None:
            raise ModelError(
                f"gathered_parameters got a parameter of shape {list(p.shape)} on the meta device that "
                "zeroshard.meta_init() (deepspeed.zero.Init) did not build, or whose model is gone: it has no "
                "values to gather. Build the model under meta_init and gather its parameters before "
                "zeroshard.initialize, or after initialize")
        by_model.setdefault(id(model), (model, []))[1].append(p)
    done: list[nn.Parameter] = []
    try:
        for model, wanted in by_model.values():
            done += _materialise_in(model, wanted)
    except BaseException:  # the models materialised before the one that failed go back
        for p in done:
            _put_back(p, None)
        raise
    return done


def _materialise_in(model: nn.Module, wanted: list[nn.Parameter]) -> list[nn.Parameter]:
    """`wanted` and the other parameters their modules in `model` hold directly, materialised."""
    ids = {id(p) for p in wanted}
    owners = [m for m in model.modules() if any(id(q) in ids for q in m.parameters(recurse=False))]
    whole = list({id(q): q for m in owners for q in m.parameters(recurse=False) if q.is_meta}.values())
    attributes = {id(q): dict(q.__dict__) for q in whole}  # giving memory swaps them out
    try:
        # What the init does not set stays NaN: the block may set it, initialize names it if still NaN.
        materialize = Materializer.for_model(model, recorded_init(model), torch.device("cpu"), keep_real=False)
        materialize(owners, whole, check=False)
    except BaseException:  # nothing stays real
        for q in whole:
            q.__dict__.update(attributes[id(q)])
            if not q.is_meta:
                _put_back(q, None)
        raise
    for q in whole:
        q.__dict__.update(attributes[id(q)])
    return whole


def _world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _check_modifier(modifier_rank: int | None, world: int) -> None:
    if modifier_rank is None:
        return
    if modifier_rank >= world:
        raise ModelError(f"gathered_parameters(modifier_rank={modifier_rank}) on {world} rank(s): name a rank "
                         f"from 0 to {world - 1}")
    if modifier_rank != 0 and not dist.is_initialized():
        raise ModelError(
            f"gathered_parameters(modifier_rank={modifier_rank}) before zeroshard.initialize on a model built "
            f"under zeroshard.meta_init() (deepspeed.zero.Init): rank {modifier_rank}'s edits can reach the "
            f"other ranks only through the process group, which does not exist yet. Call "
            f"torch.distributed.init_process_group() (or deepspeed.init_distributed()) before the block, or make "
            f"the edits on rank 0 (modifier_rank=0: initialize starts every rank from rank 0's values)")
