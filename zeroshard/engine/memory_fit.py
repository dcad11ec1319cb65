"""Before any model state is made: do the model states of a node's ranks fit in the memory they have?

Without this check a model too large for its node is found out by the
kernel: its OOM killer ends one rank part-way through construction or the
first step, with no message, and the other ranks wait in a collective. So
construction first counts, per rank, the model states it is about to hold
in memory by pool (`estimate.offload.offload_pool_bytes` over its trained
elements, with its offload settings; on a CPU device the device pool is host
memory too), less the trained parameters it holds already, and compares
each limit's sum over the ranks under it (a memory cgroup, the host's
available memory: `offload.headroom`; a GPU's free memory) with that limit's
headroom. Every rank's figures travel in the agreement of construction
(`agreement.py`), so every rank raises the same `OutOfMemoryError`, naming
the limit and the fixes.

Only a certain failure raises: the count leaves out what is not certain
(activations, staging buffers, a gathered unit, fragmentation), so a run that
passes can still run out, and `zeroshard estimate` remains the planning tool.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch

from zeroshard.comm import Comm
from zeroshard.config import Config
from zeroshard.core.optimizer_tiers import swapped_state_keys
from zeroshard.errors import OutOfMemoryError
from zeroshard.estimate.formulas import state_bytes_per_element
from zeroshard.estimate.offload import offload_pool_bytes, ratio_numel
from zeroshard.offload.headroom import Headroom, host_limits

_CERTAIN = ("params", "grads", "master", "optimizer")  # the kinds that exist once construction ends
# A heap that keeps freed blocks holds up to about twice what a rank holds (an 85M-parameter model with a disk
# tier on one rank: 1.53 GiB resident against 0.73 GiB; docs/offload.md)
HEAP_SLACK = 2


@dataclass(frozen=True)
class _Row:
    """One rank's need against one limit it lives under."""

    key: tuple[str, str]  # (host name, the limit): ranks with the same key share the limit
    rank: int
    need: int  # bytes this rank will add under the limit
    limit: Headroom
    spill: int = 0  # bytes of this rank's states on disk: what the limit would hold without the disk tier


def memory_rows(comm: Comm, config: Config, optimizer: torch.optim.Optimizer, device: torch.device,
                params: list[torch.nn.Parameter]) -> list[_Row]:
    """This rank's need against each limit it lives under, for the agreement to send to every rank."""
    pools = _state_bytes(config, optimizer, sum(p.numel() for p in params), comm.world_size)
    held = sum(p.numel() * p.element_size() for p in params if p.device.type == device.type and not p.is_meta)
    host = socket.gethostname()
    on_host = pools["host"] + (pools["device"] if device.type == "cpu" else 0)
    host_need = max(0, on_host - (held if device.type == "cpu" else 0))
    rows = [_Row((host, limit.where if limit.shared else f"{limit.where} of rank {comm.rank}"), comm.rank, host_need,
                 limit, pools["disk"]) for limit in host_limits()]
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        gpu = Headroom(free, f"the free memory of GPU {device.index}", total)
        rows.append(_Row((host, gpu.where), comm.rank, max(0, pools["device"] - held), gpu))
    return rows


def check_states_fit(everyone: list[_Row]) -> bool:
    """Raise `OutOfMemoryError` if some limit cannot hold its ranks' model states (`everyone`: every rank's
    `memory_rows`, the same on every rank); else return whether host memory is short (`_host_short`)."""
    over = _over_limits(everyone)
    if over:
        raise OutOfMemoryError(
            f"the model states do not fit: {'; '.join(over)}. Started anyway, the kernel would end a rank "
            "part-way with no message. Offload the optimizer state (zero_optimization.offload_optimizer "
            '{"device": "cpu"} or {"device": "nvme", "nvme_path": ...}) and at stage 3 the parameters '
            "(offload_param), train on more ranks or nodes, or a smaller model; `zeroshard estimate` "
            "(--host-mem, --disk-mem) gives the largest model that fits")
    return _host_short([row for row in everyone if row.spill])  # the host limits of ranks with a disk tier


def _host_short(rows: list[_Row]) -> bool:
    """Whether some host limit has less than HEAP_SLACK times what its ranks would hold in memory with no disk
    tier: then a disk tier is there for want of memory, and freed blocks must go back to the system at once
    (`offload.memory.return_freed_blocks`). Otherwise glibc's heap keeps them for the next step's tensors of
    the same sizes, which then cost no page faults (GPT 100m, stage 3, 2 ranks: 1404 ms a step against 1757
    with every block of 64 KiB and more mapped anew)."""
    sums = [_sum(under, lambda r: r.need + r.spill) for under in _by_limit(rows).values()]
    return any(free < HEAP_SLACK * need for free, need in sums)


def _state_bytes(config: Config, optimizer: torch.optim.Optimizer, numel: int, world: int) -> dict[str, int]:
    """This rank's model states per pool, bytes: the kinds construction makes, staging left out."""
    zero = config.zero_optimization
    opt, param = zero.offload_optimizer, zero.offload_param
    per_element = state_bytes_per_element(config.training_dtype, config.communication_data_type,
                                          config.gradient_accumulation_steps, config.stage)
    per_element["optimizer_bytes"] = 4 * _state_tensors(optimizer)  # fp32, the master's size each
    offloaded = ratio_numel(numel, world, opt.ratio) if opt.device != "none" else None
    pools = offload_pool_bytes(numel, world, config.stage, **per_element, offload_optimizer=opt.device,
                               offload_param=param.device, offloaded_numel=offloaded,
                               max_in_cpu=param.max_in_cpu)
    return {pool: sum(pools[pool][kind] for kind in _CERTAIN) for pool in ("device", "host", "disk")}


def _state_tensors(optimizer: torch.optim.Optimizer) -> int:
    """Tensors of a master's size the optimizer keeps per master (Adam: 2), from one probe step; 0 for an
    optimizer that cannot be built again alone (a lower bound: the check must only raise on a certain failure)."""
    try:
        return min(len(swapped_state_keys(optimizer, group)) for group in optimizer.param_groups)
    except Exception:  # a custom optimizer's constructor or step may need more than its param groups
        return 0


def _over_limits(rows: list[_Row]) -> list[str]:
    """A sentence for each limit whose ranks together need more than its headroom."""
    out = []
    for (host, where), under in _by_limit(rows).items():
        free, need = _sum(under, lambda r: r.need)
        if need > free:
            ranks = ", ".join(f"rank {r.rank} {_gib(r.need)}" for r in under)
            out.append(f"on {host}, {where} (limit {_gib(under[0].limit.limit)}) has {_gib(free)} free but the "
                       f"ranks under it need {_gib(need)} more ({ranks})")
    return out


def _by_limit(rows: list[_Row]) -> dict[tuple[str, str], list[_Row]]:
    by_key: dict[tuple[str, str], list[_Row]] = {}
    for row in rows:
        by_key.setdefault(row.key, []).append(row)
    return by_key


def _sum(under: list[_Row], need) -> tuple[int, int]:
    """(the limit's free bytes, its ranks' summed `need(row)`); free measured apart by each rank: the most
    generous reading decides."""
    return max(r.limit.nbytes for r in under), sum(need(r) for r in under)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
