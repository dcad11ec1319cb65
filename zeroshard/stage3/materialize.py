"""Models built on the meta device: initialised unit by unit, each rank keeping only its shard.

`zeroshard.initialize(model_on_meta, optimizer, config, init=fn)` at stage 3:
each unit's parameters get their full buffer on the real device, `fn(module)`
initialises every module that holds them directly (as `module.reset_parameters`
would), rank 0's values are broadcast and the buffer is sharded before the
next unit is made. A model whose full size exceeds one rank's memory never
exists whole on any rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from zeroshard.core.flat import give_memory
from zeroshard.errors import ModelError


def on_meta(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def default_device() -> torch.device:
    """This rank's GPU when there is one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@dataclass(frozen=True)
class Materializer:
    """Initialises modules whose parameters were just given real memory."""

    init: Callable[[nn.Module], None]
    device: torch.device

    def __call__(self, owners: list[nn.Module], params: list[nn.Parameter]) -> None:
        """Give `params` still on meta their own memory, then run `init` on each owner module."""
        for p in params:
            if p.device.type == "meta":
                give_memory(p, torch.empty_like(p, device=self.device))
        with torch.no_grad():
            for module in owners:
                for name, buffer in module.named_buffers(recurse=False):
                    if buffer.device.type == "meta":
                        setattr(module, name, torch.empty_like(buffer, device=self.device))
                self.init(module)


def check_materializable(model: nn.Module, init: Callable | None, stage: int) -> None:
    if not on_meta(model):
        if init is not None:
            raise ModelError("init= initialises a model built on the meta device, but this model's "
                             "parameters are real; drop init= or build the model under "
                             "torch.device('meta')")
        return
    if stage != 3:
        raise ModelError(f"the model is on the meta device, which only stage 3 can materialise shard by "
                         f"shard; set zero_optimization.stage to 3 (it is {stage}), or build the model "
                         "on a real device")
    if init is None:
        raise ModelError("the model is on the meta device: pass init=fn to zeroshard.initialize, where "
                         "fn(module) initialises the parameters a module holds directly (for example "
                         "`lambda m: m.reset_parameters() if hasattr(m, 'reset_parameters') else None`)")
