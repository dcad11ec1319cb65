"""Reading a sharded checkpoint into a trainer, from any world size, stage or training dtype.

`engine.load_checkpoint(load_dir)` calls `load` here. A load is all or
nothing. First every rank reads and checks everything it will need, without
changing anything: the manifest and its seal, every file's presence, size
and header (save id, tensors, dtypes), state.pt's parts, the model and
optimizer against the checkpoint, its share of the checksums (`verify.py`),
and the optimizer state it will install. Then the ranks agree: on any
problem every rank raises the same `CheckpointError` and the trainer is
bit for bit what it was. Only then does each rank read exactly the elements
its own shards need (byte ranges of the rank files) into the trainer; the
ranks agree once more after, and an I/O failure part-way on any rank fails
every rank's trainer with one error (`_apply_everywhere`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from zeroshard.checkpoint.checks import agree, holdings, mismatch
from zeroshard.checkpoint.client_state import from_plain
from zeroshard.checkpoint.files import (
    DAMAGED_FIX,
    STATE,
    CheckpointError,
    holds_no_checkpoint,
    read_manifest,
    read_state,
    resolve,
)
from zeroshard.checkpoint.holdings import Holdings
from zeroshard.checkpoint.pieces import PieceReader
from zeroshard.checkpoint.protocol import Counters, Trainer
from zeroshard.checkpoint.verify import (
    checksum_problems,
    header_problems,
    raise_first,
    share,
    state_problems,
)
from zeroshard.comm import all_gather_object

log = logging.getLogger(__name__)

# Param-group keys the engine chooses for the device at hand; a checkpoint does not carry them over.
_IMPLEMENTATION_KEYS = {"params", "fused", "foreach", "capturable", "differentiable"}


@dataclass(frozen=True)
class _Parts:
    """Which parts of a checkpoint a load reads into the trainer (the weights always)."""

    optimizer: bool
    scheduler: bool
    counters: bool


@dataclass(frozen=True)
class _Plan:
    """Everything a load installs, read and checked before any rank changes anything."""

    path: Path
    manifest: dict
    state: dict
    reader: PieceReader
    optimizer_state: dict | None  # for optimizer.load_state_dict; None: keep the trainer's


def load(trainer: Trainer, load_dir: str | Path, tag: str | int | float | None = None,
         load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True, load_module_only: bool = False,
         must_exist: bool = True) -> tuple[Path, dict] | tuple[None, None]:
    """Read a checkpoint into the trainer; returns (the tag directory, the saved client_state).

    As DeepSpeed: the weights always; the step counters and fp16 loss scale
    unless `load_module_only`; the optimizer state and param-group settings,
    and the LR scheduler, when their flags say so and not `load_module_only`.
    With `must_exist` false, `tag` None and no checkpoint of any kind in `load_dir` on any rank
    (a resume-if-present script's first run), nothing is loaded: every rank warns and returns
    (None, None), as DeepSpeed does.
    """
    parts = _Parts(load_optimizer_states and not load_module_only, load_lr_scheduler_states and not load_module_only,
                   not load_module_only)
    trainer.check_checkpoint_boundary("load_checkpoint")
    comm, held = trainer.comm, holdings(trainer)
    if not must_exist and tag is None and all(all_gather_object(comm, holds_no_checkpoint(load_dir))):
        log.warning("rank %d: no checkpoint in %s yet (no 'latest' file, no tag): nothing loaded, "
                    "load_checkpoint returns (None, None); pass must_exist=True to make this an error",
                    comm.rank, load_dir)
        return None, None
    plan, error = None, None
    try:
        plan = _prepare(trainer, held, load_dir, tag, parts)
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # whatever else a damaged file raises: agreed, so that no rank is left waiting
        error = (f"the checkpoint in {load_dir} cannot be read ({type(exc).__name__}: {exc}); it is damaged: "
                 f"{DAMAGED_FIX}")
    try:
        agree(comm, error)
        _apply_everywhere(trainer, held, plan, parts)
    finally:
        if plan is not None:
            plan.reader.close()
    if comm.rank == 0:
        log.info("loaded checkpoint %s (written by %d ranks at stage %d, step %d)", plan.path,
                 plan.manifest["world_size"], plan.manifest["stage"], plan.manifest["global_steps"])
    return plan.path, from_plain(plan.state["client_state"])


def _prepare(trainer: Trainer, held: Holdings, load_dir: str | Path, tag: str | None, parts: _Parts) -> _Plan:
    """Read and check everything the load needs; raises CheckpointError with the first problem."""
    path = resolve(load_dir, tag)
    manifest = read_manifest(path)
    state = read_state(path)
    raise_first(state_problems(path / STATE, manifest, state))
    reader = PieceReader(path, manifest)
    try:
        raise_first(header_problems(path, manifest, reader.handles))
        error = mismatch(trainer.optimizer, held, manifest, reader, parts.optimizer)
        raise_first([error] if error else _scaler_problems(trainer, path, state, parts))
        raise_first(checksum_problems(path, manifest, share(manifest, trainer.comm.rank, trainer.comm.world_size)))
        optimizer_state = _optimizer_state(trainer, held, reader, manifest, state) if parts.optimizer else None
    except BaseException:
        reader.close()
        raise
    return _Plan(path, manifest, state, reader, optimizer_state)


def _scaler_problems(trainer: Trainer, path: Path, state: dict, parts: _Parts) -> list[str]:
    saved = state["loss_scaler"]
    if not parts.counters or trainer.scaler is None or saved is None:
        return []
    lacking = sorted(set(trainer.scaler.state_dict()) - set(saved))
    return [(f"checkpoint file {path / STATE} holds an fp16 loss scale without {', '.join(lacking)}: it is "
             f"damaged or was rewritten; {DAMAGED_FIX}")] if lacking else []


def _apply_everywhere(trainer: Trainer, held: Holdings, plan: _Plan, parts: _Parts) -> None:
    """`_apply`, then agree on how it went: past the checks only I/O can fail (a file that went away, a
    read error), but then this rank's trainer is partly loaded, so every rank's trainer is failed and
    every rank raises the same error, instead of the others training on."""
    why = None
    try:
        _apply(trainer, held, plan, parts)
    except Exception as exc:
        why = (f"reading {plan.path} failed part-way ({type(exc).__name__}: {exc}); the weights are partly "
               "loaded, so this engine cannot continue: restart the job and load the checkpoint again")
    try:
        agree(trainer.comm, why)
    except CheckpointError as exc:
        trainer.fail(f"load_checkpoint failed part-way ({exc})")
        raise


def _apply(trainer: Trainer, held: Holdings, plan: _Plan, parts: _Parts) -> None:
    """Install what `_prepare` read and checked: the values, the optimizer state, counters, scheduler."""
    _load_values(trainer, held, plan.reader)
    if plan.optimizer_state is not None:
        trainer.optimizer.load_state_dict(plan.optimizer_state)
    if parts.counters:
        _load_counters(trainer, plan.state)
    if parts.scheduler and trainer.lr_scheduler is not None and plan.state["lr_scheduler"] is not None:
        trainer.lr_scheduler.load_state_dict(plan.state["lr_scheduler"])


def _load_values(trainer: Trainer, held: Holdings, reader: PieceReader) -> None:
    """Masters, frozen parameters and buffers; then the 16-bit parameters and replicas follow the masters."""
    trainer.release_gathered()  # shards change under the gathered buffers
    for t in held.trained:
        for run in t.held.runs():
            reader.read_into("param", run.name, run.start, t.bucket.master[run.at : run.at + run.numel])
    for flat, span in held.frozen:
        for run in span.runs():
            reader.read_into("param", run.name, run.start, flat.shard_data[run.at : run.at + run.numel])
    for kind, tensors in (("param", held.whole), ("buffer", held.buffers)):
        for name, tensor in tensors:
            values = torch.empty(tensor.numel(), dtype=tensor.dtype)
            reader.read_into(kind, name, 0, values)
            with torch.no_grad():
                tensor.copy_(values.view(tensor.shape))
    trainer.params_from_masters()


def _optimizer_state(trainer: Trainer, held: Holdings, reader: PieceReader, manifest: dict, state: dict) -> dict:
    """The optimizer's state for this job's masters, read into new tensors, for torch's own load_state_dict."""
    optimizer = trainer.optimizer
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    tensors: dict[int, dict] = {}
    for t in held.trained:
        scalars = state["scalars"].get(t.held.names[0], {})
        if not scalars and not manifest["optimizer_state"]:
            continue  # saved before the first step: no state yet
        entry = dict(scalars)
        for key in manifest["optimizer_state"]:
            values = torch.zeros_like(t.bucket.master)
            for run in t.held.runs():
                reader.read_into("optim." + key, run.name, run.start, values[run.at : run.at + run.numel])
            entry[key] = values
        tensors[index[id(t.bucket.master)]] = entry
    groups = [{**{k: v for k, v in saved.items() if k not in _IMPLEMENTATION_KEYS},
               **{k: v for k, v in group.items() if k in _IMPLEMENTATION_KEYS - {"params"}},
               "params": [index[id(p)] for p in group["params"]]}
              for saved, group in zip(state["param_groups"], optimizer.param_groups)]
    return {"state": tensors, "param_groups": groups}


def _load_counters(trainer: Trainer, state: dict) -> None:
    trainer.restore_counters(Counters(state["global_steps"], state["skipped_steps"]))
    if trainer.scaler is not None and state["loss_scaler"] is not None:
        trainer.scaler.load_state_dict(state["loss_scaler"])
    elif trainer.scaler is not None and trainer.comm.rank == 0:
        log.info("the checkpoint was not written in fp16: the loss scale starts at %g", trainer.scaler.scale)
