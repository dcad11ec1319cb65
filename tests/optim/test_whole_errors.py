"""Misuse of several optimizers is a clear error on every rank: ranks whose lists differ, an empty list, the
Muon block given param-group settings, a scheduler built on one optimizer of the list."""

import torch

from tests.distributed import run_ranks
from tests.optim import whole


def _attempt(fn):
    try:
        fn()
    except Exception as exc:  # the message is what the tests check
        return f"{type(exc).__name__}: {exc}"
    return None


def _lists_differ(rank, world, device):
    import zeroshard

    model = whole.make_model()
    muon, adamw = whole.make_optimizers("muon", model)
    if rank == 1:
        muon.param_groups[0]["lr"] = 0.5
    return _attempt(lambda: zeroshard.initialize(model, [muon, adamw], {"train_micro_batch_size_per_gpu": 1}))


def test_ranks_whose_optimizers_differ_stop_together():
    errors = run_ranks(_lists_differ, 2)
    assert all(e is not None and "RankMismatchError" in e and "param group 0 has other lr" in e for e in errors), errors


def _misuse(rank, world, device):
    import zeroshard

    model = whole.make_model()
    muon, adamw = whole.make_optimizers("muon", model)
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2]},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    return {
        "empty": _attempt(lambda: zeroshard.initialize(whole.make_model(), [], {})),
        "block_groups": _attempt(lambda: zeroshard.initialize(
            model, None, {"optimizer": {"type": "Muon"}}, model_parameters=groups)),
        "member_scheduler": _attempt(lambda: zeroshard.initialize(
            model, [muon, adamw], {}, lr_scheduler=torch.optim.lr_scheduler.StepLR(muon, 1))),
    }


def test_misuse_names_the_cause_and_the_fix():
    (errors,) = run_ranks(_misuse, 1)
    assert "OptimizerError" in errors["empty"] and "not an empty list" in errors["empty"]
    assert "ConfigError" in errors["block_groups"] and "(weight_decay) have nowhere to go" in errors["block_groups"]
    assert "built on one optimizer of the list" in errors["member_scheduler"]
    assert "lr_scheduler=lambda opt:" in errors["member_scheduler"]
