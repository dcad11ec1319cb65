"""The engine's config from Lightning's Trainer: what `Trainer(...)` says, written into the DeepSpeed config.

Lightning's flags are the user's settings for the whole run, so they fill
the config's keys: `accumulate_grad_batches` is `gradient_accumulation_steps`,
`gradient_clip_val` is `gradient_clipping`, the precision flag is the bf16 or
fp16 block. A key the config already holds must agree with the flag
(Lightning's DeepSpeedStrategy refuses any `gradient_accumulation_steps` in
the config; an equal value is accepted here), and what zeroshard cannot do
the way Lightning means it (clipping by value, a whole model in bf16 without
fp32 masters) is refused with the setting that works.
"""

from __future__ import annotations

import copy
from pathlib import Path

from zeroshard.config import ConfigError
from zeroshard.config.frozen_optimizer import frozen_model_config
from zeroshard.config.keys import raw_config
from zeroshard.config.values import AUTO
from zeroshard.deepspeed.unsupported import UnsupportedError

# Lightning's precision flag: the config block it turns on (None: full precision, the config decides).
PRECISION_BLOCKS = {"32-true": None, "32": None, "bf16-mixed": "bf16", "16-mixed": "fp16"}
DEFAULT_STAGE = 2  # as Lightning's DeepSpeedStrategy


def strategy_config(config: dict | str | Path | None, stage: int | None) -> dict:
    """The config given to the strategy (a dict, or a JSON file's path), a copy, with the ZeRO stage set."""
    config = raw_config(config, "ZeroshardStrategy(config=...)") if config is not None else {}
    zero = config.setdefault("zero_optimization", {})
    written = zero.get("stage")
    if stage is not None and written is not None and written != stage:
        raise ConfigError(f"ZeroshardStrategy(stage={stage}) but the config's zero_optimization.stage is {written}: "
                          "give the stage once")
    zero["stage"] = written if written is not None else stage if stage is not None else DEFAULT_STAGE
    return config


def fit_config(config: dict, accumulate: int, clip_val: float | None, clip_algorithm: str | None,
               precision: str) -> dict:
    """`config` with the Trainer's accumulation, clipping and precision written in (a copy)."""
    config = copy.deepcopy(config)
    _agree(config, "gradient_accumulation_steps", accumulate, "Trainer(accumulate_grad_batches=...)")
    if clip_val:
        clip_algorithm = getattr(clip_algorithm, "value", clip_algorithm)  # Lightning's GradClipAlgorithmType
        if clip_algorithm not in (None, "norm"):
            raise UnsupportedError(f"Trainer(gradient_clip_algorithm={clip_algorithm!r}) is not supported by "
                                   "zeroshard, which clips the global gradient norm over all shards: use "
                                   "gradient_clip_algorithm='norm' (the default)")
        _agree(config, "gradient_clipping", float(clip_val), "Trainer(gradient_clip_val=...)")
    elif config.get("gradient_clipping") == AUTO:
        config["gradient_clipping"] = 0.0  # the Trainer clips nothing
    _precision_block(config, precision)
    return config


def _agree(config: dict, key: str, value, flag: str) -> None:
    """The flag's `value` at `key`, where the config leaves it out or says "auto" (transformers' and
    Accelerate's DeepSpeed configs do); another value is an error."""
    if config.get(key, AUTO) not in (AUTO, value):
        raise ConfigError(f"the config's {key} is {config[key]} but {flag} says {value}: the Trainer's flag sets it, "
                          f"so leave {key} out of the config (or make them equal)")
    config[key] = value


def _precision_block(config: dict, precision: str) -> None:
    """bf16-mixed and 16-mixed turn on the bf16 or fp16 block (fp32 master weights, 16-bit compute)."""
    if precision not in PRECISION_BLOCKS:
        raise UnsupportedError(
            f"Trainer(precision={precision!r}) is not supported by ZeroshardStrategy: zeroshard trains in fp32 or "
            "in mixed precision with fp32 master weights; use precision='bf16-mixed' or '16-mixed' (or '32-true')")
    block = PRECISION_BLOCKS[precision]
    if block is None:
        return
    other = "fp16" if block == "bf16" else "bf16"
    if config.get(other, {}).get("enabled") not in (None, False, AUTO):
        raise ConfigError(f"Trainer(precision={precision!r}) but the config enables {other}: choose one precision")
    if config.get(block, {}).get("enabled", AUTO) not in (AUTO, True):
        raise ConfigError(f"Trainer(precision={precision!r}) but the config's {block} block says enabled: false; "
                          "remove that block or the flag")
    config.setdefault(block, {})["enabled"] = True
    if config.get(other, {}).get("enabled") == AUTO:
        config[other]["enabled"] = False


def eval_config(config: dict, precision: str) -> dict:
    """For an engine that only evaluates a checkpoint: the precision flag's, without optimizer, scheduler or
    optimizer offload."""
    config = frozen_model_config(config)
    _precision_block(config, precision)
    return config
