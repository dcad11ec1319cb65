"""A checkpoint without its frozen parameters (`exclude_frozen_parameters=True`, DeepSpeed's argument).

A LoRA or other adapter fine-tune trains a small part of a large frozen base;
its checkpoint need hold only the trained state (their fp32 masters and
optimizer state, the counters, scheduler, loss scale and client_state). The
frozen base is left out, and a resume loads it again the way the run first
did (`from_pretrained`, the same init) before `load_checkpoint`.

So that a resume onto another base is refused rather than trained on, the
manifest keeps every parameter's name, shape and dtype (`params`, as any
checkpoint) and, under `frozen_excluded`, a fingerprint of each frozen
parameter's values: a sum over its bytes, each weighted by its position in
the parameter, modulo the prime 2**31 - 1. A sum of pieces is the sum of
the whole, so each rank adds up the pieces it holds (stage 3's frozen
shards; a share of the replicated ones below stage 3) and the fingerprint
is the same for any world size and stage; one byte changed, or two bytes
swapped, changes it. A load compares the engine's frozen parameters with
it before anything changes (`load_check`).
"""

from __future__ import annotations

import torch

from zeroshard.checkpoint.holdings import Holdings
from zeroshard.comm import Comm, all_gather_object
from zeroshard.dtypes import from_torch_name

EXCLUDED = "frozen_excluded"  # the manifest's key: frozen parameter name -> fingerprint (8 hex digits)
_PRIME = (1 << 31) - 1
_CHUNK = 1 << 22  # bytes a step: 256 x 2**31 x 2**22 < 2**63, so an int64 sum cannot overflow


def _weighted_sum(values: torch.Tensor, start: int) -> int:
    """Sum of the bytes of 1-D `values` (elements `start`... of its parameter), each times its byte's position
    in the parameter plus one, modulo `_PRIME`."""
    raw = values.detach().contiguous().view(torch.uint8)
    first, total = start * values.element_size(), 0
    for lo in range(0, raw.numel(), _CHUNK):
        piece = raw[lo : lo + _CHUNK].to(torch.int64)
        weights = torch.arange(first + lo + 1, first + lo + 1 + piece.numel(), dtype=torch.int64,
                               device=piece.device) % _PRIME
        total += int((piece * weights).sum())
    return total % _PRIME


def fingerprints(held: Holdings, comm: Comm, dtypes: dict[str, torch.dtype]) -> dict[str, str]:
    """The fingerprint of each frozen parameter of `held` named in `dtypes`, its values taken in that dtype
    (the one the checkpoint records), by name. Every rank calls it (one gather)."""
    sums: dict[str, int] = {}
    for flat, span in held.frozen:  # stage 3: this rank's shard of each frozen flat
        for run in span.runs():
            if run.name in dtypes:
                piece = flat.shard_data[run.at : run.at + run.numel].to(dtypes[run.name])
                sums[run.name] = sums.get(run.name, 0) + _weighted_sum(piece, run.start)
    shared = [(name, tensor) for name, tensor in held.whole if name in dtypes]
    for name, tensor in shared[comm.rank :: comm.world_size]:  # replicated: each rank sums a share of them
        sums[name] = _weighted_sum(tensor.reshape(-1).to(dtypes[name]), 0)
    total = dict.fromkeys(dtypes, 0)
    for part in all_gather_object(comm, sums):
        for name, value in part.items():
            total[name] = (total[name] + value) % _PRIME
    return {name: f"{value:08x}" for name, value in total.items()}


def save_record(held: Holdings, comm: Comm) -> dict[str, str]:
    """The manifest's `frozen_excluded` of a save that leaves out `held.not_stored`. Every rank calls it."""
    table = held.param_table()
    return fingerprints(held, comm, {name: from_torch_name(table[name]["dtype"]) for name in table
                                     if name in held.not_stored})


def load_check(held: Holdings, manifest: dict, comm: Comm) -> str | None:
    """Why the engine's frozen parameters are not the base a checkpoint without them was saved on, or None.
    Every rank calls it (one gather), after the checks of names, shapes and trained parameters."""
    recorded, theirs = manifest[EXCLUDED], manifest["params"]
    mine = fingerprints(held, comm, {name: from_torch_name(theirs[name]["dtype"]) for name in recorded})
    differ = [name for name in recorded if mine[name] != recorded[name]]
    if not differ:
        return None
    dtypes = held.param_table()
    listed = ", ".join(f"'{n}' ({mine[n]} here, {recorded[n]} saved"
                       + (f"; held in {dtypes[n]['dtype']} here, {theirs[n]['dtype']} when saved" if
                          dtypes[n]["dtype"] != theirs[n]["dtype"] else "") + ")" for n in differ[:3])
    more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
    return (f"the checkpoint was saved without its frozen parameters (exclude_frozen_parameters=True), and "
            f"this engine's frozen parameters are not the ones it was trained on: {len(differ)} of "
            f"{len(recorded)} differ, by their fingerprints: {listed}{more}. Load the same base model as the "
            "saving run (the same from_pretrained path and revision, or the same init and seed) in the same "
            "training dtype before initialize, then load_checkpoint")


def excluded(manifest: dict) -> frozenset[str]:
    """The frozen parameters a checkpoint leaves out (none unless saved with exclude_frozen_parameters)."""
    return frozenset(manifest.get(EXCLUDED) or ())


def describe(manifest: dict) -> str:
    """What a checkpoint holds, in a sentence for `zeroshard checkpoint verify` and `consolidate`."""
    left_out = excluded(manifest)
    if not left_out:
        return "it holds every parameter, buffer and the optimizer state"
    numel = sum(int(torch.Size(manifest["params"][n]["shape"]).numel()) for n in left_out)
    kept = len(manifest["params"]) - len(left_out)
    return (f"it holds the trainable state only ({kept} trained parameters with their optimizer state, and the "
            f"buffers): its {len(left_out)} frozen parameters ({numel:,} elements) were left out "
            "(exclude_frozen_parameters=True)")
