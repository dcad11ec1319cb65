"""What each rank alone holds, and a checkpoint keeps for it: PowerSGD's state, bucket by bucket.

The masters and the optimizer state are pieces of parameters, written once
over all ranks and read back by any job (`holdings.py`). PowerSGD's state
(comm/powersgd.py) is not: every rank has its own error feedback over the
whole bucket, its own Q and counters. Each rank writes its buckets' state
into its own rank file as 1-D tensors under `powersgd.<part>:@bucket<i>`
(`PowerSgd.state_dict()`: q, error, counters), with no `runs`: the piece
reader and the coverage checks, which read by parameter, never see them,
while the manifest lists their dtype and length and the file's checksum
covers them like any other tensor.

A load with the optimizer state gives them back to the same rank, then the
seeds stand where they stood (every bucket's random starts, summed), so a
resume continues bit for bit. A checkpoint written by another number of
ranks, with other buckets (another bucket size, rank or model), or without
PowerSGD cannot be used: the state is dropped with one line in the log that
says why, and each bucket starts over at the checkpoint's step (no error
yet, a new random Q, no second warm-up). Every rank decides from the
manifest alone, so all decide alike.
"""

from __future__ import annotations

import logging

import torch

from zeroshard.checkpoint.files import rank_file, window_key
from zeroshard.comm import Comm
from zeroshard.comm.powersgd import PowerSgd
from zeroshard.core.bucket import Bucket

log = logging.getLogger(__name__)

KIND = "powersgd"


def _key(part: str, index: int) -> str:
    return window_key(f"{KIND}.{part}", f"@bucket{index}")


def _low_ranks(buckets: list[Bucket]) -> list[tuple[int, PowerSgd]]:
    return [(i, b.powersgd) for i, b in enumerate(buckets) if b.powersgd is not None]


def rank_state(buckets: list[Bucket]) -> dict[str, torch.Tensor]:
    """This rank's own tensors for its rank file, by key (none without PowerSGD)."""
    return {_key(part, i): tensor for i, low in _low_ranks(buckets) for part, tensor in low.state_dict().items()}


def restore_rank_state(buckets: list[Bucket], comm: Comm, manifest: dict, handles: dict, step: int) -> None:
    """Give each bucket its PowerSGD state from this rank's file (`handles`: the open rank files by name), or
    start it over at `step` (the checkpoint's) when the checkpoint's cannot be used, saying why."""
    lows = _low_ranks(buckets)
    if not lows:
        return
    why = _unusable(lows, comm.world_size, manifest, rank_file(comm.rank))
    if why is not None:
        if comm.rank == 0:
            log.warning("PowerSGD's state in the checkpoint is not used: %s. Each bucket starts over at step %d "
                        "(no error feedback yet, a new random Q)", why, step)
        for _, low in lows:
            low.reset(step)
        return
    handle = handles[rank_file(comm.rank)]
    for i, low in lows:
        low.load_state_dict({part: handle.get_tensor(_key(part, i)) for part in low.state_dict()})
    lows[0][1].seeds.restore(sum(low.draws for _, low in lows))


def _unusable(lows: list[tuple[int, PowerSgd]], world_size: int, manifest: dict, name: str) -> str | None:
    """Why the checkpoint's state cannot be this job's, from the manifest; None if it can."""
    if manifest["world_size"] != world_size:
        return (f"it was written by {manifest['world_size']} ranks and this job has {world_size}, while each "
                "rank's error feedback and Q are its own and cannot be split or merged")
    stored = manifest["files"].get(name, {}).get("tensors")
    if not stored or not any(key.startswith(KIND + ".") for key in stored):
        return "the checkpoint holds none (it was written without communication_compression powersgd)"
    for i, low in lows:
        for part, tensor in low.state_dict().items():
            saved = stored.get(_key(part, i))
            if saved is None or saved[1] != tensor.numel():
                held = "none" if saved is None else f"{saved[1]} elements"
                return (f"its bucket {i} differs from this job's ({part}: {held} saved, {tensor.numel()} here): "
                        "another model, reduce_bucket_size, rank or error_feedback")
    return None
