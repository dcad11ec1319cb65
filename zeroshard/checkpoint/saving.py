"""Writing a sharded checkpoint: every rank writes its shard, rank 0 the state and the manifest.

`engine.save_checkpoint(save_dir)` calls `save` here. A checkpoint holds the
fp32 master weights, the optimizer state, frozen parameters and buffers by
parameter name (`files.py` has the layout), so the reading job may have
another world size, another ZeRO stage or another training dtype than the
writing one (`loading.py`). It runs on every rank of the group and raises the
same error on every rank: a rank that cannot write says so before any rank
goes on, so a failed save leaves the previous checkpoints as they were.
"""

from __future__ import annotations

import io
import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from zeroshard.checkpoint.checks import agree, first_not_plain, holdings
from zeroshard.checkpoint.files import (
    FORMAT,
    MANIFEST,
    STATE,
    VERSION,
    CheckpointError,
    check_tag,
    commit,
    fsync_file,
    partial_dir,
    rank_file,
    runs_metadata,
    window_key,
    write_bytes,
)
from zeroshard.checkpoint.holdings import Holdings, Span
from zeroshard.checkpoint.protocol import Trainer
from zeroshard.comm import all_gather_object
from zeroshard.version import __version__

log = logging.getLogger(__name__)




# -- save ---------------------------------------------------------------------------


def save(trainer: Trainer, save_dir: str | Path, tag: str | None = None,
         client_state: dict | None = None, save_latest: bool = True) -> Path:
    """Write the trainer's training state to `save_dir/tag` (default tag: global_step<N>); returns that path."""
    trainer.check_checkpoint_boundary("save_checkpoint")
    tag = tag or f"global_step{trainer.counters().global_steps}"
    save_dir = Path(save_dir)
    comm, held = trainer.comm, holdings(trainer)
    state, error = None, None
    try:
        check_tag(tag)
    except CheckpointError as exc:  # agreed below, so that no rank waits for one that stopped here
        error = str(exc)
    if comm.rank == 0 and error is None:
        state, error = _serialized_state(trainer, held, client_state)
    agree(comm, error)
    tags = all_gather_object(comm, tag)
    if len(set(tags)) > 1:
        raise CheckpointError(f"the ranks asked for different tags ({', '.join(map(repr, tags))}); pass the same "
                              "tag on every rank (or none: global_step<N>)")
    partial = partial_dir(save_dir, tag)
    if comm.rank == 0:
        error = _attempt(lambda: _fresh_dir(save_dir, partial), f"cannot create {partial}")
    agree(comm, error)
    path = partial / rank_file(comm.rank)
    sizes: dict[str, int] = {}

    def write_shard() -> None:
        tensors, runs = _windows(trainer, held)
        save_file(tensors, str(path), metadata={"format": FORMAT, "rank": str(comm.rank), "runs": runs_metadata(runs)})
        sizes[path.name] = fsync_file(path)

    agree(comm, _attempt(write_shard, f"cannot write its shard to {partial}"))
    everyone = all_gather_object(comm, sizes)
    if comm.rank == 0:
        files = {name: size for rank_sizes in everyone for name, size in rank_sizes.items()}

        def finish() -> None:
            _check_shared(partial, files)
            files[STATE] = write_bytes(partial / STATE, state)
            write_bytes(partial / MANIFEST, _manifest(trainer, held, files).encode())
            commit(save_dir, tag, save_latest)

        error = _attempt(finish, f"cannot complete {partial}")
    agree(comm, error)  # every rank returns once the tag is in place
    if comm.rank == 0:
        log.info("saved checkpoint %s (%d rank files)", save_dir / tag, comm.world_size)
    return save_dir / tag


def _attempt(action, what: str) -> str | None:
    """Run `action`; its failure becomes the message every rank raises (the previous tags stay intact).

    Any exception, not only OSError: safetensors reports a failed write in its own error type,
    and a rank that raised alone would leave the others waiting in the next agreement.
    """
    try:
        action()
    except Exception as exc:
        return f"{what} ({exc}); the save was abandoned and earlier checkpoints are intact"
    return None


def _fresh_dir(save_dir: Path, partial: Path) -> None:
    save_dir.mkdir(parents=True, exist_ok=True)
    if partial.exists():  # left by a save that failed
        shutil.rmtree(partial)
    partial.mkdir()


def _check_shared(partial: Path, files: dict[str, int]) -> None:
    """Every rank's file must be visible to rank 0, which completes the checkpoint."""
    for name, size in files.items():
        if not (partial / name).is_file() or (partial / name).stat().st_size != size:
            raise OSError(f"{name}, written by another rank, is not in rank 0's {partial}: save_dir must be "
                          "on a filesystem every node shares (NFS, Lustre, a mounted bucket)")


def _windows(trainer: Trainer, held: Holdings) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
    """This rank's tensors (its shard of masters, optimizer state and frozen flats; rank 0 adds the
    replicated) and the runs of parameters each holds. CPU tensors are written as they are, no copy."""
    tensors: dict[str, torch.Tensor] = {}
    runs: dict[str, list] = {}

    def add(kind: str, window: str, span: Span, tensor: torch.Tensor) -> None:
        entries = [[r.name, r.start, r.at, r.numel] for r in span.runs()]
        if entries:  # a shard of padding only holds nothing
            key = window_key(kind, window)
            tensors[key] = tensor.detach().reshape(-1).cpu()
            runs[key] = entries

    for i, t in enumerate(held.trained):
        add("param", f"@shard{i}", t.own, t.own_part(t.bucket.master))
        for key, value in trainer.optimizer.state.get(t.bucket.master, {}).items():
            if torch.is_tensor(value) and value.shape == t.bucket.master.shape:
                add("optim." + key, f"@shard{i}", t.own, t.own_part(value))
    for j, (flat, span) in enumerate(held.frozen):
        add("param", f"@frozen{j}", span, flat.shard_data)
    if trainer.comm.rank == 0:
        for kind, named in (("param", held.whole), ("buffer", held.buffers)):
            for name, tensor in named:
                add(kind, name, Span.whole(name, tensor.numel()), tensor)
    return tensors, runs


def _serialized_state(trainer: Trainer, held: Holdings, client_state: dict | None) -> tuple[bytes | None, str | None]:
    """state.pt's bytes, checked to load with weights_only=True; or why they cannot be written."""
    optimizer = trainer.optimizer
    scalars: dict[str, dict] = {}
    for t in held.trained:
        values = {k: v for k, v in optimizer.state.get(t.bucket.master, {}).items()
                  if not (torch.is_tensor(v) and v.shape == t.bucket.master.shape)}
        for name in t.held.names:
            scalars[name] = {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in values.items()}
    state = {
        "global_steps": trainer.counters().global_steps,
        "skipped_steps": trainer.counters().skipped_steps,
        "loss_scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
        "lr_scheduler": trainer.lr_scheduler.state_dict() if trainer.lr_scheduler is not None else None,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "scalars": scalars,
        "client_state": client_state if client_state is not None else {},
    }
    where = first_not_plain(state["client_state"], "client_state") or first_not_plain(
        state["lr_scheduler"], "the LR scheduler's state_dict()")
    buffer = io.BytesIO()
    try:
        if where is None:
            torch.save(state, buffer)
            torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as exc:  # what the walk above does not foresee: torch's own message
        where = f"the state ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    if where is not None:
        return None, (f"{where} cannot be stored as plain data. client_state and the LR scheduler's state may "
                      "hold only tensors, numbers, strings, None, and lists, tuples and dicts of them, so that "
                      "checkpoints load without running pickled code; nothing was written")
    return buffer.getvalue(), None


def _manifest(trainer: Trainer, held: Holdings, sizes: dict[str, int]) -> str:
    optimizer = trainer.optimizer
    state_keys = sorted({k for t in held.trained for k, v in optimizer.state.get(t.bucket.master, {}).items()
                         if torch.is_tensor(v) and v.shape == t.bucket.master.shape})
    manifest = {
        "format": FORMAT, "version": VERSION, "zeroshard": __version__, "torch": torch.__version__,
        "world_size": trainer.comm.world_size, "stage": trainer.config.stage,
        "training_dtype": trainer.config.training_dtype, "global_steps": trainer.counters().global_steps,
        "optimizer": type(optimizer).__name__, "optimizer_state": state_keys,
        "param_groups": len(optimizer.param_groups),
        "params": held.param_table(), "buffers": held.buffer_table(),
        "state_dict": _state_dict_keys(trainer),
        "files": dict(sorted(sizes.items())),
    }
    return json.dumps(manifest, indent=1)


def _state_dict_keys(trainer: Trainer) -> dict[str, str]:
    """Each key of the module's state dict -> the parameter or buffer name it is stored under."""
    first: dict[int, str] = {}
    names = trainer.param_names()
    keys = {}
    for key, tensor in trainer.module.state_dict(keep_vars=True).items():
        keys[key] = names.get(id(tensor)) or first.setdefault(id(tensor), key)
    return keys
