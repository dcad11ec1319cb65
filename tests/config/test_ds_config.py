"""DeepSpeed config compatibility: "auto", batch sizes, optimizer/scheduler blocks, strict, config check.

Schedules are checked against DeepSpeed's formulas written out here
(deepspeed/runtime/lr_schedules.py, docs "Scheduler Parameters"); optimizers
against the torch optimizer built by hand. DeepSpeed is not a dependency.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from zeroshard.config import Config, ConfigError, ConfigFacts
from zeroshard.config.blocks import build_optimizer, build_scheduler


def error_of(source, facts=None) -> str:
    with pytest.raises(ConfigError) as info:
        Config.load(source, facts)
    return str(info.value)


def problems(*lines: str) -> str:
    return "invalid zeroshard config (dict):\n" + "\n".join(f"  - {line}" for line in lines)


# ---- "auto" ----

def test_auto_values_without_facts_are_errors_and_sizes_take_defaults():
    raw = {
        "gradient_accumulation_steps": "auto", "train_micro_batch_size_per_gpu": 2, "train_batch_size": "auto",
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "allgather_bucket_size": "auto"},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": 10}},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    config, report = Config.load_with_report(raw, ConfigFacts(world_size=4))
    d = config.to_dict()
    assert (d["train_batch_size"], d["gradient_accumulation_steps"]) == (8, 1)
    assert d["zero_optimization"]["reduce_bucket_size"] == 25_000_000
    assert d["scheduler"]["params"]["warmup_max_lr"] is None  # the optimizer's lr
    assert [key for key, _, _ in report.resolved] == [
        "zero_optimization.reduce_bucket_size", "zero_optimization.allgather_bucket_size",
        "scheduler.params.warmup_max_lr", "train_batch_size", "gradient_accumulation_steps"]
    assert report.resolved[0][2] == "zeroshard's default (the model has no config.hidden_size)"
    assert error_of({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}) == problems(
        'optimizer.params.lr is "auto", which zeroshard cannot work out here; put a value (Hugging Face\'s '
        "Trainer fills it from its arguments), or pass the optimizer in code to zeroshard.initialize, which "
        'fills every optimizer.params "auto"')


def test_auto_total_num_steps_is_rejected():
    assert error_of({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}}) == problems(
        'scheduler.params.total_num_steps is "auto", which zeroshard cannot work out here; put the number '
        "of optimizer steps of the run (Hugging Face's Trainer computes it from epochs and data, which "
        "zeroshard.initialize does not see), or pass lr_scheduler= to zeroshard.initialize",
        "scheduler.params.total_num_steps is required for WarmupDecayLR")


def test_auto_without_a_rule_is_rejected():
    assert error_of({"zero_optimization": {"stage": "auto"}}) == problems(
        'zero_optimization.stage is "auto", which zeroshard cannot work out here; put a value (the keys '
        'with an "auto" rule are listed in docs/deepspeed-config.md)')


# ---- train_batch_size = micro x accumulation x world ----

@pytest.mark.parametrize("given, world, expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_batch_size": 32}, 8, (32, 4, 1)),
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 2, (30, 3, 5)),
    ({"train_micro_batch_size_per_gpu": 3}, 2, (6, 3, 1)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 4}, 2,
     (24, 3, 4)),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2}, 3, (6, 2, 1)),
])
def test_batch_sizes_derived_as_deepspeed_does(given, world, expected):
    c = Config.load(given, ConfigFacts(world_size=world))
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == expected


def test_batch_size_mismatch_names_all_three_numbers():
    assert error_of({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                     "gradient_accumulation_steps": 4}, ConfigFacts(world_size=4)) == problems(
        "train_batch_size 16 is not train_micro_batch_size_per_gpu 2 x gradient_accumulation_steps 4 x "
        'world size 4 (= 32); change one of them, or leave one of the three out (or "auto") to have it derived')


def test_batch_size_that_does_not_divide_says_so():
    """The key left out was already to be derived: the advice is the divisibility, not to leave a key out."""
    assert error_of({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
                    ConfigFacts(world_size=2)) == problems(
        "train_batch_size 10 is not divisible by train_micro_batch_size_per_gpu 4 x world size 2 (= 8), so "
        "gradient_accumulation_steps cannot be derived from it; make train_batch_size a multiple of 8, or give "
        "gradient_accumulation_steps and change the others to agree")
    assert error_of({"train_batch_size": 12, "gradient_accumulation_steps": 4}, ConfigFacts(world_size=2)) == \
        problems("train_batch_size 12 is not divisible by gradient_accumulation_steps 4 x world size 2 (= 8), so "
                 "train_micro_batch_size_per_gpu cannot be derived from it; make train_batch_size a multiple of 8, "
                 "or give train_micro_batch_size_per_gpu and change the others to agree")


def test_train_batch_size_without_world_size():
    assert error_of({"train_batch_size": 16, "gradient_accumulation_steps": 2}) == problems(
        "train_batch_size needs the world size to derive train_micro_batch_size_per_gpu; let "
        "zeroshard.initialize load the config, or give `zeroshard config check --world-size N`")


def test_loaded_config_is_checked_again_against_the_world_size():
    config = Config.load({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                          "gradient_accumulation_steps": 4})  # world size unknown: not checked yet
    assert Config.load(config, ConfigFacts(world_size=2)) == config
    assert error_of(config, ConfigFacts(world_size=4)).startswith(
        "invalid zeroshard config (Config):\n  - train_batch_size 16 is not")


# ---- optimizer block ----

@pytest.mark.parametrize("block, line", [
    (7, 'optimizer must be a JSON object such as {"type": "AdamW", "params": {"lr": 0.001}}; got 7'),
    ({"params": {}}, "optimizer.type is required: one of Adam, AdamW, SGD, Muon"),
    ({"type": "Lamb"}, 'optimizer.type "Lamb" is not supported by zeroshard; use one of Adam, AdamW, SGD, Muon, '
                       "or pass a torch optimizer to zeroshard.initialize"),
    ({"type": "AdamW", "legacy_fusion": False},
     "unknown key 'optimizer.legacy_fusion'; allowed keys in 'optimizer': params, type"),
    ({"type": "AdamW", "params": [1]}, "optimizer.params must be a JSON object; got [1]"),
    ({"type": "AdamW", "params": {"momentum": 0.9}},
     "unknown key 'optimizer.params.momentum'; parameters of AdamW: adam_w_mode, betas, eps, lr, "
     "torch_adam, weight_decay"),
    ({"type": "SGD", "params": {"momentun": 0.9}},
     "unknown key 'optimizer.params.momentun' (did you mean 'momentum'?); parameters of SGD: dampening, "
     "lr, momentum, nesterov, weight_decay"),
    ({"type": "Adam", "params": {"max_grad_norm": 1.0}},
     "unknown key 'optimizer.params.max_grad_norm' (clipping is the top-level key gradient_clipping); "
     "parameters of Adam: adam_w_mode, betas, eps, lr, torch_adam, weight_decay"),
    ({"type": "Adam", "params": {"lr": -1}}, "optimizer.params.lr must be a finite number >= 0; got -1"),
    ({"type": "Adam", "params": {"betas": [0.9]}},
     "optimizer.params.betas must be two numbers in [0, 1), such as [0.9, 0.999]; got [0.9]"),
    ({"type": "Adam", "params": {"torch_adam": "yes"}},
     'optimizer.params.torch_adam must be true or false (a JSON boolean); got "yes"'),
    ({"type": "AdamW", "params": {"adam_w_mode": False}},
     "optimizer.params.adam_w_mode is false but optimizer.type is AdamW, which always decouples weight "
     "decay; use type Adam for Adam with L2 weight decay"),
    ({"type": "SGD", "params": {"nesterov": True}},
     "optimizer.params.nesterov needs momentum > 0 and dampening 0; got momentum 0.0 and dampening 0.0"),
])
def test_optimizer_block_errors(block, line):
    assert error_of({"optimizer": block}) == problems(line)


def _two_params():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


@pytest.mark.parametrize("block, expected_class, expected", [
    # DeepSpeed: "Adam" with adam_w_mode true (its default) is AdamW.
    ({"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1}}, torch.optim.AdamW,
     {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}),
    ({"type": "adam", "params": {"lr": 0.01, "weight_decay": 0.1, "adam_w_mode": False}}, torch.optim.Adam,
     {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}),
    ({"type": "ADAMW", "params": {"betas": [0.8, 0.9], "eps": 1e-6}}, torch.optim.AdamW,
     {"lr": 1e-3, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.0}),
    # torch_adam builds torch's AdamW from the params as given: torch's weight_decay default.
    ({"type": "AdamW", "params": {"torch_adam": True}}, torch.optim.AdamW,
     {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}),
    ({"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9, "nesterov": True}}, torch.optim.SGD,
     {"lr": 0.5, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.0, "nesterov": True}),
])
def test_optimizer_from_block_equals_torch_built_by_hand(block, expected_class, expected):
    model, reference_model = _two_params(), _two_params()
    built = build_optimizer(Config.load({"optimizer": block}).optimizer, model)
    by_hand = expected_class(reference_model.parameters(), **expected)
    assert type(built) is expected_class
    for key, value in expected.items():
        assert built.param_groups[0][key] == value
    for _ in range(3):  # same updates
        for m, opt in ((model, built), (reference_model, by_hand)):
            opt.zero_grad()
            m(torch.ones(2, 4)).square().sum().backward()
            opt.step()
    for a, b in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(a, b)


# ---- scheduler block: DeepSpeed's formulas, written out independently ----
# DeepSpeed's engine steps the schedule after each optimizer step and the
# schedule starts at iteration -1, so optimizer step k (1-based) uses iteration k - 2.

def ds_warmup(it, n, kind):
    n = max(2, n)
    return math.log(it + 1) / math.log(n) if kind == "log" else it / n


def ds_warmup_lr(it, lo, hi, n, kind):
    if it < 0:
        return lo
    return hi if it >= max(2, n) else lo + (hi - lo) * ds_warmup(it, n, kind)


def ds_warmup_decay_lr(it, lo, hi, n, total, kind):
    if it < max(2, n):
        return ds_warmup_lr(it, lo, hi, n, kind)
    return lo + (hi - lo) * max(0.0, (total - it) / max(1, total - max(2, n)))


def ds_warmup_cosine_lr(it, base, total, min_ratio, n, cos_min, kind):
    if it < 0:
        return 0.0
    if it < max(2, n):
        return base * (min_ratio + (1 - min_ratio) * ds_warmup(it, n, kind))
    progress = min(1.0, (it - max(2, n) + 1) / max(1, total - max(2, n)))
    return base * max(0.0, cos_min + (1 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)


SCHEDULES = [
    ({"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 5}},
     lambda it: ds_warmup_lr(it, 0.01, 0.1, 5, "log")),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}},
     lambda it: ds_warmup_lr(it, 0.0, 0.5, 4, "linear")),  # max = the optimizer's lr
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 1}},  # DeepSpeed warms up over at least 2
     lambda it: ds_warmup_lr(it, 0.0, 0.5, 1, "log")),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_num_steps": 3}},
     lambda it: ds_warmup_decay_lr(it, 0.0, 0.001, 3, 10, "log")),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": 8, "warmup_num_steps": 3, "warmup_min_lr": 0.1,
                                          "warmup_max_lr": 0.3, "warmup_type": "linear"}},
     lambda it: ds_warmup_decay_lr(it, 0.1, 0.3, 3, 8, "linear")),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 3}},
     lambda it: ds_warmup_cosine_lr(it, 0.5, 10, 0.0, 3, 0.0001, "log")),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "warmup_num_steps": 4, "warmup_min_ratio": 0.2,
                                           "cos_min_ratio": 0.1, "warmup_type": "linear"}},
     lambda it: ds_warmup_cosine_lr(it, 0.5, 9, 0.2, 4, 0.1, "linear")),
]


@pytest.mark.parametrize("block, formula", SCHEDULES)
def test_schedule_follows_deepspeed_formulas(block, formula):
    optimizer = torch.optim.SGD(_two_params().parameters(), lr=0.5)
    schedule = build_scheduler(Config.load({"scheduler": block}).scheduler, optimizer)
    for step in range(1, 15):  # the lr optimizer step `step` runs with, then the engine steps the schedule
        assert optimizer.param_groups[0]["lr"] == pytest.approx(formula(step - 2), rel=1e-12, abs=1e-15)
        optimizer.step()
        schedule.step()


@pytest.mark.parametrize("block, line", [
    ({"type": "warmuplr"}, "scheduler.type \"warmuplr\" is not supported by zeroshard (did you mean "
                           "'WarmupLR'? DeepSpeed matches scheduler names exactly); use one of WarmupLR, "
                           "WarmupDecayLR, WarmupCosineLR, or build a torch LR scheduler on "
                           "engine.optimizer and step it yourself"),
    ({"type": "OneCycle"}, 'scheduler.type "OneCycle" is not supported by zeroshard; use one of WarmupLR, '
                           "WarmupDecayLR, WarmupCosineLR, or build a torch LR scheduler on "
                           "engine.optimizer and step it yourself"),
    ({"type": "WarmupCosineLR", "params": {}}, "scheduler.params.total_num_steps is required for WarmupCosineLR"),
    ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}},
     'scheduler.params.warmup_type must be "log" or "linear"; got "cosine"'),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}},
     "scheduler.params.warmup_num_steps must be a positive integer; got 0"),
    ({"type": "WarmupLR", "params": {"last_batch_iteration": 5}},
     "scheduler.params.last_batch_iteration must be -1 (the schedule starts at the beginning); got 5"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 5, "cos_min_ratio": 2}},
     "scheduler.params.cos_min_ratio must be a number in [0, 1]; got 2.0"),
])
def test_scheduler_block_errors(block, line):
    assert error_of({"scheduler": block}) == problems(line)


# ---- strict ----

def test_strict_false_still_rejects_unknown_keys():
    with pytest.raises(ConfigError, match=r"unknown key 'gradient_clippin' \(did you mean 'gradient_clipping'"):
        Config.load({"strict": False, "gradient_clippin": 1.0, "fp16": {}})


def test_strict_must_be_a_boolean():
    assert error_of({"strict": "no"}) == problems('strict must be true or false (a JSON boolean); got "no"')


# ---- zeroshard config check ----

def test_config_check_prints_the_effective_config(tmp_path, capsys):
    from zeroshard.app.cli import main

    path = tmp_path / "ds.json"
    raw = {"train_batch_size": 16, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "adamw", "params": {"lr": "auto"}}}
    path.write_text(json.dumps(raw))
    assert main(["config", "check", str(path), "--world-size", "4"]) == 0
    out, err = capsys.readouterr()
    printed = json.loads(out)
    assert (printed["train_micro_batch_size_per_gpu"], printed["optimizer"]["type"]) == (2, "AdamW")
    assert printed["optimizer"]["params"]["lr"] == "auto (at initialize)"
    assert "    optimizer.params.lr: from the optimizer passed in code (an error if none is passed)" in err
    assert "    train_micro_batch_size_per_gpu = 2  (derived: " in err


def test_config_check_prints_the_error(tmp_path, capsys):
    from zeroshard.app.cli import main

    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 7}}')
    assert main(["config", "check", str(path)]) == 1
    assert capsys.readouterr().err == (
        f"zeroshard config check: invalid zeroshard config (file '{path}'):\n"
        "  - zero_optimization.stage must be one of 0, 1, 2, 3; got 7\n")


def test_config_check_lists_what_strict_false_ignores(tmp_path, capsys):
    from zeroshard.app.cli import main

    path = tmp_path / "ds.json"
    path.write_text('{"strict": false, "amp": {"enabled": true}, "steps_per_print": 100, '
                    '"zero_optimization": {"stage": 1}}')
    assert main(["config", "check", str(path)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["zero_optimization"]["stage"] == 1
    assert err == ("zeroshard config:\n  accepted with no effect in zeroshard:\n    steps_per_print: zeroshard prints "
                   "no periodic progress; log engine.get_lr() and the loss yourself\n"
                   '  ignored because the config says "strict": false:\n    amp: error: Apex AMP is not supported: '
                   'use the "bf16" or "fp16" section\n')


def test_config_reference_is_generated():
    from pathlib import Path

    from zeroshard.config.reference import reference

    committed = (Path(__file__).parents[2] / "docs" / "config-reference.md").read_text(encoding="utf-8")
    assert committed == reference(), "regenerate: python -m zeroshard.config.reference > docs/config-reference.md"


def test_numbers_written_as_strings_read_as_the_numbers_they_spell():
    """DeepSpeed reads its config with pydantic's lax mode: "200000000" is an int there, "0.5" a float. The
    same strings, and whole floats written in exponent form ("5e8"), give the same numbers here."""
    from pydantic import TypeAdapter

    raw = {"train_micro_batch_size_per_gpu": "2", "gradient_clipping": "0.5",
           "zero_optimization": {"stage": 2, "reduce_bucket_size": "200000000", "allgather_bucket_size": "5e8"}}
    config = Config.load(raw)
    zero = config.zero_optimization
    assert zero.reduce_bucket_size == TypeAdapter(int).validate_python("200000000")
    assert zero.allgather_bucket_size == 500_000_000 and type(zero.allgather_bucket_size) is int
    assert config.gradient_clipping == TypeAdapter(float).validate_python("0.5")
    assert config.train_micro_batch_size_per_gpu == 2
    bad = {**raw, "zero_optimization": {"stage": 2, "reduce_bucket_size": "5e8x", "allgather_bucket_size": "2.5"}}
    with pytest.raises(ConfigError) as error:
        Config.load(bad)
    assert 'reduce_bucket_size must be a positive integer; got "5e8x"' in str(error.value)
    assert 'allgather_bucket_size must be a positive integer; got "2.5"' in str(error.value)
