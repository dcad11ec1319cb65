"""Block quantization for the wire (ZeRO++ qwZ and qgZ): symmetric int8 or int4, an fp32 scale per block.

A tensor is flattened and cut into blocks of `block_size` elements, the last
block padded with zeros. Each block b gets the scale s_b = max|x| / qmax
(qmax = 127 for int8, 7 for int4) and its values q = round(x / s_b), so
dequantizing, q * s_b, is off by at most s_b / 2 per element: the ZeRO++
paper's block-based quantization. A block of zeros has scale 0 and
dequantizes to zeros exactly; a block holding inf or nan gets a non-finite
scale, so it dequantizes to non-finite values and the overflow check after
the reduction still sees it.

With `hadamard`, each block is rotated by the orthonormal Walsh-Hadamard
matrix H before quantizing and rotated back after dequantizing (H is its own
inverse). The rotation spreads an outlier over the whole block, so the scale
follows the block's norm rather than its largest element: heavy-tailed
gradients lose much less at int4. The error bound then holds in the rotated
basis: the error of a block has an L2 norm of at most s_b * sqrt(block_size) / 2.

All reductions happen in fp32; only what travels is quantized. Every
function is vectorized over blocks (the only Python loop is over the
log2(block_size) stages of the Hadamard transform) and takes plain tensors.
With `BlockCodec(compiled=True)` the same arithmetic runs as the kernels
torch.compile generates from it (C++ loops on CPU, Triton on GPU): each
step of the eager version reads and writes a whole tensor, the compiled
one makes one pass. On CPU (one thread, 25M bf16 values) the int8
quantization took 15 ms compiled against 293 ms eager, after a first call
that compiles for a few seconds (`benchmarks/zeropp_collectives.py`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from zeroshard.errors import ZeroshardError
from zeroshard.estimate.zeropp import quantized_bytes

SCALE_DTYPE = torch.float32


class CodecError(ZeroshardError, ValueError):
    """A quantizer setting or input that cannot be used (bits, block size, dtype)."""


@dataclass(frozen=True)
class BlockCodec:
    """How a message is quantized: `bits` (8 or 4) per value, one scale per `block_size` elements."""

    bits: int = 8
    block_size: int = 256  # elements per block (and per scale)
    hadamard: bool = False  # rotate each block before quantizing; needs a power-of-two block size
    compiled: bool = False  # run the arithmetic as torch.compile's kernels (same values as eager; see _kernel)

    def __post_init__(self) -> None:
        if self.bits not in (8, 4):
            raise CodecError(f"quantization bits must be 8 or 4, not {self.bits!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise CodecError(f"the quantization block size must be a positive integer, not {self.block_size!r}")
        if self.bits == 4 and self.block_size % 2:
            raise CodecError(f"int4 packs two values a byte, so its block size must be even, not {self.block_size}")
        if self.hadamard and self.block_size & (self.block_size - 1):
            raise CodecError(f"the Hadamard rotation needs a power-of-two block size, not {self.block_size}; "
                             "use 32, 64, 128, ... or turn the rotation off")

    @property
    def qmax(self) -> int:
        """The largest quantized magnitude: 127 (int8) or 7 (int4); symmetric, so -qmax..qmax."""
        return 2 ** (self.bits - 1) - 1

    def blocks(self, numel: int) -> int:
        """Blocks (and scales) of a message of `numel` elements: the last one padded."""
        return -(-numel // self.block_size)

    @property
    def payload_bytes_per_block(self) -> int:
        return self.block_size * self.bits // 8


@dataclass(frozen=True)
class Quantized:
    """A quantized message: what travels is `payload` and `scales`."""

    payload: torch.Tensor  # (blocks, block_size) int8; int4: (blocks, block_size // 2) uint8, two values a byte
    scales: torch.Tensor  # (blocks,) fp32: block b's values are payload[b] * scales[b]
    numel: int  # elements of the message before padding
    codec: BlockCodec


def message_bytes(numel: int, codec: BlockCodec) -> int:
    """Bytes on the wire for one message of `numel` elements: padded payload plus one fp32 scale per block.

    Pure arithmetic, equal to `payload.nbytes + scales.nbytes` of `quantize`'s
    result; the formula lives in `estimate/zeropp.py`, so the estimator shares it.
    """
    return quantized_bytes(numel, codec.bits, codec.block_size)


def quantize(x: torch.Tensor, codec: BlockCodec) -> Quantized:
    """Quantize `x` (any shape, fp32 / bf16 / fp16; read flattened) block by block."""
    if not x.is_floating_point():
        raise CodecError(f"only floating-point tensors are quantized, not {x.dtype}")
    kernel = _kernel(_quantize_blocks, codec.compiled)
    payload, scales = kernel(_padded_blocks(x, codec), codec.qmax, codec.hadamard, codec.bits == 4)
    return Quantized(payload, scales, x.numel(), codec)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The message's `numel` values as a 1-D tensor of `dtype`, computed in fp32 and cast once at the end."""
    blocks = _kernel(_dequantize_blocks, q.codec.compiled)(q.payload, q.scales, q.codec.hadamard, q.codec.bits == 4,
                                                           dtype)
    return blocks.reshape(-1)[: q.numel]


def _quantize_blocks(blocks: torch.Tensor, qmax: int, rotate: bool, pack: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, fp32 scales) of (rows, block) values of any float dtype: the arithmetic of `quantize`."""
    blocks = blocks.to(SCALE_DTYPE)
    if rotate:
        blocks = hadamard(blocks)
    scales = blocks.abs().amax(dim=1) / qmax
    # A zero block divides by 1 instead of its scale 0, so its values are 0, not nan.
    divisors = torch.where(scales == 0, torch.ones_like(scales), scales)
    values = torch.round(blocks / divisors[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return (pack_int4(values) if pack else values), scales


def _dequantize_blocks(payload: torch.Tensor, scales: torch.Tensor, rotate: bool, unpack: bool,
                       dtype: torch.dtype) -> torch.Tensor:
    """(rows, block) values of `dtype` from a payload and its scales: the arithmetic of `dequantize`."""
    values = unpack_int4(payload) if unpack else payload
    blocks = values.to(SCALE_DTYPE) * scales[:, None]
    if rotate:
        blocks = hadamard(blocks)
    return blocks.to(dtype)


@functools.cache
def _compiled(kernel):
    return torch.compile(kernel, dynamic=True)


def _kernel(kernel, compiled: bool):
    """`kernel` as it is, or as torch.compile generates it (one fused loop instead of a tensor per step)."""
    return _compiled(kernel) if compiled else kernel


def _padded_blocks(x: torch.Tensor, codec: BlockCodec) -> torch.Tensor:
    """`x` flattened as (blocks, block_size), in its own dtype, the tail padded with zeros (which never raise a
    scale)."""
    flat = x.reshape(-1)
    pad = codec.blocks(x.numel()) * codec.block_size - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, codec.block_size)


def hadamard(blocks: torch.Tensor) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard transform of each row of `blocks` (rows, n), n a power of two.

    The fast transform: log2(n) butterfly stages, each pairing element i with
    i + h inside runs of 2h, done with reshapes over all rows at once. This is
    Sylvester's H_n = [[H, H], [H, -H]] / sqrt(2), symmetric and orthonormal,
    so applying it twice gives the input back (within float rounding). Each
    stage writes into one of two preallocated buffers (`out=`), not a new
    stacked tensor: 3x faster on CPU, and the same additions, so the same
    bits. Element-wise arithmetic, unlike a matmul with H, gives every rank
    and every batch shape the same result, which qwZ needs (all ranks must
    dequantize identical weights).
    """
    rows, n = blocks.shape
    if n & (n - 1):
        raise CodecError(f"the Hadamard transform needs a power-of-two length, not {n}")
    x = blocks.contiguous()
    buffers = (torch.empty_like(x), torch.empty_like(x))  # ping-pong, so the input itself is never written
    h, stage = 1, 0
    while h < n:
        pairs, out = x.view(rows, n // (2 * h), 2, h), buffers[stage % 2].view(rows, n // (2 * h), 2, h)
        torch.add(pairs[:, :, 0], pairs[:, :, 1], out=out[:, :, 0])
        torch.sub(pairs[:, :, 0], pairs[:, :, 1], out=out[:, :, 1])
        x, h, stage = buffers[stage % 2], 2 * h, stage + 1
    return x * n ** -0.5


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], an even count along the last dimension, as uint8 holding two values a byte.

    Element 2i goes in the low nibble and 2i + 1 in the high one, each as its
    4-bit two's complement. The last dimension halves.
    """
    if values.dtype != torch.int8 or values.shape[-1] % 2:
        raise CodecError(f"pack_int4 takes int8 values with an even last dimension, not {values.dtype} "
                         f"{tuple(values.shape)}")
    nibbles = (values & 0x0F).to(torch.uint8).view(*values.shape[:-1], values.shape[-1] // 2, 2)
    return nibbles[..., 0] | (nibbles[..., 1] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The int8 values `pack_int4` packed: the last dimension doubles.

    Each nibble is moved to the top of a byte and read as int8; the
    arithmetic shift right by 4 then brings it back sign-extended.
    """
    if packed.dtype != torch.uint8:
        raise CodecError(f"unpack_int4 takes uint8 bytes, not {packed.dtype}")
    low = (packed << 4).view(torch.int8) >> 4
    high = packed.view(torch.int8) >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)
