"""OffloadStates: device memory freed on demand, `engine.offload_states()` / `engine.reload_states()` (DeepSpeed's).

Between steps (reinforcement learning with a generator that shares the GPU: free the training states,
generate, reload), the states `include` names leave the device and come back bit for bit:

| DeepSpeed's `OffloadStateTypeEnum` | memory_stats kind | what moves |
|---|---|---|
| `optim_states` | optimizer | the optimizer's state of the masters on the device |
| `hp_params` | master | the fp32 masters on the device |
| `lp_params` | params | flat buffers, stage 3's shards, any other parameter |
| `lp_grads` | grads | gradient buffers and `.grad`, whatever the window holds |
| `contiguous_grad_buffer` | staging | the staging blocks |

[Note: offloaded storage]
What moves is storages, not tensors. Each storage of the selected kinds in the device pool (core/memory.py's
`device_tensors`, the lists `memory_stats` counts) is copied whole into a host tensor of bytes (pinned on
CUDA when asked) and resized to zero bytes: its memory goes back to the allocator (`empty_cache` gives it to
the driver), while every tensor over it (parameters' views of a flat buffer, the master's shard view, `.grad`
views, the optimizer's state) keeps the same storage object. `reload_states` resizes each one back and copies
its bytes in: every view is valid again, no tensor is replaced. A storage two kinds share (in fp32 the master
is the parameters' own) moves when either is named, and counts under the kind `memory_stats` gives it. A free
staging block holds nothing (its contents are undefined until the next acquire), so it is freed, not copied.

A tensor over a zero-byte storage must not be read: on the CPU that is a crash, on CUDA an illegal address.
So while states are off the device the module's parameters (and `.grad`s) over a moved storage point at empty
tensors, `module.state_dict()` refuses, and so do the engine's calls (`check_on_device`) and stage 3's
gathers (`FlatParams.restore_full`), each with `StatesOffloadedError`, naming `reload_states()`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn as nn

from zeroshard.core.bucket import Bucket
from zeroshard.core.flat import FlatParams
from zeroshard.core.local import local
from zeroshard.core.memory import device_tensors
from zeroshard.core.optimizer_tiers import Tier
from zeroshard.core.staging import StagingPool
from zeroshard.engine.offload import Offload
from zeroshard.engine.state import EngineStateError, TrainingState
from zeroshard.errors import StatesOffloadedError

log = logging.getLogger(__name__)


class OffloadStateTypeEnum(str, Enum):
    """DeepSpeed's `deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum`: the states one may offload."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class OffloadDeviceEnum(str, Enum):
    """DeepSpeed's `deepspeed.runtime.zero.offload_config.OffloadDeviceEnum`; `offload_states` takes cpu only."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


KIND = {OffloadStateTypeEnum.optim_states: "optimizer", OffloadStateTypeEnum.hp_params: "master",
        OffloadStateTypeEnum.lp_params: "params", OffloadStateTypeEnum.lp_grads: "grads",
        OffloadStateTypeEnum.contiguous_grad_buffer: "staging"}


def _value(member) -> str:
    return getattr(member, "value", member)  # DeepSpeed's own enum members, ours, or plain strings


def parse_include(include) -> list[OffloadStateTypeEnum]:
    """`include` (None: every state) as our members, in DeepSpeed's order; a name not among them is an error."""
    if include is None:
        return list(OffloadStateTypeEnum)
    if isinstance(include, str) or not hasattr(include, "__iter__"):
        include = [include]
    names, known = [_value(m) for m in include], [m.value for m in OffloadStateTypeEnum]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"offload_states(include=...): {unknown} not among the states {known} "
                         "(OffloadStateTypeEnum); None offloads them all")
    return [m for m in OffloadStateTypeEnum if m.value in names]


def check_device(device) -> None:
    if _value(device) != OffloadDeviceEnum.cpu.value:
        raise ValueError(f"offload_states(device={_value(device)!r}): states are offloaded to host memory only, "
                         "device='cpu' (OffloadDeviceEnum.cpu); for disk, configure zero_optimization's "
                         "offload_optimizer / offload_param with device 'nvme'")


@dataclass
class _Moved:
    """One storage off the device: its bytes, the kind memory_stats counts it under, its host copy."""

    storage: torch.UntypedStorage
    nbytes: int
    kind: str
    copied: bool  # False: a free staging block, freed without a copy
    host: torch.Tensor | None = None


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


class OffloadStates:
    """The states off the device now, their host copies, and the parameters pointed away meanwhile."""

    def __init__(self, module: nn.Module, buckets: list[Bucket], optimizer: torch.optim.Optimizer,
                 pool: StagingPool, frozen: list[FlatParams], offload: Offload, device: torch.device, rank: int):
        self.module, self.buckets, self.optimizer, self.pool, self.frozen = module, buckets, optimizer, pool, frozen
        self.by_config, self.device, self.rank = offload, device, rank  # Offload: what the config moved
        self.offloaded: list[OffloadStateTypeEnum] = []  # in the order they left
        self._moved: list[_Moved] = []
        self._pointed: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor | None]] = []  # param, .data, .grad
        self._hook = None  # the module's state_dict refusal while offloaded

    def check_on_device(self, call: str = "forward, backward, step, checkpoints and exports") -> None:
        """`StatesOffloadedError` while any state is off the device."""
        if self.offloaded:
            names = ", ".join(m.value for m in self.offloaded)
            raise StatesOffloadedError(f"{call}: the model states {names} are off the device "
                                       "(engine.offload_states()); call engine.reload_states() first")

    def check_between_steps(self, state: TrainingState) -> None:
        if state is not TrainingState.IDLE:
            raise EngineStateError(f"offload_states() between steps only, and the engine is in state "
                                   f"{state.value!r}: call it after engine.step() (a failed engine cannot go on)")

    def offload(self, include, device, pin_memory: bool, non_blocking: bool) -> None:
        """Move the states `include` names that are still on the device (states offloaded already stay so)."""
        check_device(device)
        new = [m for m in parse_include(include) if m not in self.offloaded]
        self._say_already_off(new)
        kinds = {KIND[m] for m in new}
        moved = self._select(kinds)
        self._point_away({m.storage.data_ptr() for m in moved})
        for m in moved:
            if m.copied:
                pin = pin_memory and m.storage.device.type == "cuda"
                m.host = torch.empty(m.nbytes, dtype=torch.uint8, pin_memory=pin)
                m.host.copy_(_bytes_of(m.storage), non_blocking=non_blocking)
            m.storage.resize_(0)  # stream-ordered on CUDA: the copy above reads it first
        self._moved += moved
        self.offloaded += new
        if self._hook is None and self.offloaded:
            self._hook = self.module.register_state_dict_pre_hook(
                lambda *_: self.check_on_device("module.state_dict()"))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _select(self, kinds: set[str]) -> list[_Moved]:
        """The device pool's storages (of this device) that the kinds `kinds` hold, each once, under the kind
        memory_stats counts it in; a free staging block without a host copy."""
        free = {t.untyped_storage().data_ptr() for t in self.pool.free_tensors()}
        counted: dict[int, _Moved] = {}
        chosen: set[int] = set()
        for kind, tensors in device_tensors(self.module, self.buckets, self.optimizer, self.pool, self.frozen,
                                            self.by_config.tiers, self.by_config.param_tier).items():
            for t in tensors:
                if t is None or t.device.type != self.device.type or not t.untyped_storage().nbytes():
                    continue
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in counted:
                    counted[ptr] = _Moved(storage, storage.nbytes(), kind, copied=ptr not in free)
                if kind in kinds:
                    chosen.add(ptr)
        return [m for ptr, m in counted.items() if ptr in chosen]

    def _point_away(self, moved: set[int]) -> None:
        """Point the module's parameters over a moved storage at empty tensors, `.grad`s over one at None."""
        for p in self.module.parameters():
            data, grad = local(p).data, p.grad
            data_moved = data.untyped_storage().data_ptr() in moved and data.numel() > 0
            grad_moved = grad is not None and local(grad).untyped_storage().data_ptr() in moved
            if data_moved or grad_moved:
                self._pointed.append((p, data, grad))
                if data_moved:
                    local(p).data = data.new_empty(0)
                if grad_moved:
                    p.grad = None

    def reload(self, non_blocking: bool) -> None:
        """Every offloaded state back into its own storage, bit for bit; nothing offloaded: nothing to do."""
        for m in self._moved:
            m.storage.resize_(m.nbytes)
            if m.host is not None:
                _bytes_of(m.storage).copy_(m.host, non_blocking=non_blocking)
        for p, data, grad in reversed(self._pointed):  # the first pointing away holds the original
            local(p).data = data
            p.grad = grad
        if self._hook is not None:
            self._hook.remove()
        self._moved, self._pointed, self.offloaded, self._hook = [], [], [], None

    def host_bytes(self) -> dict[str, int]:
        """Host bytes of the copies, by memory_stats kind (what the host pool holds for them)."""
        out: dict[str, int] = {}
        for m in self._moved:
            if m.host is not None:
                out[m.kind] = out.get(m.kind, 0) + m.host.untyped_storage().nbytes()
        return out

    def _say_already_off(self, new: list[OffloadStateTypeEnum]) -> None:
        """Rank 0 says which of the states named live off the device by config (nothing to move for them)."""
        tiers = self.by_config.tiers
        off = [tiers.tier_of(i).value for i in range(len(self.buckets)) if tiers.tier_of(i) is not Tier.DEVICE]
        said = []
        if off and {OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params} & set(new):
            said.append(f"the masters and optimizer state of {len(off)} of {len(self.buckets)} buckets "
                        f"(offload_optimizer: {sorted(set(off))})")
        if self.by_config.param_tier is not Tier.DEVICE and OffloadStateTypeEnum.lp_params in new:
            said.append(f"stage 3's parameter shards (offload_param: {self.by_config.param_tier.value})")
        if said and self.rank == 0:
            log.info("offload_states: %s live off the device already, and stay where they are", "; ".join(said))
