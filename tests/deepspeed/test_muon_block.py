"""DeepSpeed's `"optimizer": {"type": "Muon"}` block under `import zeroshard.deepspeed as deepspeed`.

The split is DeepSpeed's (deepspeed/__init__.py `set_optimizer_flags`): trained parameters with 2 or more
dimensions whose names contain neither "embed" nor "lm_head" to Muon, the rest to AdamW, with its keys
(`muon_lr` and `adam_lr` over `lr`); a parameter's own `use_muon` is kept. At stages 1-3 on 2 ranks a
DeepSpeed-style script trains as torch's Muon and AdamW on that split in one process, at torch Muon's bf16
tolerance (its Newton-Schulz runs in bf16: tests/optim/test_whole_parity.py).
"""

import pytest
import torch
import torch.nn as nn

from tests.distributed import run_ranks

STEPS, ROWS = 3, 8
PARAMS = {"lr": 1e-3, "muon_lr": 2e-2, "momentum": 0.9, "weight_decay": 0.01, "betas": [0.9, 0.98], "eps": 1e-8}


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2))
        self.norm = nn.LayerNorm(32)
        self.lm_head = nn.Linear(32, 64, bias=False)
        self.gate = nn.Linear(32, 32)
        self.gate.weight.use_muon = False  # the user's own choice, kept

    def forward(self, tokens):
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = h + layer(h)
        return self.lm_head(self.norm(h + self.gate(h)))


def _model():
    torch.manual_seed(0)
    return TinyLM()


def _loss(model, tokens):
    return nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def _batch(step):
    return torch.randint(64, (ROWS, 9), generator=torch.Generator().manual_seed(step))


def _muon_names(model):
    return sorted(n for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n and "lm_head" not in n
                  and n != "gate.weight")


def _reference():
    model = _model()
    names = _muon_names(model)
    muon = torch.optim.Muon([p for n, p in model.named_parameters() if n in names], lr=PARAMS["muon_lr"],
                            momentum=PARAMS["momentum"], weight_decay=PARAMS["weight_decay"])
    adamw = torch.optim.AdamW([p for n, p in model.named_parameters() if n not in names], lr=PARAMS["lr"],
                              betas=tuple(PARAMS["betas"]), eps=PARAMS["eps"], weight_decay=PARAMS["weight_decay"])
    losses = []
    for step in range(STEPS):
        loss = _loss(model, _batch(step))
        loss.backward()
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _script(rank, world, device, stage):
    import zeroshard
    import zeroshard.deepspeed as deepspeed

    model = _model()
    config = {"train_micro_batch_size_per_gpu": ROWS // world, "optimizer": {"type": "muon", "params": PARAMS},
              "zero_optimization": {"stage": stage}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    names = {id(p): n for n, p in model.named_parameters()}
    kinds = [type(m).__name__ for m in optimizer.optimizers]
    split = {kind: sorted(names[id(p)] for b in engine.buckets if b.param_group == g for p in b.params)
             for g, kind in enumerate(kinds)}  # one param group each; the groups now hold the masters
    keys = {"Muon": ("lr", "weight_decay", "momentum"), "AdamW": ("lr", "weight_decay", "betas", "eps")}
    settings = [{k: g[k] for k in keys[kind]} for g, kind in zip(optimizer.param_groups, kinds)]
    losses = []
    for step in range(STEPS):
        rows = _batch(step).chunk(world)[rank]
        loss = engine(rows[:, :-1])
        loss = nn.functional.cross_entropy(loss.flatten(0, 1), rows[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with zeroshard.gathered_parameters(list(model.parameters())):
        weights = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    return split, settings, kinds, losses, weights


def test_the_block_splits_as_deepspeed_with_its_keys():
    (split, settings, kinds, _, _), = run_ranks(_script, 1, 0)
    assert kinds == ["Muon", "AdamW"]
    assert split["Muon"] == _muon_names(_model())
    assert "gate.weight" in split["AdamW"] and "embed_tokens.weight" in split["AdamW"]
    assert settings == [{"lr": 2e-2, "weight_decay": 0.01, "momentum": 0.9},
                        {"lr": 1e-3, "weight_decay": 0.01, "betas": (0.9, 0.98), "eps": 1e-8}]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_deepspeed_script_with_the_block_trains_as_one_process(stage):
    losses, weights = _reference()
    results = run_ranks(_script, 2, stage)
    for step in range(STEPS):
        got = sum(r[3][step] for r in results) / 2
        assert abs(got - losses[step]) <= 1e-4 * abs(losses[step]), (step, got, losses[step])
    assert (results[0][4] - weights).abs().max() <= 8 * PARAMS["muon_lr"] * 2 ** -8
