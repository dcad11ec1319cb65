"""Writing a sharded checkpoint: every rank writes its shard, rank 0 the state and the manifest.

`engine.save_checkpoint(save_dir)` calls `save` here. A checkpoint holds the
fp32 master weights, the optimizer state, frozen parameters and buffers by
parameter name (`files.py` has the layout), so the reading job may have
another world size, another ZeRO stage or another training dtype than the
writing one (`loading.py`). It runs on every rank of the group and raises the
same error on every rank: a rank that cannot write says so before any rank
goes on, so a failed save leaves the previous checkpoints as they were.

Each rank file's crc32 is computed as its bytes go out (`writer.py`); the
manifest records every file's size and checksum and a save id that rank 0
draws and every file carries, so a load tells a damaged file, or a file of
another save, from a good one. A save whose master weights or optimizer
state hold a non-finite value is refused on every rank before anything is
written: it would replace a good checkpoint with a diverged one.

With `exclude_frozen_parameters=True` no frozen parameter is written, only
their fingerprints in the manifest (`frozen.py`): the checkpoint holds the
trainable state, and resumes onto the base model loaded again.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import uuid
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from zeroshard.checkpoint.checks import as_error, first_not_plain, holdings
from zeroshard.checkpoint.client_state import NotPlain, to_plain
from zeroshard.checkpoint.files import (
    FORMAT,
    MANIFEST,
    STATE,
    VERSION,
    CheckpointError,
    check_tag,
    commit,
    partial_dir,
    rank_file,
    runs_metadata,
    sealed,
    window_key,
    write_bytes,
)
from zeroshard.checkpoint.frozen import EXCLUDED, save_record
from zeroshard.checkpoint.holdings import Holdings, Span
from zeroshard.checkpoint.model_config import hf_config
from zeroshard.checkpoint.rank_state import rank_state
from zeroshard.checkpoint.protocol import Checkpointable
from zeroshard.checkpoint.turns import Surveyed, Turns, own_tensor, owned_everywhere, survey
from zeroshard.checkpoint.writer import bytes_entry, write_streamed
from zeroshard.comm import Comm, all_gather_object
from zeroshard.comm.agreement import agree
from zeroshard.core.optimizers import optimizer_name
from zeroshard.version import __version__

log = logging.getLogger(__name__)


# -- save ---------------------------------------------------------------------------


def save(trainer: Checkpointable, save_dir: str | Path, tag: str | int | float | None = None,
         client_state: dict | None = None, save_latest: bool = True, exclude_frozen_parameters: bool = False) -> Path:
    """Write the trainer's training state to `save_dir/tag` (default tag: global_step<N>); returns that path.

    A number as tag (DeepSpeed's getting-started loop passes `loss.item()`) names the directory `str(tag)`.
    Ranks that ask for different tags (each its own loss) follow the config's `checkpoint.tag_validation`,
    as DeepSpeed's: "Warn" (default) writes rank 0's with a warning on rank 0, "Ignore" writes rank 0's
    silently, "Fail" raises `CheckpointError` on every rank before anything is written.
    `exclude_frozen_parameters`: the trainable state only, no frozen parameter (`frozen.py`).
    """
    began = begin(trainer, save_dir, tag, client_state, exclude_frozen_parameters)
    comm, entries = trainer.comm, {}

    def write_shard() -> None:
        windows, runs = windows_of(trainer, began.held, began.surveyed)
        path = began.partial / rank_file(comm.rank)
        entries[rank_file(comm.rank)] = _write_windows(trainer, path, windows, began.metadata(runs))

    agree(comm, as_error(attempt(write_shard, f"cannot write its shard to {began.partial}")))
    return publish(comm, began, all_gather_object(comm, entries), save_latest)


@dataclass
class Began:
    """A save once every rank has agreed to write it: its tag, save id and partial directory, what each
    bucket holds, and (rank 0) state.pt's bytes and the manifest of the save's step, less its files."""

    save_dir: Path
    tag: str
    save_id: str
    partial: Path
    rank: int
    started: int | None  # rank 0: the partial directory's creation time (older partial directories are stale)
    held: Holdings
    surveyed: list[Surveyed]
    state: bytes | None  # rank 0
    manifest: dict | None  # rank 0

    def metadata(self, runs: dict[str, list]) -> dict[str, str]:
        """A rank file's metadata: whose file it is, of which save, and the runs each tensor holds."""
        return {"format": FORMAT, "rank": str(self.rank), "save_id": self.save_id, "runs": runs_metadata(runs)}


def begin(trainer: Checkpointable, save_dir: str | Path, tag: str | int | float | None,
          client_state: dict | None, exclude_frozen: bool = False) -> Began:
    """Everything of a save before a rank file is written, agreed by every rank: the checks (boundary, tag,
    finite state, plain client_state), rank 0's state.pt and manifest of this step, the partial directory.
    `exclude_frozen`: the frozen parameters are not written, their fingerprints go into the manifest."""
    trainer.check_checkpoint_boundary("save_checkpoint")
    if not isinstance(save_dir, (str, os.PathLike)):
        raise CheckpointError(f"save_dir must be a path (str or pathlib.Path); got {type(save_dir).__name__}")
    tag = f"global_step{trainer.counters().global_steps}" if tag is None else tag
    save_dir = Path(save_dir)
    comm, held = trainer.comm, holdings(trainer)
    held = held.without_frozen() if exclude_frozen else held
    left_out = save_record(held, comm) if exclude_frozen else None  # every rank: one gather
    save_id = uuid.uuid4().hex if comm.rank == 0 else None  # rank 0's, shared with the tag below
    state, manifest, error = None, None, None
    try:
        tag = check_tag(tag)
    except CheckpointError as exc:  # agreed below, so that no rank waits for one that stopped here
        error = str(exc)
    surveyed, unfit = _survey(trainer, held)
    error = error or unfit
    owned, unread = owned_everywhere(trainer, held)  # every rank, whatever its own error: one gather
    error = error or unread
    if comm.rank == 0 and error is None:
        state, error = _serialized_state(trainer, held, surveyed, client_state, save_id, owned["scalars"])
        manifest = _manifest(trainer, held, surveyed, save_id, owned["shapes"]) | (
            {EXCLUDED: left_out} if exclude_frozen else {})
    agree(comm, as_error(error))
    tag, save_id = _agreed_tag(comm, tag, save_id, trainer.config.checkpoint.tag_validation)
    partial = partial_dir(save_dir, tag)
    started: list[int] = []
    if comm.rank == 0:
        error = attempt(lambda: started.append(_fresh_dir(save_dir, partial)), f"cannot create {partial}")
    agree(comm, as_error(error))
    return Began(save_dir, tag, save_id, partial, comm.rank, (started or [None])[0], held, surveyed, state, manifest)


def publish(comm: Comm, began: Began, everyone: list[dict[str, dict]], save_latest: bool) -> Path:
    """Complete a save whose rank files are written (`everyone`: each rank's manifest entries): rank 0 checks
    it sees every file, writes state.pt and the manifest, renames the tag into place and points `latest` at
    it; every rank returns once that is done, or raises the same error (earlier checkpoints intact)."""
    error = None
    if comm.rank == 0:
        files = {name: entry for rank_entries in everyone for name, entry in rank_entries.items()}

        def finish() -> None:
            _check_shared(began.partial, files)
            write_bytes(began.partial / STATE, began.state)
            files[STATE] = bytes_entry(began.state)
            write_bytes(began.partial / MANIFEST, sealed(began.manifest | {"files": dict(sorted(files.items()))}).encode())
            commit(began.save_dir, began.tag, save_latest)
            _remove_stale(began.save_dir, began.started)

        error = attempt(finish, f"cannot complete {began.partial}")
    agree(comm, as_error(error))  # every rank returns once the tag is in place
    if comm.rank == 0:
        log.info("saved checkpoint %s (%d rank files)", began.save_dir / began.tag, comm.world_size)
    return began.save_dir / began.tag


def _survey(trainer: Checkpointable, held: Holdings) -> tuple[list[Surveyed], str | None]:
    """`survey`: the masters and optimizer state as the trainer holds them, a group at a time (offload: read
    from disk); state that cannot be read back is an error every rank raises, not one rank's exception."""
    try:
        return survey(trainer, held)
    except Exception as exc:
        return [], (f"cannot read its master weights and optimizer state ({type(exc).__name__}: {exc}); nothing "
                    "was written and earlier checkpoints are intact")


def _agreed_tag(comm: Comm, tag: str, save_id: str | None, validation: str) -> tuple[str, str]:
    """Rank 0's tag and save id (one gather for both). Ranks that asked for different tags: by `validation`
    (config `checkpoint.tag_validation`), a warning on rank 0 ("Warn"), nothing ("Ignore"), or the same
    `CheckpointError` on every rank ("Fail"; every rank has every tag, so none waits for another)."""
    asked = all_gather_object(comm, (tag, save_id))
    tags = [t for t, _ in asked]
    if len(set(tags)) == 1 or validation == "Ignore":
        return asked[0]
    listed = _tags_by_rank(tags)
    if validation == "Fail":
        raise CheckpointError(f"the ranks asked for different checkpoint tags ({listed}) and the config's "
                              "checkpoint.tag_validation is \"Fail\": pass the same tag on every rank (or none: "
                              "global_step<N>); nothing was written")
    if comm.rank == 0:
        log.warning("the ranks asked for different checkpoint tags (%s); every rank writes rank 0's, '%s' "
                    "(pass the same tag on every rank, or none: global_step<N>; config checkpoint.tag_validation "
                    "\"Ignore\" silences this, \"Fail\" makes it an error)", listed, tags[0])
    return asked[0]


def _tags_by_rank(tags: list[str], shown: int = 4) -> str:
    """The first few ranks' tags (rank 0: '0.52', rank 1: '0.61', ... (8 ranks)): a thousand ranks' losses
    would make a message no one reads."""
    listed = ", ".join(f"rank {rank}: {t!r}" for rank, t in enumerate(tags[:shown]))
    return listed if len(tags) <= shown else f"{listed}, ... ({len(tags)} ranks)"


def attempt(action, what: str) -> str | None:
    """Run `action`; its failure becomes the message every rank raises (the previous tags stay intact).

    Any exception, not only OSError (a tensor of a dtype safetensors cannot store, say): a rank that
    raised alone would leave the others waiting in the next agreement.
    """
    try:
        action()
    except Exception as exc:
        return f"{what} ({exc}); the save was abandoned and earlier checkpoints are intact"
    return None


def _fresh_dir(save_dir: Path, partial: Path) -> int:
    """Create the partial directory (its mode follows the umask); returns its creation time (ns)."""
    save_dir.mkdir(parents=True, exist_ok=True)
    if partial.exists():  # left by a save that failed
        shutil.rmtree(partial)
    partial.mkdir()
    return partial.stat().st_mtime_ns


def _remove_stale(save_dir: Path, started: int) -> None:
    """Remove the partial directories of saves that died before this one began, whatever their tag.

    Only older ones: a partial directory changed since this save began may be another job's save
    in progress. A directory that cannot be removed is left for the next save.
    """
    try:
        stale = [p for p in save_dir.glob(".*.partial") if p.is_dir() and p.stat().st_mtime_ns < started]
    except OSError:  # a directory listed, then removed by another job's save: next time
        return
    for directory in stale:
        shutil.rmtree(directory, ignore_errors=True)
        log.info("removed %s, left by a save that did not complete", directory)


def _check_shared(partial: Path, files: dict[str, dict]) -> None:
    """Every rank's file must be visible to rank 0, which completes the checkpoint."""
    for name, entry in files.items():
        if not (partial / name).is_file() or (partial / name).stat().st_size != entry["size"]:
            raise OSError(f"{name}, written by another rank, is not in rank 0's {partial}: save_dir must be "
                          "on a filesystem every node shares (NFS, Lustre, a mounted bucket)")


@dataclass(frozen=True)
class _Window:
    """One tensor of a rank file: its dtype and elements, the turn of `resident_buckets` that holds it in
    memory (-1: always in memory), and how to get it then."""

    dtype: torch.dtype
    numel: int
    turn: int
    get: Callable[[], torch.Tensor]


def windows_of(trainer: Checkpointable, held: Holdings, surveyed: list[Surveyed]
             ) -> tuple[dict[str, _Window], dict[str, list]]:
    """This rank's tensors (its shard of masters, optimizer state and frozen flats; rank 0 adds the
    replicated; its own PowerSGD state, `rank_state.py`) and the runs of parameters each holds, less the
    frozen parameters the save leaves out (`held.not_stored`). CPU tensors are written as they are, no copy."""
    windows: dict[str, _Window] = {}
    runs: dict[str, list] = {}

    def add(kind: str, window: str, span: Span, dtype: torch.dtype, numel: int, turn: int, get) -> None:
        entries = [[r.name, r.start, r.at, r.numel] for r in held.stored_runs(span)]
        if entries:  # a shard of padding only (or of frozen parameters left out) holds nothing
            key = window_key(kind, window)
            windows[key] = _Window(dtype, numel, turn, get)
            runs[key] = entries

    for i, (t, seen) in enumerate(zip(held.trained, surveyed)):
        for kind, (dtype, numel) in seen.tensors.items():  # in memory during the bucket's turn only
            add(kind, f"@shard{i}", seen.spans.get(kind, t.own), dtype, numel, seen.turn,
                lambda t=t, kind=kind: own_tensor(trainer.optimizer, t, kind))
    always = [("param", f"@frozen{j}", span, flat.shard_data) for j, (flat, span) in enumerate(held.frozen)]
    if trainer.comm.rank == 0:  # what every rank holds whole: parameters in no flat buffer, the module's buffers
        always += [(kind, name, Span.whole(name, tensor.numel()), tensor)
                   for kind, named in (("param", held.whole), ("buffer", held.buffers)) for name, tensor in named]
    for kind, window, span, tensor in always:
        add(kind, window, span, tensor.dtype, tensor.numel(), -1, lambda tensor=tensor: tensor.detach().reshape(-1))
    for key, tensor in rank_state(trainer.buckets).items():  # this rank's own, no parameter's pieces: no runs
        windows[key] = _Window(tensor.dtype, tensor.numel(), -1, lambda tensor=tensor: tensor)
    return windows, runs


def _write_windows(trainer: Checkpointable, path: Path, windows: dict[str, _Window], metadata: dict[str, str]) -> dict:
    """The rank file, a turn of the trainer's buckets at a time: what is always in memory first, then each
    bucket's tensors in the order of its turn, so each group of the disk tier is read once."""
    order = sorted(windows, key=lambda key: (windows[key].turn, key))
    with closing(Turns(trainer)) as turns:
        def fetch(key: str) -> torch.Tensor:
            if windows[key].turn >= 0:
                turns.reach(windows[key].turn)
            return windows[key].get()

        return write_streamed(path, {key: (windows[key].dtype, windows[key].numel) for key in order}, fetch, metadata)


def _serialized_state(trainer: Checkpointable, held: Holdings, surveyed: list[Surveyed], client_state: dict | None,
                      save_id: str, owned_scalars: dict[str, dict]) -> tuple[bytes | None, str | None]:
    """state.pt's bytes, checked to load with weights_only=True; or why they cannot be written.
    `owned_scalars`: the scalars of the tensors owned whole, from every rank."""
    optimizer = trainer.optimizer
    scalars: dict[str, dict] = {}
    for t, seen in zip(held.trained, surveyed):  # the state not laid out like the master: always in memory
        values = {k: v for k, v in optimizer.state.get(t.bucket.master, {}).items() if k not in seen.state_keys}
        for name in t.held.names:
            scalars[name] = {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in values.items()}
    scalars |= owned_scalars
    state = {
        "global_steps": trainer.counters().global_steps,
        "skipped_steps": trainer.counters().skipped_steps,
        "loss_scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
        "lr_scheduler": trainer.lr_scheduler.state_dict() if trainer.lr_scheduler is not None else None,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "scalars": scalars,
        "client_state": {},
        "save_id": save_id,
    }
    try:
        state["client_state"] = to_plain(client_state if client_state is not None else {})
        where = first_not_plain(state["lr_scheduler"], "the LR scheduler's state_dict()")
    except NotPlain as exc:
        where = str(exc)
    buffer = io.BytesIO()
    try:
        if where is None:
            torch.save(state, buffer)
            torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as exc:  # what the walk above does not foresee: torch's own message
        where = f"the state ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    if where is not None:
        return None, (f"{where} cannot be stored as plain data. client_state and the LR scheduler's state may "
                      "hold only tensors, numbers, strings, None, and lists, tuples and dicts of them (and, in "
                      "client_state, pathlib.Path and argparse.Namespace), so that "
                      "checkpoints load without running pickled code; nothing was written")
    return buffer.getvalue(), None


def _manifest(trainer: Checkpointable, held: Holdings, surveyed: list[Surveyed], save_id: str,
              owned_shapes: dict[str, dict[str, list[int]]]) -> dict:
    """The manifest of the save's step, less `files` (added when every rank's file is written).
    "group_state": each param group's state keys laid out like the master; "owned_state": name -> key ->
    shape of the state of each tensor owned whole (`owned_shapes`, from every rank)."""
    optimizer = trainer.optimizer
    state_keys = sorted({k for seen in surveyed for k in seen.state_keys} | {
        k for keys in owned_shapes.values() for k in keys})
    group_state = [sorted({k for t, seen in zip(held.trained, surveyed) if t.bucket.param_group == g
                           for k in seen.state_keys}) for g in range(len(optimizer.param_groups))]
    manifest = {
        "format": FORMAT, "version": VERSION, "zeroshard": __version__, "torch": torch.__version__,
        "world_size": trainer.comm.world_size, "stage": trainer.config.stage,
        "training_dtype": trainer.config.training_dtype, "global_steps": trainer.counters().global_steps,
        "optimizer": optimizer_name(optimizer), "optimizer_state": state_keys,
        "group_state": group_state, "owned_state": owned_shapes,
        "param_groups": len(optimizer.param_groups),
        "params": held.param_table(), "buffers": held.buffer_table(),
        "state_dict": _state_dict_keys(trainer),
        "hf_config": hf_config(trainer.module),  # a transformers model's config.json, for consolidate
        "save_id": save_id,
    }
    return manifest


def _state_dict_keys(trainer: Checkpointable) -> dict[str, str]:
    """Each key of the module's state dict -> the parameter or buffer name it is stored under."""
    first: dict[int, str] = {}
    names = trainer.param_names()
    keys = {}
    for key, tensor in trainer.module.state_dict(keep_vars=True).items():
        keys[key] = names.get(id(tensor)) or first.setdefault(id(tensor), key)
    return keys
