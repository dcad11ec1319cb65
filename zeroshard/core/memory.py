"""What `engine.memory_stats()` reports: bytes of model states held by this rank.

Counted from the tensors themselves, each storage once: parameter storage
shared with the fp32 master shard (fp32 training) counts under `params` only.
At stage 3 `params` is the persistent shards plus whatever is gathered now.
With 16-bit parameters the fp32 master is a storage of its own, and the fp32
sum of several micro-steps' gradients counts under `grads`. ZeRO++'s hpZ
secondary shards (held from a unit's first gather after a step until the
next step) count under `hpz_secondary`, 0 without hpZ.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from zeroshard.core.bucket import Bucket
from zeroshard.core.flat import FlatParams
from zeroshard.core.local import local
from zeroshard.core.optim import state_tensors
from zeroshard.core.staging import StagingPool


class MemoryStats(dict):
    """Bytes per kind of model state. Reading the old key `buffers` still gives `staging`, with a
    DeprecationWarning, for one release; it is not a key of its own, so summing the values stays right."""

    def __missing__(self, key: str) -> int:
        if key == "buffers":
            warnings.warn("memory_stats()['buffers'] is now memory_stats()['staging'] (communication staging "
                          "memory); the old key goes away in the next release", DeprecationWarning, stacklevel=2)
            return self["staging"]
        raise KeyError(key)


def _storage_bytes(tensors, seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def model_state_bytes(
    model: nn.Module, buckets: list[Bucket], optimizer: torch.optim.Optimizer, pool: StagingPool,
    frozen: list[FlatParams] = (),
) -> MemoryStats:
    """Bytes per kind of model state this rank holds; `staging` is the pooled communication staging memory.

    `frozen`: stage 3's flat buffers of parameters that do not require grad.
    """
    seen: set[int] = set()
    flats = [b.flat for b in buckets] + list(frozen)
    params = _storage_bytes([f.data for f in flats] + [f.shard_data for f in flats]
                            + [local(p).data for p in model.parameters()], seen)
    grads = _storage_bytes([b.grad_shard for b in buckets] + [b.full_grad for b in buckets]
                           + [b.grad_acc for b in buckets] + [local(p.grad) for p in model.parameters()], seen)
    master = _storage_bytes([b.master for b in buckets], seen)
    opt = _storage_bytes(state_tensors(optimizer), seen)
    staging = _storage_bytes(pool.tensors(), seen)
    secondary = _storage_bytes([f.secondary for f in flats], seen)
    return MemoryStats(params=params, grads=grads, master=master, optimizer=opt, staging=staging,
                       hpz_secondary=secondary)
