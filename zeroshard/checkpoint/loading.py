"""Reading a sharded checkpoint into a trainer, from any world size, stage or training dtype.

`engine.load_checkpoint(load_dir)` calls `load` here. A load is all or
nothing. First every rank reads and checks everything it will need, without
changing anything: the manifest and its seal, every file's presence, size
and header (save id, tensors, dtypes), state.pt's parts, the model and
optimizer against the checkpoint, its share of the checksums (`verify.py`),
and that the files hold every element it will read (a checkpoint saved
without its frozen parameters: that the engine's frozen base is the one it
was saved on, `frozen.py`). Then the ranks agree:
on any problem every rank raises the same `CheckpointError` and the trainer
is bit for bit what it was. Only then does each rank read exactly the
elements its own shards need (byte ranges of the rank files) into the
trainer: masters and optimizer state straight into the tensors that hold
them, a group of buckets at a time as the trainer holds them in memory
(`Checkpointable.resident_buckets`: offloaded to disk, a sub-group at a time,
written back before the next ones are read), so a load needs no second
copy of them. The ranks agree once more after, and an I/O failure part-way
on any rank fails every rank's trainer with one error (`_apply_everywhere`).
"""

from __future__ import annotations

import logging
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import torch

from zeroshard.checkpoint.checks import as_error, holdings, mismatch
from zeroshard.checkpoint.client_state import from_plain
from zeroshard.checkpoint.files import (
    DAMAGED_FIX,
    STATE,
    CheckpointError,
    group_state_keys,
    holds_no_checkpoint,
    read_manifest,
    read_state,
    resolve,
)
from zeroshard.checkpoint.frozen import excluded, load_check
from zeroshard.checkpoint.holdings import Holdings, Trained
from zeroshard.checkpoint.pieces import PieceReader
from zeroshard.checkpoint.protocol import Counters, Checkpointable
from zeroshard.checkpoint.rank_state import restore_rank_state
from zeroshard.checkpoint.turns import master_state
from zeroshard.checkpoint.verify import (
    checksum_problems,
    header_problems,
    raise_first,
    share,
    state_problems,
)
from zeroshard.comm import all_gather_object
from zeroshard.comm.agreement import agree
from zeroshard.core.optim import steps_whole

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
class _OptimizerPlan:
    """The optimizer state a load installs: its tensors read into each bucket's master-sized state in the
    bucket's turn (`Checkpointable.resident_buckets`), the rest as state.pt has it."""

    keys: list[list[str]]  # by trained bucket: its state tensors laid out like the master (Adam: exp_avg, ...)
    scalars: list[dict | None]  # by trained bucket: its other state (step); None: none saved (before a step)
    groups: list[dict]  # the param groups, for optimizer.load_state_dict
    owned: dict[str, dict[str, list[int]]]  # name -> key -> shape: the state of each tensor owned whole
    owned_scalars: dict[str, dict]  # name -> its other state, of each tensor owned whole


@dataclass(frozen=True)
class _Plan:
    """Everything a load installs, read and checked before any rank changes anything."""

    path: Path
    manifest: dict
    state: dict
    held: Holdings  # the trainer's, less the frozen parameters the checkpoint leaves out
    reader: PieceReader
    optimizer: _OptimizerPlan | None  # None: keep the trainer's optimizer state


def load(trainer: Checkpointable, load_dir: str | Path, tag: str | int | float | None = None,
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
        agree(comm, as_error(error))
        if plan.held.not_stored:  # saved without its frozen parameters: is the engine's base the one saved on?
            agree(comm, as_error(load_check(plan.held, plan.manifest, comm)))
        _apply_everywhere(trainer, plan.held, plan, parts)
    finally:
        if plan is not None:
            plan.reader.close()
    if comm.rank == 0:
        log.info("loaded checkpoint %s (written by %d ranks at stage %d, step %d)", plan.path,
                 plan.manifest["world_size"], plan.manifest["stage"], plan.manifest["global_steps"])
    return plan.path, from_plain(plan.state["client_state"])


def _prepare(trainer: Checkpointable, held: Holdings, load_dir: str | Path, tag: str | None, parts: _Parts) -> _Plan:
    """Read and check everything the load needs; raises CheckpointError with the first problem."""
    path = resolve(load_dir, tag)
    manifest = read_manifest(path)
    held = held.without_frozen(excluded(manifest)) if excluded(manifest) else held
    state = read_state(path)
    raise_first(state_problems(path / STATE, manifest, state))
    reader = PieceReader(path, manifest)
    try:
        raise_first(header_problems(path, manifest, reader.handles))
        error = mismatch(trainer.optimizer, held, manifest, reader, parts.optimizer)
        raise_first([error] if error else _scaler_problems(trainer, path, state, parts))
        raise_first(checksum_problems(path, manifest, share(manifest, trainer.comm.rank, trainer.comm.world_size)))
        optimizer = _optimizer_plan(trainer, held, manifest, state) if parts.optimizer else None
    except BaseException:
        reader.close()
        raise
    return _Plan(path, manifest, state, held, reader, optimizer)


def _scaler_problems(trainer: Checkpointable, path: Path, state: dict, parts: _Parts) -> list[str]:
    saved = state["loss_scaler"]
    if not parts.counters or trainer.scaler is None or saved is None:
        return []
    lacking = sorted(set(trainer.scaler.state_dict()) - set(saved))
    return [(f"checkpoint file {path / STATE} holds an fp16 loss scale without {', '.join(lacking)}: it is "
             f"damaged or was rewritten; {DAMAGED_FIX}")] if lacking else []


def _apply_everywhere(trainer: Checkpointable, held: Holdings, plan: _Plan, parts: _Parts) -> None:
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
        agree(trainer.comm, as_error(why))
    except CheckpointError as exc:
        trainer.fail(f"load_checkpoint failed part-way ({exc})")
        raise


def _apply(trainer: Checkpointable, held: Holdings, plan: _Plan, parts: _Parts) -> None:
    """Install what `_prepare` read and checked: the values, the optimizer state (PowerSGD's with it),
    counters, scheduler."""
    _load_values(trainer, held, plan)
    if plan.optimizer is not None:
        trainer.optimizer.load_state_dict(_optimizer_state(trainer.optimizer, held, plan.optimizer))
        restore_rank_state(trainer.buckets, trainer.comm, plan.manifest, plan.reader.handles,
                           plan.state["global_steps"])
    if parts.counters:
        _load_counters(trainer, plan.state)
    if parts.scheduler and trainer.lr_scheduler is not None and plan.state["lr_scheduler"] is not None:
        trainer.lr_scheduler.load_state_dict(plan.state["lr_scheduler"])


def _load_values(trainer: Checkpointable, held: Holdings, plan: _Plan) -> None:
    """Masters and their optimizer state a group of buckets at a time (offload: each group written back to
    disk before the next ones are read), frozen parameters (those the checkpoint holds) and buffers; then
    the replicated parameters are gathered (each bucket's own part took its master in its turn)."""
    trainer.release_gathered()  # shards change under the gathered buffers
    reader = plan.reader
    with closing(trainer.resident_buckets(write=True)) as turns:
        for group in turns:
            for i in group:
                saved = plan.optimizer is not None and plan.optimizer.scalars[i] is not None
                _load_trained(trainer.optimizer, held.trained[i], reader, plan.optimizer.keys[i] if saved else [],
                              plan.optimizer.owned if plan.optimizer is not None else {})
    for flat, span in held.frozen:
        for run in held.stored_runs(span):
            reader.read_into("param", run.name, run.start, flat.shard_data[run.at : run.at + run.numel])
    for kind, tensors in (("param", held.whole), ("buffer", held.buffers)):
        for name, tensor in tensors:
            if kind == "param" and name in held.not_stored:
                continue  # left out of the checkpoint: the engine's own value, checked by `load_check`
            values = torch.empty(tensor.numel(), dtype=tensor.dtype)
            reader.read_into(kind, name, 0, values)
            with torch.no_grad():
                tensor.copy_(values.view(tensor.shape))
    trainer.gather_params()


def _load_trained(optimizer: torch.optim.Optimizer, t: Trained, reader: PieceReader, keys: list[str],
                  owned: dict[str, dict[str, list[int]]]) -> None:
    """A bucket's master, and its optimizer state `keys`, in its turn: read into the state tensors it holds
    (keeping them: offload's swap files follow them), or into new ones of the master's size. The state of
    each tensor the rank owns whole (`owned`: name -> key -> shape) is read whole into tensors of its shape."""
    master = t.bucket.master
    for run in t.held.runs():
        reader.read_into("param", run.name, run.start, master[run.at : run.at + run.numel])
    for name, view in t.owned():
        for key, shape in owned.get(name, {}).items():
            values = optimizer.state[view].get(key)
            if values is None or list(values.shape) != shape:
                values = optimizer.state[view][key] = torch.zeros(shape, dtype=master.dtype, device=master.device)
            reader.read_into("optim." + key, name, 0, values.view(-1))
    held_now = master_state(optimizer, master)
    for key in keys:
        values = held_now.get(key)
        if values is None:
            values = optimizer.state[master][key] = torch.zeros_like(master)
        else:
            values.zero_()  # the padding too, as a new tensor's
        for run in t.held.runs():
            reader.read_into("optim." + key, run.name, run.start, values[run.at : run.at + run.numel])


def _optimizer_plan(trainer: Checkpointable, held: Holdings, manifest: dict, state: dict) -> _OptimizerPlan:
    """What the optimizer takes from the checkpoint, for this job's masters (no tensor read yet)."""
    optimizer = trainer.optimizer
    index = _param_index(optimizer)
    keys = [group_state_keys(manifest, t.bucket.param_group) for t in held.trained]
    scalars = []
    for t, bucket_keys in zip(held.trained, keys):
        saved = state["scalars"].get(t.held.names[0], {})
        scalars.append(dict(saved) if saved or bucket_keys else None)  # neither: saved before the first step
    groups = [{**{k: v for k, v in saved.items() if k not in _IMPLEMENTATION_KEYS},
               **{k: v for k, v in group.items() if k in _IMPLEMENTATION_KEYS - {"params"}},
               "params": [index[id(p)] for p in group["params"]]}
              for saved, group in zip(state["param_groups"], optimizer.param_groups)]
    owned = manifest.get("owned_state", {})
    whole = {name for t in held.trained for name, _ in t.owned()}  # scalars of tensors owned whole
    return _OptimizerPlan(keys, scalars, groups, owned, {name: state["scalars"].get(name, {}) for name in whole})


def _optimizer_state(optimizer: torch.optim.Optimizer, held: Holdings, plan: _OptimizerPlan) -> dict:
    """For torch's own load_state_dict: the saved scalars and groups, and the state tensors the buckets'
    turns filled (the same tensor objects, so offload's swap files still follow them)."""
    index = _param_index(optimizer)
    state = {index[id(t.bucket.master)]: scalars | {k: optimizer.state[t.bucket.master][k] for k in keys}
             for t, scalars, keys in zip(held.trained, plan.scalars, plan.keys)
             if scalars is not None and not steps_whole(t.bucket)}
    for t in held.trained:  # the tensors owned whole: their scalars and the tensors read in their turn
        for name, view in t.owned():
            if name in plan.owned or plan.owned_scalars.get(name):
                state[index[id(view)]] = dict(plan.owned_scalars.get(name, {})) | {
                    k: optimizer.state[view][k] for k in plan.owned.get(name, {})}
    return {"state": state, "param_groups": plan.groups}


def _param_index(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """id(parameter) -> its index in the optimizer's state_dict."""
    return {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}


def _load_counters(trainer: Checkpointable, state: dict) -> None:
    trainer.restore_counters(Counters(state["global_steps"], state["skipped_steps"]))
    if trainer.scaler is not None and state["loss_scaler"] is not None:
        trainer.scaler.load_state_dict(state["loss_scaler"])
    elif trainer.scaler is not None and trainer.comm.rank == 0:
        log.info("the checkpoint was not written in fp16: the loss scale starts at %g", trainer.scaler.scale)
