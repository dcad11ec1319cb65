"""`zeroshard estimate --optimizer`: each stage's optimizer bytes per rank equal what the engine holds.

The reference is an engine of the same preset with the demo's settings (the
ones `--model tiny` plans with), the same mix of optimizers over the same
param groups (`mix_groups`), after one step: `memory_stats()["optimizer"]`
on every rank, against the JSON's per-rank list, min and max.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed import run_ranks
from tests.optim.whole import Lamb
from zeroshard.app.cli import main
from zeroshard.app.estimate.model_count import DEMO_BUCKET_SIZE, DEMO_PERSISTENCE_THRESHOLD, DEMO_WRAP
from zeroshard.app.estimate.optimizer_mix import mix_groups
from zeroshard.app.models import PRESETS, GPT

_MAKE = {"muon": lambda ps: torch.optim.Muon(ps, lr=0.02), "adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-4),
         "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2), "lamb": lambda ps: Lamb(ps, lr=1e-2)}


def _engine_bytes(rank, world, device, preset, kind):
    """memory_stats()["optimizer"] of this rank after one step, at stages 1, 2 and 3."""
    import zeroshard

    held = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = GPT(PRESETS[preset])
        optimizers = [_MAKE[name](params) for name, params in mix_groups(kind, model)]
        config = {"train_micro_batch_size_per_gpu": 1,
                  "zero_optimization": {"stage": stage, "reduce_bucket_size": DEMO_BUCKET_SIZE,
                                        "allgather_bucket_size": DEMO_BUCKET_SIZE,
                                        "stage3_wrap_classes": list(DEMO_WRAP),
                                        "stage3_param_persistence_threshold": DEMO_PERSISTENCE_THRESHOLD}}
        engine = zeroshard.initialize(model, optimizers if len(optimizers) > 1 else optimizers[0], config)
        tokens = torch.randint(PRESETS[preset].vocab_size, (1, 9), generator=torch.Generator().manual_seed(rank))
        engine.backward(engine(tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
        engine.step()
        held[str(stage)] = engine.memory_stats()["optimizer"]
    return held


def _estimate(capsys, preset, world, kind) -> dict:
    assert main(["estimate", "--model", preset, "--gpus", str(world), "--optimizer", kind, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["optimizer_mix"]


@pytest.mark.parametrize(("preset", "world", "kind"), [("tiny", 2, "muon"), ("tiny", 4, "muon"),
                                                       ("demo", 4, "muon"), ("tiny", 4, "adafactor"),
                                                       ("tiny", 2, "lamb"), ("tiny", 2, "adamw")])
def test_bytes_per_rank_equal_the_engine(capsys, preset, world, kind):
    estimated = _estimate(capsys, preset, world, kind)
    measured = run_ranks(_engine_bytes, world, preset, kind)
    for stage, row in estimated["by_stage"].items():
        per_rank = [held[stage] for held in measured]
        assert row["per_rank"] == per_rank, stage
        assert (row["min"], row["max"], row["imbalance"]) == (min(per_rank), max(per_rank),
                                                             max(per_rank) - min(per_rank))
    if kind == "adamw":  # element-wise: nothing owned, nothing padded
        assert estimated["largest_owned"] is None
        assert all(row["padding_elements"] == 0 for row in estimated["by_stage"].values())


def test_cli_prints_the_table(capsys):
    assert main(["estimate", "--model", "tiny", "--gpus", "2", "--optimizer", "muon"]) == 0
    out = capsys.readouterr().out
    assert "optimizer state per rank, --optimizer muon" in out
    assert "min/rank" in out and "imbalance" in out and "padding" in out
    assert "largest tensor owned whole: blocks.0.mlp.0.weight (128, 32)" in out


def test_optimizer_needs_a_model(capsys):
    with pytest.raises(SystemExit):
        main(["estimate", "--params", "7B", "--gpus", "2", "--optimizer", "muon"])
    assert "--optimizer needs --model" in capsys.readouterr().err
