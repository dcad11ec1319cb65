"""`Accelerator.save_state` / `load_state` with the engine: its sharded checkpoint beside Accelerate's own files.

Accelerate's `save_state` writes each prepared model's, optimizer's and
scheduler's state dict from this process, which for the engine would be one
rank's shards under names no other world size could read. So the engine's
objects are taken out of the accelerator's lists while Accelerate saves or
loads the rest (RNG states, dataloader positions, its step counter,
registered objects), and the engine writes its own checkpoint, model,
optimizer, schedule and counters, in the tag `pytorch_model` of the same
directory, where Accelerate's DeepSpeed path puts DeepSpeed's. It is
written from a save-state pre-hook, which Accelerate calls with the final
directory (after `automatic_checkpoint_naming` chose it) and before its own
files, so a save refused by the engine (not at a window's end) leaves no
half-written state behind; loading likewise reads the engine's checkpoint
first. That checkpoint loads on any world size or stage
(docs/checkpoints.md); Accelerate's own files are per process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from zeroshard.accelerate.views import EngineOptimizer
from zeroshard.deepspeed.unsupported import UnsupportedError
from zeroshard.engine.stepped import SteppedByEngine

ENGINE_TAG = "pytorch_model"  # accelerate's MODEL_NAME: where its DeepSpeed path saves the engine


def save_state(accelerator, save: Callable, output_dir, safe_serialization: bool, engine_kwargs: dict):
    """Accelerate's `save` (its `save_state`) with the engine's checkpoint written first into the same directory;
    `engine_kwargs` go to `engine.save_checkpoint` (client_state, exclude_frozen_parameters, asynchronous)."""
    engine = accelerator.engine
    inside = engine.micro_steps % int(engine.gradient_accumulation_steps)
    if inside:  # the engine's own refusal speaks of engine.step(); this one of the script's loop
        raise UnsupportedError(
            f"accelerator.save_state() inside an accumulation window ({inside} of its "
            f"{int(engine.gradient_accumulation_steps)} micro-batches done): the window's gradients are not in "
            "a checkpoint. Call it where accelerator.sync_gradients is True, after the backward that ends a window")

    def save_engine(models, weights, directory) -> None:
        engine.save_checkpoint(directory, tag=ENGINE_TAG, **engine_kwargs)

    with _hook(accelerator.register_save_state_pre_hook, save_engine), engine_set_aside(accelerator):
        return save(output_dir, safe_serialization)


def load_state(accelerator, load: Callable, input_dir, load_kwargs: dict | None, engine_kwargs: dict) -> None:
    """The engine's checkpoint from the directory Accelerate resolves, then Accelerate's own state; `map_location`
    goes to Accelerate, the other keywords to `engine.load_checkpoint`."""
    engine_kwargs = dict(engine_kwargs)
    accelerate_kwargs = {"map_location": engine_kwargs.pop("map_location")} if "map_location" in engine_kwargs else {}

    def load_engine(models, directory) -> None:
        accelerator.engine.load_checkpoint(directory, tag=ENGINE_TAG, must_exist=True, **engine_kwargs)

    with _hook(accelerator.register_load_state_pre_hook, load_engine), engine_set_aside(accelerator):
        return load(input_dir, load_kwargs, **accelerate_kwargs)


@contextlib.contextmanager
def engine_set_aside(accelerator) -> Iterator[None]:
    """The accelerator's model, optimizer and scheduler lists without the engine's, for the duration."""
    engine = accelerator.engine
    lists = {"_models": lambda m: m is engine,
             "_optimizers": lambda o: isinstance(o, EngineOptimizer),
             "_schedulers": lambda s: isinstance(s, SteppedByEngine) and s.stepped is engine.lr_scheduler}
    kept = {name: list(getattr(accelerator, name)) for name in lists}
    for name, is_engines in lists.items():
        getattr(accelerator, name)[:] = [obj for obj in kept[name] if not is_engines(obj)]
    try:
        yield
    finally:
        for name, objects in kept.items():
            getattr(accelerator, name)[:] = objects


@contextlib.contextmanager
def _hook(register: Callable, hook: Callable) -> Iterator[None]:
    handle = register(hook)
    try:
        yield
    finally:
        handle.remove()
