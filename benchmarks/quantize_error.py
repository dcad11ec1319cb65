"""Relative error per shard of each codec in ZeRO++'s two-hop quantized gradient reduce-scatter (qgZ), in one process.

    python benchmarks/quantize_error.py [--ranks 16] [--ranks-per-node 8] [--shard 16384] [--seeds 3]

The codecs (comm/compress/quantize.py): int8, int4, fp8_e4m3 and fp8_e5m2, each
with and without the Hadamard rotation ("+hadamard").

N ranks' gradients are drawn as tensors, independent per rank and element:
Gaussian, or Student-t with 3 degrees of freedom for heavy tails. With no
signal shared between ranks the mean is smallest against what each rank
sends, so the relative error is at its worst. They are reduced as qgZ does:
each rank quantizes its gradient and sends it inside its node (hop 1); each
receiver dequantizes and sums in fp32, requantizes the node sum and sends it
across nodes (hop 2), where it is dequantized, summed in fp32 and divided by
N: the exact mean. Every message is made of whole shards and `--shard` is a
multiple of every block size, so blocks never straddle two messages, and
quantizing each rank's whole gradient at once gives the same blocks as
quantizing message by message.

Printed, in markdown, for each codec and block size: the relative error
per shard, ||mean_q - mean|| / ||mean|| over each rank's shard against the
fp64 mean (the mean over shards and seeds, and the worst); the worst shard's
error as a share of the bound derived from the block scales (`two_hop_mean`);
the bytes a message puts on the wire per element, scales included, and that
as a fraction of bf16 (M = 2 bytes per element) and of fp32: the volume of
a hop.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch

from zeroshard.comm.compress.quantize import HADAMARD, BlockCodec, dequantize, message_bytes, quantize
from zeroshard.dtypes import WIRE_FORMATS

CODECS = [f + rotation for f in WIRE_FORMATS for rotation in ("", HADAMARD)]  # names for BlockCodec.named
DISTRIBUTIONS = ("gaussian", "student-t3")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=16, help="N, data-parallel ranks")
    p.add_argument("--ranks-per-node", type=int, default=8, help="D; N / D nodes")
    p.add_argument("--shard", type=int, default=16384, help="elements per rank's shard (a multiple of each block)")
    p.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128, 256, 2048], help="block sizes")
    p.add_argument("--codecs", nargs="+", choices=CODECS, default=CODECS)
    p.add_argument("--distributions", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS))
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args()
    if args.ranks % args.ranks_per_node:
        p.error(f"--ranks {args.ranks} is not a multiple of --ranks-per-node {args.ranks_per_node}")
    if any(args.shard % block for block in args.blocks):
        p.error(f"--shard {args.shard} must be a multiple of every block size {args.blocks}")
    return args


def gradients(distribution: str, ranks: int, numel: int, seed: int) -> torch.Tensor:
    """(ranks, numel) fp32: independent draws for each rank and element."""
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(ranks, numel, generator=g)
    if distribution == "gaussian":
        return normal
    chi2 = torch.randn(3, ranks, numel, generator=g).square().sum(0)
    return normal / (chi2 / 3).sqrt()  # Student-t, 3 degrees of freedom


def over_the_wire(messages: torch.Tensor, codec: BlockCodec) -> tuple[torch.Tensor, torch.Tensor]:
    """What the receivers get, every row quantized and dequantized (rows are whole blocks, see above),
    and the scales that went with it, (rows, blocks per row)."""
    q = quantize(messages, codec)
    return dequantize(q).view_as(messages), q.scales.view(messages.shape[0], -1)


def two_hop_mean(grads: torch.Tensor, ranks_per_node: int, codec: BlockCodec) -> tuple[torch.Tensor, torch.Tensor]:
    """qgZ's result for every shard at once (hop 1 inside nodes, fp32 sums, hop 2 across nodes, / N), and
    its error bound per block: half a scale times the codec's level gap (1 for int8 and int4) for each
    quantization that fed it, / N.

    The bound holds per element, or with the rotation per element of the rotated block; H is orthonormal,
    so either way a block's error has an L2 norm of at most sqrt(block_size) times it.
    """
    ranks, numel = grads.shape
    received, hop1_scales = over_the_wire(grads, codec)
    node_sums = received.view(ranks // ranks_per_node, ranks_per_node, numel).sum(1)
    arrived, hop2_scales = over_the_wire(node_sums, codec)
    return arrived.sum(0) / ranks, (hop1_scales.sum(0) + hop2_scales.sum(0)) * codec.level_gap / (2 * ranks)


def shard_errors(grads: torch.Tensor, ranks_per_node: int, codec: BlockCodec) -> tuple[torch.Tensor, torch.Tensor]:
    """(ranks,) relative error of each rank's shard of the mean against the fp64 mean, and (ranks,) that
    error's share of its bound, sqrt(block_size * sum over the shard's blocks of bound^2)."""
    ranks = grads.shape[0]
    exact = grads.double().mean(0).view(ranks, -1)
    mean, block_bounds = two_hop_mean(grads, ranks_per_node, codec)
    error = (mean.double().view(ranks, -1) - exact).norm(dim=1)
    bound = (codec.block_size * block_bounds.double().view(ranks, -1).square().sum(1)).sqrt()
    return error / exact.norm(dim=1), error / bound


def measure(args: argparse.Namespace) -> dict[tuple[str, str, int], tuple[torch.Tensor, torch.Tensor]]:
    """(relative errors, shares of the bound) of every shard and seed, by (distribution, codec, block)."""
    numel = args.ranks * args.shard
    found: dict[tuple[str, str, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for distribution in args.distributions:
        for seed in range(args.seeds):
            grads = gradients(distribution, args.ranks, numel, seed)
            for name in args.codecs:
                for block in args.blocks:
                    errors = shard_errors(grads, args.ranks_per_node, BlockCodec.named(name, block))
                    found.setdefault((distribution, name, block), []).append(errors)
    return {key: (torch.cat([e for e, _ in runs]), torch.cat([b for _, b in runs])) for key, runs in found.items()}


def error_table(args: argparse.Namespace, errors: dict, cell) -> list[str]:
    lines = ["| gradients | codec | " + " | ".join(f"block {b}" for b in args.blocks) + " |",
             "|---|---|" + "---:|" * len(args.blocks)]
    for distribution in args.distributions:
        for name in args.codecs:
            cells = [cell(*errors[distribution, name, b]) for b in args.blocks]
            lines.append(f"| {distribution} | {name} | " + " | ".join(cells) + " |")
    return lines


def bytes_table(args: argparse.Namespace) -> list[str]:
    """Wire bytes per element of one shard-sized message, and that as a fraction of bf16's 2 bytes (M) and of
    fp32's 4, by format (the rotation sends no more)."""
    lines = ["| format | " + " | ".join(f"block {b}" for b in args.blocks) + " |",
             "|---|" + "---:|" * len(args.blocks)]
    for fmt in dict.fromkeys(BlockCodec.named(name).format for name in args.codecs):
        per_element = [message_bytes(args.shard, BlockCodec(fmt, b)) / args.shard for b in args.blocks]
        cells = [f"{v:.4f} B = {v / 2:.4f} M = {v / 4:.4f} fp32" for v in per_element]
        lines.append(f"| {fmt} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    errors = measure(args)
    nodes = args.ranks // args.ranks_per_node
    print(f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"torch {torch.__version__}; N = {args.ranks} ranks as {nodes} nodes x {args.ranks_per_node}; "
          f"{args.shard} elements per shard; {args.seeds} seeds; {time.perf_counter() - start:.1f} s\n")
    print("Relative error per shard of the two-hop quantized mean, mean over shards and seeds (worst):\n")
    print("\n".join(error_table(args, errors, lambda rel, share: f"{rel.mean():.4f} ({rel.max():.4f})")))
    print("\nThe worst shard's error as a share of the bound derived from the block scales (<= 1 required):\n")
    print("\n".join(error_table(args, errors, lambda rel, share: f"{share.max():.3f}")))
    print("\nBytes on the wire per element of a message, scales included (M = 2 bytes, bf16):\n")
    print("\n".join(bytes_table(args)))


if __name__ == "__main__":
    main()
