"""Gradient sync driven by the caller: custom loops that run their own backward passes reproduce one process.

`engine.pipeline_backward()` around any backward leaves gradients on `.grad`
(accumulating); `engine.reduce_gradients()` reduces them now (stages 2-3 may
do so after every micro-batch); `engine.scale_gradients(f)` divides the
step's gradients; `engine.step()` reduces what is left. The calls the state
does not allow are errors.
"""

import pytest
import torch

import zeroshard
from tests.distributed import run_ranks
from tests.recipes import Case, loss_of, make_model, make_optimizer, micro_batch, relative_error, train_reference
from zeroshard.engine.state import EngineStateError

STEPS, MICRO = 6, 2
CASES = [(0, False), (1, False), (2, False), (2, True), (3, True)]  # (stage, reduce after every micro-batch)


def _custom_loop(rank, world, device, stage, per_micro):
    case = Case(stage=stage, accumulation=MICRO, clip=0.5)
    model = make_model(device=device)
    config = case.config() | {"gradient_accumulation_steps": 1}  # the loop accumulates, not the engine
    engine = zeroshard.initialize(model, make_optimizer(case.optimizer, model), config)
    engine.set_gradient_sync(False)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(MICRO):
            x, y = micro_batch(step, case, world, rank, micro)
            with engine.pipeline_backward():  # any backward of the caller's: here a plain one
                loss = loss_of(engine, x.to(device), y.to(device))
                loss.backward()
            if per_micro:
                engine.reduce_gradients()
            total += loss.item() / MICRO
        engine.scale_gradients(MICRO)  # each micro-batch's loss is a mean: the window's mean
        engine.step()
        losses.append(total)
    full = engine.full_state_dict()  # named_parameters(): the tied embedding once, as the reference counts it
    weights = torch.cat([full[name].reshape(-1).cpu() for name, _ in model.named_parameters()])
    return losses, weights, _refusals(engine, stage)


def _refusals(engine, stage):
    """The calls the state does not allow, each an EngineStateError."""
    refused = []
    with pytest.raises(EngineStateError):
        engine.reduce_gradients()  # no backward since the step
    refused.append("reduce before backward")
    if stage < 2:
        x = torch.zeros(1, 8, dtype=torch.long, device=engine.device)
        with engine.pipeline_backward():
            loss_of(engine, x, x).backward()
        engine.reduce_gradients()
        with pytest.raises(EngineStateError):
            engine.reduce_gradients()  # stages 0-1 reduce a window once
        refused.append("second reduce at stage 0-1")
        with pytest.raises(EngineStateError):
            engine.set_gradient_sync(True)  # inside a window
        refused.append("sync switched inside a window")
        with pytest.raises(EngineStateError, match="reduced twice"):
            with engine.pipeline_backward():  # a backward after the window's one reduction
                loss_of(engine, x, x).backward()
        refused.append("backward after the reduction at stage 0-1")
    return refused


def _all_cases(rank, world, device):
    return [_custom_loop(rank, world, device, stage, per_micro) for stage, per_micro in CASES]


def test_loops_of_their_own_backwards_match_one_process():
    per_rank = run_ranks(_all_cases, 2)
    for i, (stage, per_micro) in enumerate(CASES):
        ref_losses, ref_weights = train_reference(Case(stage=stage, accumulation=MICRO, clip=0.5), 2, STEPS)
        losses = torch.tensor([r[i][0] for r in per_rank]).mean(0)
        assert ((losses - torch.tensor(ref_losses)).abs() / torch.tensor(ref_losses)).max() <= 2e-5, (stage, per_micro)
        assert relative_error(per_rank[0][i][1], ref_weights) <= 1e-4, (stage, per_micro)
        assert per_rank[0][i][2] == (["reduce before backward"] if stage >= 2 else [
            "reduce before backward", "second reduce at stage 0-1", "sync switched inside a window",
            "backward after the reduction at stage 0-1"])
