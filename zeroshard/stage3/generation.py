"""Generation at stage 3: every rank runs as many forwards as the rank that generates longest.

Each forward gathers every unit from all ranks, so a rank that stops
generating early (a shorter `max_new_tokens`, an end-of-sequence token)
leaves the others waiting in their next gather. Hugging Face's `generate`
has the cure, `synced_gpus=True`: a finished rank keeps running forward, its
results discarded, until an all-reduce says every rank is finished. transformers
turns it on by itself only when it detects DeepSpeed ZeRO-3 or FSDP.

So at stage 3 on several ranks zeroshard makes `synced_gpus=True` the default
of the model's `generate` (any `generate` with a `synced_gpus` parameter): on
that model instance only, so `engine.module.generate` and the user's
`model.generate` (the same object) both have it, and nothing global changes.
`synced_gpus=False` is an error that says why.
"""

from __future__ import annotations

import inspect
import logging
import types
from functools import partial

import torch.distributed as dist
import torch.nn as nn

from zeroshard.comm import Comm
from zeroshard.errors import ZeroshardError

log = logging.getLogger(__name__)


class GenerationError(ZeroshardError, ValueError):
    """`generate` called in a way that would leave the stage-3 ranks waiting for each other."""


def sync_generation(model: nn.Module, comm: Comm) -> bool:
    """Give `model.generate` the default `synced_gpus=True` if it has that parameter and there are
    several ranks; returns whether it did."""
    generate = getattr(type(model), "generate", None)
    if comm.world_size == 1 or not callable(generate) or "synced_gpus" not in inspect.signature(generate).parameters:
        return False
    whole_world = dist.get_world_size() == comm.world_size  # transformers all-reduces over the default group
    # A method bound to this instance: a deep copy of the model rebinds it to the copy.
    model.generate = types.MethodType(partial(_synced_generate, generate, comm.world_size, whole_world), model)
    if comm.rank == 0:
        log.info("stage 3 on %d ranks: %s.generate defaults to synced_gpus=True (every rank runs forward until "
                 "the last one finishes generating)", comm.world_size, type(model).__name__)
    return True


def _synced_generate(generate, world_size: int, whole_world: bool, model: nn.Module, *args,
                     synced_gpus: bool | None = None, **kwargs):
    if synced_gpus is not None and not synced_gpus:
        raise GenerationError(
            f"generate(synced_gpus=False) on a ZeRO stage 3 model sharded over {world_size} ranks: each forward "
            "gathers parameters from every rank, so a rank that finishes generating first would leave the others "
            "waiting forever. Leave synced_gpus out (zeroshard makes it True) or pass synced_gpus=True")
    if not whole_world:
        raise GenerationError(
            "generate at stage 3 on a process group smaller than the world: transformers' synced_gpus all-reduces "
            "over the default process group, which ranks outside the engine's group would never join. "
            "Initialize the engine on the default group to generate with it")
    return generate(model, *args, synced_gpus=True, **kwargs)
