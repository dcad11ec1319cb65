"""Sharded checkpoints of an engine: every rank writes its shard, any job reads them back.

`engine.save_checkpoint(save_dir)` and `engine.load_checkpoint(load_dir)`
call `save` and `load` here. A checkpoint holds the fp32 master weights,
the optimizer state, frozen parameters and buffers by parameter name
(`checkpoint_files.py` has the layout), so the reading job may have another
world size, another ZeRO stage or another training dtype than the writing
one. Both run on every rank of the group and raise the same error on every
rank: a rank that cannot write or read says so before any rank changes
anything, so a failed save leaves the previous checkpoint and a failed load
leaves the engine as they were.
"""

from __future__ import annotations

import io
import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

import zeroshard
from zeroshard.checkpoint_checks import check_boundary, first_not_plain, mismatch
from zeroshard.checkpoint_files import (
    FORMAT,
    MANIFEST,
    STATE,
    VERSION,
    CheckpointError,
    PieceReader,
    check_tag,
    commit,
    fsync_file,
    partial_dir,
    rank_file,
    read_manifest,
    read_state,
    resolve,
    runs_metadata,
    window_key,
    write_bytes,
)
from zeroshard.comm import Comm, all_gather_object
from zeroshard.holdings import Holdings, Span

if TYPE_CHECKING:
    from zeroshard.engine import Engine

log = logging.getLogger(__name__)

# Param-group keys the engine chooses for the device at hand; a checkpoint does not carry them over.
_IMPLEMENTATION_KEYS = {"params", "fused", "foreach", "capturable", "differentiable"}


def agree(comm: Comm, error: str | None) -> None:
    """Raise the same CheckpointError on every rank if any rank has an error."""
    errors = all_gather_object(comm, error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, first = failed[0]
        raise CheckpointError(first if comm.world_size == 1 else f"rank {rank}: {first}")


def holdings(engine: "Engine") -> Holdings:
    frozen = [f for mu in engine.module_units for f in mu.frozen]
    return Holdings.of(engine.module, engine.units, frozen, engine._names)


# -- save ---------------------------------------------------------------------------


def save(engine: "Engine", save_dir: str | Path, tag: str | None = None,
         client_state: dict | None = None, save_latest: bool = True) -> Path:
    """Write the engine's training state to `save_dir/tag` (default tag: global_step<N>); returns that path."""
    check_boundary(engine, "save_checkpoint")
    tag = tag or f"global_step{engine.global_steps}"
    save_dir = Path(save_dir)
    comm, held = engine.comm, holdings(engine)
    state, error = None, None
    try:
        check_tag(tag)
    except CheckpointError as exc:  # agreed below, so that no rank waits for one that stopped here
        error = str(exc)
    if comm.rank == 0 and error is None:
        state, error = _serialized_state(engine, held, client_state)
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
        tensors, runs = _windows(engine, held)
        save_file(tensors, str(path), metadata={"format": FORMAT, "rank": str(comm.rank), "runs": runs_metadata(runs)})
        sizes[path.name] = fsync_file(path)

    agree(comm, _attempt(write_shard, f"cannot write its shard to {partial}"))
    everyone = all_gather_object(comm, sizes)
    if comm.rank == 0:
        files = {name: size for rank_sizes in everyone for name, size in rank_sizes.items()}

        def finish() -> None:
            _check_shared(partial, files)
            files[STATE] = write_bytes(partial / STATE, state)
            write_bytes(partial / MANIFEST, _manifest(engine, held, files).encode())
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


def _windows(engine: "Engine", held: Holdings) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
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
        add("param", f"@shard{i}", t.own, t.own_part(t.unit.master))
        for key, value in engine.optimizer.state.get(t.unit.master, {}).items():
            if torch.is_tensor(value) and value.shape == t.unit.master.shape:
                add("optim." + key, f"@shard{i}", t.own, t.own_part(value))
    for j, (flat, span) in enumerate(held.frozen):
        add("param", f"@frozen{j}", span, flat.shard_data)
    if engine.comm.rank == 0:
        for kind, named in (("param", held.whole), ("buffer", held.buffers)):
            for name, tensor in named:
                add(kind, name, Span.whole(name, tensor.numel()), tensor)
    return tensors, runs


def _serialized_state(engine: "Engine", held: Holdings, client_state: dict | None) -> tuple[bytes | None, str | None]:
    """state.pt's bytes, checked to load with weights_only=True; or why they cannot be written."""
    optimizer = engine.optimizer
    scalars: dict[str, dict] = {}
    for t in held.trained:
        values = {k: v for k, v in optimizer.state.get(t.unit.master, {}).items()
                  if not (torch.is_tensor(v) and v.shape == t.unit.master.shape)}
        for name in t.held.names:
            scalars[name] = {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in values.items()}
    state = {
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
        "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
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


def _manifest(engine: "Engine", held: Holdings, sizes: dict[str, int]) -> str:
    optimizer = engine.optimizer
    state_keys = sorted({k for t in held.trained for k, v in optimizer.state.get(t.unit.master, {}).items()
                         if torch.is_tensor(v) and v.shape == t.unit.master.shape})
    manifest = {
        "format": FORMAT, "version": VERSION, "zeroshard": zeroshard.__version__, "torch": torch.__version__,
        "world_size": engine.comm.world_size, "stage": engine.config.stage,
        "training_dtype": engine.config.training_dtype, "global_steps": engine.global_steps,
        "optimizer": type(optimizer).__name__, "optimizer_state": state_keys,
        "param_groups": len(optimizer.param_groups),
        "params": held.param_table(), "buffers": held.buffer_table(),
        "state_dict": _state_dict_keys(engine),
        "files": dict(sorted(sizes.items())),
    }
    return json.dumps(manifest, indent=1)


def _state_dict_keys(engine: "Engine") -> dict[str, str]:
    """Each key of the module's state dict -> the parameter or buffer name it is stored under."""
    first: dict[int, str] = {}
    keys = {}
    for key, tensor in engine.module.state_dict(keep_vars=True).items():
        keys[key] = engine._names.get(id(tensor)) or first.setdefault(id(tensor), key)
    return keys


# -- load ---------------------------------------------------------------------------


def load(engine: "Engine", load_dir: str | Path, tag: str | None = None, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True, load_module_only: bool = False) -> tuple[Path, dict]:
    """Read a checkpoint into the engine; returns (the tag directory, the saved client_state).

    As DeepSpeed: the weights always; the step counters and fp16 loss scale
    unless `load_module_only`; the optimizer state and param-group settings,
    and the LR scheduler, when their flags say so and not `load_module_only`.
    """
    if load_module_only:
        load_optimizer_states = load_lr_scheduler_states = False
    check_boundary(engine, "load_checkpoint")
    comm, held = engine.comm, holdings(engine)
    path, manifest, state, reader, error = None, None, None, None, None
    try:
        path = resolve(load_dir, tag)
        manifest = read_manifest(path)
        state = read_state(path)
        reader = PieceReader(path, manifest)
        error = mismatch(engine, held, manifest, reader, load_optimizer_states)
    except CheckpointError as exc:
        error = str(exc)
    try:
        agree(comm, error)
        _load_values(engine, held, reader)
        if load_optimizer_states:
            _load_optimizer(engine, held, reader, manifest, state)
        if not load_module_only:
            _load_counters(engine, state)
        if load_lr_scheduler_states and engine.lr_scheduler is not None and state["lr_scheduler"] is not None:
            engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    finally:
        if reader is not None:
            reader.close()
    if comm.rank == 0:
        log.info("loaded checkpoint %s (written by %d ranks at stage %d, step %d)", path,
                 manifest["world_size"], manifest["stage"], manifest["global_steps"])
    return path, state["client_state"]


def _load_values(engine: "Engine", held: Holdings, reader: PieceReader) -> None:
    """Masters, frozen parameters and buffers; then the 16-bit parameters and replicas follow the masters."""
    if engine.schedule is not None:
        engine.schedule.release_all()  # shards change under the gathered buffers
    for t in held.trained:
        for run in t.held.runs():
            reader.read_into("param", run.name, run.start, t.unit.master[run.at : run.at + run.numel])
    for flat, span in held.frozen:
        for run in span.runs():
            reader.read_into("param", run.name, run.start, flat.shard_data[run.at : run.at + run.numel])
    for kind, tensors in (("param", held.whole), ("buffer", held.buffers)):
        for name, tensor in tensors:
            values = torch.empty(tensor.numel(), dtype=tensor.dtype)
            reader.read_into(kind, name, 0, values)
            with torch.no_grad():
                tensor.copy_(values.view(tensor.shape))
    for t in held.trained:
        t.unit.cast_master_to_params()
    for pending in [t.unit.gather_params(engine.comm) for t in held.trained if t.unit.gathers_after_step]:
        pending.wait()


def _load_optimizer(engine: "Engine", held: Holdings, reader: PieceReader, manifest: dict, state: dict) -> None:
    """Rebuild the optimizer's state for this job's masters, through torch's own load_state_dict."""
    optimizer = engine.optimizer
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    tensors: dict[int, dict] = {}
    for t in held.trained:
        scalars = state["scalars"].get(t.held.names[0], {})
        if not scalars and not manifest["optimizer_state"]:
            continue  # saved before the first step: no state yet
        entry = dict(scalars)
        for key in manifest["optimizer_state"]:
            values = torch.zeros_like(t.unit.master)
            for run in t.held.runs():
                reader.read_into("optim." + key, run.name, run.start, values[run.at : run.at + run.numel])
            entry[key] = values
        tensors[index[id(t.unit.master)]] = entry
    groups = [{**{k: v for k, v in saved.items() if k not in _IMPLEMENTATION_KEYS},
               **{k: v for k, v in group.items() if k in _IMPLEMENTATION_KEYS - {"params"}},
               "params": [index[id(p)] for p in group["params"]]}
              for saved, group in zip(state["param_groups"], optimizer.param_groups)]
    optimizer.load_state_dict({"state": tensors, "param_groups": groups})


def _load_counters(engine: "Engine", state: dict) -> None:
    engine.global_steps = state["global_steps"]
    engine.skipped_steps = state["skipped_steps"]
    engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps
    if engine.scaler is not None and state["loss_scaler"] is not None:
        engine.scaler.load_state_dict(state["loss_scaler"])
    elif engine.scaler is not None and engine.comm.rank == 0:
        log.info("the checkpoint was not written in fp16: the loss scale starts at %g", engine.loss_scale)
