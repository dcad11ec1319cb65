"""`TrainingArguments(deepspeed=...)` without the `deepspeed` package, and the config the Trainer fills from them.

transformers' `TrainingArguments.__post_init__` turns a `deepspeed=` config
into accelerate's `DeepSpeedPlugin`, which needs the `deepspeed` package and
would make accelerate run DeepSpeed. zeroshard's `TrainingArguments` keeps
the config aside (`args.zeroshard_deepspeed`) and leaves `args.deepspeed`
None, so transformers and accelerate set up plain torch.distributed; the
`zeroshard.hf.Trainer` then trains through zeroshard's engine with it.

The "auto" values are filled by transformers' own `HfTrainerDeepSpeedConfig`
methods (`trainer_config_process`, `trainer_config_finalize`), so a config
means what it means under transformers + DeepSpeed. Its constructor is not
run: it checks for the `deepspeed` package and registers the config
globally, which tells `from_pretrained` and friends that DeepSpeed's ZeRO-3
is live (`is_deepspeed_zero3_enabled()`); zeroshard's stage 3 needs neither.
"""

from __future__ import annotations

import copy

import torch.nn as nn
import transformers
from accelerate.utils.deepspeed import HfDeepSpeedConfig as AccelerateDeepSpeedConfig
from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

from zeroshard.config import ConfigError
from zeroshard.config.keys import raw_config


class _ConfigKeptAside:
    """Mixed into transformers' argument classes: `deepspeed=` is kept for zeroshard, hidden from accelerate."""

    zeroshard_deepspeed: dict | str | None = None

    def __post_init__(self):
        self.zeroshard_deepspeed, self.deepspeed = self.deepspeed, None
        super().__post_init__()
        if self.zeroshard_deepspeed is not None:
            # Fail on the file's mistakes (a path that is not there, JSON that does not parse) at once, as
            # transformers does, and on mismatches with these arguments, with the world size known later.
            filled_config(self)

    @property
    def place_model_on_device(self) -> bool:
        """False: `zeroshard.deepspeed.initialize` places the model (a model built under `zero.Init` is on meta)."""
        return False


class TrainingArguments(_ConfigKeptAside, transformers.TrainingArguments):
    """transformers' `TrainingArguments`; `deepspeed=` a DeepSpeed config file or dict, trained by zeroshard."""


class Seq2SeqTrainingArguments(_ConfigKeptAside, transformers.Seq2SeqTrainingArguments):
    """transformers' `Seq2SeqTrainingArguments`; `deepspeed=` as for `TrainingArguments`."""


class _TrainerConfig(AccelerateDeepSpeedConfig):
    """transformers' filling of "auto" from the arguments (its methods, taken as they are), over accelerate's
    config reader, without transformers' constructor (see the module docstring). Without the `deepspeed`
    package transformers' class does not derive from accelerate's, whose lookups its methods use."""

    _borrowed = HfTrainerDeepSpeedConfig.__dict__
    is_auto, fill_match, fill_only = _borrowed["is_auto"], _borrowed["fill_match"], _borrowed["fill_only"]
    trainer_config_process = _borrowed["trainer_config_process"]
    trainer_config_finalize = _borrowed["trainer_config_finalize"]

    def __init__(self, config: dict):
        super().__init__(copy.deepcopy(config))
        self._dtype, self.mismatches = None, []


def carry_config(given, kept) -> None:
    """The DeepSpeed config of the arguments `given` to a trainer onto the arguments it `kept`: TRL's trainers
    rebuild a plain `TrainingArguments` as their own config class (`SFTConfig(**args.to_dict())`), which would
    drop the config kept aside, and the run would train with none."""
    config = getattr(given, "zeroshard_deepspeed", None)
    if config is not None and kept is not given and getattr(kept, "zeroshard_deepspeed", None) is None:
        kept.zeroshard_deepspeed = config


def config_given(args) -> dict | None:
    """The DeepSpeed config these arguments carry (a dict, read from its file if a path), or None."""
    given = getattr(args, "zeroshard_deepspeed", None)
    if given is None:
        given = getattr(args, "deepspeed", None)  # transformers' own arguments, with `deepspeed` installed
    if given is None or isinstance(given, dict):
        return given
    return raw_config(given, "TrainingArguments(deepspeed=...)")


def filled_config(args, model: nn.Module | None = None, num_training_steps: int | None = None) -> dict:
    """The config with every "auto" that transformers fills from `args` filled (with `model`: its hidden size's
    keys and the scheduler's step counts too); a value that disagrees with `args` is a `ConfigError` naming all."""
    config = _TrainerConfig(config_given(args) or {})
    config.trainer_config_process(args)
    precision = getattr(args, "mixed_precision", "no")  # "bf16" with --bf16, "fp16" with --fp16
    if precision in ("bf16", "fp16") and precision not in config.config:
        # As accelerate's DeepSpeedPlugin.set_mixed_precision: the flag enables the block a config leaves out.
        config.config[precision] = {"enabled": True}
    if model is not None:
        try:
            config.trainer_config_finalize(args, model, num_training_steps)
        except ValueError as exc:  # transformers' message names every mismatch, or the missing hidden size
            raise ConfigError(str(exc)) from exc
    elif config.mismatches:
        raise ConfigError("the DeepSpeed config disagrees with the TrainingArguments:\n" + "\n".join(
            config.mismatches) + "\nset these config values to \"auto\" (the Trainer fills them) or change the "
            "arguments")
    return config.config
