"""ZeroshardStrategy against Lightning's own DDP strategy: the same LightningModule, loss for loss.

On 2 CPU ranks (NCCL on CUDA when there are GPUs), with accumulate_grad_batches 2,
gradient_clip_val 0.5, AdamW and a step-interval StepLR from configure_optimizers,
validation every epoch: at stages 1, 2 and 3, a fit of one epoch, a checkpoint
(`trainer.save_checkpoint`), and a second fit resumed from it with `ckpt_path=`
record the same losses, validation losses and global_step as DDP's uninterrupted
two epochs (2e-5), and predict the same outputs. The stage-3 checkpoint resumed on
1 process with twice the batch trains the same global batches, so its second epoch
equals DDP's too, and a fresh module validated from it with no fit (`trainer.validate(ckpt_path=)`)
gives DDP's validation losses after the first epoch. bf16-mixed is the engine's bf16 (fp32 masters), within bf16's
tolerance of DDP under autocast.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.lightning.lit import fit, lightning_module, loaders, predictions, torchrun_env, trainer

pytest.importorskip("lightning")

REL = 2e-5
BF16_REL = 2e-2
STAGES = (1, 2, 3)
# Every parameter sharded at stage 3 (the default threshold would keep this small model's parameters whole).
CONFIG = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def _zeroshard(stage: int):
    from zeroshard.lightning import ZeroshardStrategy

    return ZeroshardStrategy(stage=stage, config=CONFIG)


def _on_2_ranks(rank, world, device, out) -> dict:
    with torchrun_env(rank, world):
        ddp = fit(device, world, "ddp", out / "ddp", epochs=2)
        result = {"ddp": _summary(ddp)}
        for stage in STAGES:
            first = fit(device, world, _zeroshard(stage), out / f"s{stage}", epochs=1)
            first["trainer"].save_checkpoint(out / f"s{stage}.ckpt")
            resumed = fit(device, world, _zeroshard(stage), out / f"s{stage}", epochs=2,
                          ckpt_path=str(out / f"s{stage}.ckpt"))
            result[stage] = {**_summary(resumed), "first": first["losses"], "first_val": first["val"],
                             "first_step": first["step"]}
        result["validated"] = _validated(device, world, out / "s3.ckpt")
        built = fit(device, world, _zeroshard(3), out / "configured", epochs=1, module=lightning_module(True))
        result["configured"] = {"losses": built["losses"], "built_on": built["module"].built_on}
        result["ddp_bf16"] = fit(device, world, "ddp", out / "ddp_bf16", epochs=1, precision="bf16-mixed")["losses"]
        bf16 = fit(device, world, _zeroshard(3), out / "bf16", epochs=1, precision="bf16-mixed")
        result["bf16"] = bf16["losses"]
        result["bf16_enabled"] = bf16["trainer"].strategy.engine.bfloat16_enabled()
    return result


def _validated(device, world, checkpoint) -> list:
    """A fresh module validated from the stage-3 checkpoint of the first epoch, with no fit before."""
    module = lightning_module()
    trainer(device, world, _zeroshard(3), checkpoint.parent / "validate", 1).validate(
        module, loaders(4)[1], ckpt_path=str(checkpoint))
    return module.val_losses


def _summary(run) -> dict:
    return {"losses": run["losses"], "val": run["val"], "step": run["step"], "predicted": predictions(run),
            "lr": run["trainer"].optimizers[0].param_groups[0]["lr"]}


def _resumed_on_1_process(rank, world, device, out) -> dict:
    """The 2-rank stage-3 checkpoint on 1 process with batch 8: the same global batches as the 2-rank run."""
    with torchrun_env(rank, world):
        run = fit(device, world, _zeroshard(3), out / "one", epochs=2, batch=8, ckpt_path=str(out / "s3.ckpt"))
        return {"losses": run["losses"], "step": run["step"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    return run_ranks(_on_2_ranks, 2, out)[0], run_ranks(_resumed_on_1_process, 1, out)[0]


def _close(got, want, rel):
    assert len(got) == len(want), (got, want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= rel * abs(b), (i, a, b, got, want)


@pytest.mark.parametrize("stage", STAGES)
def test_fit_and_resume_equal_ddp(runs, stage):
    result, _ = runs
    ddp, got = result["ddp"], result[stage]
    steps_per_epoch = len(ddp["losses"]) // 2
    _close(got["first"] + got["losses"], ddp["losses"], REL)  # the resumed fit trains the second epoch only
    assert len(got["losses"]) == steps_per_epoch
    _close(got["first_val"] + got["val"], ddp["val"], REL)
    assert got["first_step"] == ddp["step"] // 2 and got["step"] == ddp["step"] == 8  # 2 epochs of 8 batches per rank, 2 per step
    assert got["lr"] == pytest.approx(ddp["lr"], rel=1e-12)  # the StepLR's state came back with the checkpoint
    torch.testing.assert_close(got["predicted"], ddp["predicted"], rtol=REL, atol=1e-6)


def test_validate_from_a_checkpoint_without_fit(runs):
    result, _ = runs
    first_epoch_val = result["ddp"]["val"][:len(result["ddp"]["val"]) // 2]
    assert len(first_epoch_val) == 2  # 16 samples, 2 ranks, batches of 4
    _close(result["validated"], first_epoch_val, REL)


def test_configure_model_builds_on_meta_at_stage_3(runs):
    """`configure_model` runs under zero.Init: its layers are built on the meta device and materialized shard by
    shard, with the values the same seed gives a whole model."""
    result, _ = runs
    got = result["configured"]
    assert got["built_on"] == "meta"
    _close(got["losses"], result["ddp"]["losses"][:len(got["losses"])], REL)
    assert len(got["losses"]) == 8  # 64 samples, 2 ranks, batches of 4


def test_resumed_on_1_process_continues_as_ddp(runs):
    result, one = runs
    second_epoch = result["ddp"]["losses"][len(result["ddp"]["losses"]) // 2:]
    _close(one["losses"], second_epoch, REL)  # each micro-batch of 8 is the 2 ranks' micro-batches of 4
    assert one["step"] == result["ddp"]["step"]


def test_bf16_mixed_within_bf16_tolerance(runs):
    result, _ = runs
    assert result["bf16_enabled"]
    _close(result["bf16"], result["ddp_bf16"], BF16_REL)
    assert result["bf16"] != result["ddp"]["losses"][:len(result["bf16"])]  # trained in bf16, not fp32
