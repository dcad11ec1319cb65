"""`gathered_parameters`: full parameters outside forward (inspection, EMA, initialisation).

At stage 3 a parameter is an empty tensor between uses; inside the context
its unit is gathered. At stages 1-2 entering waits for the all-gathers after
the step still in flight (`overlap_param_gather`, `core/param_gather.py`). Every rank must enter the context with the same
parameters, in the same order, since entering gathers. With
`modifier_rank=r`, rank r's edits made inside the context are kept on exit
on every rank (broadcast, then each rank keeps its shard); with None, edits
are dropped at stage 3 (the shards were not touched) and stay local to the
rank at stages 0-2. Kept edits reach the optimizer's master too: with 16-bit
parameters the master of an edited unit restarts from their rounded values.

Entering runs collectives whenever a unit is gathered or `modifier_rank` is
given, so the ranks first meet in the store (`comm/watch/entry.py`): a rank that
enters alone raises `CollectiveError` within `rank_check_timeout`, naming
the ranks that did not, instead of hanging.

Before `initialize`, on a model built under `meta_init` (DeepSpeed's
`zero.Init`), the meta parameters are materialised for the block and the
edits kept until `initialize` applies them (`meta_edits.py`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.nn as nn

from zeroshard.comm import Comm, broadcast
from zeroshard.comm.watch.entry import enter
from zeroshard.errors import ModelError
from zeroshard.stage3.meta_edits import whole_before_initialize

_PLACEMENT = "_zeroshard_placement"


@dataclass(frozen=True)
class Placement:
    """Where an engine keeps a parameter: its comm, its bucket if it trains, and at stage 3 its
    unit's index in the schedule."""

    comm: Comm
    owner: object | None = None  # the Bucket whose master it has, if it trains
    schedule: object | None = None  # GatherSchedule
    unit: int | None = None
    post_step: object | None = None  # PostStepGather: stages 1-2's gathers after the step, waited first


def place(param: nn.Parameter, placement: Placement) -> None:
    setattr(param, _PLACEMENT, placement)


@contextmanager
def gathered_parameters(params: nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None
                        ) -> Iterator[None]:
    """Make `params` whole for the duration of the block (a no-op for parameters already whole)."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    _check_arguments(params, modifier_rank)
    if any(p.is_meta and getattr(p, _PLACEMENT, None) is None for p in params):  # before initialize
        with whole_before_initialize(params, modifier_rank):
            yield
        return
    placements = [getattr(p, _PLACEMENT, None) for p in params]
    units = list(dict.fromkeys((pl.schedule, pl.unit) for pl in placements if pl and pl.unit is not None))
    placed = [pl for pl in placements if pl is not None]
    for post_step in {id(pl.post_step): pl.post_step for pl in placed if pl.post_step is not None}.values():
        post_step.wait()  # stages 1-2: the last step's values, all landed (a local wait, no collective)
    if modifier_rank is not None:
        _check_masters_free(placed, units)
    if units or (modifier_rank is not None and placed):  # collectives follow: every rank must be here
        enter(placed[0].comm, "gathered_parameters")
    gathered_here = [(schedule, i) for schedule, i in units if not schedule.in_use(i)]
    for schedule, i in units:
        schedule.need(i)
    try:
        yield
        if modifier_rank is not None:
            _keep_edits(params, placements, units, modifier_rank)
    finally:  # units that were whole already (an outer block, a forward) stay whole
        for schedule, i in gathered_here:
            schedule.release(i)


def _check_arguments(params: list, modifier_rank: int | None) -> None:
    bad = [p for p in params if not isinstance(p, torch.Tensor)]
    if bad:
        raise ModelError(f"gathered_parameters takes parameters (one, or an iterable such as "
                         f"module.parameters()); got {type(bad[0]).__name__} {bad[0]!r:.40}")
    if modifier_rank is not None and (isinstance(modifier_rank, bool) or not isinstance(modifier_rank, int)
                                      or modifier_rank < 0):
        raise ModelError(f"modifier_rank must be None or a rank number (0, 1, ...); got {modifier_rank!r}")


def _check_masters_free(placed: list[Placement], units: list) -> None:
    """Kept edits reach the optimizer's masters: not while the delayed update's CPU step updates them, nor
    while they are on disk (checked before anything changes; every rank holds the same buckets at the same
    step, so every rank raises)."""
    owners = [pl.owner for pl in placed if pl.owner is not None]
    owners += [bucket for schedule, i in units for bucket in schedule.units[i].buckets]
    if any(owner.master_on_disk for owner in owners):
        raise ModelError("gathered_parameters(modifier_rank=...) keeps edits in the optimizer's masters, which "
                         "live on disk between steps (offload_optimizer nvme): change the weights through a "
                         "checkpoint instead (save, edit the saved weights, load), or offload the optimizer to cpu")
    if any(owner.stepping for owner in owners):
        raise ModelError("gathered_parameters(modifier_rank=...) keeps edits in the optimizer's masters, which the "
                         "delayed update (offload_optimizer.delayed_update) is stepping on another thread now: "
                         "call engine.flush_update() on every rank before the block")


def _keep_edits(params, placements, units, src: int) -> None:
    with torch.no_grad():
        for schedule, i in units:
            unit = schedule.units[i]
            for flat in unit.gathered_flats:
                broadcast(schedule.comm, flat.data, src=src)
            unit.scatter_edits()
        replicated = [(p, pl) for p, pl in zip(params, placements) if pl is not None and pl.unit is None]
        for p, pl in replicated:  # every rank takes rank src's values
            broadcast(pl.comm, p.data, src=src)
        for owner in {id(pl.owner): pl.owner for _, pl in replicated if pl.owner is not None}.values():
            owner.take_params_into_master()


def keys_by_tensor(state: dict[str, torch.Tensor]) -> dict[int, list[str]]:
    """id(tensor) -> its keys in `state` (a tied tensor has several)."""
    keys: dict[int, list[str]] = {}
    for key, tensor in state.items():
        keys.setdefault(id(tensor), []).append(key)
    return keys


def full_state_dict(module: nn.Module, schedule, keep: bool) -> dict[str, torch.Tensor]:
    """Stage 3: the module's full state dict (copies), gathering its units one at a time; {} unless `keep`.

    Every unit is gathered, `keep` or not: the ranks that keep nothing gather with those that do.
    """
    state = module.state_dict(keep_vars=True)  # the live tensors: the sharded parameters are empty
    keys_of = keys_by_tensor(state)
    listed = {i: [(key, p) for flat in unit.gathered_flats for p in flat.params for key in keys_of.get(id(p), [])]
              for i, unit in enumerate(schedule.units)}
    full = gathered_copies(schedule, listed, keep)
    if not keep:
        return {}
    return {key: full[key] if key in full else tensor.detach().clone() for key, tensor in state.items()}


def gathered_copies(schedule, listed: dict[int, list[tuple[str, torch.Tensor]]], keep: bool = True
                    ) -> dict[str, torch.Tensor]:
    """Key -> a full copy of its parameter, for the (key, parameter) pairs listed under each unit's index,
    gathering the units one at a time in index order; {} unless `keep` (the units are gathered all the same).

    Units that are whole already (inside `gathered_parameters`, a forward) stay whole.
    """
    copies: dict[str, torch.Tensor] = {}
    for i in sorted(listed):
        with whole_unit(schedule, i):
            for key, p in listed[i] if keep else []:
                copies[key] = p.detach().clone()
    return copies


@contextmanager
def whole_unit(schedule, i: int):
    """Unit `i` whole for the block; released after it unless it was whole before (an outer block, a
    forward keeps it)."""
    was_whole = schedule.in_use(i)
    schedule.need(i)
    yield schedule.units[i]
    if not was_whole:
        schedule.release(i)
