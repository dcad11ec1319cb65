"""`initialize(wrap=...)` written into the raw config before it is validated: stage 3's unit classes from code.

The classes' names become `zero_optimization.stage3_wrap_classes` in the raw
dict, so the validated config is the only one there is (no copy of it is
rewritten afterwards). Below stage 3 the argument has no effect, as
DeepSpeed's `zero.Init` does nothing there, and rank 0 says so; names that
the config gives otherwise are a `ConfigError`.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from zeroshard.config.errors import ConfigError

log = logging.getLogger("zeroshard.config")


def merge_wrap_argument(raw: dict, names: tuple[str, ...]) -> None:
    """Write `names` (the classes of `initialize(wrap=...)`) into the raw config's stage 3 units, in place.

    A raw config whose `zero_optimization` or stage is malformed is left as it is: validation names it."""
    zero = raw.get("zero_optimization", {})
    if not names or not isinstance(zero, dict):
        return
    stage = zero.get("stage", 0)
    if stage != 3:  # one script for every stage, as DeepSpeed's zero.Init does nothing below stage 3
        if isinstance(stage, int) and (not dist.is_initialized() or dist.get_rank() == 0):
            log.info("wrap=%s has no effect at stage %d: it chooses stage 3's units", list(names), stage)
        return
    given = zero.get("stage3_wrap_classes")
    if given is not None and not isinstance(given, (list, tuple)):  # validation names it
        return
    if given and tuple(given) != names:
        raise ConfigError(f"wrap={list(names)} and zero_optimization.stage3_wrap_classes="
                          f"{list(given)} disagree; give the units in one place")
    raw["zero_optimization"] = zero | {"stage3_wrap_classes": list(names)}
