"""`zeroshard train --compress`: the demo's gradients on the wire through a codec, and their bytes' formula."""

from __future__ import annotations

import argparse

import zeroshard
from zeroshard import estimate
from zeroshard.config.compression import CODECS
from zeroshard.dtypes import WIRE_BITS

# The flag's names: fp8 is e4m3 (more mantissa, the range gradients scaled per block need).
_NAMES = {"fp8": "fp8_e4m3"}
CHOICES = ("none", "int8", "int4", "fp8", "fp8_e5m2", "powersgd")


def add_compress(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compress", choices=CHOICES, default=None,
                        help="gradient reductions through a codec (communication_compression.gradients.codec): "
                             "int8, int4, fp8 (e4m3) or fp8_e5m2 at any stage, with "
                             "error feedback; powersgd (rank 4) at stages 0-1; docs/compression.md (default: none, "
                             "or the config's)")


def compress_keys(args: argparse.Namespace, raw: dict) -> None:
    """Set the config's gradient codec from --compress (its other keys, from --config, stay)."""
    if args.compress is None:
        return
    block = raw.setdefault("communication_compression", {})
    gradients = {"codec": _NAMES.get(args.compress, args.compress)}
    if args.compress != "none":
        old = block.get("gradients") or {}
        gradients = old | gradients if old.get("codec") == gradients["codec"] else gradients
    block["gradients"] = gradients


def reduction_formula(engine: zeroshard.Engine, accumulation: int) -> dict[str, int]:
    """Logical bytes per optimizer step of the gradient reductions, when a codec compresses them:
    estimate.compressed_reduction_bytes over the buckets (stage 0: reduce-scatter and gather of the
    all-reduce; stages 2-3 reduce every micro-step), exact buckets (stage 3's persistent ones) at their
    own size; PowerSGD's all-reduces (stages 0-1); and stages 1-2's gathers after the step through the
    parameters' codec. Empty without a codec."""
    return _gradients(engine, accumulation) | _gathers_after_the_step(engine)


def _gathers_after_the_step(engine: zeroshard.Engine) -> dict[str, int]:
    """Stages 1-2's all-gather of the updated shards through the parameters' codec (qwZ's bytes per bucket)."""
    params = engine.config.communication_compression.parameters
    if params.codec == "none" or engine.config.stage not in (1, 2):
        return {}
    return {"all_gather": sum(estimate.qwz_all_gather_bytes(b.flat.padded_numel, engine.comm.world_size,
                                                            WIRE_BITS[params.codec], params.block_size)
                              for b in engine.buckets)}


def _gradients(engine: zeroshard.Engine, accumulation: int) -> dict[str, int]:
    grads = engine.config.communication_compression.gradients
    if grads.codec == "powersgd":
        return {"all_reduce": sum(_low_rank_bytes(b, engine, grads.rank) for b in engine.buckets), "reduce_scatter": 0}
    if grads.codec not in CODECS:
        return {}
    world, stage = engine.comm.world_size, engine.config.stage
    per_node = engine.config.zero_optimization.ranks_per_node if grads.hierarchical else None
    bits = WIRE_BITS[grads.codec]
    reductions = accumulation if stage >= 2 else 1
    out = {"reduce_scatter": 0, "all_gather": 0}
    for bucket in engine.buckets:
        numel = bucket.flat.padded_numel
        if bucket.compressed is None:
            out["reduce_scatter"] += reductions * numel * engine.precision.reduce_dtype.itemsize
            continue
        for op, nbytes in estimate.compressed_reduction_bytes(numel, world, bits, grads.block_size, stage == 0,
                                                              per_node).items():
            out[op] += reductions * nbytes
    return {"all_reduce": 0, "reduce_scatter": out["reduce_scatter"]} | (
        {"all_gather": out["all_gather"]} if stage == 0 else {})


def _low_rank_bytes(bucket, engine: zeroshard.Engine, rank: int) -> int:
    """One bucket's PowerSGD all-reduces in its last step: exact in the warm-up (the reduce dtype), else P, Q and
    the exact part (estimate.powersgd_bytes)."""
    low = bucket.powersgd
    if low.step <= low.settings.start_step:
        return low.numel * engine.precision.reduce_dtype.itemsize
    return estimate.powersgd_bytes([tuple(s) for s in bucket.flat.shapes], rank)
