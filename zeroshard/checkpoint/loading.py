"""Reading a sharded checkpoint into a trainer, from any world size, stage or training dtype.

`engine.load_checkpoint(load_dir)` calls `load` here. Every rank reads exactly
the elements its own shards need (byte ranges of the rank files), and every
rank raises the same `CheckpointError` before any rank changes anything, so
a failed load leaves the trainer as it was.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from zeroshard.checkpoint.checks import agree, holdings, mismatch
from zeroshard.checkpoint.files import CheckpointError, PieceReader, read_manifest, read_state, resolve
from zeroshard.checkpoint.holdings import Holdings
from zeroshard.checkpoint.protocol import Counters, Trainer

log = logging.getLogger(__name__)

# Param-group keys the engine chooses for the device at hand; a checkpoint does not carry them over.
_IMPLEMENTATION_KEYS = {"params", "fused", "foreach", "capturable", "differentiable"}

def load(trainer: Trainer, load_dir: str | Path, tag: str | None = None, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True, load_module_only: bool = False) -> tuple[Path, dict]:
    """Read a checkpoint into the trainer; returns (the tag directory, the saved client_state).

    As DeepSpeed: the weights always; the step counters and fp16 loss scale
    unless `load_module_only`; the optimizer state and param-group settings,
    and the LR scheduler, when their flags say so and not `load_module_only`.
    """
    if load_module_only:
        load_optimizer_states = load_lr_scheduler_states = False
    trainer.check_checkpoint_boundary("load_checkpoint")
    comm, held = trainer.comm, holdings(trainer)
    path, manifest, state, reader, error = None, None, None, None, None
    try:
        path = resolve(load_dir, tag)
        manifest = read_manifest(path)
        state = read_state(path)
        reader = PieceReader(path, manifest)
        error = mismatch(trainer.optimizer, held, manifest, reader, load_optimizer_states)
    except CheckpointError as exc:
        error = str(exc)
    try:
        agree(comm, error)
        _load_values(trainer, held, reader)
        if load_optimizer_states:
            _load_optimizer(trainer, held, reader, manifest, state)
        if not load_module_only:
            _load_counters(trainer, state)
        if load_lr_scheduler_states and trainer.lr_scheduler is not None and state["lr_scheduler"] is not None:
            trainer.lr_scheduler.load_state_dict(state["lr_scheduler"])
    finally:
        if reader is not None:
            reader.close()
    if comm.rank == 0:
        log.info("loaded checkpoint %s (written by %d ranks at stage %d, step %d)", path,
                 manifest["world_size"], manifest["stage"], manifest["global_steps"])
    return path, state["client_state"]


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


def _load_optimizer(trainer: Trainer, held: Holdings, reader: PieceReader, manifest: dict, state: dict) -> None:
    """Rebuild the optimizer's state for this job's masters, through torch's own load_state_dict."""
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
    optimizer.load_state_dict({"state": tensors, "param_groups": groups})


def _load_counters(trainer: Trainer, state: dict) -> None:
    trainer.restore_counters(Counters(state["global_steps"], state["skipped_steps"]))
    if trainer.scaler is not None and state["loss_scaler"] is not None:
        trainer.scaler.load_state_dict(state["loss_scaler"])
    elif trainer.scaler is not None and trainer.comm.rank == 0:
        log.info("the checkpoint was not written in fp16: the loss scale starts at %g", trainer.scaler.scale)
