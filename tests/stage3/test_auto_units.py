"""Stage 3 without `wrap=`: the size policy's units are modules that run, and training equals one process.

A container without a forward of its own (ModuleList, ModuleDict) is never
called, so a unit made of it would never be gathered and its blocks would
run on empty shards. References: single-process PyTorch trained on the
global batch (losses and weights), and the unit names worked out by hand
from the default `stage3_auto_wrap_min_params` (1M elements). A forward that
reads a sharded parameter outside its unit's forward raises an error naming
the parameter, checked on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroshard
import zeroshard.deepspeed as deepspeed
from tests.distributed import RankFailure, run_ranks
from tests.recipes import relative_error

ROWS, STEPS, LR = 8, 3, 1e-3


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class ListModel(nn.Module):
    """Eight blocks of 262,656 elements in a ModuleList (2.1M together) and a head."""

    width = 512

    def __init__(self, blocks: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList(Block(self.width) for _ in range(blocks))
        self.head = nn.Linear(self.width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class DictModel(nn.Module):
    """A trunk and four heads of 262,400 elements in a ModuleDict (1.05M together)."""

    width = 256

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(self.width, self.width)
        self.heads = nn.ModuleDict({k: nn.Linear(self.width, 1024) for k in "abcd"})

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return sum(head(h).mean(-1, keepdim=True) for head in self.heads.values())


class Pair(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.inner, self.outer = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.outer(torch.tanh(self.inner(x)))


class BigBlocks(ListModel):
    """Four blocks of 148,512 elements each, over the auto-wrap size the case sets (1e5), each Linear under it."""

    width = 272

    def __init__(self):
        super().__init__(blocks=0)
        self.blocks = nn.ModuleList(Pair(self.width) for _ in range(4))


MODELS = {"list": (ListModel, {}, [f"blocks.{i}" for i in range(8)]),
          "dict": (DictModel, {}, [f"heads.{k}" for k in "abcd"]),
          "big": (BigBlocks, {"stage3_auto_wrap_min_params": 100_000}, [f"blocks.{i}" for i in range(4)])}


def _batch(step: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, width, generator=g), torch.randn(ROWS, 1, generator=g)


def _reference(kind: str) -> tuple[list[float], torch.Tensor]:
    cls = MODELS[kind][0]
    torch.manual_seed(0)
    model = cls()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, cls.width)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(rank: int, world: int, device, kind: str):
    cls, zero, _ = MODELS[kind]
    torch.manual_seed(0)
    model = cls().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    engine = zeroshard.initialize(model, opt, {"zero_optimization": {"stage": 3, **zero}})
    rows = ROWS // world
    losses = []
    for step in range(STEPS):
        x, y = (t[rank * rows:(rank + 1) * rows].to(device) for t in _batch(step, cls.width))
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    full = engine.full_state_dict()
    weights = torch.cat([full[name].reshape(-1).cpu() for name, _ in model.named_parameters()])
    return losses, weights, [unit.name for unit in engine.schedule.units]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_the_size_policy_picks_modules_that_run_and_trains_as_one_process(kind, world):
    ref_losses, ref_weights = _reference(kind)
    results = run_ranks(_train, world, kind)
    assert sorted(results[0][2]) == sorted(["(root)", *MODELS[kind][2]])
    losses = [sum(r[0][step] for r in results) / world for step in range(STEPS)]  # each rank's mean, averaged
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 2e-5 * abs(want)
    for losses_r, weights, _ in results:
        assert relative_error(weights, ref_weights) <= 1e-4


# -- GPT-2 (4 layers of 256) under deepspeed.initialize, as a DeepSpeed script builds it ------------------

def _gpt2():
    import transformers

    config = transformers.GPT2Config(vocab_size=512, n_positions=32, n_embd=256, n_layer=4, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(512, (4, 16), generator=torch.Generator().manual_seed(step))


def _gpt2_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        tokens = _tokens(step)
        loss = model(input_ids=tokens, labels=tokens).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_gpt2(rank: int, world: int, device):
    model = _gpt2().to(device)
    config = {"train_micro_batch_size_per_gpu": 4 // world, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rows = 4 // world
    losses = []
    for step in range(STEPS):
        tokens = _tokens(step)[rank * rows:(rank + 1) * rows].to(device)
        # Each rank's loss is the mean over its own tokens; equal row counts make the ranks' mean the global one.
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    full = engine.full_state_dict()
    return losses, {k: v.cpu() for k, v in full.items()}, [unit.name for unit in engine.schedule.units]


@pytest.mark.parametrize("world", [1, 2])
def test_gpt2_under_deepspeed_initialize_without_wrap_trains_as_one_process(world):
    ref_losses, ref_state = _gpt2_reference()
    results = run_ranks(_train_gpt2, world)
    assert sorted(results[0][2]) == sorted(["(root)", *(f"transformer.h.{i}" for i in range(4))])
    losses = [sum(r[0][step] for r in results) / world for step in range(STEPS)]
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 2e-5 * abs(want)
    want = torch.cat([ref_state[key].reshape(-1) for key in sorted(ref_state)])
    for _, state, _ in results:
        assert sorted(state) == sorted(ref_state)
        assert relative_error(torch.cat([state[key].reshape(-1) for key in sorted(ref_state)]), want) <= 1e-4


# -- a sharded parameter read outside its unit's forward names itself ----------------------------------------

class Table(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 32))

    def forward(self, ids):
        return self.weight[ids]


class ReadsOutside(nn.Module):
    """The head reads the table's weight itself, after the table's own forward released it."""

    def __init__(self, multiline: bool):
        super().__init__()
        self.table, self.mid, self.multiline = Table(), nn.Linear(32, 32), multiline

    def forward(self, ids):
        h = self.mid(self.table(ids))
        if self.multiline:
            weight = self.table.weight
            return F.linear(
                h, weight)
        return F.linear(h, self.table.weight)


def _read_outside(rank: int, world: int, device, multiline: bool):
    torch.manual_seed(0)
    model = ReadsOutside(multiline).to(device)
    engine = zeroshard.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
                                  wrap=[Table])
    engine(torch.tensor([1, 2, 3], device=device))


@pytest.mark.parametrize("multiline", [False, True])
def test_a_sharded_parameter_used_outside_its_units_forward_is_named_on_every_rank(multiline):
    with pytest.raises(RankFailure) as failure:
        run_ranks(_read_outside, 2, multiline)
    messages = failure.value.messages()
    assert len(messages) == 2
    for message in messages:
        assert message.startswith("ModelError"), message
        assert "parameter 'table.weight' of unit 'table'" in message
        assert "module '(root)' (ReadsOutside)" in message and "wrap=" in message
