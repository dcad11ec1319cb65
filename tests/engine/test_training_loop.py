"""The training loop people write: `loss.backward()`, several backward passes per step, `no_sync`, sums.

References: single-process PyTorch on the concatenated global batch (fp32:
`train_reference`; bf16: the mixed-precision recipe `train_reference_mixed`),
and for the bytes the engine's own single-backward loop (`comm_stats()`).
Every loop form trains the same recipe as the reference, written the way a
DDP or FSDP2 user writes it: the two-loss form splits each sequence's tokens
into two losses, GradCache computes the loss on outputs made without
gradients and backpropagates each chunk's share through a second forward
(`out.backward(grad)`, a non-scalar backward).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import run_ranks
from tests.recipes import (
    Case,
    flat_weights,
    make_engine,
    make_model,
    micro_batch,
    relative_error,
    train_reference,
    train_reference_mixed,
)

STEPS = 3
FORMS = ("pytorch", "two_losses", "coalesced", "gradcache", "no_sync", "ddp", "ddp_sync")
# 16-bit: the loss split and the chunks round differently from one backward of the whole loss.
TOLERANCE = {"fp32": (2e-5, 1e-4), "bf16": (1e-2, 6e-3)}


def _token_losses(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float().flatten(0, 1), y.flatten(), reduction="none").view(y.shape)


def _micro_step(engine, form: str, x, y, last: bool) -> float:
    """One micro-step's backward passes in `form`; returns the micro-batch's mean loss."""
    if form == "gradcache":
        return _gradcache(engine, x, y)
    if form in ("two_losses", "coalesced"):
        out = engine(x)
        per_token, half = _token_losses(out, y), y.shape[1] // 2
        first, second = per_token[:, :half].sum() / y.numel(), per_token[:, half:].sum() / y.numel()
        with engine.coalesce_grad_reduction() if form == "coalesced" else contextlib.nullcontext():
            first.backward(retain_graph=True)
            second.backward()
        return (first + second).item()
    with engine.no_sync() if form == "no_sync" and not last else contextlib.nullcontext():
        loss = _token_losses(engine(x), y).mean()
        loss.backward()
    return loss.item()


def _gradcache(engine, x, y) -> float:
    """GradCache: outputs without gradients, the loss on all of them, then each row's forward and
    `out.backward(its share of the gradient)`."""
    with torch.no_grad():
        outs = torch.cat([engine(row) for row in x.split(1)])
    leaf = outs.float().requires_grad_()
    loss = _token_losses(leaf, y).mean()
    loss.backward()
    for row, grad in zip(x.split(1), leaf.grad.split(1)):
        out = engine(row)
        out.backward(grad.to(out.dtype))
    return loss.item()


def _train(rank, world, device, case: Case, form: str):
    if form.startswith("ddp"):
        return _train_ddp(rank, world, device, case, form)
    engine = make_engine(case, device=device)
    optimizer = engine.optimizer  # the loop steps the optimizer it built, as under DDP
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(case.accumulation):
            x, y = (t.to(device) for t in micro_batch(step, case, world, rank, micro))
            total += _micro_step(engine, form, x, y, micro == case.accumulation - 1) / case.accumulation
            if form == "pytorch":
                optimizer.step()
                optimizer.zero_grad()
            else:
                engine.step()
        losses.append(total)
    return losses, _weights(engine), engine.global_steps


def _train_ddp(rank, world, device, case: Case, form: str):
    """DDP's accumulation: the config's window is one micro-step, the loop's k backward passes of loss / k
    make it (`no_sync` around all but the last in "ddp", none in "ddp_sync"), then one optimizer.step()."""
    config = case.config() | {"gradient_accumulation_steps": 1, "train_micro_batch_size_per_gpu": None}
    engine = make_engine(case, config=config, device=device)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(case.accumulation):
            x, y = (t.to(device) for t in micro_batch(step, case, world, rank, micro))
            last = micro == case.accumulation - 1
            with engine.no_sync() if form == "ddp" and not last else contextlib.nullcontext():
                loss = _token_losses(engine(x), y).mean() / case.accumulation
                loss.backward()
            total += loss.item()
        engine.optimizer.step()
        losses.append(total)
    return losses, _weights(engine), engine.global_steps


def _weights(engine) -> torch.Tensor:
    full = engine.full_state_dict()
    return torch.cat([full[n].float().reshape(-1).cpu() for n, _ in engine.module.named_parameters()])


def _cases(dtype: str) -> list[Case]:
    optimizer = "adamw1_slow" if dtype != "fp32" else "sgd"  # SGD: a gradient off by a factor moves the weights
    return [Case(stage=s, accumulation=2, clip=0.5, dtype=dtype, optimizer=optimizer) for s in (0, 1, 2, 3)]


def _train_all(rank, world, device, dtype):
    return {(case.stage, form): _train(rank, world, device, case, form) for case in _cases(dtype) for form in FORMS}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_loop_form_matches_one_process(world, dtype):
    per_rank = run_ranks(_train_all, world, dtype)
    loss_tol, weight_tol = TOLERANCE[dtype]
    for case in _cases(dtype):
        reference = train_reference if dtype == "fp32" else train_reference_mixed
        ref_losses, ref_weights = reference(case, world, STEPS)
        for form in FORMS:
            losses, weights, steps = per_rank[0][(case.stage, form)]
            assert steps == STEPS, f"stage {case.stage} {form}: {steps} optimizer steps"
            mean = torch.tensor([r[(case.stage, form)][0] for r in per_rank]).mean(0)
            loss_err = ((mean - torch.tensor(ref_losses)).abs() / torch.tensor(ref_losses)).max().item()
            weight_err = relative_error(weights, ref_weights)
            assert loss_err <= loss_tol, f"stage {case.stage} {form} {dtype} x{world}: loss error {loss_err:.2e}"
            assert weight_err <= weight_tol, f"stage {case.stage} {form} {dtype} x{world}: weights {weight_err:.2e}"
            assert relative_error(weights, flat_weights(make_model())) > 1e-3, f"{form}: the weights did not move"


# -- bytes and memory ---------------------------------------------------------


def _window_bytes(engine, backward, accumulation: int, world: int, rank: int, device) -> tuple[int, list[int]]:
    """Reduce-scatter bytes of one window of `backward(engine, x, y, micro)` passes, and the gradient bytes
    `memory_stats()` reports after each micro-step's backward."""
    before, grads = engine.comm_stats()["reduce_scatter"].bytes, []
    for micro in range(accumulation):
        x, y = (t.to(device) for t in micro_batch(0, Case(accumulation=accumulation), world, rank, micro))
        backward(engine, x, y, micro)
        grads.append(engine.memory_stats()["grads"])
        engine.step()
    return engine.comm_stats()["reduce_scatter"].bytes - before, grads


def _one_loss(engine, x, y, micro):
    _token_losses(engine(x), y).mean().backward()


def _bytes(rank, world, device):
    out = {}
    for stage in (2, 3):
        case = Case(stage=stage)
        for form in ("two_losses", "coalesced", "gradcache"):
            out[stage, form] = _window_bytes(make_engine(case, device=device),
                                             lambda e, x, y, m, f=form: _micro_step(e, f, x, y, True), 1, world,
                                             rank, device)[0]
        with_gradcache = make_engine(case, device=device)
        out[stage, "gradcache_coalesced"] = _window_bytes(
            with_gradcache, lambda e, x, y, m: _coalesced_gradcache(e, x, y), 1, world, rank, device)[0]
        out[stage, "one"] = _window_bytes(make_engine(case, device=device), _one_loss, 1, world, rank, device)[0]
        out[stage, "autograd_grad"] = _window_bytes(make_engine(case, device=device), _after_autograd_grad, 1,
                                                    world, rank, device)[0]
        window = Case(stage=stage, accumulation=4)
        engine = make_engine(window, device=device)
        out[stage, "every"] = _window_bytes(engine, _one_loss, 4, world, rank, device)
        out[stage, "no_sync"] = _window_bytes(make_engine(window, device=device), _no_sync_but_last, 4, world,
                                              rank, device)
        per_window = window.config()
        per_window["zero_optimization"]["reduce_once_per_window"] = True
        out[stage, "per_window"] = _window_bytes(make_engine(window, config=per_window, device=device), _one_loss,
                                                 4, world, rank, device)
        out[stage, "numel"] = sum(p.numel() for p in make_model().parameters())
    return out


def _after_autograd_grad(engine, x, y, micro):
    """`torch.autograd.grad` through the model (it writes no .grad: no pass), then the loss's backward."""
    out = engine(x)
    loss = _token_losses(out, y).mean()
    (grad,) = torch.autograd.grad(loss, out, retain_graph=True)
    assert grad.abs().sum() > 0
    loss.backward()


def _coalesced_gradcache(engine, x, y):
    with engine.coalesce_grad_reduction():
        _gradcache(engine, x, y)


def _no_sync_but_last(engine, x, y, micro):
    with engine.no_sync() if micro < 3 else contextlib.nullcontext():
        _one_loss(engine, x, y, micro)


def test_several_passes_and_no_sync_cost_the_bytes_of_one_reduction():
    for out in run_ranks(_bytes, 2):
        for stage in (2, 3):
            one = out[stage, "one"]
            assert one > 0
            # Each reducing pass reduces its own gradients; coalescing makes them one reduction.
            assert out[stage, "two_losses"] == 2 * one and out[stage, "gradcache"] == 2 * one
            assert out[stage, "coalesced"] == one and out[stage, "gradcache_coalesced"] == one
            assert out[stage, "autograd_grad"] == one
            every, every_grads = out[stage, "every"]
            assert every == 4 * one
            held = 4 * out[stage, "numel"]  # the whole fp32 gradient, on .grad
            for form in ("no_sync", "per_window"):
                window, grads = out[stage, form]
                assert window == one, f"stage {stage} {form}: {window} bytes for a window, one reduction is {one}"
                assert [g - e for g, e in zip(grads[:3], every_grads[:3])] == [held] * 3, (stage, form, grads)
                assert grads[3] == every_grads[3]  # the last backward reduced and freed them


# -- a loss normalised by the global token count -------------------------------

TOKENS = Case(accumulation=2, clip=0.5, optimizer="sgd")


def _mask(y: torch.Tensor, rank: int, micro: int) -> torch.Tensor:
    """Each rank and micro-step counts a different number of tokens (the last ones of each row left out)."""
    keep = y.shape[1] - (2 * rank + micro + 1)
    return (torch.arange(y.shape[1], device=y.device) < keep).expand_as(y)


def _global_tokens(world: int) -> int:
    y = micro_batch(0, TOKENS, world, 0, 0)[1]
    return sum(int(_mask(y, r, m).sum()) for r in range(world) for m in range(TOKENS.accumulation))


def _token_sum(out, y, mask) -> torch.Tensor:
    return (_token_losses(out, y) * mask).sum()


def _train_tokens(rank, world, device, stage: int, way: str):
    config = Case(**{**TOKENS.__dict__, "stage": stage}).config()
    config |= {"gradient_divide_factor": 1.0} if way == "factor" else {}
    config |= {"gradient_allreduce_op": "sum"} if way == "sum" else {}
    engine = make_engine(TOKENS, config=config, device=device)
    if way == "set_factor":
        engine.set_gradient_divide_factor(1.0)
    tokens, norms = _global_tokens(world), []
    for step in range(STEPS):
        for micro in range(TOKENS.accumulation):
            x, y = (t.to(device) for t in micro_batch(step, TOKENS, world, rank, micro))
            loss = _token_sum(engine(x), y, _mask(y, rank, micro)) / tokens
            engine.backward(loss, scale_wrt_gas=False) if way == "sum" else loss.backward()
            engine.step()
        norms.append(engine.global_grad_norm)
    full = engine.full_state_dict()
    return norms, torch.cat([full[n].reshape(-1).cpu() for n, _ in engine.module.named_parameters()])


def _tokens_reference(world: int):
    """One process: every rank's and micro-step's tokens in one loss, divided by their count."""
    model, tokens, norms = make_model(), _global_tokens(world), []
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(STEPS):
        total = sum(_token_sum(model(x), y, _mask(y, r, m)) for r in range(world) for m in range(2)
                    for x, y in [micro_batch(step, TOKENS, world, r, m)])
        (total / tokens).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), TOKENS.clip).item())
        optimizer.step()
        optimizer.zero_grad()
    return norms, flat_weights(model)


def _tokens_all(rank, world, device):
    return {(s, w): _train_tokens(rank, world, device, s, w) for s in (0, 1, 2, 3)
            for w in ("factor", "set_factor", "sum")}


@pytest.mark.parametrize("world", [2, 4])
def test_a_token_normalised_loss_equals_one_process_summing_it(world):
    ref_norms, ref_weights = _tokens_reference(world)
    for (stage, way), (norms, weights) in run_ranks(_tokens_all, world)[0].items():
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0,
                                   msg=lambda m: f"stage {stage} {way}: gradient norms {m}")
        assert relative_error(weights, ref_weights) <= 1e-4, f"stage {stage} {way} x{world}"


# -- fp16 ---------------------------------------------------------------------


def _fp16(rank, world, device):
    from tests.core.test_precision import POISONED, _fp16_run

    case = Case(dtype="fp16", optimizer="adamw1", clip=1.0)
    return {(stage, plain): _fp16_run(rank, world, device, Case(**{**case.__dict__, "stage": stage}), 7,
                                      poisoned=POISONED, plain=plain)[:2]
            for stage in (0, 1, 2, 3) for plain in (True, False)}


def test_fp16_loss_backward_skips_overflowing_steps_on_every_rank():
    from tests.core.test_precision import POISONED

    for out in run_ranks(_fp16, 2):
        for stage in (0, 1, 2, 3):
            (snapshots, history), (_, engine_history) = out[stage, True], out[stage, False]
            assert [h[1] for h in history] == [h[1] for h in engine_history]  # skipped steps, step by step
            assert [h[0] for h in history] == [h[0] for h in engine_history]  # the loss scale
            assert [torch.isinf(torch.tensor(h[3])).item() for h in history] == [s in POISONED for s in range(7)]
            for k in POISONED:  # nothing a skipped step may change changed
                assert all(torch.equal(a, b) for a, b in zip(snapshots[k], snapshots[k + 1])), (stage, k)
            assert not all(torch.equal(a, b) for a, b in zip(snapshots[1], snapshots[2]))
