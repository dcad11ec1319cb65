"""`zeroshard estimate --compress`: each gradient codec's bytes per step and the link speed below which it pays.

The figures are `zeroshard.estimate.compression_summary`'s (the model is in
zeroshard/estimate/break_even.py and docs/compression.md): per codec, the
logical bytes per optimizer step as `comm_stats()` records them, their ratio
to the exact step's, the bytes each rank sends, its error feedback, and the
bandwidth below which the step is expected faster compressed. The one
measurement is the codec's own time: this module quantizes (with error
feedback) and dequantizes 2^20 gradient values per codec on this machine's
CPU, the work a compressed reduction adds to every element of a bucket.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from zeroshard import estimate
from zeroshard.app.flags import positive_float
from zeroshard.app.estimate.model_count import REDUCE_BUCKET_SIZE, ParamCount
from zeroshard.app.units import count, human_bytes
from zeroshard.comm.compress.messages import decode_rows, encode_rows
from zeroshard.comm.compress.quantize import BlockCodec
from zeroshard.config.compression import CODECS
from zeroshard.dtypes import WIRE_BITS

MEASURED_ELEMENTS = 2**20  # a few milliseconds per pass per codec; the median of REPEATS passes
REPEATS = 5
DEFAULT_STAGE = 2


def add_compress(parser: argparse.ArgumentParser) -> None:
    """The flags of the compression table (`--compress` turns it on; the others need it)."""
    group = parser.add_argument_group("gradient compression (communication_compression.gradients)")
    group.add_argument("--compress", nargs="*", metavar="CODEC", default=None,
                       help=f"print each codec's bytes per step and break-even link speed: {', '.join(CODECS)} "
                            "(none named: all), no rotation (the config's default), error feedback on")
    group.add_argument("--stage", type=int, choices=estimate.STAGES, default=None,
                       help=f"with --compress: the ZeRO stage (default: {DEFAULT_STAGE})")
    group.add_argument("--step-seconds", type=positive_float, default=None, metavar="T",
                       help="with --compress: the measured compute time of one step (forward, backward, optimizer) "
                            "on a fast link; without it: 0, nothing overlaps (the highest break-even)")
    group.add_argument("--overlap", type=float, default=None, metavar="F",
                       help="with --step-seconds: the share of T the gradient reduction can hide behind, in "
                            f"[0, 1] (default: backward's, {estimate.BACKWARD_SHARE:.2f})")
    group.add_argument("--bucket-size", type=count, default=None, metavar="ELEMENTS",
                       help="with --compress or --micro-batch (the step's peak): reduce_bucket_size (default: the "
                            "demo's for a preset, the engine's otherwise)")


def check_compress(args: argparse.Namespace) -> None:
    """A flag that needs another, or a codec name that is none: an argparse error."""
    error = args.command_parser.error
    needs = [("--stage", args.stage, "--compress"), ("--step-seconds", args.step_seconds, "--compress"),
             ("--bucket-size", None if args.micro_batch else args.bucket_size, "--compress or --micro-batch"),
             ("--overlap", args.overlap, "--step-seconds")]
    for flag, value, other in needs:
        if value is not None and (args.compress is None or (other == "--step-seconds" and args.step_seconds is None)):
            error(f"{flag} needs {other}: without it the flag changes nothing")
    unknown = [name for name in args.compress or () if name not in CODECS]
    if unknown:
        error(f"--compress {' '.join(unknown)}: not a codec; choose from {', '.join(CODECS)}")
    if args.overlap is not None and not 0 <= args.overlap <= 1:
        error(f"--overlap must be in [0, 1], a share of --step-seconds; got {args.overlap}")


def codec_seconds_per_element(name: str, block_size: int, world_size: int, elements: int | None = None,
                              repeats: int = REPEATS) -> float:
    """Seconds per gradient element of a compressed reduction's codec work on this CPU: the sender's
    quantize with error feedback of its N chunks (`encode_rows`), the receiver's dequantize of N chunks
    (`decode_rows`); the median of `repeats` passes over `elements` values (default MEASURED_ELEMENTS) on one
    thread, after one warm-up pass."""
    elements = elements or MEASURED_ELEMENTS
    codec = BlockCodec(name, block_size)  # the config's default: no rotation
    rows = max(1, min(world_size, elements))
    grads = torch.randn(rows, -(-elements // rows), generator=torch.Generator().manual_seed(0))
    error = torch.zeros_like(grads)
    times, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # one rank's share: ranks split the host's cores (and 2 threads on 2 busy cores thrash)
    try:
        for _ in range(repeats + 1):
            start = time.perf_counter()
            decode_rows(encode_rows(grads, codec, error), grads.shape[1], codec)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times[1:]) / grads.numel()


def compression(args: argparse.Namespace, counted: ParamCount | None, dtype_bytes: tuple[int, int]) -> dict:
    """The "compression" object of the estimate: the codecs' bytes, measured codec times, break-even.
    `counted`: the model's count (None with --params); `dtype_bytes`: the parameters' and gradients'."""
    stage = DEFAULT_STAGE if args.stage is None else args.stage
    buckets = stage_buckets(args, stage, counted)
    names = args.compress or list(CODECS)
    compute = args.step_seconds or 0.0
    share = estimate.BACKWARD_SHARE if args.overlap is None else args.overlap
    codecs = {name: (WIRE_BITS[name], codec_seconds_per_element(name, args.block_size, args.gpus))
              for name in names}
    summary = estimate.compression_summary(buckets, args.gpus, stage, codecs, args.block_size,
                                           param_bytes=dtype_bytes[0], reduce_bytes=dtype_bytes[1],
                                           compute=compute, overlap=share * compute)
    summary["measured"] = (f"codec seconds per element: quantize with error feedback + dequantize of "
                           f"{MEASURED_ELEMENTS:,} values on one thread of this machine's CPU, median of {REPEATS}")
    return summary


def stage_buckets(args: argparse.Namespace, stage: int, counted: ParamCount | None) -> list:
    """What the stage reduces: the counted model's buckets (stages 0-2) or flats (stage 3); with --params,
    Ψ cut in buckets of --bucket-size (default the engine's), or one flat at stage 3."""
    if counted is not None:
        return list(counted.flats if stage == 3 else counted.buckets)
    size = args.bucket_size or REDUCE_BUCKET_SIZE
    if stage == 3:
        return [args.params]
    return [min(size, args.params - start) for start in range(0, args.params, size)]


def rate(bytes_per_second: float | None) -> str:
    """A link speed in bits per second, as links are sold: 10 Gbit/s, 940 Mbit/s."""
    if bytes_per_second is None:
        return "any"
    if bytes_per_second == 0:
        return "never"
    bits = 8 * bytes_per_second
    for unit, size in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= size:
            return f"{bits / size:.3g} {unit}"
    return f"{bits:.3g} bit/s"


def print_compression(console: Console, summary: dict) -> None:
    """One row per codec beside the exact step: bytes, ratio, wire, error feedback, codec time, break-even."""
    stage, n = summary["stage"], summary["world_size"]
    console.print(f"[bold]gradient codecs at stage {stage}[/], {n} GPUs: bytes per optimizer step and the link "
                  "speed below which the step is expected faster compressed")
    table = Table(show_edge=False)
    for column in ("codec", "bytes/step", "ratio", "sent/rank", "EF/rank", "codec s", "pays below"):
        table.add_column(column, justify="left" if column == "codec" else "right", no_wrap=True)
    exact = summary["exact"]
    table.add_row("exact", human_bytes(exact["total_bytes"]), "1", human_bytes(exact["wire_bytes_per_rank"]),
                  "0", "0", "")
    for name, row in summary["codecs"].items():
        table.add_row(name, human_bytes(row["total_bytes"]), f"{row['ratio']:.3f}",
                      human_bytes(row["wire_bytes_per_rank"]), human_bytes(row["error_feedback_bytes"]),
                      f"{row['codec_seconds']:.3g}", rate(row["break_even_bytes_per_second"]))
    console.print(table)
    compute, overlap = summary["compute_seconds"], summary["overlap_seconds"]
    given = (f"C = {compute:g} s of compute, the reduction hides behind up to O = {overlap:.3g} s of it"
             if compute else "no --step-seconds: C = 0 and nothing overlaps, so these are the highest break-evens")
    console.print("[dim]" + "\n".join([
        "bytes/step: logical bytes per step summed over ops, as engine.comm_stats() records them, scales included",
        "sent/rank: bytes each rank sends per step; EF: error feedback memory; codec s: its quantize and dequantize",
        "pays below: the step is expected faster compressed on a slower link (each rank's speed, each way)",
        "model: step = C + max(0, reduction sent / bw - O) + other sent / bw + codec s (docs/compression.md)",
        given, summary["measured"]]) + "[/]")

