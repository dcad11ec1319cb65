"""The DeepSpeed-style config of `zeroshard.accelerate.Accelerator`, filled from the Accelerator's own arguments.

An Accelerate script says its accumulation, mixed precision and clipping to
the `Accelerator` (`gradient_accumulation_steps=`, `mixed_precision=`, and
here `max_grad_norm=`, the value it passes to `clip_grad_norm_`); the
engine reads them from its config. So each is written into the config where
the config leaves it out or says `"auto"`, and a config that says something
else is a `ConfigError` naming both values and the fix: the script and the
engine would otherwise train with different settings and nobody would know.
Accelerate's own DeepSpeed integration fills the same keys the same way.
"""

from __future__ import annotations

import copy
import os

from zeroshard.config import ConfigError
from zeroshard.config.keys import raw_config
from zeroshard.config.values import AUTO
from zeroshard.deepspeed.unsupported import UnsupportedError

PRECISIONS = ("no", "bf16", "fp16")


def read_config(config: dict | str | os.PathLike | None) -> dict:
    """A copy of the config dict, or the JSON file `config` names, read now so its mistakes show at once."""
    if config is None:
        raise ConfigError("zeroshard.accelerate.Accelerator needs config=: a DeepSpeed-style config dict or the path "
                          "of its JSON file, such as config={\"zero_optimization\": {\"stage\": 2}}")
    return raw_config(config, "Accelerator(config=...)")


def filled_config(config: dict, accumulation: int | None, precision: str | None,
                  max_grad_norm: float | None) -> dict:
    """`config` with the Accelerator's settings written in; None for a setting the script did not give.

    `accumulation`: micro-batches per optimizer step; `precision`: "no", "bf16" or "fp16"; `max_grad_norm`: the
    clipping norm. Every disagreement is listed in one `ConfigError`.
    """
    filled = copy.deepcopy(config)
    problems = []
    problems += _fill(filled, "gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    problems += _fill(filled, "gradient_clipping", max_grad_norm, "max_grad_norm")
    problems += _fill_precision(filled, precision)
    if filled.get("gradient_clipping") == AUTO:
        problems.append('gradient_clipping is "auto", and nothing fills it: pass Accelerator(max_grad_norm=...) '
                        "(the max_norm your clip_grad_norm_ calls use), or put the number in the config")
    if problems:
        raise ConfigError("the zeroshard config disagrees with the Accelerator's arguments:\n- " + "\n- ".join(problems)
                          + "\nleave these keys out of the config or set them to \"auto\" (the Accelerator fills "
                          "them), or pass the Accelerator the config's values")
    return filled


def _fill(config: dict, key: str, given, argument: str) -> list[str]:
    """Write `given` at `key` when the config leaves it out or says "auto"; a different value is a problem."""
    if given is None:
        return []
    value = config.get(key, AUTO)
    if value == AUTO:
        config[key] = given
        return []
    if value != given:
        return [f"config {key} is {value!r} but Accelerator({argument}={given!r})"]
    return []


def _fill_precision(config: dict, precision: str | None) -> list[str]:
    """`mixed_precision` as the config's bf16 and fp16 sections: the chosen one enabled, the other not."""
    if precision is None:
        return []
    if precision not in PRECISIONS:
        raise UnsupportedError(f"Accelerator(mixed_precision={precision!r}) is not supported by zeroshard: use one of "
                               f"{', '.join(PRECISIONS)} (the engine trains in the config's bf16 or fp16)")
    problems = []
    for section in ("bf16", "fp16"):
        block = config.get(section)
        if block is None:
            if precision == section:
                config[section] = {"enabled": True}
            continue
        if not isinstance(block, dict):
            continue  # the config's own checks name it
        wanted = precision == section
        enabled = block.get("enabled", AUTO)
        if enabled == AUTO:
            block["enabled"] = wanted
        elif bool(enabled) != wanted:
            problems.append(f"config {section}.enabled is {enabled!r} but Accelerator(mixed_precision={precision!r})")
    return problems


def precision_of(config: dict) -> str | None:
    """"bf16", "fp16" or "no" as the config says; None while one of them is "auto" (the model's dtype decides)."""
    states = {section: (config.get(section) or {}).get("enabled", False) for section in ("bf16", "fp16")}
    if AUTO in states.values():
        return None
    return next((section for section, on in states.items() if on), "no")
