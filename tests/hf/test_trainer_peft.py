"""`zeroshard.hf.Trainer` with a PEFT LoRA model, its learning rate and its windows.

A tiny Llama (tests/hf/models.py) with LoRA on q_proj and v_proj, trained by
the Trainer's own AdamW and linear schedule with warm-up (no config blocks),
accumulation 2, clipping. At stage 3 every parameter is sharded (persistence
threshold 0), the frozen base included, so it is gathered and released as
the steps go. The reference is transformers' own `Trainer` on
the same ranks, seed and data: one process, and DDP on 2 ranks. Each logged
loss agrees within 2e-5 relative at stages 2 and 3, and the logged
`learning_rate` sequence is the reference's, value for value: the rate each
step used. The checkpoint at step 3 holds the adapters' state only (the
frozen base is left out, as transformers asks of DeepSpeed for PEFT models),
and `resume_from_checkpoint` on it continues the same losses.

An epoch whose batches per rank are not a multiple of the accumulation is
refused before the first step, naming the counts and the settings that
avoid it; the settings it names train.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.hf.models import VOCAB, config_of
from tests.hf.test_trainer import _close, _torchrun_env

LENGTH, SAMPLES, STEPS = 16, 48, 6


def _lora():
    import peft
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config_of("llama"))
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                      target_modules=["q_proj", "v_proj"]))


def _dataset(samples: int = SAMPLES) -> list[dict]:
    ids = torch.randint(VOCAB, (samples, LENGTH), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def _arguments(cls, out: Path, device, **kw):
    settings = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    max_grad_norm=0.5, learning_rate=1e-2, warmup_steps=2, lr_scheduler_type="linear",
                    max_steps=STEPS, save_steps=3, logging_steps=1, seed=7, report_to=[],
                    use_cpu=device.type == "cpu", disable_tqdm=True)
    return cls(**{**settings, **kw})


def _logged(trainer, key: str) -> list[tuple[int, float]]:
    return [(entry["step"], entry[key]) for entry in trainer.state.log_history if key in entry and "loss" in entry]


def _reference(rank, world, device, out: Path) -> dict:
    import transformers as tf

    _torchrun_env(rank, world)
    trainer = tf.Trainer(model=_lora(), args=_arguments(tf.TrainingArguments, out, device), train_dataset=_dataset())
    trainer.train()
    return {"loss": _logged(trainer, "loss"), "lr": _logged(trainer, "learning_rate")}


def _zeroshard(rank, world, device, out: Path, stage: int, resume: bool = False, **kw):
    from zeroshard.hf import Trainer, TrainingArguments

    _torchrun_env(rank, world)
    dataset = kw.pop("dataset", None) or _dataset()
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    ds_config = {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto",
                 "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
    args = _arguments(TrainingArguments, out, device, deepspeed=ds_config, **kw)
    trainer = Trainer(model=_lora(), args=args, train_dataset=dataset)
    trainer.train(resume_from_checkpoint=resume or None)
    return trainer


def _runs(rank, world, device, out: Path) -> dict:
    result = {"reference": _reference(rank, world, device, out / "reference")}
    for stage in (2, 3):
        trainer = _zeroshard(rank, world, device, out / f"s{stage}", stage)
        result[stage] = {"loss": _logged(trainer, "loss"), "lr": _logged(trainer, "learning_rate")}
    if rank == 0:  # a run directory holding only the stage-3 run's checkpoint-3
        shutil.copytree(out / "s3" / "checkpoint-3", out / "resumed" / "checkpoint-3")
    torch.distributed.barrier()
    resumed = _zeroshard(rank, world, device, out / "resumed", 3, resume=True)
    result["resumed"] = [(s, loss) for s, loss in _logged(resumed, "loss") if s > 3]
    return result


@pytest.fixture(scope="module", params=[1, 2])
def runs(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"peft{request.param}")
    return out, request.param, run_ranks(_runs, request.param, out)[0]


@pytest.mark.parametrize("stage", [2, 3])
def test_peft_lora_losses_equal_transformers_trainer(runs, stage):
    _, _, results = runs
    assert len(results["reference"]["loss"]) == STEPS
    _close(results[stage]["loss"], results["reference"]["loss"], 2e-5)


@pytest.mark.parametrize("stage", [2, 3])
def test_logged_learning_rate_is_the_one_each_step_used(runs, stage):
    _, _, results = runs
    want = results["reference"]["lr"]
    # By hand: linear warm-up over 2 steps (step i at lr x i / 2), then linear to 0 at step 6 (lr x (6 - i) / 4).
    assert [lr for _, lr in want] == [0.0, 1e-2 / 2, 1e-2, 1e-2 * 3 / 4, 1e-2 / 2, 1e-2 / 4]
    assert results[stage]["lr"] == want


def test_peft_checkpoint_holds_the_adapters_only_and_resumes(runs):
    out, _, results = runs
    manifest = json.loads((out / "s3" / "checkpoint-3" / "global_step3" / "manifest.json").read_text())
    trained = [n for n, p in manifest["params"].items() if p["group"] is not None]
    assert trained and all("lora_" in n for n in trained)
    assert sorted(manifest["frozen_excluded"]) == sorted(n for n in manifest["params"] if n not in trained)
    _close(results["resumed"], results[3]["loss"][3:], 2e-5)


def _short_window(rank, world, device, out: Path) -> dict:
    """48 samples, 2 a batch per rank, accumulation 5: 24 / world batches, not a multiple of 5."""
    from zeroshard.deepspeed.unsupported import UnsupportedError

    with pytest.raises(UnsupportedError) as refused:
        _zeroshard(rank, world, device, out / "short", 2, gradient_accumulation_steps=5, max_steps=-1)
    assert not list((out / "short").glob("checkpoint-*"))  # refused before a step, not at the epoch's end
    advised = {}
    for name, kw in {"max_steps": {"max_steps": 24 // world // 5},
                     "accumulation": {"gradient_accumulation_steps": 6, "max_steps": -1},
                     "dataset": {"dataset": _dataset(40), "max_steps": -1}}.items():
        trainer = _zeroshard(rank, world, device, out / name, 2, **{"gradient_accumulation_steps": 5, **kw})
        advised[name] = trainer.state.global_step
    return {"message": str(refused.value), "advised": advised}


@pytest.mark.parametrize("world", [1, 2])
def test_a_short_last_window_is_refused_before_training_with_advice_that_works(tmp_path, world):
    result = run_ranks(_short_window, world, tmp_path)[0]
    batches = 24 // world
    message = result["message"]
    assert message.startswith(f"each epoch has {batches} batches per rank, which is not a multiple of "
                              f"gradient_accumulation_steps (5): its last window would hold {batches % 5}")
    per_epoch = -(-batches // 5)  # transformers counts the short window as a step
    assert f"this run of {3 * per_epoch} optimizer steps ({per_epoch} an epoch) would reach it" in message
    assert f"max_steps={batches // 5} or fewer" in message and "Nothing was trained" in message
    assert f"gradient_accumulation_steps=6 (it must divide {batches})" in message
    assert "a training set of 40 samples instead of 48" in message
    assert f"x world size = 2 x 5 x {world}" in message
    epochs = 3  # TrainingArguments' default num_train_epochs
    assert result["advised"] == {"max_steps": batches // 5, "accumulation": epochs * batches // 6,
                                 "dataset": epochs * (40 // (2 * 5 * world))}
