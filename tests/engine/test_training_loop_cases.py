"""The PyTorch-style loop in the shapes a review found wrong, each against one process on the same global batch.

A GAN (the generator's loss reaches the discriminator, whose `zero_grad()`
drops it), a list of optimizers stepped one by one, a loss on a feature a
forward hook caught (the backward reaches a parameter before any output), a
rank whose loss reaches no parameter with `reduce_once_per_window`, fp16 on
chained forwards, and a divide factor with `scale_wrt_gas=False`. SGD: a
gradient off by a factor moves the weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.distributed import run_ranks

STEPS, ROWS, LR = 3, 4, 0.1


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.b(F.gelu(self.a(x)))


def _model(seed: int) -> MLP:
    torch.manual_seed(seed)
    return MLP()


def _rows(step: int, rank: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(ROWS, 8, generator=torch.Generator().manual_seed(100 * step + 10 * rank + micro))


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _weights(engine) -> torch.Tensor:
    full = engine.full_state_dict()
    return torch.cat([full[n].float().reshape(-1) for n, _ in engine.module.named_parameters()])


def _engine(model, stage: int, optimizer=None, **config):
    import zeroshard

    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=LR)
    return zeroshard.initialize(model, optimizer, {"zero_optimization": {"stage": stage}} | config)


def _gan(rank, world, device, stage):
    g, d = _engine(_model(0), stage), _engine(_model(1), stage)
    for step in range(STEPS):
        x = _rows(step, rank)
        d.optimizer.zero_grad()  # drops what the generator's loss left in the discriminator
        (d(x).square().mean() + d(g(x).detach()).add(1).square().mean()).backward()
        d.optimizer.step()
        g.optimizer.zero_grad()
        d(g(x)).sub(1).square().mean().backward()
        g.optimizer.step()
    return _weights(g), _weights(d)


def _gan_reference(world):
    g, d = _model(0), _model(1)
    og, od = torch.optim.SGD(g.parameters(), lr=LR), torch.optim.SGD(d.parameters(), lr=LR)
    for step in range(STEPS):
        x = torch.cat([_rows(step, r) for r in range(world)])
        od.zero_grad()
        (d(x).square().mean() + d(g(x).detach()).add(1).square().mean()).backward()
        od.step()
        og.zero_grad()
        d(g(x)).sub(1).square().mean().backward()
        og.step()
    return _flat(g), _flat(d)


def _optimizer_list(rank, world, device, stage):
    model = _model(0)
    first = torch.optim.SGD([model.a.weight, model.b.weight], lr=LR)
    second = torch.optim.SGD([model.a.bias, model.b.bias], lr=LR)
    engine = _engine(model, stage, [first, second])
    for step in range(STEPS):
        F.mse_loss(engine(_rows(step, rank)), _rows(step, rank).flip(-1)).backward()
        first.step()  # the engine's step, for both
        second.step()
        first.zero_grad()
        second.zero_grad()
    return _weights(engine), engine.global_steps


def _feature_loss(rank, world, device, stage):
    model = _model(0)
    features = []
    model.a.register_forward_hook(lambda module, args, out: features.append(out))
    engine = _engine(model, stage)
    for step in range(STEPS):
        x = _rows(step, rank)
        out = engine(x)
        (F.mse_loss(out, x.flip(-1)) + features.pop().square().mean()).backward()
        engine.step()
    return _weights(engine)


def _plain_reference(world, loss_fn, accumulation: int = 1, divide: float | None = None):
    """One process: the mean (or, with `divide`, the sum over `divide`) of every rank's and micro-step's loss."""
    model = _model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        losses = [loss_fn(model, step, r, m) for r in range(world) for m in range(accumulation)]
        (sum(losses) / (divide or len(losses))).backward()
        optimizer.step()
        optimizer.zero_grad()
    return _flat(model)


def _mse(model, step, rank, micro=0):
    x = _rows(step, rank, micro)
    return F.mse_loss(model(x), x.flip(-1))


def _feature_mse(model, step, rank, micro=0):
    x = _rows(step, rank, micro)
    return F.mse_loss(model(x), x.flip(-1)) + model.a(x).square().mean()


def _rank0_only(model, step, rank, micro):
    return _mse(model, step, rank, micro) if rank == 0 else _mse(model, step, rank, micro).detach() * 0


def _empty_rank(rank, world, device, stage):
    """Rank 1's loss reaches no parameter (`engine.backward` runs an empty pass there);
    `reduce_once_per_window` holds micro-step 0 on both ranks."""
    engine = _engine(_model(0), stage, gradient_accumulation_steps=2,
                     zero_optimization={"stage": stage, "reduce_once_per_window": True})
    for step in range(STEPS):
        for micro in range(2):
            loss = _mse(engine, step, rank, micro)  # every rank runs the forward (stage 3 gathers in it)
            if rank == 1:
                loss = torch.zeros((), requires_grad=True)
            engine.backward(loss)
            engine.step()
    return _weights(engine)


def _summed(rank, world, device, stage):
    engine = _engine(_model(0), stage, gradient_accumulation_steps=2, gradient_divide_factor=1.0)
    for step in range(STEPS):
        for micro in range(2):
            engine.backward(_mse(engine, step, rank, micro) / (2 * world), scale_wrt_gas=False)
            engine.step()
    return _weights(engine)


def _fp16_chained(rank, world, device, stage, plain: bool):
    engine = _engine(_model(0), stage, fp16={"enabled": True, "initial_scale_power": 8})
    scales = []
    for step in range(STEPS):
        x = _rows(step, rank)
        loss = F.mse_loss(engine(engine(x)).float(), x)
        loss.backward() if plain else engine.backward(loss)
        engine.step()
        scales.append((engine.loss_scale, engine.global_grad_norm))
    return _weights(engine), scales


def _all(rank, world, device):
    out = {}
    for stage in (0, 1, 2, 3):
        out["gan", stage] = _gan(rank, world, device, stage)
        out["list", stage] = _optimizer_list(rank, world, device, stage)
        out["summed", stage] = _summed(rank, world, device, stage)
        out["fp16", stage] = [_fp16_chained(rank, world, device, stage, plain) for plain in (True, False)]
    for stage in (0, 1, 2):  # stage 3: a parameter used outside its unit's forward (the hook) is refused
        out["feature", stage] = _feature_loss(rank, world, device, stage)
    for stage in (2, 3):
        out["empty", stage] = _empty_rank(rank, world, device, stage)
    return out


def _close(got: torch.Tensor, want: torch.Tensor, what) -> None:
    assert ((got - want).norm() / want.norm()).item() <= 1e-5, what


def test_the_reviewed_loops_match_one_process():
    out = run_ranks(_all, 2)[0]
    gan = _gan_reference(2)
    plain = _plain_reference(2, _mse)
    for stage in (0, 1, 2, 3):
        for got, want, name in zip(out["gan", stage], gan, ("generator", "discriminator")):
            _close(got, want, ("gan", stage, name))
        weights, steps = out["list", stage]
        assert steps == STEPS, ("list", stage, steps)
        _close(weights, plain, ("list", stage))
        _close(out["summed", stage], _plain_reference(2, _mse, 2, divide=4), ("summed", stage))
        (plain_w, plain_scales), (engine_w, engine_scales) = out["fp16", stage]
        assert [s for s, _ in plain_scales] == [s for s, _ in engine_scales], ("fp16", stage)
        torch.testing.assert_close(torch.tensor([n for _, n in plain_scales]),
                                   torch.tensor([n for _, n in engine_scales]), rtol=1e-2, atol=0)
        assert ((plain_w - engine_w).norm() / engine_w.norm()).item() <= 1e-3, ("fp16", stage)
    for stage in (0, 1, 2):
        _close(out["feature", stage], _plain_reference(2, _feature_mse), ("feature", stage))
    for stage in (2, 3):
        _close(out["empty", stage], _plain_reference(2, _rank0_only, 2), ("empty", stage))
