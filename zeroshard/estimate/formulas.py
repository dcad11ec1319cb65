"""The memory and communication model of ZeRO stages 0-3 (DESIGN.md sections 1 and 2).

Pure functions of the parameter count Ψ (`numel`, elements), the world size N
and the stage, following the ZeRO paper (Rajbhandari et al., 2020), section 3
"Where did all the memory go?" and section 5 "ZeRO-DP: communication
analysis", and the ZeRO++ paper (Wang et al., 2023) for the cross-node
volume. Every figure is in bytes. The engine's measured `memory_stats()` and
per-step `comm_stats()` deltas must equal these. How a flat buffer splits
(`shard_numel`, `padded_numel`) is the plan's (plan/flats.py). `summarize` gathers them
for one setup into the object `zeroshard estimate --json` prints (estimate/summary.py).
"""

from __future__ import annotations

from zeroshard.dtypes import BYTES, DTYPES, MASTER_DTYPE, TRAINING_DTYPES
from zeroshard.plan.flats import shard_numel  # the plan's split, priced here

STAGES = (0, 1, 2, 3)  # the formulas; which stages the engine runs is the engine's business

# Ring algorithms: bytes each rank sends (and receives) per logical byte.
# all-reduce = reduce-scatter + all-gather, hence twice the factor.
_RING_STEPS = {"reduce_scatter": 1, "all_gather": 1, "all_to_all": 1, "all_reduce": 2}
_FP32_BYTES = BYTES["fp32"]
# The step check: per rank, five float64 figures (gradient squares, non-finite flag, two step counters,
# the checksum of the rank's collectives).
_STEP_CHECK_BYTES = 5 * 8
_ADAM_BYTES = 2 * _FP32_BYTES  # Adam's two moments, fp32 whatever the training dtype

# Bytes per element of (parameters, gradients, fp32 master weights) per training dtype: 16-bit
# training keeps an fp32 master copy; fp32 parameters are their own master copy.
DTYPE_BYTES = {name: (BYTES[name], BYTES[name], 0 if DTYPES[name] == MASTER_DTYPE else MASTER_DTYPE.itemsize)
               for name in TRAINING_DTYPES}


def _check(numel: int, world_size: int, stage: int) -> None:
    if numel < 0:
        raise ValueError(f"numel must be >= 0 elements; got {numel}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 rank; got {world_size}")
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {', '.join(map(str, STAGES))}; got {stage}")


def model_state_bytes(
    numel: int, world_size: int, stage: int, param_bytes: int = 4, grad_bytes: int = 4,
    master_bytes: int = 0, optimizer_bytes: int = 8, optimizer_scalar_bytes: int = 0,
    largest_unit: int = 0, hpz_partition_size: int = 1,
) -> dict[str, int]:
    """Bytes of model states one rank holds: {"params", "grads", "master", "optimizer"}.

    `numel` is Ψ in elements; the `*_bytes` arguments are bytes per element
    (K in the paper is master_bytes + optimizer_bytes). The defaults are fp32
    training with Adam(W): parameters 4Ψ, gradients 4Ψ, master weights 0 (the
    fp32 parameters are the master copy), moments 8Ψ. Mixed precision with
    Adam is param_bytes=2, grad_bytes=2, master_bytes=4, optimizer_bytes=8.

    Stage 0 holds everything in full; stage 1 divides master and optimizer
    state by N; stage 2 also the gradients; stage 3 also the parameters, plus
    one gathered unit of `largest_unit` elements while it computes: its
    parameters and its unreduced gradient, both in the parameter dtype
    (autograd's gradients have the parameter's dtype). `optimizer_scalar_bytes`
    is per-rank scalar state not divided by N (torch's Adam keeps a 4-byte
    step counter per optimizer tensor).

    `hpz_partition_size` D > 1 (ZeRO++'s hpZ, stage 3 only) adds the key
    "hpz_secondary": the secondary shard this rank keeps from the first
    forward to the step, 1/D of the padded parameters (zeropp.hpz_secondary_bytes
    for several flats). Without hpZ the key is absent.
    """
    _check(numel, world_size, stage)
    shard = shard_numel(numel, world_size)
    sharded_states = shard if stage >= 1 else numel
    grads = shard if stage >= 2 else numel
    unit = largest_unit if stage == 3 else 0
    states = {
        "params": param_bytes * ((shard if stage == 3 else numel) + unit),
        "grads": grad_bytes * grads + param_bytes * unit,
        "master": master_bytes * sharded_states,
        "optimizer": optimizer_bytes * sharded_states + optimizer_scalar_bytes,
    }
    if hpz_partition_size > 1 and stage == 3:
        states["hpz_secondary"] = param_bytes * (shard * world_size // hpz_partition_size)
    return states


def state_bytes_per_element(training: str = "fp32", communication: str | None = None,
                            accumulation: int = 1, stage: int = 0) -> dict[str, int]:
    """Bytes per element of each model state, as `model_state_bytes` takes them, for a precision setup.

    `training` is "fp32", "bf16" or "fp16"; `communication` the reduce dtype
    (None: the training dtype). In fp32: 4 + 4 + 0 + 8. In 16 bits the
    paper's 2 + 2 + 4 + 8, except that the gradients' fp32 sum over several
    micro-steps (or an fp32 reduction) adds 4 bytes per element to the 16-bit
    gradients at stages 0-1, and replaces them (4 instead of 2) at stage 2.
    """
    param, grads, master = DTYPE_BYTES[_dtype(training)]
    if master and (accumulation > 1 or communication == "fp32"):  # 16-bit gradients summed in fp32
        grads = _FP32_BYTES if stage >= 2 else grads + _FP32_BYTES
    return {"param_bytes": param, "grad_bytes": grads, "master_bytes": master, "optimizer_bytes": _ADAM_BYTES}


def comm_bytes_per_step(
    numel: int, stage: int, elem_bytes: int = 4, reduce_scatter: bool = True,
    accumulation: int = 1, reduce_bytes: int | None = None,
) -> dict[str, int]:
    """Logical bytes per optimizer step, per collective: {"all_reduce", "reduce_scatter", "all_gather"}.

    Logical bytes are the full buffer of each collective (the nccl-tests
    "size"), the same on every rank, as `engine.comm_stats()` records them;
    `wire_bytes` turns them into bytes sent. Stage 0 all-reduces the
    gradients once per step; stage 1 reduce-scatters them once per step;
    stage 2 reduce-scatters in every one of the `accumulation` micro-steps.
    Stages 1-2 then all-gather the updated parameters. Stage 3 gathers the
    parameters in every micro-step's forward and again in its backward, and
    reduce-scatters the gradients. `reduce_scatter=False` runs each
    reduce-scatter as an all-reduce of the same buffer. `elem_bytes` is the
    parameters' bytes per element (the all-gathers), `reduce_bytes` the
    gradients' on the wire (default `elem_bytes`). The step check before each
    optimizer step (gradient norm, non-finite flag, counters) is an op of its
    own, `step_check`: see `step_check_bytes`.
    """
    _check(numel, 1, stage)
    if accumulation < 1:
        raise ValueError(f"accumulation must be >= 1 micro-step; got {accumulation}")
    grads = (reduce_bytes or elem_bytes) * numel
    out = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0}
    if stage == 0:
        out["all_reduce"] += grads
        return out
    reductions = grads * (accumulation if stage >= 2 else 1)
    out["reduce_scatter" if reduce_scatter else "all_reduce"] += reductions
    # Stages 1-2 gather once after the step; stage 3 twice per micro-step (forward, backward).
    out["all_gather"] = elem_bytes * numel * (2 * accumulation if stage == 3 else 1)
    return out


def step_check_bytes(world_size: int) -> int:
    """Logical bytes of the step check, once per optimizer step at every stage and dtype: an all-gather
    of five float64 figures per rank (gradient squares, non-finite flag, global step, micro-step, the
    checksum of the collectives the rank ran; see
    zeroshard/core/grad_norm.py). Clipping and fp16's overflow test use it: no other collective."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 rank; got {world_size}")
    return _STEP_CHECK_BYTES * world_size


def fault_check_bytes(world_size: int, checks: int) -> int:
    """Logical bytes of offload's fault checks: an all-gather of one 8-byte flag per rank after each piece of
    disk I/O that may fail on one rank alone (zeroshard/core/faults.py): once per optimizer step with swap
    files, and at stage 3 before each gather of a unit whose shards are on disk (forward and backward)."""
    return 8 * world_size * checks


def wire_bytes(logical: int, world_size: int, op: str) -> float:
    """Bytes each rank sends (and receives) for `logical` bytes of `op` on a ring of N ranks.

    Reduce-scatter and all-gather send (N-1)/N of the buffer, all-reduce
    2(N-1)/N (DESIGN.md section 1); all-to-all sends every chunk but its own,
    also (N-1)/N. One rank sends nothing.
    """
    if op not in _RING_STEPS:
        raise ValueError(f"unknown collective '{op}'; expected one of {', '.join(_RING_STEPS)}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 rank; got {world_size}")
    return logical * _RING_STEPS[op] * (world_size - 1) / world_size


# ZeRO++ (stage 3): qwZ halves the forward gather, hpZ keeps the backward gather in the node,
# qgZ quarters the gradient reduction: 3M -> 0.5M + 0 + 0.25M across nodes (DESIGN.md section 2).
_ZEROPP_CROSS_NODE = 0.75


def default_optimizer_bytes(dtype: str) -> int:
    """K, the paper's optimizer-state bytes per parameter with Adam: master copy + two fp32 moments."""
    return DTYPE_BYTES[_dtype(dtype)][2] + _ADAM_BYTES


def precision_bytes(dtype: str = "bf16", optimizer_bytes: int | None = None) -> dict[str, int]:
    """`model_state_bytes`'s per-element arguments for a training dtype and K (None: Adam's K)."""
    param, grad, master = DTYPE_BYTES[_dtype(dtype)]
    k = default_optimizer_bytes(dtype) if optimizer_bytes is None else optimizer_bytes
    if k < master:
        raise ValueError(f"optimizer_bytes (K) must be >= {master} bytes per parameter with {dtype}, "
                         f"whose fp32 master copy alone takes {master}; got {k}")
    return {"param_bytes": param, "grad_bytes": grad, "master_bytes": master, "optimizer_bytes": k - master}


def _dtype(dtype: str) -> str:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype '{dtype}'; expected one of {', '.join(DTYPE_BYTES)}")
    return dtype


def memory_per_gpu(numel: int, world_size: int, stage: int, dtype: str = "bf16",
                   optimizer_bytes: int | None = None, largest_unit: int = 0, hpz_partition_size: int = 1) -> int:
    """Bytes of model states per GPU: the sum of `model_state_bytes` for this dtype and K."""
    states = model_state_bytes(numel, world_size, stage, largest_unit=largest_unit,
                               hpz_partition_size=hpz_partition_size, **precision_bytes(dtype, optimizer_bytes))
    return sum(states.values())


def largest_model(gpu_mem: int, world_size: int, stage: int, dtype: str = "bf16",
                  optimizer_bytes: int | None = None, largest_unit: int = 0, hpz_partition_size: int = 1) -> int:
    """The largest Ψ (elements) whose model states fit in `gpu_mem` bytes per GPU; 0 if none does.

    Exact for `memory_per_gpu` (shards rounded up): a bisection, since
    memory grows with Ψ. At stage 3 the gathered unit keeps `largest_unit`.
    """
    def fits(numel: int) -> bool:
        return memory_per_gpu(numel, world_size, stage, dtype, optimizer_bytes, largest_unit,
                              hpz_partition_size) <= gpu_mem

    low, high = 0, gpu_mem * world_size + 1  # every parameter costs at least 1 byte / N per GPU
    if not fits(low):
        return 0
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def cross_node_bytes(numel: int, stage: int, elem_bytes: int, nodes: int, zeropp: bool = False) -> int:
    """Bytes per GPU per step that cross node boundaries, in the papers' units (M = elem_bytes × Ψ).

    One node: 0. Several: every collective spans the nodes, so stages 0-2
    move 2M (an all-reduce, or a reduce-scatter and an all-gather) and stage 3
    moves 3M (two gathers and a reduce-scatter); the ring factor (N-1)/N is
    left out, as the papers do. `zeropp` (stage 3 only): the papers' nominal
    0.75M; `summarize` gives the exact figure as the engine records it
    (zeropp.stage3_comm_bytes).
    """
    _check(numel, 1, stage)
    if zeropp and stage != 3:
        raise ValueError(f"ZeRO++ applies to stage 3 only; got stage {stage}")
    if nodes <= 1:
        return 0
    model = elem_bytes * numel
    if zeropp:
        return round(_ZEROPP_CROSS_NODE * model)
    return (3 if stage == 3 else 2) * model
