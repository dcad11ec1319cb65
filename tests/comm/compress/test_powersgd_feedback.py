"""PowerSGD's error feedback over 50 steps (issue 26's acceptance 2, for the low-rank codec, stages 0-1).

PowerSGD is biased: a rank-r approximation of a full-rank mean leaves part
of it out at every step. Each rank's gradients here are a fixed full-rank
G plus noise, as training's are a slow drift plus noise, reduced at rank 2.
What the steps leave out, D_t = sum over s <= t of (exact mean - applied
result), is what the sum of the applied updates misses of the uncompressed
sum. With error feedback it equals the mean over the ranks of their errors
(the errors keep it, to the rounding of fp32) and stays bounded: from step
25 to 50 it grows by less than a quarter. Without, the same part of G is
left out at every step and D grows in step with t (by more than half from
step 25 to 50, twice in exact proportion). The bound is not a constant
derived from the compressor: one power iteration makes no promise of a
fixed share per step; the contrast with the run without error feedback is
what shows the test can fail.
"""

from __future__ import annotations

import pytest
import torch

from tests.comm.compress.test_powersgd import SHAPES, Given, _config
from tests.distributed import run_ranks

STEPS, HALF = 50, 25
SETTINGS = {"rank": 2, "warm_start": True}


def _drifting(rank: int, step: int, device) -> list[torch.Tensor]:
    """G (the same on every rank and step) plus noise of half its scale."""
    base, noise = torch.Generator().manual_seed(7), torch.Generator().manual_seed(100 * step + rank)
    return [(torch.randn(s, generator=base) + 0.5 * torch.randn(s, generator=noise)).to(device) for s in SHAPES]


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1).cpu() for t in tensors])


def _run(rank, device, error_feedback: bool) -> dict:
    """Stage 1: the applied results summed, and this rank's error in the parameters' order, at HALF and STEPS."""
    import zeroshard

    model = Given().to(device)
    config = _config(1, SETTINGS | {"error_feedback": error_feedback}, 10**7, "fp32", 1)
    engine = zeroshard.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    (bucket,) = engine.buckets
    position = {id(p): j for j, p in enumerate(bucket.params)}  # the bucket holds them in backward order
    applied, out = torch.zeros(sum(p.numel() for p in model.ps)), {}
    for step in range(STEPS):
        engine.backward(engine(*_drifting(rank, step, device)))
        applied += _flat(p.grad for p in model.ps)
        if step + 1 in (HALF, STEPS):
            error = None
            if error_feedback:
                pieces = bucket.flat.views(bucket.powersgd.error)
                error = _flat(pieces[position[id(p)]] for p in model.ps)
            out[step + 1] = (applied.clone(), error)
        engine.step()
    return out


def _both(rank, world, device) -> dict:
    return {ef: _run(rank, device, ef) for ef in (True, False)}


@pytest.mark.parametrize("world", [2, 4])
def test_error_feedback_keeps_what_was_not_sent_bounded(world):
    results = run_ranks(_both, world)
    exact = {t: sum(_flat(_drifting(r, s, "cpu")) for s in range(t) for r in range(world)) / world
             for t in (HALF, STEPS)}
    left_out = {}
    for ef in (True, False):
        applied = {t: results[0][ef][t][0] for t in (HALF, STEPS)}
        assert all(torch.equal(applied[t], r[ef][t][0]) for r in results for t in applied)  # one result everywhere
        left_out[ef] = {t: exact[t] - applied[t] for t in (HALF, STEPS)}
    scale = sum(_flat(_drifting(r, s, "cpu")).norm() for s in range(STEPS) for r in range(world)) / world
    for t in (HALF, STEPS):
        mean_error = sum(r[True][t][1] for r in results) / world
        assert (left_out[True][t] - mean_error).norm() <= 1e-5 * scale, t
    grows = {ef: (left_out[ef][STEPS].norm() / left_out[ef][HALF].norm()).item() for ef in (True, False)}
    assert grows[True] < 1.25 and grows[False] > 1.5, grows
