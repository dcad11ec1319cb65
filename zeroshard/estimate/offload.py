"""The memory of ZeRO-Offload and ZeRO-Infinity: three pools per rank (device, host, disk), by kind.

ZeRO-Offload (Ren et al., 2021) keeps a rank's fp32 master shard, its
optimizer state and its fp32 gradient shard in host memory and runs the
optimizer step on the CPU; ZeRO-Infinity (Rajbhandari et al., 2021) moves
master and optimizer state on to NVMe, and at stage 3 the parameter shards
to the host or NVMe. `offload_pool_bytes` is the layout the engine
implements (DESIGN.md section 2b), the figure `memory_stats(pool=...)` must
equal per pool and per kind; with nothing offloaded its device pool is
`formulas.model_state_bytes`. Bytes per rank; Ψ = `numel` trained elements,
N = `world_size`, S = ceil(Ψ / N) (formulas.shard_numel).

The layout. O = offloaded elements of the shard (all S, or a ratio's
prefix of the buckets), R = S - O; p, g, m, K = bytes per element of
parameters, gradients, master, optimizer state (formulas.py); U = the
largest unit and P = persistent elements (whole on every rank), stage 3
only; S_p = ceil((Ψ - P) / N), the sharded parameters.

- device: params pΨ at stages 1-2; at stage 3 p(S_p + P + U), or p(P + U)
  with the parameters offloaded. grads gΨ (stage 1), gR (stage 2),
  gR + pU (stage 3). master mR, optimizer KR. staging: with O > 0, the
  gradient bucket in flight to the host, reduce_bucket_size × the reduce
  dtype's bytes (p by default).
- host, optimizer "cpu": grads 4O (the fp32 gradient shard the CPU step
  reads, micro-steps summed into it), master 4O (fp32, a tensor of its own
  even in fp32 training: the device keeps the parameters), optimizer KO.
  With `delayed_update` at stages 2-3, grads 8O: the CPU step of one step
  reads its own copy of the shard while the next step's backward sums into
  it (stage 1's 4O already is such a copy: the window sums on the device).
  "nvme": grads 4O at stage 1 and with `delayed_update` (0 at stages 2-3:
  on disk), staging (4 + K + G) × min(B × min(sub_group_size, O), O),
  B = max(buffer_count, 3) (the buffers a sub-group's master, state and, at
  stages 2-3 without `delayed_update`, gradient are read into, as many
  sub-groups as one reads ahead, one steps and one writes behind, never
  more than the tier; G = 4 there, else 0).
  Parameters "cpu": params pS_p; "nvme": params p·min(max_in_cpu, S_p) and
  staging + p·min(param_buffer_count × param_buffer_size, S_p -
  min(max_in_cpu, S_p)) (the shards a step keeps for the next forward and
  the read buffers, never more than the shards on disk). The engine moves
  whole buckets and reads a unit's shards together: with L the largest
  such piece (`largest_shard`), a sub-group counts as at least min(L, O)
  and the parameter buffers as at least 3L (a unit gathered, one
  prefetched, one read ahead).
- disk, optimizer "nvme": master 4O, optimizer KO, and at stages 2-3 grads
  4O (the gradient shard waits there between the reductions that add to
  it; not on a tp/pp mesh, where it stays on the host); parameters "nvme":
  params p(S_p - min(max_in_cpu, S_p)).
- pinned (a part of the host pool, with pin_memory): every host tensor the
  device copies to or from: grads, master, params, staging. The optimizer's
  moments, which only the CPU step touches, stay pageable.

Excluded, as in formulas.py: activations, the framework's own memory (CUDA
context, allocator fragmentation, the OS), each disk buffer's alignment (up
to 8 KiB: its size rounded up to 4 KiB, and 4 KiB to align its start) and
the I/O threads' bounce buffers (one aio.block_size each, made when a
transfer is not aligned), and per-tensor scalar optimizer
state (torch's Adam keeps a 4-byte step per tensor: the caller adds it where
its optimizer lives). Pure arithmetic: it knows no model class.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from zeroshard.estimate.formulas import model_state_bytes, precision_bytes, shard_numel
from zeroshard.errors import ZeroshardError
# The config's defaults for the offload blocks and sub_group_size (DeepSpeed's), read from its schema.
from zeroshard.plan.defaults import BUFFER_COUNT, MAX_IN_CPU, PARAM_BUFFER_COUNT, PARAM_BUFFER_SIZE, SUB_GROUP_SIZE

DEVICES = ("none", "cpu", "nvme")  # offload_optimizer.device / offload_param.device
POOLS = ("device", "host", "disk")
KINDS = ("params", "grads", "master", "optimizer", "staging")
FP32_BYTES = 4  # the offloaded master and gradient shards are fp32 whatever the training dtype



class UnboundedError(ZeroshardError, ValueError):
    """No memory limit grows with Ψ: every pool that does is unlimited, so no largest model exists."""


@dataclass(frozen=True)
class OffloadSetup:
    """One offload setup, as the config's `offload_optimizer` and `offload_param` blocks give it.

    `ratio`: the fraction of the optimizer bytes offloaded (1: all; the
    engine offloads whole buckets, a prefix, until their bytes reach it).
    `reduce_bucket_size`: elements of the gradient bucket in flight from the
    device to the host (device `staging`). Sizes are in elements per rank.
    `host_mem`, `disk_mem`: bytes per node that bound the largest model
    (None: no limit).
    """

    optimizer: str = "none"
    param: str = "none"
    ratio: float = 1.0
    pin_memory: bool = False
    reduce_bucket_size: int = 0
    buffer_count: int = BUFFER_COUNT
    sub_group_size: int = SUB_GROUP_SIZE
    param_buffer_count: int = PARAM_BUFFER_COUNT
    param_buffer_size: int = PARAM_BUFFER_SIZE
    max_in_cpu: int = MAX_IN_CPU
    delayed_update: bool = False  # the CPU step reads its own copy of the gradient shard (stages 2-3)
    host_mem: int | None = None
    disk_mem: int | None = None

    @property
    def on(self) -> bool:
        return self.optimizer != "none" or self.param != "none"

    def layout(self) -> dict:
        """The keyword arguments of `offload_pool_bytes` this setup fixes (all but `offloaded_numel`)."""
        return {"offload_optimizer": self.optimizer, "offload_param": self.param, "pin_memory": self.pin_memory,
                "reduce_bucket_size": self.reduce_bucket_size, "buffer_count": self.buffer_count,
                "sub_group_size": self.sub_group_size, "param_buffer_count": self.param_buffer_count,
                "param_buffer_size": self.param_buffer_size, "max_in_cpu": self.max_in_cpu,
                "delayed_update": self.delayed_update}


def ratio_numel(numel: int, world_size: int, ratio: float) -> int:
    """Ψ_off, the offloaded elements of a rank's shard for `ratio` r: ceil(r × S), r read as its decimal.

    The engine offloads whole buckets until their optimizer bytes reach r of
    the total; this is the figure for one bucket per element. Pass the
    engine's exact count to `offload_pool_bytes` as `offloaded_numel`.
    """
    if not 0 <= ratio <= 1:
        raise ValueError(f"the offload ratio must be in [0, 1]; got {ratio}")
    return -(-Fraction(str(ratio)) * shard_numel(numel, world_size) // 1)


def offload_pool_bytes(
    numel: int, world_size: int, stage: int, param_bytes: int = 4, grad_bytes: int = 4, master_bytes: int = 0,
    optimizer_bytes: int = 8, *, offload_optimizer: str = "none", offload_param: str = "none",
    offloaded_numel: int | None = None, reduce_bucket_size: int = 0, reduce_bytes: int | None = None,
    buffer_count: int = BUFFER_COUNT, sub_group_size: int = SUB_GROUP_SIZE,
    param_buffer_count: int = PARAM_BUFFER_COUNT, param_buffer_size: int = PARAM_BUFFER_SIZE,
    max_in_cpu: int = MAX_IN_CPU, largest_unit: int = 0, persistent_numel: int = 0, hpz_partition_size: int = 1,
    pin_memory: bool = False, param_pin_memory: bool | None = None, delayed_update: bool = False,
    largest_shard: int = 0,
) -> dict:
    """Bytes one rank holds per pool and kind: {"device", "host", "disk": {kind: bytes}, "pinned": bytes}.

    Kinds are params, grads, master, optimizer, staging; the formulas are in
    the module's docstring. The per-element arguments are
    `formulas.model_state_bytes`'s (`grad_bytes` carries the fp32 sum of
    several micro-steps, as `state_bytes_per_element` gives it).
    `offloaded_numel` is O (None: the whole shard; `ratio_numel` for a
    ratio). `largest_unit`, `persistent_numel` and `hpz_partition_size`
    count at stage 3 only. `pin_memory` is the optimizer block's,
    `param_pin_memory` the parameter block's (None: `pin_memory`).
    `delayed_update`: the optimizer block's; the CPU step's gradient copy
    is host memory only the CPU reads (never pinned). `largest_shard`: the
    elements of the largest piece the disk moves whole (a bucket's shard: a
    sub-group holds whole buckets; a unit's parameter shards: read
    together), when known; 0 = at most a sub-group and the parameter buffers.
    """
    shard = shard_numel(numel, world_size)
    off = 0 if offload_optimizer == "none" else (shard if offloaded_numel is None else offloaded_numel)
    _check(numel, stage, shard, offload_optimizer, offload_param, offloaded_numel, off, persistent_numel,
           hpz_partition_size, delayed_update)
    persistent = persistent_numel if stage == 3 else 0
    param_shard = shard_numel(numel - persistent, world_size)  # S_p
    base = model_state_bytes(numel, world_size, stage, param_bytes, grad_bytes, master_bytes, optimizer_bytes,
                             largest_unit=largest_unit, hpz_partition_size=hpz_partition_size)
    unit = largest_unit if stage == 3 else 0
    params_whole = param_shard * (offload_param == "none")  # the shards stay on the device without offload_param
    device = {
        "params": param_bytes * (persistent + unit + params_whole) if stage == 3 else base["params"],
        "grads": base["grads"] - grad_bytes * off * (stage >= 2),
        "master": base["master"] - master_bytes * off,
        "optimizer": base["optimizer"] - optimizer_bytes * off,
        "staging": reduce_bucket_size * (param_bytes if reduce_bytes is None else reduce_bytes) * (off > 0),
    } | ({"hpz_secondary": base["hpz_secondary"]} if "hpz_secondary" in base else {})
    in_cpu = min(max_in_cpu, param_shard) if offload_param == "nvme" else param_shard * (offload_param == "cpu")
    grads_on_disk = stage >= 2 and not delayed_update  # the delayed update's thread reads its own copy
    per_element = FP32_BYTES + optimizer_bytes + FP32_BYTES * grads_on_disk  # G: the gradient read with them
    # Parameter shards: those kept for the next forward, or the units read at once (gathered, prefetched, read
    # ahead: stage3/schedule.py), whichever is more; never more than the shards on disk.
    staging = {"optimizer": per_element * _in_flight(off, buffer_count, sub_group_size, largest_shard)
                            * (offload_optimizer == "nvme"),
               "params": min(max(param_buffer_count * param_buffer_size, 3 * largest_shard), param_shard - in_cpu)
                         * param_bytes * (offload_param == "nvme")}
    host, disk = _off_device(offload_optimizer, offload_param, off, param_bytes, optimizer_bytes, in_cpu,
                             param_shard, staging, grads_on_disk)
    pin_params = pin_memory if param_pin_memory is None else param_pin_memory
    pinned = (pin_memory * (host["grads"] + host["master"] + staging["optimizer"])
              + pin_params * (host["params"] + staging["params"]))
    host["grads"] += FP32_BYTES * off * (delayed_update and stage >= 2)
    return {"device": device, "host": host, "disk": disk, "pinned": int(pinned)}


def _in_flight(off: int, buffer_count: int, sub_group_size: int, largest_shard: int) -> int:
    """Elements of the disk tier in memory at once: sub-groups read ahead (buffer_count - 2, at least 1), one
    stepping, one written behind (core/optimizer_tiers.py), each at least a whole bucket; never more than the
    tier."""
    group = max(min(sub_group_size, off), min(largest_shard, off))
    return min((max(1, buffer_count - 2) + 2) * group, off)


def _off_device(offload_optimizer: str, offload_param: str, off: int, param_bytes: int, optimizer_bytes: int,
                in_cpu: int, param_shard: int, staging: dict[str, int],
                grads_on_disk: bool) -> tuple[dict[str, int], dict[str, int]]:
    """The host and disk pools: O offloaded elements of optimizer state, `in_cpu` parameter elements on the
    host (the rest of the shard S_p on disk with offload_param "nvme"), and the host's disk buffers;
    `grads_on_disk` (stages 2-3): the gradient shard of disk masters lives on disk too."""
    on_host, on_disk = offload_optimizer == "cpu", offload_optimizer == "nvme"
    grads_out = on_disk and grads_on_disk
    host = {"params": param_bytes * in_cpu, "grads": FP32_BYTES * off * (not grads_out),
            "master": FP32_BYTES * off * on_host,
            "optimizer": optimizer_bytes * off * on_host, "staging": staging["optimizer"] + staging["params"]}
    disk = {"params": param_bytes * (param_shard - in_cpu) * (offload_param == "nvme"),
            "grads": FP32_BYTES * off * grads_out,
            "master": FP32_BYTES * off * on_disk, "optimizer": optimizer_bytes * off * on_disk, "staging": 0}
    return host, disk


def _check(numel: int, stage: int, shard: int, offload_optimizer: str, offload_param: str,
           offloaded_numel: int | None, off: int, persistent_numel: int, hpz_partition_size: int,
           delayed_update: bool) -> None:
    for name, device in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if device not in DEVICES:
            raise ValueError(f"{name} must be one of {', '.join(DEVICES)}; got '{device}'")
    if offload_optimizer != "none" and stage == 0:
        raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3 (the offloaded state is a shard); "
                         "got stage 0")
    if offload_param != "none" and stage != 3:
        raise ValueError(f"offload_param needs ZeRO stage 3 (only stage 3 shards the parameters); got stage {stage}")
    if offload_optimizer == "none" and delayed_update:
        raise ValueError("delayed_update needs an offloaded optimizer: give offload_optimizer 'cpu' or 'nvme'")
    if offload_optimizer == "none" and offloaded_numel:
        raise ValueError(f"offloaded_numel {offloaded_numel} without an offloaded optimizer: give "
                         "offload_optimizer 'cpu' or 'nvme', or leave offloaded_numel out")
    if not 0 <= off <= shard:
        raise ValueError(f"offloaded_numel must be between 0 and the rank's shard, {shard} elements; got {off}")
    if not 0 <= persistent_numel <= numel:
        raise ValueError(f"persistent_numel must be between 0 and numel {numel}; got {persistent_numel}")
    if hpz_partition_size > 1 and offload_param != "none":
        raise ValueError("hpZ (hpz_partition_size > 1) keeps a secondary copy of the parameters on the device, "
                         "which offload_param does not allow: give hpz_partition_size 1 or offload_param 'none'")


def pool_totals(pools: dict) -> dict[str, int]:
    """{"device", "host", "disk": bytes}: each pool summed over its kinds."""
    return {pool: sum(pools[pool].values()) for pool in POOLS}


def largest_model_offload(
    device_mem: int, host_mem: int | None, disk_mem: int | None, world_size: int, stage: int,
    dtype: str = "bf16", offload_optimizer: str = "cpu", offload_param: str = "none", *,
    ranks_per_node: int = 1, optimizer_bytes: int | None = None, ratio: float = 1.0, reserve: float = 0.0,
    **layout,
) -> int:
    """The largest Ψ (elements) whose three pools fit; 0 if none does.

    `device_mem` is bytes per GPU; `host_mem` and `disk_mem` bytes per node,
    shared by its `ranks_per_node` ranks (None: no limit). `reserve` is the
    fraction of every pool held back for what the formula excludes
    (activations, the CUDA context and allocator, the OS, other files).
    `layout`: `offload_pool_bytes`'s other keywords (reduce_bucket_size,
    buffer_count, sub_group_size, param_buffer_*, max_in_cpu, largest_unit,
    persistent_numel). Bytes per element from `formulas.precision_bytes`,
    as `formulas.largest_model`. Exact: the pools grow with Ψ, so the answer
    is bracketed by doubling and then bisected. UnboundedError when no
    limited pool grows with Ψ (stage 3 with parameters and optimizer off the
    device and neither `host_mem` nor `disk_mem` given).
    """
    if not 0 <= reserve < 1:
        raise ValueError(f"reserve must be a fraction in [0, 1); got {reserve}")
    per_element = precision_bytes(dtype, optimizer_bytes)
    limits = {pool: None if mem is None else int(mem * (1 - reserve)) // scale
              for pool, mem, scale in (("device", device_mem, 1), ("host", host_mem, ranks_per_node),
                                       ("disk", disk_mem, ranks_per_node))}

    def fits(numel: int) -> bool:
        off = None if offload_optimizer == "none" else ratio_numel(numel, world_size, ratio)
        totals = pool_totals(offload_pool_bytes(numel, world_size, stage, **per_element, **layout,
                                                offload_optimizer=offload_optimizer, offload_param=offload_param,
                                                offloaded_numel=off))
        return all(limit is None or totals[pool] <= limit for pool, limit in limits.items())

    low = layout.get("persistent_numel", 0)  # persistent parameters are part of Ψ
    if not fits(low):
        return 0
    high = max(2 * low, 1)
    while fits(high):
        low, high = high, 2 * high
        if high > 2**64:
            raise UnboundedError(f"no memory limit bounds the model at stage {stage} with the optimizer on "
                                 f"'{offload_optimizer}' and the parameters on '{offload_param}': give the "
                                 "host and disk memory")
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def offload_summary(numel: int, gpus: int, ranks_per_node: int, dtype: str, optimizer_bytes: int | None,
                    setup: OffloadSetup, largest_unit: int = 0, persistent_numel: int = 0,
                    gpu_mem: int | None = None) -> dict:
    """The "offload" object of `zeroshard estimate --json`: the three pools per stage, JSON-ready.

    Stages 1-3 ("3" only when the parameters are offloaded). `device`,
    `host`, `disk`: {stage: {kind: bytes}} per rank (one GPU); `pinned`
    {stage: bytes} per rank; `*_per_node`: a node's `ranks_per_node` ranks
    together (host memory and disks are the node's). `largest_model`:
    {stage: Ψ} fitting `gpu_mem` per GPU and the setup's host and disk memory per node
    (null without `gpu_mem`, or when no limit bounds Ψ).
    """
    per_element = precision_bytes(dtype, optimizer_bytes)
    stages = (3,) if setup.param != "none" else (1, 2, 3)
    common = {"largest_unit": largest_unit, "persistent_numel": persistent_numel, **setup.layout()}
    off = None if setup.optimizer == "none" else ratio_numel(numel, gpus, setup.ratio)
    pools = {str(s): offload_pool_bytes(numel, gpus, s, **per_element, offloaded_numel=off, **common)
             for s in stages}
    out = {"optimizer": setup.optimizer, "params": setup.param, "ratio": setup.ratio, "offloaded_numel": off,
           "layout": common, "ranks_per_node": ranks_per_node,
           "gpu_mem_bytes": gpu_mem, "host_mem_bytes": setup.host_mem, "disk_mem_bytes": setup.disk_mem}
    for pool in POOLS:
        out[pool] = {s: p[pool] for s, p in pools.items()}
    out["pinned"] = {s: p["pinned"] for s, p in pools.items()}
    for key in ("host", "disk", "pinned"):
        out[f"{key}_per_node"] = {s: ranks_per_node * (p[key] if key == "pinned" else sum(p[key].values()))
                                  for s, p in pools.items()}
    out["largest_model"] = None if gpu_mem is None else {
        str(s): _largest_or_none(gpu_mem, gpus, s, dtype, setup, ranks_per_node=ranks_per_node,
                                 optimizer_bytes=optimizer_bytes, ratio=setup.ratio, largest_unit=largest_unit,
                                 persistent_numel=persistent_numel)
        for s in stages}
    return out


def _largest_or_none(gpu_mem: int, gpus: int, stage: int, dtype: str, setup: OffloadSetup, **kwargs) -> int | None:
    layout = setup.layout()
    devices = (layout.pop("offload_optimizer"), layout.pop("offload_param"))
    layout.pop("pin_memory")
    try:
        return largest_model_offload(gpu_mem, setup.host_mem, setup.disk_mem, gpus, stage, dtype, *devices, **kwargs,
                                     **layout)
    except UnboundedError:
        return None
