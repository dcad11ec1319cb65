"""Edits between `deepspeed.zero.Init` and `initialize` stick, or say why.

Each case builds a small model under `zero.Init` (zeroshard.deepspeed), edits it before `initialize`, and
checks at stage 3 on 1 and 2 ranks that the full value after `initialize` is the edit (a value worked out
by hand, or the value read inside the block) on every rank; the kept cases then train 3 SGD steps equal to
one plain PyTorch process started from the same values with the edit written in by hand. A parameter no
initialisation sets reads NaN in the block and is kept once set there (named by initialize if not). The
other kinds of edit are errors naming the parameter. One spawn per world size runs every case.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zeroshard
import zeroshard.deepspeed as deepspeed
from tests.distributed import run_ranks

CONFIG = {"train_micro_batch_size_per_gpu": 2,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
STEPS = 3


def _build() -> nn.Module:
    with deepspeed.zero.Init():
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(step: int, world: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(2 * world, 4, generator=g), torch.randn(2 * world, 2, generator=g)


def _train(engine, rank: int, world: int, device) -> tuple[list[float], dict]:
    losses = []
    for step in range(STEPS):
        x, y = (t[2 * rank:2 * rank + 2].to(device) for t in _batch(step, world))
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, {k: v.cpu() for k, v in engine.module.state_dict().items()}


def _kept(edit, rank: int, world: int, device) -> dict:
    """Build, `edit(model, rank)` (returns the values it expects per key), initialize, train."""
    torch.manual_seed(1)
    model = _build()
    expected = edit(model, rank)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=CONFIG)
    start = {k: v.cpu() for k, v in model.state_dict().items()}
    losses, end = _train(engine, rank, world, device)
    return {"expected": expected, "start": start, "losses": losses, "end": end}


def _fill_on_rank0(model, rank):
    with deepspeed.zero.GatheredParameters(model[0].weight, modifier_rank=0):
        if rank == 0:
            model[0].weight.data.fill_(2.0)
    return {"0.weight": torch.full((8, 4), 2.0)}


def _scale_on_last_rank(model, rank):
    """A read-modify-write on the last rank: it reads rank 0's values (broadcast on entry)."""
    last = dist.get_world_size() - 1
    with deepspeed.zero.GatheredParameters([model[2].weight, model[2].bias], modifier_rank=last):
        read = model[2].weight.detach().clone()
        if rank == last:
            with torch.no_grad():
                model[2].weight.mul_(0.5)
                model[2].bias.fill_(-1.0)
    return {"2.weight": read * 0.5, "2.bias": torch.full((2,), -1.0)}


def _dropped_without_modifier(model, rank):
    """modifier_rank=None: the edit is dropped (DeepSpeed's rule); what was read is what initialize gives."""
    with deepspeed.zero.GatheredParameters(model[0].bias, modifier_rank=None):
        read = model[0].bias.detach().clone()
        model[0].bias.data.fill_(7.0)
    return {"0.bias": read}


def _in_order(model, rank):
    """Two edits of one parameter, by two ranks: the second sees the first."""
    with deepspeed.zero.GatheredParameters(model[2].bias, modifier_rank=0):
        if rank == 0:
            model[2].bias.data.fill_(2.0)
    with deepspeed.zero.GatheredParameters(model[2].bias, modifier_rank=dist.get_world_size() - 1):
        model[2].bias.data.add_(1.0)  # every rank: only the modifier's counts
    return {"2.bias": torch.full((2,), 3.0)}


def _assigned_after_the_block(model, rank):
    """A new real nn.Parameter among meta ones keeps its values (rank 0's, as initialize broadcasts)."""
    model[2].weight = nn.Parameter(torch.full((2, 8), 3.0))
    return {"2.weight": torch.full((2, 8), 3.0)}


def _kept_edits() -> list:
    return [_fill_on_rank0, _scale_on_last_rank, _dropped_without_modifier, _in_order, _assigned_after_the_block]


def _error(make) -> str:
    try:
        model = make()
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=CONFIG)
    except zeroshard.ModelError as exc:
        return str(exc)
    return "no error"


def _in_place_on_meta():
    model = _build()
    with torch.no_grad():
        model[0].weight.fill_(2.0)  # a meta tensor: nothing to keep
    return model


def _replaced_inside_the_block():
    with deepspeed.zero.Init():
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        model[2].bias = nn.Parameter(torch.zeros(2))
    return model


class Scaled(nn.Module):
    """A parameter no initialisation sets (no reset_parameters): DeepSpeed scripts set it in GatheredParameters."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.scale


def _custom(rank: int, set_it: bool) -> str:
    """Reads NaN (the sentinel) in the block; kept once set, named by initialize if left unset."""
    with deepspeed.zero.Init():
        model = nn.Sequential(nn.Linear(4, 4), Scaled())
    with deepspeed.zero.GatheredParameters(model[1].scale, modifier_rank=0):
        unset = bool(torch.isnan(model[1].scale).all())
        if set_it and rank == 0:
            model[1].scale.data.fill_(1.5)
    try:
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=CONFIG)
    except zeroshard.ModelError as exc:
        return f"{unset} {exc}"
    return f"{unset} {model.state_dict()['1.scale'].tolist()}"


def _ranks(rank, world, device):
    kept = {edit.__name__: _kept(edit, rank, world, device) for edit in _kept_edits()}
    errors = {make.__name__: _error(make) for make in (_in_place_on_meta, _replaced_inside_the_block)}
    errors["custom set"], errors["custom unset"] = _custom(rank, True), _custom(rank, False)
    return kept, errors


def _reference(start: dict, world: int) -> tuple[list[float], dict]:
    """One plain PyTorch process from the same values, on the concatenated batches."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model.load_state_dict(start)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, world)
        per_rank = [nn.functional.mse_loss(model(x[2 * r:2 * r + 2]), y[2 * r:2 * r + 2]) for r in range(world)]
        opt.zero_grad()
        torch.stack(per_rank).mean().backward()
        opt.step()
        losses.append([loss.item() for loss in per_rank])
    return losses, model.state_dict()


@pytest.mark.parametrize("world", [1, 2])
def test_edits_before_initialize_are_kept_or_named(world):
    results = run_ranks(_ranks, world)
    for name in (edit.__name__ for edit in _kept_edits()):
        first = results[0][0][name]
        for kept, _ in results:  # every rank holds the same values, the edit's
            case = kept[name]
            for key, value in first["expected"].items():
                assert torch.equal(case["start"][key], value), (name, key)
            assert all(torch.equal(case["start"][k], first["start"][k]) for k in first["start"]), name
        # The reference gets the edit by hand, the rest from the materialised values.
        start = {**first["start"], **first["expected"]}
        losses, weights = _reference(start, world)
        for rank, (kept, _) in enumerate(results):
            for got, want in zip(kept[name]["losses"], losses):
                assert abs(got - want[rank]) <= 2e-5 * abs(want[rank]), (name, rank)
            for key, value in weights.items():
                assert torch.allclose(kept[name]["end"][key], value, rtol=1e-4, atol=1e-6), (name, key)
    for _, errors in results:
        assert "'2.weight'" not in errors["_in_place_on_meta"]
        assert errors["_in_place_on_meta"].startswith("parameter(s) '0.weight' were changed in place after "
                                                      "zeroshard.meta_init() (deepspeed.zero.Init)")
        assert "gathered_parameters(param, modifier_rank=0)" in errors["_in_place_on_meta"]
        assert errors["_replaced_inside_the_block"].startswith(
            "the parameter 'bias' of a Linear was replaced inside zeroshard.meta_init() (deepspeed.zero.Init)")
        assert "Assign it after the block" in errors["_replaced_inside_the_block"]
        assert errors["custom set"] == "True [1.5, 1.5, 1.5, 1.5]"
        assert errors["custom unset"].startswith("True parameter(s) '1.scale' of a model built on the meta device "
                                                 "were not initialised")


def test_another_modifier_rank_before_the_process_group_is_an_error(monkeypatch):
    """Without a process group rank 1's edit cannot reach rank 0, whose values initialize broadcasts (this
    process may hold a group from other tests: the script's moment before init_process_group is mimicked)."""
    monkeypatch.setitem(os.environ, "WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    model = _build()
    with pytest.raises(zeroshard.ModelError, match=r"modifier_rank=1\) before zeroshard.initialize .* "
                                                   r"torch.distributed.init_process_group\(\)"):
        with deepspeed.zero.GatheredParameters(model[0].weight, modifier_rank=1):
            pass
    assert model[0].weight.is_meta


def _in_place_on_one_rank(rank: int, world: int, device, editor: int) -> str:
    model = _build()
    if rank == editor:
        with torch.no_grad():
            model[2].bias.zero_()  # on meta, on this rank alone: the others have nothing to report
    try:
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=CONFIG)
    except zeroshard.ModelError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("editor", [0, 1])
def test_an_edit_on_meta_by_one_rank_stops_every_rank(editor):
    """The check runs before the group is joined; the other ranks hear of it in initialize's agreement
    instead of waiting there for the rank that stopped."""
    for message in run_ranks(_in_place_on_one_rank, 2, editor, timeout_s=120):
        assert message.startswith(f"the model of rank {editor} cannot be used; every rank stops: parameter(s) "
                                  "'2.bias' were changed in place after zeroshard.meta_init()"), message
