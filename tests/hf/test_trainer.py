"""`zeroshard.hf.Trainer` on 2 ranks against transformers' own `Trainer` with DDP (issue 28, acceptance 1).

A tiny GPT-2 built from its config (no dropout, so both trainers see the
same function), transformers' ds_config_zero2.json and ds_config_zero3.json
as they are (offload blocks included), accumulation 2, clipping, max_steps,
save_steps. The reference is transformers' `Trainer` on the same ranks, seed
and data with DDP: the same samplers, so the same global batches. The
config's WarmupLR is DeepSpeed's schedule (log warm-up over the
`max(1, warmup_steps)` steps transformers fills, which DeepSpeed raises to 2),
given to the reference as a LambdaLR (the first two steps at lr 0). Each logged loss must agree: fp32
within 2e-5 relative, bf16 within 1%.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks

DATA = Path(__file__).parent.parent / "config" / "data"
VOCAB, LENGTH, SAMPLES = 96, 16, 64
LR = 1e-2


def _gpt2():
    import transformers as tf

    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=LENGTH,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return tf.GPT2LMHeadModel(config)


def _dataset() -> list[dict]:
    ids = torch.randint(VOCAB, (SAMPLES, LENGTH), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def _torchrun_env(rank: int, world: int) -> None:
    """What torchrun sets, which accelerate reads (the group itself is the test's, already formed)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", OMP_NUM_THREADS="1")


def _arguments(cls, out: Path, device, **kw):
    settings = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    max_grad_norm=0.5, learning_rate=LR, max_steps=6, save_steps=3, logging_steps=1, seed=7,
                    report_to=[], use_cpu=device.type == "cpu", disable_tqdm=True)
    return cls(**{**settings, **kw})


def _losses(trainer) -> list[tuple[int, float]]:
    return [(entry["step"], entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]


def _deepspeed_warmup_lr(step: int) -> float:
    """DeepSpeed's WarmupLR for warmup_num_steps 1 (raised to 2), log warm-up, as a factor of the lr at optimizer
    step `step` (from 0): the first step runs at warmup_min_lr (0), step i >= 1 at log(i) / log(2), at most 1."""
    return min(1.0, math.log(max(step, 1)) / math.log(2))


def _reference(rank, world, device, out: Path, bf16: bool) -> list:
    import transformers as tf

    _torchrun_env(rank, world)
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _deepspeed_warmup_lr)
    args = _arguments(tf.TrainingArguments, out, device, bf16=bf16)
    trainer = tf.Trainer(model=model, args=args, train_dataset=_dataset(), optimizers=(opt, sched))
    trainer.train()
    return _losses(trainer)


def _zeroshard(rank, world, device, out: Path, config: str, bf16: bool, resume: bool = False, **kw):
    """The trainer and its logged losses; resumed, only the steps this call trained (the others come from the
    checkpoint's trainer_state.json), and they must be the steps after the checkpoint's."""
    import transformers as tf

    from zeroshard.hf import Trainer, TrainingArguments

    class Trained(tf.TrainerCallback):
        steps: list[int] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    _torchrun_env(rank, world)
    args = _arguments(TrainingArguments, out, device, bf16=bf16, deepspeed=str(DATA / config), **kw)
    trainer = Trainer(model=_gpt2(), args=args, train_dataset=_dataset(), callbacks=[Trained()])
    trainer.train(resume_from_checkpoint=resume or None)
    losses = [(step, loss) for step, loss in _losses(trainer) if step in Trained.steps]
    assert [step for step, _ in losses] == Trained.steps, (losses, Trained.steps)
    return trainer, losses


def _parity_on_2_ranks(rank, world, device, out: Path) -> dict:
    result = {"ddp": _reference(rank, world, device, out / "ddp", bf16=False),
              "ddp_bf16": _reference(rank, world, device, out / "ddp_bf16", bf16=True)}
    for config in ("ds_config_zero2.json", "ds_config_zero3.json"):
        trainer, result[config] = _zeroshard(rank, world, device, out / config, config, bf16=False)
        if "zero3" in config:
            _copy_checkpoint(rank, out / config / "checkpoint-3", out / "resumed")
            _, result["resumed"] = _zeroshard(rank, world, device, out / "resumed", config, bf16=False, resume=True)
            result.update(_saved_and_evaluated(trainer, out / "saved", device))
    trainer, result["bf16"] = _zeroshard(rank, world, device, out / "bf16", "ds_config_zero3.json", bf16=True)
    result["bf16_enabled"] = trainer.engine.bfloat16_enabled()  # --bf16 adds the block the file lacks
    return result


def _copy_checkpoint(rank, checkpoint: Path, run: Path) -> None:
    """`run` holds only `checkpoint`: `resume_from_checkpoint=True` there resumes from it."""
    if rank == 0:
        shutil.copytree(checkpoint, run / checkpoint.name)
    torch.distributed.barrier()


def _saved_and_evaluated(trainer, where: Path, device) -> dict:
    trainer.save_model(str(where))
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]], device=device)
    engine = trainer.engine
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=ids).logits.cpu()
    metrics = trainer.evaluate(eval_dataset=_dataset()[:8])
    generated = trainer.model.generate(ids, max_new_tokens=4, do_sample=False).cpu()
    return {"logits": logits, "eval_loss": metrics["eval_loss"], "generated": generated,
            "stage": engine.zero_optimization_stage()}


def _resume_on_4_ranks(rank, world, device, out: Path) -> list:
    """The 2-rank zero3 run's checkpoint-3, resumed on 4 ranks with half the micro-batch: the same global batches."""
    _copy_checkpoint(rank, out / "ds_config_zero3.json" / "checkpoint-3", out / "resumed_on_4")
    _, losses = _zeroshard(rank, world, device, out / "resumed_on_4", "ds_config_zero3.json", bf16=False,
                           resume=True, per_device_train_batch_size=1)
    return losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer")
    return out, run_ranks(_parity_on_2_ranks, 2, out)


def _close(got, want, rel):
    assert [s for s, _ in got] == [s for s, _ in want], (got, want)
    for (step, a), (_, b) in zip(got, want):
        assert abs(a - b) <= rel * abs(b), (step, a, b, got, want)


@pytest.mark.parametrize("config", ["ds_config_zero2.json", "ds_config_zero3.json"])
def test_losses_equal_transformers_trainer_with_ddp(runs, config):
    _, results = runs
    assert len(results[0]["ddp"]) == 6
    _close(results[0][config], results[0]["ddp"], 2e-5)


def test_bf16_losses_within_one_percent(runs):
    _, results = runs
    assert results[0]["bf16_enabled"]
    _close(results[0]["bf16"], results[0]["ddp_bf16"], 1e-2)
    assert results[0]["bf16"] != results[0]["ds_config_zero3.json"]  # bf16 computes otherwise than fp32


def test_resume_continues_the_same_losses_on_2_and_4_ranks(runs):
    out, results = runs
    want = results[0]["ds_config_zero3.json"]
    _close(results[0]["resumed"], want[3:], 2e-5)
    _close(run_ranks(_resume_on_4_ranks, 4, out)[0], want[3:], 2e-5)


def test_saved_model_loads_with_from_pretrained_and_gives_the_engine_logits(runs):
    import transformers as tf

    out, results = runs
    assert results[0]["stage"] == 3
    model = tf.AutoModelForCausalLM.from_pretrained(out / "saved").eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])).logits
    torch.testing.assert_close(logits, results[0]["logits"], rtol=1e-5, atol=1e-5)
    assert math.isfinite(results[0]["eval_loss"]) and results[0]["eval_loss"] == results[1]["eval_loss"]
    assert torch.equal(results[0]["generated"], model.generate(torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]),
                                                               max_new_tokens=4, do_sample=False))
    assert json.loads((out / "saved" / "config.json").read_text())["model_type"] == "gpt2"
