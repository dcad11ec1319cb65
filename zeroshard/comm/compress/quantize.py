"""Block codecs for the wire: int8, int4 (two a byte), fp8 e4m3 or e5m2, each with an fp32 scale per block.

A tensor is flattened and cut into blocks of `block_size` elements, the last
block padded with zeros. Each block b gets the scale s_b = max|x| / qmax and
travels as the values x / s_b in the codec's format (`BlockCodec.format`):

- "int8", "int4": symmetric integers, q = round(x / s_b) with qmax = 127 or
  7 (int4 packed two a byte), so dequantizing, q * s_b, is off by at most
  s_b / 2 per element: the ZeRO++ paper's block-based quantization;
- "fp8_e4m3", "fp8_e5m2": torch's float8_e4m3fn / float8_e5m2 cast of
  x / s_b, qmax the format's largest finite value (448, 57344), sent as its
  bytes (uint8), so an element is off by at most s_b times half a unit in
  the last place of its scaled value: relative 2^-4 (e4m3) or 2^-3 (e5m2)
  for normal values, an absolute floor of half the smallest subnormal below.

A block of zeros has scale 0 and dequantizes to zeros exactly; a block
holding inf or nan gets a non-finite scale, so it dequantizes to non-finite
values and the overflow check after the reduction still sees it.

With `hadamard`, each block is rotated by the orthonormal Walsh-Hadamard
matrix H before quantizing and rotated back after dequantizing (H is its own
inverse). The rotation spreads an outlier over the whole block, so the scale
follows the block's norm rather than its largest element: heavy-tailed
gradients lose much less at int4. The error bound then holds in the rotated
basis: at int8 or int4 the error of a block has an L2 norm of at most
s_b * sqrt(block_size) / 2.

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
import logging
import math
from dataclasses import dataclass

import torch

from zeroshard.dtypes import FP8_DTYPES, WIRE_BITS, WIRE_FORMATS, WireFormat
from zeroshard.errors import ZeroshardError
from zeroshard.estimate.zeropp import quantized_bytes

log = logging.getLogger(__name__)
SCALE_DTYPE = torch.float32
HADAMARD = "+hadamard"  # a codec's name with the rotation: "int4+hadamard"


class CodecError(ZeroshardError, ValueError):
    """A codec setting or input that cannot be used (format, block size, dtype)."""


@dataclass(frozen=True)
class BlockCodec:
    """How a message travels: each value in `format`, one fp32 scale per `block_size` elements."""

    format: WireFormat = "int8"  # "int8", "int4" (two values a byte), "fp8_e4m3" or "fp8_e5m2"
    block_size: int = 256  # elements per block (and per scale)
    hadamard: bool = False  # rotate each block before quantizing; needs a power-of-two block size
    compiled: bool = False  # run the arithmetic as torch.compile's kernels (same values as eager; see _kernel)

    def __post_init__(self) -> None:
        if self.format not in WIRE_FORMATS:
            raise CodecError(f"a codec's format is one of {', '.join(WIRE_FORMATS)}, not {self.format!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise CodecError(f"the quantization block size must be a positive integer, not {self.block_size!r}")
        if self.format == "int4" and self.block_size % 2:
            raise CodecError(f"int4 packs two values a byte, so its block size must be even, not {self.block_size}")
        if self.hadamard and self.block_size & (self.block_size - 1):
            raise CodecError(f"the Hadamard rotation needs a power-of-two block size, not {self.block_size}; "
                             "use 32, 64, 128, ... or turn the rotation off")

    @classmethod
    def named(cls, name: str, block_size: int = 256, hadamard: bool = False, compiled: bool = False) -> BlockCodec:
        """The codec `name` gives: a format, rotated if it ends in "+hadamard" ("int4+hadamard") or if `hadamard`."""
        fmt, plus, rest = name.partition("+")
        if plus and rest != HADAMARD[1:]:
            raise CodecError(f"a codec's name is a format ({', '.join(WIRE_FORMATS)}), optionally followed by "
                             f"'{HADAMARD}', not {name!r}")
        return cls(fmt, block_size, hadamard or bool(plus), compiled)

    @property
    def name(self) -> str:
        """The name `named` reads back: the format, and "+hadamard" when rotated."""
        return self.format + (HADAMARD if self.hadamard else "")

    @property
    def bits(self) -> int:
        """Bits a value on the wire: 8, or 4 for int4."""
        return WIRE_BITS[self.format]

    @property
    def fp8(self) -> torch.dtype | None:
        """torch's float8 dtype of an fp8 format; None for the integer ones."""
        return FP8_DTYPES.get(self.format)

    @property
    def qmax(self) -> float:
        """The largest scaled magnitude, max|x| / scale: 127 (int8), 7 (int4), the fp8 format's largest
        finite value (448 for e4m3, 57344 for e5m2). The integers are symmetric, -qmax..qmax."""
        return torch.finfo(self.fp8).max if self.fp8 else 2 ** (self.bits - 1) - 1

    @property
    def level_gap(self) -> float:
        """The widest gap between adjacent scaled levels: 1 for the integers, for fp8 the spacing of its
        top binade (32 for e4m3, 8192 for e5m2). Every format rounds an element to within
        scale * level_gap / 2, the bound on a block's elements that needs only its scale."""
        if self.fp8 is None:
            return 1.0
        info = torch.finfo(self.fp8)
        return 2.0 ** math.floor(math.log2(info.max)) * info.eps

    @property
    def payload_dtype(self) -> torch.dtype:
        """The payload's dtype: int8 for int8, uint8 bytes for int4 (two values each) and fp8 (its bits)."""
        return torch.int8 if self.format == "int8" else torch.uint8

    def blocks(self, numel: int) -> int:
        """Blocks (and scales) of a message of `numel` elements: the last one padded."""
        return -(-numel // self.block_size)

    @property
    def payload_bytes_per_block(self) -> int:
        return self.block_size * self.bits // 8


@dataclass(frozen=True)
class Quantized:
    """A quantized message: what travels is `payload` and `scales`."""

    # (blocks, block_size) int8 values, or uint8 fp8 bits; int4: (blocks, block_size // 2) uint8, two values a byte
    payload: torch.Tensor
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
    payload, scales = kernel(_padded_blocks(x, codec), codec.qmax, codec.fp8, codec.hadamard, codec.format == "int4")
    return Quantized(payload, scales, x.numel(), codec)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The message's `numel` values as a 1-D tensor of `dtype`, computed in fp32 and cast once at the end."""
    codec = q.codec
    blocks = _kernel(_dequantize_blocks, codec.compiled)(q.payload, q.scales, codec.fp8, codec.hadamard,
                                                         codec.format == "int4", dtype)
    return blocks.reshape(-1)[: q.numel]


def _quantize_blocks(blocks: torch.Tensor, qmax: float, fp8: torch.dtype | None, rotate: bool,
                     pack: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, fp32 scales) of (rows, block) values of any float dtype: the arithmetic of `quantize`."""
    blocks = blocks.to(SCALE_DTYPE)
    if rotate:
        blocks = hadamard(blocks)
    scales = blocks.abs().amax(dim=1) / qmax
    # A zero block divides by 1 instead of its scale 0, so its values are 0, not nan.
    divisors = torch.where(scales == 0, torch.ones_like(scales), scales)
    scaled = blocks / divisors[:, None]
    if fp8 is not None:  # torch's own rounding to nearest; |scaled| <= qmax, the format's largest finite value
        return scaled.to(fp8).view(torch.uint8), scales
    values = torch.round(scaled).clamp_(-qmax, qmax).to(torch.int8)
    return (pack_int4(values) if pack else values), scales


def _dequantize_blocks(payload: torch.Tensor, scales: torch.Tensor, fp8: torch.dtype | None, rotate: bool,
                       unpack: bool, dtype: torch.dtype) -> torch.Tensor:
    """(rows, block) values of `dtype` from a payload and its scales: the arithmetic of `dequantize`."""
    if fp8 is not None:
        values = payload.view(fp8)
    else:
        values = unpack_int4(payload) if unpack else payload
    blocks = values.to(SCALE_DTYPE) * scales[:, None]
    if rotate:
        blocks = hadamard(blocks)
    return blocks.to(dtype)


@functools.cache
def _compiled(kernel):
    """`kernel` as torch.compile generates it; if compiling (or a compiled call) fails, `kernel` itself from then
    on, with a warning: the same arithmetic, so the same values on every rank whichever runs."""
    fast, failed = torch.compile(kernel, dynamic=True), []

    def run(*args):
        if failed:
            return kernel(*args)
        try:
            return fast(*args)
        except Exception as exc:  # the compiler's own errors are of many kinds
            out = kernel(*args)  # an error of the input (or of memory) is raised as it is, compiling stays on
            failed.append(exc)
            log.warning("the quantizer %s could not run compiled (%s: %.200s); it runs eagerly from now on, "
                        "with the same values (zeropp_compile_quantizers: false skips the attempt)",
                        kernel.__name__, type(exc).__name__, exc)
            return out

    return run


def _kernel(kernel, compiled: bool):
    """`kernel` as it is, or as torch.compile generates it (one fused loop instead of a tensor per step)."""
    return _compiled(kernel) if compiled else kernel


def compile_unavailable(device: torch.device) -> str | None:
    """Why torch.compile cannot build the quantizers' kernels for `device` on this machine; None when it can."""
    try:
        if device.type == "cuda":
            from torch.utils._triton import has_triton

            return None if has_triton() else "Triton is not installed"
        if device.type == "cpu":
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()  # raises when no C++ compiler is found
            return None
    except Exception as exc:  # torch's own checks raise several kinds
        return f"no C++ compiler for torch.compile ({type(exc).__name__}: {exc})"
    return f"torch.compile builds no kernels for {device.type} devices"


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
