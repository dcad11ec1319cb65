"""What `engine.memory_stats()` reports: bytes of model states held by this rank.

Counted from the tensors themselves, each storage once: parameter storage
shared with the fp32 master shard (fp32 training) counts under `params` only.
At stage 3 `params` is the persistent shards plus whatever is gathered now.
With 16-bit parameters the fp32 master is a storage of its own, and the fp32
sum of several micro-steps' gradients counts under `grads`. ZeRO++'s hpZ
secondary shards (held from a unit's first gather after a step until the
next step) count under `hpz_secondary`, 0 without hpZ. The state of a
compressed gradient reduction (a codec's error feedback, comm/compress/reduce.py;
PowerSGD's P, Q and error feedback, comm/compress/powersgd.py) counts under
`compression`, 0 without one.

Beside the model states held now, each pool reports `activations`, the bytes
autograd saved in the last training forward (`activation_meter.py`), and
`peak`, the step's peak: what is held now plus the largest forward's
activations of the accumulation window. `MemoryStats.held()` sums the kinds
held now, without those two.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from zeroshard.core.bucket import Bucket
from zeroshard.core.flat import FlatParams
from zeroshard.core.local import local
from zeroshard.core.optimizer_tiers import OptimizerTiers, Tier
from zeroshard.core.staging import StagingPool


# Not held now: the last forward's saved bytes (freed by its backward) and the step's peak.
NOT_HELD = ("activations", "peak")


class MemoryStats(dict):
    """Bytes per kind of model state, and `activations` and `peak`. Reading the old key `buffers` still
    gives `staging`, with a DeprecationWarning, for one release; it is not a key of its own."""

    def held(self) -> int:
        """Bytes held now: every kind but `activations` and `peak`."""
        return sum(n for kind, n in self.items() if kind not in NOT_HELD)

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


def device_tensors(
    model: nn.Module, buckets: list[Bucket], optimizer: torch.optim.Optimizer, pool: StagingPool,
    frozen: list[FlatParams] = (), tiers: OptimizerTiers | None = None, param_tier: Tier = Tier.DEVICE,
) -> dict[str, list[torch.Tensor | None]]:
    """The tensors of each kind in the device pool, kinds in the order a shared storage is counted (the first
    kind that holds it): what `model_state_bytes` counts there, and what `engine.offload_states()` moves."""
    tier = _tiers(buckets, tiers)
    flats = [b.flat for b in buckets] + list(frozen)
    apart = _apart(flats, param_tier)
    return {
        "params": [f.data for f in flats] + [f.shard_data for f in flats if f not in apart]
                  + [local(p).data for p in model.parameters()],
        "grads": [b.grad_shard for b in buckets if not b.offload] + [b.full_grad for b in buckets]
                 + [b.grad_acc for b in buckets] + [local(p.grad) for p in model.parameters()],
        "master": [b.master for b, t in zip(buckets, tier) if t is Tier.DEVICE],
        "optimizer": _state_of(optimizer, buckets, tier, {Tier.DEVICE}),
        "staging": pool.tensors(),
        "hpz_secondary": [f.secondary for f in flats],
        "compression": [t for b in buckets if b.feedback for t in b.feedback.tensors().values()]
                       + [t for b in buckets if b.powersgd is not None for t in b.powersgd.tensors()],
    }


def _tiers(buckets: list[Bucket], tiers: OptimizerTiers | None) -> list[Tier]:
    return [tiers.tier_of(i) if tiers else Tier.DEVICE for i in range(len(buckets))]


def _apart(flats: list[FlatParams], param_tier: Tier) -> list[FlatParams]:
    """Stage 3's sharded flats whose shards live on the host or on disk (parameter offload)."""
    return [f for f in flats if f.shard_data is not None] if param_tier is not Tier.DEVICE else []


def model_state_bytes(
    model: nn.Module, buckets: list[Bucket], optimizer: torch.optim.Optimizer, pool: StagingPool,
    frozen: list[FlatParams] = (), tiers: OptimizerTiers | None = None, param_tier: Tier = Tier.DEVICE,
    offload_buffers: list[torch.Tensor] = (),
) -> dict[str, MemoryStats]:
    """Bytes per kind of model state this rank holds, by pool: {"device", "host", "disk"}.

    `staging` is the pooled communication staging memory on the device, and on the host the offload's
    aligned buffers (a disk sub-group or parameter shard in flight). `frozen`: stage 3's flat buffers of
    parameters that do not require grad. `tiers`: where each bucket's master and optimizer state live;
    `param_tier`: where stage 3's sharded parameters live.
    """
    tier = _tiers(buckets, tiers)
    flats = [b.flat for b in buckets] + list(frozen)
    apart = _apart(flats, param_tier)
    seen: set[int] = set()
    device = MemoryStats({kind: _storage_bytes(tensors, seen) for kind, tensors in device_tensors(
        model, buckets, optimizer, pool, frozen, tiers, param_tier).items()})
    # The offload buffers first: a disk sub-group in memory (in flight, or kept between steps) points into
    # them, and counts as staging, not again as host master or optimizer state.
    host_staging = _storage_bytes(offload_buffers, seen)
    host = MemoryStats(
        params=_storage_bytes([f.shard_data for f in apart if f.shard_swap is None], seen),
        grads=_storage_bytes([b.grad_shard for b in buckets if b.offload and b.on_disk is None]
                             + [b.host_grad for b in buckets], seen),
        master=_storage_bytes([b.master for b, t in zip(buckets, tier) if t is Tier.HOST], seen),
        # A disk master's scalar state (Adam's step) stays in host memory.
        optimizer=_storage_bytes(_state_of(optimizer, buckets, tier, {Tier.HOST, Tier.DISK}), seen),
        staging=host_staging,
        hpz_secondary=0, compression=0)
    on_disk = tiers.disk_bytes() if tiers else {"master": 0, "optimizer": 0, "grads": 0}
    disk = MemoryStats(params=sum(f.shard_swap.nbytes for f in flats if f.shard_swap is not None),
                       grads=on_disk["grads"],
                       master=on_disk["master"], optimizer=on_disk["optimizer"], staging=0, hpz_secondary=0,
                       compression=0)
    return {"device": device, "host": host, "disk": disk}


def _state_of(optimizer: torch.optim.Optimizer, buckets: list[Bucket], tier: list[Tier], where: set[Tier]):
    """The optimizer's state tensors held in memory for the masters in the tiers `where` (state of any
    other tensor counts on the device)."""
    masters = {id(stepped): t for b, t in zip(buckets, tier) for stepped in b.stepped}
    return [v for p, state in optimizer.state.items() if masters.get(id(p), Tier.DEVICE) in where
            for v in state.values() if torch.is_tensor(v)]


def with_activations(by_pool: dict[str, MemoryStats], last: dict[str, int],
                     window_peak: dict[str, int]) -> dict[str, MemoryStats]:
    """Each pool with `activations` (the last forward's saved bytes in it) and `peak` (held now + the
    largest forward's of the window)."""
    return {pool: MemoryStats(stats, activations=last.get(pool, 0), peak=stats.held() + window_peak.get(pool, 0))
            for pool, stats in by_pool.items()}


def total(by_pool: dict[str, MemoryStats]) -> MemoryStats:
    """The pools added up, kind by kind (without offload: the device pool)."""
    pools = list(by_pool.values())
    return MemoryStats({kind: sum(p[kind] for p in pools) for kind in pools[0]})
