"""Checkpoints: the engine's checkpoint calls (save, load, the asynchronous save in flight).

They hand the checkpoint package the engine's `CheckpointAdapter`, never the
engine. On a mesh each model part (pp, tp coordinate) saves and loads its
own data-parallel checkpoint under the directory (`checkpoint/mesh.py`).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from zeroshard import checkpoint
from zeroshard.checkpoint import CheckpointError
from zeroshard.checkpoint.async_save import AsyncSave, save_async
from zeroshard.checkpoint.files import LATEST, point_latest
from zeroshard.checkpoint.mesh import check_mesh, part_dir, write_mesh
from zeroshard.comm import all_gather_object
from zeroshard.engine.checkpoint_adapter import CheckpointAdapter


class Checkpoints:
    """`engine`'s (a `zeroshard.Engine`'s) checkpoint calls, over its `adapter`; the asynchronous save in flight."""

    def __init__(self, engine, adapter: CheckpointAdapter):
        self.engine, self.adapter = engine, adapter
        self.in_flight: AsyncSave | None = None  # an asynchronous save not yet published as `latest`

    def save(self, save_dir: str | Path, tag: str | int | float | None, client_state: dict | None,
             save_latest: bool, exclude_frozen_parameters: bool, asynchronous: bool | None) -> Path:
        """Write a sharded checkpoint to `save_dir/tag` (default tag `global_step<N>`; a number becomes
        `str(tag)`) and point `save_dir/latest` at it (unless `save_latest` is false); returns the tag's
        directory. Every rank must call it, at an accumulation boundary. `client_state`: your own plain data
        (tensors, numbers, strings, lists, dicts, `Path`, `Namespace`), given back by `load_checkpoint`;
        rank 0's is the one stored. `exclude_frozen_parameters=True` (DeepSpeed's argument): the trainable
        state only, no parameter with requires_grad False; it resumes onto the same base model loaded again,
        and a load onto another base is refused (`zeroshard/checkpoint/frozen.py`).
        See `zeroshard/checkpoint/saving.py`. Called on some ranks only, it raises `CheckpointError` on
        them within `rank_check_timeout` (comm/watch/entry.py) and writes nothing.

        `asynchronous` (default: config `checkpoint.async_save`): return once the state of this step is
        copied to host memory; a background thread writes it, and the tag becomes `latest` at a later
        `engine.step()` once every rank's file is complete (`checkpoint/async_save.py`); a failed write
        raises `CheckpointError` on every rank at that step. A save in flight is completed first.
        """
        engine = self.engine
        asynchronous = engine.config.checkpoint.async_save if asynchronous is None else asynchronous
        engine._enter("save_checkpoint", CheckpointError, checkpoint_call=True)
        engine._update.land()  # a delayed update in flight, first: the state written is the whole of it
        self.wait()  # a second save waits for the first
        if engine.mesh is None and not asynchronous:
            return checkpoint.save(self.adapter, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        if engine.mesh is None:
            self.in_flight = save_async(self.adapter, save_dir, tag, client_state, save_latest,
                                        exclude_frozen_parameters)
            return self.in_flight.path
        if asynchronous:
            raise CheckpointError("an asynchronous save on a dp x tp x pp mesh is not supported yet: save with "
                                  "asynchronous=False (config checkpoint.async_save false); nothing was written")
        return self._save_parts(save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def _save_parts(self, save_dir: str | Path, tag, client_state: dict | None, save_latest: bool,
                    exclude_frozen: bool) -> Path:
        """On a mesh: each model part writes its tag; only once every part's is complete does any part's
        `latest` move to it, so the parts' `latest` never name different steps after a failed save."""
        mesh = self.engine.mesh
        if dist.get_rank() == 0:
            write_mesh(save_dir, mesh)
        where, path, error = part_dir(save_dir, mesh), None, None
        try:
            path = checkpoint.save(self.adapter, where, tag, client_state, save_latest=False,
                                   exclude_frozen_parameters=exclude_frozen)
        except CheckpointError as exc:  # raised in this part's dp group only: the other parts must hear it
            error = str(exc)
        self._every_part_agrees(error)
        if save_latest:
            error = None
            if self.engine.comm.rank == 0:  # each part's first dp rank
                try:
                    point_latest(where, path.name)
                except OSError as exc:
                    error = f"cannot point {where / LATEST} at '{path.name}' ({exc})"
            self._every_part_agrees(error)
        return path

    def _every_part_agrees(self, error: str | None) -> None:
        """Raise the same `CheckpointError` on every rank of the mesh if any part's save failed."""
        rows = all_gather_object(self.engine.cross.world, (self.engine.mesh.model_part, error))
        failed = [f"{part}: {e}" for part, e in rows if e]
        if failed:
            raise CheckpointError(f"the checkpoint was not completed by every model part ({'; '.join(failed)}); "
                                  "no part's 'latest' moved to it, so a load resumes every part from the previous "
                                  "checkpoint")

    def wait(self) -> Path | None:
        """The save in flight written by every rank and published: its tag's directory (None: none)."""
        save, self.in_flight = self.in_flight, None
        return save.wait() if save is not None else None

    def poll(self) -> None:
        """At the end of an optimizer step: publish the asynchronous save in flight once every rank has
        written it, or raise its failure on every rank."""
        save, self.in_flight = self.in_flight, None
        if save is not None and save.poll() is None:
            self.in_flight = save  # some rank is still writing

    def load(self, load_dir: str | Path, tag: str | int | float | None, load_module_strict: bool,
             load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool,
             custom_load_fn: Callable | None, must_exist: bool) -> tuple[Path, dict] | tuple[None, None]:
        """Load a checkpoint written by any world size, stage or dtype; returns (its directory, client_state).

        DeepSpeed's signature. `tag` None: the one `load_dir/latest` names (or `load_dir` itself if it is a
        tag's directory); with no checkpoint in `load_dir` yet, every rank warns and it returns (None, None),
        as DeepSpeed does (`must_exist=True` makes that a `CheckpointError`). `load_optimizer_states=False`
        keeps this engine's optimizer state, `load_lr_scheduler_states=False` its LR scheduler;
        `load_module_only=True` loads the weights alone (no counters, loss scale, optimizer or scheduler),
        to fine-tune from them. `load_module_strict=False` and `custom_load_fn` are not supported yet (errors).
        Every rank must call it; on error every rank raises `CheckpointError` and the engine is
        unchanged (called on some ranks only, they raise it within `rank_check_timeout`).
        """
        _check_load_options(load_module_strict, custom_load_fn)
        engine = self.engine
        engine._enter("load_checkpoint", CheckpointError, checkpoint_call=True)
        engine._update.land()  # a delayed update in flight lands before the load replaces the state it writes
        self.wait()  # a save in flight lands first: it may be the one to load
        load = partial(checkpoint.load, self.adapter, tag=tag, load_optimizer_states=load_optimizer_states,
                       load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                       must_exist=must_exist)
        if engine.mesh is None:
            return load(load_dir)
        check_mesh(load_dir, engine.mesh)  # every rank reads the same files: the same verdict everywhere
        return self._load_part(load, part_dir(load_dir, engine.mesh))

    def _load_part(self, load: Callable, where: Path) -> tuple[Path, dict] | tuple[None, None]:
        """Load this model part, then agree over the whole mesh: every part at the same tag and step."""
        outcome, error = (None, None), None
        try:
            outcome = load(where)
        except Exception as exc:  # raised in this part's dp group only: the other parts must hear it, whatever it is
            error = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        loaded = outcome[0].name if outcome[0] is not None else None
        engine = self.engine
        rows = all_gather_object(engine.cross.world, (engine.mesh.model_part, loaded, engine.global_steps, error))
        if len({(tag, steps) for _, tag, steps, _ in rows}) > 1 or any(e for *_, e in rows):
            what = "; ".join(f"{part}: {e or f'tag {tag}, step {steps}'}" for part, tag, steps, e in rows)
            if loaded is not None:  # this part loaded, another did not, or another step: the mesh is torn
                engine._fail(f"the model parts loaded different checkpoints ({what})")
            raise CheckpointError(f"the model parts did not all load the same checkpoint: {what}. Each part "
                                  "resolves 'latest' on its own; an interrupted save can leave them apart. Load "
                                  "an explicit tag that every part holds, then restart")
        return outcome


_MIGRATE = "see docs/migrate-from-deepspeed.md"


def _check_load_options(load_module_strict: bool, custom_load_fn: Callable | None) -> None:
    """The DeepSpeed checkpoint options zeroshard does not implement yet: an error on every rank."""
    if not load_module_strict:
        raise CheckpointError("load_module_strict=False is not supported yet: a zeroshard checkpoint loads "
                              "into the model it was saved from. To load part of a model, load a consolidated "
                              "state dict with model.load_state_dict(..., strict=False) before initialize "
                              f"({_MIGRATE})")
    if custom_load_fn is not None:
        raise CheckpointError(f"custom_load_fn is not supported yet ({_MIGRATE})")
