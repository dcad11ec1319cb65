"""Checkpoints of the uneven cases: 3 ranks (padding-only shards), and Adagrad (state built in its constructor).

References: torch's own Adagrad in one process, and the writer's full state
dict and optimizer state, which every reader must give back exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import zeroshard
from tests.distributed import run_ranks
from tests.recipes import make_engine
from zeroshard.checkpoint.consolidate import consolidate, full_tensors
from zeroshard.core.optim import OptimizerError


class Tiny(nn.Module):
    """Parameters of 1 element (a 0-d one too): on 3 ranks, ranks 1 and 2 hold padding only."""

    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(5, 4), nn.Linear(4, 1)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.frozen = nn.Parameter(torch.tensor([0.3]), requires_grad=False)

    def forward(self, x):
        return self.lin2(torch.tanh(self.lin1(x))) * self.scale + self.frozen


def _config(stage: int, world: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 1, "allgather_bucket_size": 1}  # a flat buffer per parameter
    if stage == 3:
        zero |= {"stage3_wrap_classes": ["Linear"], "stage3_param_persistence_threshold": 0}
    return {"train_micro_batch_size_per_gpu": 6 // world, "zero_optimization": zero}


def _trained(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


_OPTIMIZERS = {"adagrad": lambda model: torch.optim.Adagrad(_trained(model), lr=0.1),
               "adamw": lambda model: torch.optim.AdamW(_trained(model), lr=1e-2)}


def _train(engine, rank: int, world: int, steps) -> list[float]:
    losses = []
    for step in steps:
        x = torch.randn(6, 5, generator=torch.Generator().manual_seed(step))
        rows = 6 // world
        loss = engine(x[rank * rows:(rank + 1) * rows]).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_adagrad_is_accepted_and_trains_as_torch():
    """Adagrad builds `sum` and `step` in its constructor: a fresh one was refused as 'already has state'."""
    engine = make_engine(model=Tiny, optimizer=_OPTIMIZERS["adagrad"], config=_config(0, 1), seed=0)
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.Adagrad([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for step in range(2):
        x = torch.randn(6, 5, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    _train(engine, 0, 1, range(2))
    full = engine.full_state_dict()
    assert all(torch.equal(full[k], v) for k, v in model.state_dict().items())
    with pytest.raises(OptimizerError, match="already has state"):  # a stepped one still is refused
        zeroshard.initialize(model, opt, _config(0, 1))


def _write(rank, world, device, root, stage, optimizer, steps):
    engine = make_engine(model=Tiny, optimizer=_OPTIMIZERS[optimizer], config=_config(stage, world), seed=0)
    _train(engine, rank, world, range(steps))
    engine.save_checkpoint(root)
    full = engine.full_state_dict()
    return full, _train(engine, rank, world, range(steps, steps + 2))


def _read(rank, world, device, root, stage, optimizer, steps):
    engine = make_engine(model=Tiny, optimizer=_OPTIMIZERS[optimizer], config=_config(stage, world), seed=7)
    _train(engine, rank, world, range(3))  # trained: the load replaces all of it
    engine.load_checkpoint(root)
    full = engine.full_state_dict()
    engine.save_checkpoint(root + "_again")
    return full, _train(engine, rank, world, range(steps, steps + 2))


def _check(tmp_path, writer, reader, optimizer, steps, state_keys):
    root = str(tmp_path / "ckpt")
    written = run_ranks(_write, writer[0], root, writer[1], optimizer, steps)
    read = run_ranks(_read, reader[0], root, reader[1], optimizer, steps)
    saved = written[0][0]
    for full, _ in read:
        assert all(torch.equal(full[k], v) for k, v in saved.items())
    assert all(torch.equal(consolidate(root)[k], v) for k, v in saved.items())
    for kind in ["param"] + [f"optim.{k}" for k in state_keys]:
        before, after = full_tensors(root, kind=kind), full_tensors(root + "_again", kind=kind)
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), kind
    written_losses = torch.tensor([w[1] for w in written]).mean(0)
    read_losses = torch.tensor([r[1] for r in read]).mean(0)
    assert ((written_losses - read_losses).abs() / written_losses).max() <= 1e-5
    return Path(root)


def test_adagrad_checkpoint_moves_from_3_ranks_stage_3_to_2_ranks_stage_2(tmp_path):
    _check(tmp_path, (3, 3), (2, 2), "adagrad", 2, ["sum"])


def test_adagrad_saved_before_any_step_gives_a_trained_engine_its_fresh_state(tmp_path):
    root = _check(tmp_path, (2, 1), (3, 3), "adagrad", 0, ["sum"])
    sums = full_tensors(root.parent / "ckpt_again", kind="optim.sum")
    assert all(torch.equal(s, torch.zeros_like(s)) for s in sums.values())  # initial_accumulator_value


def test_three_ranks_with_padding_only_shards_move_between_stages(tmp_path):
    _check(tmp_path, (3, 2), (3, 3), "adamw", 2, ["exp_avg", "exp_avg_sq"])
