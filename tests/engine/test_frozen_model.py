"""A model that trains nothing (a DPO reference, a teacher): `initialize` without an optimizer, sharded at stage 3.

The reference is the same model run in one process: every stage's forward
equals it exactly. No rank holds optimizer state, master weights or
gradients; at stage 3 with one unit each of 2 ranks holds ceil(n / 2) of the
n frozen elements (the flat buffer padded to a multiple of the ranks), and
none whole. A backward through it is the clear error a loss that takes no
gradient gets.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.distributed import run_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5)).requires_grad_(False)


def _run(rank, world, device, stage: int) -> dict:
    import zeroshard
    from zeroshard.errors import ZeroshardError

    model = _model().to(device)
    engine = zeroshard.initialize(model, config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
        "stage": stage, "stage3_param_persistence_threshold": 0}})
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank)).to(device)
    with torch.no_grad():
        out = engine(x).cpu()
    try:
        engine.backward(engine(x).sum())
        refused = None
    except ZeroshardError as exc:
        refused = str(exc)
    return {"x": x.cpu(), "out": out, "memory": engine.memory_stats(), "refused": refused,
            "optimizer": type(engine.optimizer).__name__, "whole": sum(p.numel() for p in model.parameters())}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_frozen_model_runs_forward_as_one_process_holding_no_training_state(stage):
    reference = _model()
    n = sum(p.numel() for p in reference.parameters())
    for r in run_ranks(_run, 2, stage):
        assert torch.equal(r["out"], reference(r["x"]))
        memory = r["memory"]
        assert memory["optimizer"] == memory["master"] == memory["grads"] == 0
        assert r["optimizer"] == "FrozenModelOptimizer"
        assert memory["params"] == (-(-n // 2) * 4 if stage == 3 else n * 4)
        assert r["whole"] == (0 if stage == 3 else n)
        assert "requires grad" in r["refused"]
