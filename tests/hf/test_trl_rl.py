"""DPO, GRPO and distillation from `zeroshard.hf.trl` at stage 3 against TRL on DDP; a trainer of the test's own.

As tests/hf/test_trl.py: the same script with TRL's imports (DDP) and with
zeroshard's, 2 ranks, fp32, accumulation 2, clipping. DPO's reference model
(GPT-2) and GRPO's (Llama, beta 0.04) are sharded at stage 3: engines of
their own holding no weight whole on any rank. GRPO generates its rollouts
in the process, every rank taking part, with a reward of the test's own:
the same completions (the same rewards, logged) and losses within 2e-5.
DistillationTrainer at stage 3 shards the student and keeps the teacher
whole (TRL reads the teacher's head after its forward), loss for loss.
A `transformers.Trainer` subclass of the test's own (its `compute_loss`
adds an L2 term) trains through `on_zeroshard` as under DDP.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.hf import trl_setup as setup
from tests.hf.test_trainer import _close, _torchrun_env
from tests.hf.test_trl import REL, _arguments, _classes, _logged


def _dpo(out: Path, stage: int | None) -> dict:
    trainer_class, config_class = _classes("DPO", stage is not None)
    tok = setup.tokenizer()
    policy, reference = setup.model("gpt2", tok), setup.model("gpt2", tok)
    trainer = trainer_class(model=policy, ref_model=reference, args=_arguments(config_class, out, stage, max_length=16),
                            train_dataset=setup.preference_dataset(32), processing_class=tok)
    trainer.train()
    return {"loss": _logged(trainer, "loss"), "reference": type(trainer.ref_model).__name__,
            "reference_whole": sum(p.numel() for p in reference.parameters())}


def _grpo(rank, out: Path, stage: int | None) -> dict:
    trainer_class, config_class = _classes("GRPO", stage is not None)
    tok, base = setup.tokenizer(), out.parent / "base"
    if rank == 0 and not base.exists():  # GRPO builds its reference from the policy's path
        setup.model("llama", tok).save_pretrained(base)
        tok.save_pretrained(base)
    torch.distributed.barrier()
    args = _arguments(config_class, out, stage, per_device_train_batch_size=4, max_steps=3, num_generations=4,
                      max_completion_length=6, beta=0.04)
    trainer = trainer_class(model=str(base), reward_funcs=setup.colour_reward, args=args,
                            train_dataset=setup.prompt_dataset(32), processing_class=tok)
    trainer.train()
    reference = trainer.ref_model.module if stage is not None else trainer.ref_model
    return {"loss": _logged(trainer, "loss"), "reward": _logged(trainer, "reward"),
            "reference": type(trainer.ref_model).__name__,
            "reference_whole": sum(p.numel() for p in reference.parameters())}


def _distillation(out: Path, stage: int | None) -> dict:
    trainer_class, config_class = _classes("Distillation", stage is not None)
    tok = setup.tokenizer()
    teacher = setup.model("llama", tok, seed=1)  # another model: a divergence that is not zero
    trainer = trainer_class(model=setup.model("llama", tok), teacher_model=teacher, processing_class=tok,
                            args=_arguments(config_class, out, stage, max_completion_length=6),
                            train_dataset=setup.completion_dataset(32))
    trainer.train()
    return {"loss": _logged(trainer, "loss"), "teacher_whole": sum(p.numel() for p in teacher.parameters()),
            "student_whole": sum(p.numel() for p in trainer.model.parameters())}


def _runs(rank, world, device, out: Path) -> dict:
    _torchrun_env(rank, world)
    runs = {}
    for stage in (None, 3):
        runs["dpo", stage] = _dpo(out / f"dpo-{stage}", stage)
        runs["grpo", stage] = _grpo(rank, out / f"grpo-{stage}", stage)
        runs["distillation", stage] = _distillation(out / f"distillation-{stage}", stage)
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_runs, 2, tmp_path_factory.mktemp("rl"))[0]


@pytest.mark.parametrize("name", ["dpo", "grpo"])
def test_losses_equal_trl_on_ddp_with_the_reference_model_sharded(runs, name):
    want, got = runs[name, None], runs[name, 3]
    assert len(want["loss"]) >= 3
    _close(got["loss"], want["loss"], REL)
    assert want["reference_whole"] > 0 and got["reference"] == "DeepSpeedEngine" and got["reference_whole"] == 0


def test_distillation_losses_equal_trl_on_ddp_with_the_student_sharded_and_the_teacher_whole(runs):
    want, got = runs["distillation", None], runs["distillation", 3]
    assert len(want["loss"]) == 4 and all(loss > 0 for _, loss in want["loss"])
    _close(got["loss"], want["loss"], REL)
    assert got["student_whole"] == 0 and got["teacher_whole"] == want["teacher_whole"] > 0


def test_grpo_generates_the_same_completions(runs):
    want, got = runs["grpo", None]["reward"], runs["grpo", 3]["reward"]
    assert any(r for _, r in want)  # the reward is not zero throughout: completions differ between runs if unequal
    assert got == want


def _own_trainer(rank, world, device, out: Path, on_zeroshard: bool) -> list:
    import transformers as tf

    from zeroshard.hf import TrainingArguments, on_zeroshard as adapt

    class L2Trainer(tf.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            weights = [p for p in model.parameters() if p.requires_grad]
            return loss + 1e-3 * sum((w * w).sum() for w in weights)

    _torchrun_env(rank, world)
    tok = setup.tokenizer()
    ids = torch.randint(len(setup.WORDS), (32, 12), generator=torch.Generator().manual_seed(4))
    data = [{"input_ids": row, "labels": row} for row in ids]
    cls, args_cls = (adapt(L2Trainer), TrainingArguments) if on_zeroshard else (L2Trainer, tf.TrainingArguments)
    args = _arguments(args_cls, out, 2 if on_zeroshard else None)
    trainer = cls(model=setup.model("llama", tok), args=args, train_dataset=data)
    trainer.train()
    return _logged(trainer, "loss")


def test_a_trainer_subclass_of_ones_own_trains_through_on_zeroshard(tmp_path):
    want = run_ranks(_own_trainer, 2, tmp_path / "ddp", False)[0]
    got = run_ranks(_own_trainer, 2, tmp_path / "zeroshard", True)[0]
    assert len(want) == 4
    _close(got, want, REL)


def _vllm_at_stage_3(rank, world, device, out: Path) -> str:
    from zeroshard.deepspeed.unsupported import UnsupportedError

    _torchrun_env(rank, world)
    trainer_class, config_class = _classes("GRPO", True)
    args = _arguments(config_class, out, 3, use_vllm=True, num_generations=4, per_device_train_batch_size=4)
    tok = setup.tokenizer()
    with pytest.raises(UnsupportedError) as refused:
        trainer_class(model=setup.model("llama", tok), reward_funcs=setup.colour_reward, args=args,
                      train_dataset=setup.prompt_dataset(8), processing_class=tok)
    return str(refused.value)


def test_vllm_weight_sync_at_stage_3_is_refused_on_every_rank_naming_the_routes(tmp_path):
    for message in run_ranks(_vllm_at_stage_3, 2, tmp_path):
        assert message.startswith("GRPOConfig(use_vllm=True) at ZeRO stage 3 is not supported")
        assert "empty shards" in message and "use_vllm=False" in message and "iter_full_parameters" in message
