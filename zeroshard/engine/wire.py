"""How gradients and parameters travel: the codecs of `communication_compression`, or ZeRO++'s.

ZeRO++'s qgZ is a compressed reduction over the node topology without error
feedback (as the paper has it), qwZ an int8 codec on stage 3's gathers; the
`communication_compression` section gives the same machinery any codec, at
any stage, flat or over the nodes, with error feedback by default. The config
refuses a part set both ways (config/compression.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from zeroshard.comm import BlockCodec, Comm, CompressedReduction, Hops
from zeroshard.comm.compress.quantize import compile_unavailable
from zeroshard.comm.topology import build_topology
from zeroshard.config import Config
from zeroshard.config.compression import CODECS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Wire:
    """The codecs of one engine's data-parallel traffic (None: exact)."""

    gradients: CompressedReduction | None
    weights: BlockCodec | None  # parameter all-gathers: after the step (stages 1-2), every gather (stage 3)
    node: Comm | None  # hpZ: this rank's node, over which stage 3's secondary shards are spread


def wire(comm: Comm, config: Config, device: torch.device) -> Wire:
    """The codecs the config asks for. The node topology (a collective over the default group) is built
    only when hpZ or a two-hop reduction needs it. With one rank nothing travels, so nothing is quantized."""
    if comm.world_size == 1:
        return Wire(None, None, None)
    zero, compression = config.zero_optimization, config.communication_compression
    compiled = _compile_quantizers(zero.zeropp_compile_quantizers, device, comm.rank) \
        if zero.zero_quantized_weights or zero.zero_quantized_gradients else False
    grads = compression.gradients
    hierarchical = zero.zero_quantized_gradients or (grads.codec in CODECS and grads.hierarchical)
    hops = (Hops.create(comm, build_topology(comm.group, zero.ranks_per_node))
            if hierarchical or zero.zero_hpz_partition_size > 1 else None)
    gradients = None
    if zero.zero_quantized_gradients:
        codec = BlockCodec(zero.gradient_format, zero.zeropp_block_size, zero.gradient_hadamard, compiled)
        gradients = CompressedReduction(comm, hops, codec, error_feedback=False)
    elif grads.codec in CODECS:
        codec = named_codec(grads.codec, grads.block_size, grads.hadamard)
        gradients = CompressedReduction(comm, hops if grads.hierarchical else Hops.flat(comm), codec,
                                        grads.error_feedback)
    weights = None
    if zero.zero_quantized_weights:
        weights = BlockCodec("int8", zero.zeropp_block_size, compiled=compiled)
    elif compression.parameters.codec != "none":
        params = compression.parameters
        weights = named_codec(params.codec, params.block_size, params.hadamard)
    return Wire(gradients, weights, hops.node if zero.zero_hpz_partition_size > 1 else None)


def _compile_quantizers(asked: bool | None, device: torch.device, rank: int) -> bool:
    """zeropp_compile_quantizers as it applies: null is on where torch.compile can build the kernels here."""
    if asked is not None:
        return asked
    why = compile_unavailable(device)
    if why is not None and rank == 0:
        log.info("ZeRO++'s quantizers run eagerly (several times slower on a CPU): %s", why)
    return why is None


def named_codec(name: str, block_size: int, hadamard: bool) -> BlockCodec:
    """The codec of a config's name ("int8", "int4", "fp8_e4m3", "fp8_e5m2")."""
    return BlockCodec(name, block_size, hadamard)
