"""`summarize`: the estimate for one setup, JSON-ready, what `zeroshard estimate --json` prints.

It joins formulas.py (ZeRO stages 0-3) and zeropp.py (stage 3's collectives
by scope, with and without ZeRO++, and hpZ's memory). Stage 3's figures by
scope come from the flat buffers the engine would build (`flats`: from the
model's unit plan, app/estimate/model_count.py), or from one sharded flat of Ψ.
"""

from __future__ import annotations

import math
from dataclasses import asdict

from zeroshard.estimate.formulas import (
    STAGES,
    comm_bytes_per_step,
    cross_node_bytes,
    largest_model,
    model_state_bytes,
    precision_bytes,
    wire_bytes,
)
from zeroshard.estimate.offload import OffloadSetup, offload_summary
from zeroshard.estimate.zeropp import (
    PERSISTENT,
    Flat,
    ZeroPP,
    by_scope,
    hpz_secondary_bytes,
    stage3_comm_bytes,
    stage3_comm_calls,
)

ALL_PARTS = ZeroPP(qwz=True, hpz=True, qgz=True, gradient_bits=4)  # the paper's full ZeRO++: qwZ + hpZ + int4 qgZ


def summarize(numel: int, gpus: int, gpus_per_node: int | None = None, dtype: str = "bf16",
              optimizer_bytes: int | None = None, largest_unit: int = 0,
              gpu_mem: int | None = None, flats: list[Flat] | None = None,
              zeropp: ZeroPP | None = None, offload: OffloadSetup | None = None) -> dict:
    """The estimate for one setup, JSON-ready: what `zeroshard estimate --json` prints.

    Keys "0".."3" are stages. `memory_bytes`: model-state bytes per GPU;
    `memory_by_state`: the same split into params, grads, master, optimizer
    (and, at stage 3 with hpZ, hpz_secondary). `comm_bytes`: logical bytes
    per optimizer step summed over collectives, the convention of
    `engine.comm_stats()` (an all-reduce counts its buffer once);
    `comm_by_op`: per collective; `wire_bytes_per_rank`: bytes each rank
    sends on rings, the paper's 2Ψ (stages 0-2) and 3Ψ (stage 3) elements ×
    (N-1)/N. `cross_node_bytes` per GPU (see `cross_node_bytes`).
    `max_params`: the largest Ψ that fits `gpu_mem` bytes per GPU (null
    without `gpu_mem`).

    Stage 3 by scope, exact (zeropp.stage3_comm_bytes, one micro-step per
    step, D = `gpus_per_node`): `stage3_comm_by_scope` {"plain": {op: {scope:
    bytes}}, and "zeropp" with the parts `zeropp` turns on}, `stage3_comm_calls`
    alike, `stage3_model_bytes` M (e × Ψ), `stage3_flats` (how many flat
    buffers: `flats`, default one sharded flat of Ψ). `cross_node_bytes_zeropp`:
    stage 3's cross-node logical bytes per step with qwZ + hpZ + qgZ on one
    flat of Ψ (null when `gpus_per_node` does not divide `gpus`). "offload":
    the three pools with `offload` on (offload.offload_summary), else null.
    """
    gpus_per_node = min(gpus, 8) if gpus_per_node is None else gpus_per_node
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1; got {gpus_per_node}")
    zeropp = zeropp if zeropp is not None and zeropp.on else None
    hpz = gpus_per_node if zeropp is not None and zeropp.hpz else 1
    per_element = precision_bytes(dtype, optimizer_bytes)
    nodes = math.ceil(gpus / gpus_per_node)
    elem = per_element["param_bytes"]  # 16-bit training reduces and gathers in 16 bits
    flats = [Flat(numel)] if flats is None else flats
    by_state = {str(s): model_state_bytes(numel, gpus, s, largest_unit=largest_unit, **per_element)
                for s in STAGES}
    if hpz > 1:  # the secondary shards of the flats the engine would build
        by_state["3"]["hpz_secondary"] = hpz_secondary_bytes(flats, gpus, hpz, elem)
    by_op = {str(s): comm_bytes_per_step(numel, s, elem_bytes=elem) for s in STAGES}
    k = per_element["master_bytes"] + per_element["optimizer_bytes"]
    return {
        "params": numel, "largest_unit": largest_unit, "gpus": gpus, "gpus_per_node": gpus_per_node,
        "nodes": nodes, "dtype": dtype, "optimizer_bytes": k,
        "memory_bytes": {s: sum(states.values()) for s, states in by_state.items()},
        "memory_by_state": by_state,
        "comm_bytes": {s: sum(ops.values()) for s, ops in by_op.items()},
        "comm_by_op": by_op,
        "wire_bytes_per_rank": {s: round(sum(wire_bytes(b, gpus, op) for op, b in ops.items()))
                                for s, ops in by_op.items()},
        "cross_node_bytes": {str(s): cross_node_bytes(numel, s, elem, nodes) for s in STAGES},
        "cross_node_bytes_zeropp": _zeropp_cross_node(numel, gpus, gpus_per_node, elem),
        "gpu_mem_bytes": gpu_mem,
        "max_params": None if gpu_mem is None else {
            str(s): largest_model(gpu_mem, gpus, s, dtype, k, largest_unit, hpz if s == 3 else 1) for s in STAGES},
        **_stage3(numel, flats, gpus, gpus_per_node, elem, zeropp),
        "offload": None if offload is None or not offload.on else offload_summary(
            numel, gpus, min(gpus, gpus_per_node), dtype, optimizer_bytes, offload, largest_unit,
            sum(f.numel for f in flats if f.kind == PERSISTENT), gpu_mem),
    }


def _zeropp_cross_node(numel: int, gpus: int, gpus_per_node: int, elem: int) -> int | None:
    """Stage 3's cross-node bytes per step with all of ZeRO++ on one flat of Ψ; None without whole nodes."""
    if gpus <= gpus_per_node or numel == 0:
        return 0  # one node: nothing crosses
    if gpus % gpus_per_node:
        return None
    # Nodes of one GPU hold no secondary shard (config refuses hpZ there): qwZ and qgZ only.
    parts = ALL_PARTS if gpus_per_node > 1 else ZeroPP(qwz=True, qgz=True, gradient_bits=4)
    return by_scope(stage3_comm_bytes([Flat(numel)], gpus, gpus_per_node, elem, zeropp=parts))["cross_node"]


def _stage3(numel: int, flats: list[Flat], gpus: int, gpus_per_node: int, elem: int,
            zeropp: ZeroPP | None) -> dict:
    """The keys of stage 3 by scope: plain, and with the chosen parts of ZeRO++."""
    setups = {"plain": ZeroPP()} | ({"zeropp": zeropp} if zeropp is not None else {})
    if numel == 0:
        flats = []
    return {
        "stage3_model_bytes": elem * numel,
        "stage3_flats": len(flats),
        "stage3_comm_by_scope": {name: stage3_comm_bytes(flats, gpus, gpus_per_node, elem, zeropp=parts)
                                 for name, parts in setups.items()},
        "stage3_comm_calls": {name: stage3_comm_calls(flats, gpus, gpus_per_node, elem, zeropp=parts)
                              for name, parts in setups.items()},
        "zeropp": None if zeropp is None else asdict(zeropp),
    }
