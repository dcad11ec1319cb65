"""Whether a checkpoint and an engine fit: every reason a save or load must stop, as one sentence.

Each check returns (or raises) a message that names the cause and the fix;
`as_error` makes it the CheckpointError that comm/agreement.py's `agree` has
every rank raise before anything changes.
"""

from __future__ import annotations

import math

import torch

from zeroshard.checkpoint.files import CheckpointError, group_state_keys
from zeroshard.checkpoint.holdings import Holdings, Span, Trained
from zeroshard.checkpoint.pieces import PieceReader
from zeroshard.checkpoint.protocol import Checkpointable
from zeroshard.core.optimizers import optimizer_name


def as_error(why: str | None) -> CheckpointError | None:
    """This rank's reason a save or load must stop, as the error every rank raises (`comm.agreement.agree`:
    the lowest failed rank's, its rank in front when there are others); None when it has none."""
    return None if why is None else CheckpointError(why)


def holdings(trainer: Checkpointable) -> Holdings:
    """What this rank of `trainer` holds, by kind and parameter name."""
    return Holdings.of(trainer.module, trainer.buckets, trainer.frozen_flats(), trainer.param_names())


def nonfinite(t: Trained, tensors: dict[str, torch.Tensor], step: int, spans: dict[str, Span]) -> str | None:
    """Why this bucket's part of a save must not be written: its first non-finite fp32 master weight or
    optimizer state element, by parameter name; None when every element is finite. `tensors`: the rank's
    own part of the master ("param") and of each optimizer state tensor ("optim.<key>"), in memory; `spans`:
    the kinds laid out by owned tensor, not like the master.

    One sum per tensor decides (a NaN or inf anywhere makes it non-finite; it reads the shard once and
    allocates nothing); only then is the element found, in chunks of `_CHUNK` elements, so that the
    search allocates a small mask, not one of the shard's size.
    """
    for kind, tensor in tensors.items():
        if not tensor.is_floating_point() or bool(torch.isfinite(tensor.sum())):
            continue  # (a finite tensor whose sum overflows is searched, and passes)
        what, verb = ("master weights", "hold") if kind == "param" else (
            f"optimizer state '{kind.removeprefix('optim.')}'", "holds")
        for run in spans.get(kind, t.own).runs():
            at = _first_nonfinite(tensor[run.at : run.at + run.numel])
            if at is not None:
                return (f"the {what} of '{run.name}' {verb} {tensor[run.at + at].item()} (element "
                        f"{run.start + at}) at step {step}: a checkpoint of them would replace good states with "
                        "diverged ones, so nothing was written and earlier checkpoints are intact. Find where "
                        "the run diverged (its losses, engine.skipped_steps), then load the last good checkpoint")
    return None


_CHUNK = 1 << 18  # elements per finiteness test: a 256 KiB mask whatever the shard's size


def _first_nonfinite(values: torch.Tensor) -> int | None:
    for start in range(0, values.numel(), _CHUNK):
        bad = ~torch.isfinite(values[start : start + _CHUNK])
        if bad.any():
            return start + int(bad.nonzero()[0, 0])
    return None


def first_not_plain(value, where: str) -> str | None:
    """Where in `value` the first object torch.load(weights_only=True) would refuse is, with its type."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return f"{where} (a {type(value).__module__}.{type(value).__qualname__})"
    for key, item in items:
        if not isinstance(key, (bool, int, float, str)) and key is not None:
            return f"a key of {where} (a {type(key).__qualname__})"
        found = first_not_plain(item, f"{where}[{key!r}]")
        if found is not None:
            return found
    return None


def mismatch(optimizer: torch.optim.Optimizer, held: Holdings, manifest: dict, reader: PieceReader,
             with_optimizer: bool) -> str | None:
    """Why this checkpoint cannot be loaded into this engine, or None."""
    error = _model_mismatch(held, manifest) or _left_out_but_trained(held)
    if error is None and with_optimizer:
        error = _optimizer_mismatch(optimizer, held, manifest)
    if error is not None:
        return error
    needs = []
    for t in held.trained:
        keys = group_state_keys(manifest, t.bucket.param_group) if with_optimizer else []
        needs += [(k, r.name, r.start, r.numel) for k in ["param"] + ["optim." + k for k in keys]
                  for r in t.held.runs()]
        owned = manifest.get("owned_state", {}) if with_optimizer else {}
        needs += [("optim." + key, name, 0, math.prod(shape))
                  for name, _ in t.owned() for key, shape in owned.get(name, {}).items()]
    needs += [("param", r.name, r.start, r.numel) for _, span in held.frozen for r in held.stored_runs(span)]
    needs += [(kind, name, 0, tensor.numel()) for kind, named in (("param", held.whole), ("buffer", held.buffers))
              for name, tensor in named if kind == "buffer" or name not in held.not_stored]
    for kind, name, start, numel in needs:
        why = reader.missing(kind, name, start, numel)
        if why is not None:
            return f"{why}: the checkpoint is incomplete or damaged; load an earlier tag"
    return None


def _model_mismatch(held: Holdings, manifest: dict) -> str | None:
    mine, theirs = held.param_table(), manifest["params"]
    missing = [n for n in mine if n not in theirs]
    unexpected = [n for n in theirs if n not in mine]
    shapes = [f"'{n}' {theirs[n]['shape']} vs {mine[n]['shape']}" for n in mine
              if n in theirs and theirs[n]["shape"] != mine[n]["shape"]]
    buffers, their_buffers = held.buffer_table(), manifest["buffers"]
    shapes += [f"buffer '{n}' {their_buffers[n]['shape']} vs {b['shape']}" for n, b in buffers.items()
               if n in their_buffers and their_buffers[n]["shape"] != b["shape"]]
    missing += [f"buffer '{n}'" for n in buffers if n not in their_buffers]
    unexpected += [f"buffer '{n}'" for n in their_buffers if n not in buffers]
    if not (missing or unexpected or shapes):
        return None
    parts = [f"{label} ({len(items)}): {', '.join(items[:5])}{f' and {len(items) - 5} more' if len(items) > 5 else ''}"
             for label, items in (("missing from the checkpoint", missing), ("not in this model", unexpected),
                                  ("shape in checkpoint vs model", shapes)) if items]
    return ("the checkpoint was written for another model: " + "; ".join(parts) +
            ". Build the model the checkpoint was saved from, or load the weights you want into this model "
            "(model.load_state_dict(..., strict=False)) before zeroshard.initialize")


def _left_out_but_trained(held: Holdings) -> str | None:
    """A parameter trained here that the checkpoint left out as frozen (it has no values of it to load)."""
    trained = [name for t in held.trained for name in t.held.names if name in held.not_stored]
    if not trained:
        return None
    return (f"the checkpoint was saved without its frozen parameters (exclude_frozen_parameters=True), and "
            f"{len(trained)} parameters frozen then are trained here: {', '.join(trained[:5])}"
            f"{' and more' if len(trained) > 5 else ''}; it holds no values of them. Freeze them as the saving "
            "run did (requires_grad=False before initialize), or load a checkpoint saved with its frozen parameters")


def _optimizer_mismatch(optimizer: torch.optim.Optimizer, held: Holdings, manifest: dict) -> str | None:
    fix = ("; pass load_optimizer_states=False to keep this engine's optimizer state (or load_module_only=True "
           "for the weights alone)")
    name = optimizer_name(optimizer)
    if manifest["optimizer"] != name:
        return f"the checkpoint's optimizer state is {manifest['optimizer']}'s, this engine's optimizer is {name}" + fix
    if manifest["param_groups"] != len(optimizer.param_groups):
        return (f"the checkpoint's optimizer has {manifest['param_groups']} param groups, this engine's has "
                f"{len(optimizer.param_groups)}" + fix)
    saved_groups = {n: p["group"] for n, p in manifest["params"].items()}
    for n, p in held.param_table().items():
        if p["group"] is not None and saved_groups[n] != p["group"]:
            where = "frozen" if saved_groups[n] is None else f"in param group {saved_groups[n]}"
            return (f"parameter '{n}' is in param group {p['group']} here but was {where} when the checkpoint "
                    "was saved, so its optimizer state and settings do not carry over" + fix)
    return None
