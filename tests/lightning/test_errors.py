"""What ZeroshardStrategy refuses, each with the cause and the setting that works, and the registered names.

On 1 process: each case starts a fit that must stop before its first step with
the named error. `strategy="zeroshard_stage_3"` (registered on import) trains as
`strategy="ddp"` does on the same process; Lightning's ModelCheckpoint saves and prunes the
engine's checkpoint directories.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.lightning.lit import LR, fit, lightning_module, loaders, torchrun_env, trainer

pytest.importorskip("lightning")


def _refused(device, out, strategy_kw=None, fit_kw=None, module=None, ckpt_path=None) -> str:
    from zeroshard.lightning import ZeroshardStrategy

    run = trainer(device, 1, ZeroshardStrategy(**(strategy_kw or {})), out, 1, **(fit_kw or {}))
    try:
        run.fit(module or lightning_module(), *loaders(4), ckpt_path=ckpt_path)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "trained"


def _manual():
    module = lightning_module()
    module.automatic_optimization = False
    return module


def _two_optimizers():
    module = lightning_module()
    module.configure_optimizers = lambda: [torch.optim.SGD(module.net[0].parameters(), lr=0.1),
                                           torch.optim.SGD(module.net[2].parameters(), lr=0.1)]
    return module


def _no_optimizer():
    module = lightning_module()
    module.configure_optimizers = lambda: None
    return module


def _skipping():
    module = lightning_module()
    module.training_step = lambda batch, batch_idx: None
    return module


def _cases(rank, world, device, out) -> dict:
    with torchrun_env(rank, world):
        ddp_file = out / "ddp.ckpt"
        ddp = fit(device, 1, "ddp", out / "ddp", epochs=1)
        ddp["trainer"].save_checkpoint(ddp_file)
        import zeroshard.lightning  # noqa: F401 - registers the strategy names, as a user's script does
        from zeroshard.lightning import ZeroshardStrategy

        by_name = fit(device, 1, "zeroshard_stage_3", out / "named", epochs=1)
        kept = _model_checkpoint(device, out / "callback")
        blocks = _optimizer_block(device, out / "block")
        autos = fit(device, 1, ZeroshardStrategy(stage=2, config=AUTOS), out / "autos", epochs=1)["losses"]
        return {
            "manual": _refused(device, out, fit_kw={"gradient_clip_val": None, "accumulate_grad_batches": 1},
                                module=_manual()),
            "two_optimizers": _refused(device, out, module=_two_optimizers()),
            "skipping": _refused(device, out, module=_skipping()),
            "no_optimizer": _refused(device, out, module=_no_optimizer()),
            "by_value": _refused(device, out, fit_kw={"gradient_clip_algorithm": "value"}),
            "bf16_true": _refused(device, out, fit_kw={"precision": "bf16-true"}),
            "accumulation": _refused(device, out, {"config": {"gradient_accumulation_steps": 4}}),
            "short_window": _refused(device, out, fit_kw={"accumulate_grad_batches": 3}),
            "clipping": _refused(device, out, {"config": {"gradient_clipping": 1.0}}),
            "precision": _refused(device, out, {"config": {"fp16": {"enabled": True}}},
                                  {"precision": "bf16-mixed"}),
            "foreign_checkpoint": _refused(device, out, ckpt_path=str(ddp_file)),
            "ddp": ddp["losses"], "by_name": by_name["losses"],
            "by_name_stage": by_name["trainer"].strategy.engine.zero_optimization_stage(), **kept, **blocks, "autos": autos,
        }


def _optimizer_block(device, out) -> dict:
    """The config's optimizer block, configure_optimizers returning None, against DDP with that optimizer."""
    from zeroshard.lightning import ZeroshardStrategy

    def plain():
        module = lightning_module()
        module.configure_optimizers = lambda: torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.01)
        return module

    def split():  # two AdamWs over halves of the parameters: the same update as one AdamW over all
        import zeroshard

        module = lightning_module()
        first, rest = list(module.net[0].parameters()), list(module.net[2:].parameters())
        module.configure_optimizers = lambda: zeroshard.Optimizers([
            torch.optim.AdamW(first, lr=LR, weight_decay=0.01), torch.optim.AdamW(rest, lr=LR, weight_decay=0.01)])
        return module

    blockless = lightning_module()
    blockless.configure_optimizers = lambda: None
    config = {"optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}}
    return {"plain_ddp": fit(device, 1, "ddp", out / "ddp", epochs=1, module=plain())["losses"],
            "from_block": fit(device, 1, ZeroshardStrategy(stage=2, config=config), out, epochs=1,
                              module=blockless)["losses"],
            "optimizers": fit(device, 1, ZeroshardStrategy(stage=2), out, epochs=1, module=split())["losses"]}


def _model_checkpoint(device, out) -> dict:
    """Lightning's ModelCheckpoint every 2 steps, keeping the newest: the older directories removed, the kept one
    loads into a fresh module that validates as the trained one did at its end."""
    import lightning as L

    from zeroshard.lightning import ZeroshardStrategy

    callback = L.pytorch.callbacks.ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=1)
    run = fit(device, 1, ZeroshardStrategy(stage=2), out, epochs=1, enable_checkpointing=True, callbacks=[callback],
              check_val_every_n_epoch=1)
    module = lightning_module()
    trainer(device, 1, ZeroshardStrategy(stage=2), out, 1).validate(module, loaders(4)[1],
                                                                   ckpt_path=callback.best_model_path)
    return {"kept": sorted(p.name for p in out.iterdir()), "kept_is_engine": (out / "epoch=0-step=8.ckpt" /
                                                                             "checkpoint").is_dir(),
            "trained_val": run["val"], "reloaded_val": module.val_losses}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return run_ranks(_cases, 1, tmp_path_factory.mktemp("lightning_errors"))[0]


@pytest.mark.parametrize(("case", "names"), [
    ("manual", ["UnsupportedError", "automatic optimization", "automatic_optimization = True"]),
    ("two_optimizers", ["UnsupportedError", "several optimizers", "zeroshard.Optimizers"]),
    ("skipping", ["returned None", "return a loss"]),
    ("no_optimizer", ["ConfigError", "no optimizer", '"optimizer" block']),
    ("by_value", ["UnsupportedError", "gradient_clip_algorithm='value'", "'norm'"]),
    ("bf16_true", ["UnsupportedError", "bf16-true", "bf16-mixed"]),
    ("accumulation", ["ConfigError", "gradient_accumulation_steps is 4", "accumulate_grad_batches", "says 2"]),
    ("short_window", ["UnsupportedError", "16 batches per rank", "accumulate_grad_batches (3)", "hold 1",
                      "limit_train_batches=15", "max_steps=5"]),
    ("clipping", ["ConfigError", "gradient_clipping is 1.0", "gradient_clip_val", "says 0.5"]),
    ("precision", ["ConfigError", "bf16-mixed", "enables fp16"]),
    ("foreign_checkpoint", ["CheckpointError", "ddp.ckpt", "not a ZeroshardStrategy checkpoint", "state_dict"]),
])
def test_refused_with_cause_and_fix(cases, case, names):
    message = cases[case]
    assert message != "trained" and all(name in message for name in names), message


def test_registered_name_trains_as_ddp(cases):
    assert cases["by_name_stage"] == 3
    assert len(cases["by_name"]) == len(cases["ddp"]) == 16
    for a, b in zip(cases["by_name"], cases["ddp"]):
        assert abs(a - b) <= 2e-5 * abs(b), (cases["by_name"], cases["ddp"])


# A transformers-style DeepSpeed config: the Trainer's flags fill its "auto" values.
AUTOS = {"gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
         "fp16": {"enabled": "auto"}}


def test_auto_values_are_filled_from_the_trainer(cases):
    from zeroshard.lightning.config import fit_config

    assert cases["autos"] == pytest.approx(cases["ddp"], rel=2e-5)
    filled = fit_config({**AUTOS, "zero_optimization": {"stage": 2}}, 2, 0.5, None, "bf16-mixed")
    assert filled == {"gradient_accumulation_steps": 2, "gradient_clipping": 0.5, "bf16": {"enabled": True},
                      "fp16": {"enabled": False}, "zero_optimization": {"stage": 2}}
    assert fit_config(AUTOS, 1, None, None, "32-true")["gradient_clipping"] == 0.0


@pytest.mark.parametrize("case", ["from_block", "optimizers"])
def test_optimizer_from_the_config_block_or_several_as_one(cases, case):
    """The config's optimizer block (configure_optimizers returning None), or zeroshard.Optimizers of two AdamWs
    over parts of the model, against DDP with one AdamW over all of it."""
    assert len(cases[case]) == 16
    for a, b in zip(cases[case], cases["plain_ddp"]):
        assert abs(a - b) <= 2e-5 * abs(b), (cases[case], cases["plain_ddp"])


def test_model_checkpoint_callback(cases):
    assert cases["kept"] == ["epoch=0-step=8.ckpt"] and cases["kept_is_engine"]  # 4 saves, the newest kept
    assert cases["reloaded_val"] == pytest.approx(cases["trained_val"], rel=1e-6) and len(cases["trained_val"]) == 4


def test_stage_given_twice_differently():
    from zeroshard.config import ConfigError
    from zeroshard.lightning import ZeroshardStrategy

    with pytest.raises(ConfigError, match=r"stage=2.*zero_optimization.stage is 3"):
        ZeroshardStrategy(stage=2, config={"zero_optimization": {"stage": 3}})
    assert ZeroshardStrategy().stage == 2 and ZeroshardStrategy(config={"zero_optimization": {"stage": 1}}).stage == 1
