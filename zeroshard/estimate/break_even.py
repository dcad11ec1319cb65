"""When compression pays: the bytes of a step per gradient codec, and the link speed below which it is faster.

Bytes. `step_bytes` gives the logical bytes per optimizer step of each op,
as `comm_stats()` records them, for one codec of
`communication_compression.gradients` (None: exact): the gradient
reduction of every bucket (stages 0-2) or sharded flat (stage 3) through
`compressed_reduction_bytes` (scales included), the rest exact: stages 1-2's
parameter all-gather, stage 3's gathers and persistent flats
(`stage3_comm_bytes`), the step check. Bytes on the wire per rank are the
ring factors of `wire_bytes`.

Time (the model of `step_seconds`). On a link of `bandwidth` bytes per
second each way per rank, a step takes

    T(bw) = C + max(0, R / bw - O) + G / bw + t_codec

with C the step's compute (forward, backward, optimizer; what it takes on
an infinitely fast link), R the gradient reduction's bytes on the wire,
which may hide behind backward for up to O seconds (`overlap`), G the other
bytes on the wire (parameter gathers, the step check), which wait for the
optimizer step and hide behind nothing, and t_codec = e x the codec's
seconds per element (quantize with error feedback, then dequantize), e the
gradient elements through the codec per step. Latency per message,
congestion and the codec's compute slowing the overlapped backward are left
out.

Break-even. Exact and compressed differ only in R and t_codec (G and C
cancel), so T_exact(bw) - T_codec(bw) = max(0, R_x / bw - O) -
max(0, R_c / bw - O) - t_codec falls as bw grows, from +inf towards
-t_codec: one bandwidth solves it, and below it compression is faster.
`break_even_bandwidth` solves it piece by piece (`step_seconds` checks it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from zeroshard.estimate.compression import compressed_reduction_bytes, error_feedback_bytes
from zeroshard.estimate.formulas import step_check_bytes, wire_bytes
from zeroshard.estimate.zeropp import stage3_comm_bytes
from zeroshard.plan.flats import PERSISTENT, SHARDED, Flat, padded_numel
from zeroshard.plan.defaults import CODEC_BLOCK_SIZE

# The share of a step's compute that backward takes (twice the forward's multiply-adds), which the
# gradient reduction can hide behind when nothing else holds the link.
BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class StepBytes:
    """One optimizer step's communication with one gradient codec: logical bytes per op, on each rank."""

    reduction: dict[str, int]  # the gradient reduction's ops (during backward)
    rest: dict[str, int]  # parameter gathers and the step check (after the step, or outside backward)
    coded_elements: int  # gradient elements through the codec (encoded and decoded) per step; 0 exact
    error_feedback: int  # bytes of error feedback per rank (memory, not traffic)

    def by_op(self) -> dict[str, int]:
        """Logical bytes per op, both parts summed: what `comm_stats()` records over one step."""
        out = dict(self.rest)
        for op, nbytes in self.reduction.items():
            out[op] = out.get(op, 0) + nbytes
        return out

    def wire(self, world_size: int) -> tuple[float, float]:
        """(R, G): bytes each rank sends for the reduction and for the rest (`wire_bytes` of each op)."""
        def sent(ops: dict[str, int]) -> float:
            return sum(wire_bytes(b, world_size, "all_gather" if op == "step_check" else op) for op, b in ops.items())
        return sent(self.reduction), sent(self.rest)


def step_bytes(buckets: Iterable[int | Flat], world_size: int, stage: int, bits: int | None = None,
               block_size: int = CODEC_BLOCK_SIZE, param_bytes: int = 4, reduce_bytes: int | None = None,
               accumulation: int = 1, error_feedback: bool = True) -> StepBytes:
    """Bytes of one optimizer step with a gradient codec of `bits` bits per element (None: exact).

    `buckets`: elements of each gradient bucket (stages 0-2, padded or not: each is split in N shards of
    ceil(numel / N)), or stage 3's flats (`Flat`; persistent ones reduce exactly, as the engine does).
    `param_bytes` / `reduce_bytes`: bytes per element of the gathered parameters and of the exact
    gradient reduction (default `param_bytes`). The reduction is flat over the group (one hop).
    """
    if stage not in (0, 1, 2, 3) or accumulation < 1 or world_size < 1:
        raise ValueError(f"stage 0-3, accumulation >= 1 and world_size >= 1; got stage {stage}, accumulation "
                         f"{accumulation}, world_size {world_size}")
    flats = [b if isinstance(b, Flat) else Flat(b) for b in buckets]
    r = reduce_bytes or param_bytes
    reductions = accumulation if stage >= 2 else 1  # stages 0-1 reduce once per window, 2-3 every micro-step
    rest = {"step_check": step_check_bytes(world_size)}
    if stage == 3:
        plain = stage3_comm_bytes(flats, world_size, world_size, param_bytes, r, accumulation)
        rest["all_gather"] = sum(plain["all_gather"].values())
        coded = [f.numel for f in flats if f.kind == SHARDED]
        exact = sum(padded_numel(f.numel, world_size) * r * reductions for f in flats
                    if f.kind == PERSISTENT)
    else:
        coded, exact = [f.numel for f in flats], 0
        if stage >= 1:
            rest["all_gather"] = sum(padded_numel(n, world_size) * param_bytes for n in coded)
    if bits is None or world_size == 1:
        padded = sum(padded_numel(n, world_size) for n in coded) * r * reductions
        op = "all_reduce" if stage == 0 else "reduce_scatter"
        return StepBytes({op: padded + exact}, rest, 0, 0)
    reduction = {"reduce_scatter": exact, "all_gather": 0}
    feedback = 0
    for numel in coded:
        for op, nbytes in compressed_reduction_bytes(numel, world_size, bits, block_size, stage == 0).items():
            reduction[op] += reductions * nbytes
        feedback += error_feedback_bytes(numel, world_size, stage == 0) if error_feedback else 0
    if stage > 0:
        del reduction["all_gather"]
    # Each reduction encodes and decodes the padded bucket once; stage 0's gather decodes it once more.
    elements = sum(padded_numel(n, world_size) for n in coded) * reductions * (2 if stage == 0 else 1)
    return StepBytes(reduction, rest, elements, feedback)


def step_seconds(plan: StepBytes, world_size: int, bandwidth: float, compute: float, overlap: float,
                 codec_seconds_per_element: float = 0.0) -> float:
    """The model's step time T(bw) = C + max(0, R / bw - O) + G / bw + t_codec (module docstring), in seconds;
    `bandwidth` in bytes per second each way per rank."""
    reduce_wire, rest_wire = plan.wire(world_size)
    return (compute + max(0.0, reduce_wire / bandwidth - overlap) + rest_wire / bandwidth
            + plan.coded_elements * codec_seconds_per_element)


def break_even_bandwidth(exact: StepBytes, compressed: StepBytes, world_size: int, overlap: float,
                         codec_seconds_per_element: float) -> float:
    """The bandwidth (bytes per second each way per rank) below which `compressed` is the faster step:
    where step_seconds of both are equal. 0.0: never faster; math.inf: faster at any bandwidth."""
    x, _ = exact.wire(world_size)
    c, _ = compressed.wire(world_size)
    codec = compressed.coded_elements * codec_seconds_per_element
    if c >= x:
        return 0.0  # it sends no fewer bytes: only its codec's time differs
    if codec == 0:
        return math.inf if overlap == 0 else x / overlap
    # Both reductions stick out past the overlap (bw <= c / O): the difference is (x - c) / bw - codec.
    both = (x - c) / codec
    if overlap == 0 or both <= c / overlap:
        return both
    # Only the exact one sticks out (c / O < bw <= x / O): x / bw - O - codec.
    return x / (overlap + codec)


def compression_summary(buckets: Iterable[int | Flat], world_size: int, stage: int,
                        codecs: dict[str, tuple[int, float]], block_size: int = CODEC_BLOCK_SIZE, param_bytes: int = 4,
                        reduce_bytes: int | None = None, accumulation: int = 1, compute: float = 0.0,
                        overlap: float = 0.0) -> dict:
    """Each codec's bytes per step beside the exact step's, and its break-even bandwidth, as one object
    (what `zeroshard estimate --compress --json` prints under "compression").

    `codecs`: name -> (bits per element, measured seconds per element of its quantize and dequantize).
    `compute`, `overlap`: C and O of the model (seconds). Per codec: "bytes" per op and their "total",
    "ratio" = total / the exact total, "wire_bytes_per_rank" (R + G), "error_feedback_bytes" per rank,
    "codec_seconds" per step, and "break_even_bytes_per_second" (None: faster at any bandwidth).
    """
    buckets = list(buckets)
    args = (world_size, stage)
    kwargs = {"block_size": block_size, "param_bytes": param_bytes, "reduce_bytes": reduce_bytes,
              "accumulation": accumulation}
    exact = step_bytes(buckets, *args, None, **kwargs)
    exact_total = sum(exact.by_op().values())

    def row(plan: StepBytes, per_element: float) -> dict:
        by_op = plan.by_op()
        return {"bytes": by_op, "total_bytes": sum(by_op.values()),
                "ratio": sum(by_op.values()) / exact_total if exact_total else 1.0,
                "wire_bytes_per_rank": sum(plan.wire(world_size)), "error_feedback_bytes": plan.error_feedback,
                "coded_elements": plan.coded_elements, "codec_seconds_per_element": per_element,
                "codec_seconds": plan.coded_elements * per_element}

    out = {"stage": stage, "world_size": world_size, "compute_seconds": compute, "overlap_seconds": overlap,
           "exact": row(exact, 0.0), "codecs": {}}
    for name, (bits, per_element) in codecs.items():
        plan = step_bytes(buckets, *args, bits, **kwargs)
        bandwidth = break_even_bandwidth(exact, plan, world_size, overlap, per_element)
        out["codecs"][name] = row(plan, per_element) | {
            "break_even_bytes_per_second": None if math.isinf(bandwidth) else bandwidth}
    return out
