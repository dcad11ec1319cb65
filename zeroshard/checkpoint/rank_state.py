"""What each rank alone holds, and a checkpoint keeps for it: a compressed reduction's state, bucket by bucket.

The masters and the optimizer state are pieces of parameters, written once
over all ranks and read back by any job (`holdings.py`). A compressed
reduction's state is not: every rank has its own error feedback (a codec's
residuals per message, comm/compress/reduce.py; PowerSGD's error over the whole
bucket, its Q and counters, comm/compress/powersgd.py). Each rank writes its
buckets' state into its own rank file as 1-D tensors under
`<kind>.<part>:@bucket<i>` (kind `feedback` or `powersgd`), with no `runs`:
the piece reader and the coverage checks, which read by parameter, never
see them, while the manifest lists their dtype and length and the file's
checksum covers them like any other tensor.

A load with the optimizer state gives them back to the same rank (and
PowerSGD's seeds stand where they stood: every bucket's random starts,
summed), so a resume continues bit for bit. A checkpoint written by another
number of ranks, with other buckets (another bucket size, codec or model),
or without that state cannot be used: it is dropped with one line in the
log that says why, and each bucket starts over at the checkpoint's step
(nothing left out yet; PowerSGD: a new random Q, no second warm-up). Every
rank decides from the manifest alone, so all decide alike.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from zeroshard.checkpoint.files import rank_file, window_key
from zeroshard.comm import Comm
from zeroshard.core.bucket import Bucket

log = logging.getLogger(__name__)

KINDS = ("feedback", "powersgd")  # a bucket attribute each: ErrorFeedback, PowerSgd
_WHAT = {"feedback": "the codec's error feedback", "powersgd": "PowerSGD's state"}


class RankState(Protocol):
    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def reset(self, step: int) -> None: ...


def _key(kind: str, part: str, index: int) -> str:
    return window_key(f"{kind}.{part}", f"@bucket{index}")


def _states(buckets: list[Bucket]) -> list[tuple[str, int, RankState]]:
    return [(kind, i, getattr(b, kind)) for kind in KINDS for i, b in enumerate(buckets)
            if getattr(b, kind) is not None]


def rank_state(buckets: list[Bucket]) -> dict[str, torch.Tensor]:
    """This rank's own tensors for its rank file, by key (none without a compressed reduction's state)."""
    return {_key(kind, part, i): tensor for kind, i, state in _states(buckets)
            for part, tensor in state.state_dict().items()}


def restore_rank_state(buckets: list[Bucket], comm: Comm, manifest: dict, handles: dict, step: int) -> None:
    """Give each bucket its state from this rank's file (`handles`: the open rank files by name), or start it
    over at `step` (the checkpoint's) when the checkpoint's cannot be used, saying why."""
    states = _states(buckets)
    for kind in KINDS:
        mine = [(i, state) for k, i, state in states if k == kind]
        if not mine:
            continue
        why = _unusable(kind, mine, comm.world_size, manifest, rank_file(comm.rank))
        if why is not None:
            if comm.rank == 0:
                log.warning("%s in the checkpoint is not used: %s. Each bucket starts over at step %d", _WHAT[kind],
                            why, step)
            for _, state in mine:
                state.reset(step)
            continue
        handle = handles[rank_file(comm.rank)]
        for i, state in mine:
            state.load_state_dict({part: handle.get_tensor(_key(kind, part, i)) for part in state.state_dict()})
        if kind == "powersgd":
            mine[0][1].seeds.restore(sum(state.draws for _, state in mine))


def _unusable(kind: str, mine: list[tuple[int, RankState]], world_size: int, manifest: dict,
              name: str) -> str | None:
    """Why the checkpoint's state of `kind` cannot be this job's, from the manifest; None if it can."""
    if manifest["world_size"] != world_size:
        return (f"it was written by {manifest['world_size']} ranks and this job has {world_size}, while each "
                "rank's state is its own and cannot be split or merged")
    stored = manifest["files"].get(name, {}).get("tensors")
    if not stored or not any(key.startswith(kind + ".") for key in stored):
        return "the checkpoint holds none (it was written without this communication_compression)"
    for i, state in mine:
        for part, tensor in state.state_dict().items():
            saved = stored.get(_key(kind, part, i))
            if saved is None or saved[1] != tensor.numel():
                held = "none" if saved is None else f"{saved[1]} elements"
                return (f"its bucket {i} differs from this job's ({part}: {held} saved, {tensor.numel()} here): "
                        "another model, reduce_bucket_size, codec, rank or error_feedback")
    return None
