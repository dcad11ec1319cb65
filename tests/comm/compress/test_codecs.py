"""Every codec's round trip: int8, int4, fp8 e4m3 and e5m2, with and without the Hadamard rotation.

Data: Gaussian, and Student-t with 3 degrees of freedom (heavy tails: a few
large values set their block's scale), of 1, 7, 997 and 10007 elements (odd
and prime: the last block is padded) and 256 (whole blocks), read as fp32,
bf16 and fp16. The error is held to the bound that the block scales give
(s_b: block b's scale, as sent):

- int8, int4: rounding to the nearest level is off by at most s_b / 2 per
  element;
- fp8: the scaled value y = x / s_b is rounded to the nearest value of the
  format, off by at most half its unit in the last place, 2^floor(log2|y|)
  * 2^-m for a normal y (m mantissa bits) and the smallest subnormal below
  the smallest normal; times s_b;
- rotated: these hold per element of the rotated block, and H is
  orthonormal, so a block's error has at most the L2 norm of its elements'
  bounds (s_b * sqrt(block) / 2 at int8 and int4).

Each bound adds fp32's own rounding (of x / s_b, q * s_b and the rotations),
a few units of 2^-24 relative to the values. fp8's payload must be torch's
own float8 cast of the scaled block, bit for bit, and every message's bytes
what `message_bytes` says.
"""

import math

import pytest
import torch

from zeroshard.comm.compress.messages import decode_rows, encode_rows, encoding
from zeroshard.comm.compress.quantize import BlockCodec, CodecError, dequantize, hadamard, message_bytes, quantize
from zeroshard.dtypes import FP8_DTYPES, WIRE_FORMATS

BLOCK = 64
CODECS = [BlockCodec(f, BLOCK, hadamard=rotate) for f in WIRE_FORMATS for rotate in (False, True)] + [
    BlockCodec("int8", 7), BlockCodec("int4", 10), BlockCodec("fp8_e4m3", 7), BlockCodec("fp8_e5m2", 9)]  # odd
SIZES = (1, 7, 256, 997, 10007)  # one element, odd, whole blocks, primes
DISTRIBUTIONS = ("gaussian", "student-t3")
U32 = 2.0 ** -24  # fp32 unit roundoff


def draw(distribution: str, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(numel, generator=g)
    if distribution == "gaussian":
        return normal
    chi2 = torch.randn(3, numel, generator=g).square().sum(0)
    return normal / (chi2 / 3).sqrt()  # Student-t, 3 degrees of freedom


def blocks_of(flat: torch.Tensor, codec: BlockCodec) -> torch.Tensor:
    """(blocks, block) fp32, the tail padded with zeros, as the codec cuts a message."""
    pad = codec.blocks(flat.numel()) * codec.block_size - flat.numel()
    return torch.nn.functional.pad(flat.float(), (0, pad)).view(-1, codec.block_size)


def sylvester(n: int) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard matrix, built as Sylvester's [[H, H], [H, -H]] in fp64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(n)


def half_ulp(scaled: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """Half a unit in the last place of each scaled value in `fp8`: from its mantissa bits (eps = 2^-m) and
    its smallest subnormal (tiny * eps, the spacing below the smallest normal tiny)."""
    info = torch.finfo(fp8)
    binade = torch.exp2(torch.floor(torch.log2(scaled.abs()))).clamp(min=info.tiny)  # 0 -> tiny
    return binade * info.eps / 2


def element_bounds(q, scaled: torch.Tensor) -> torch.Tensor:
    """(blocks, block): each element's rounding bound from its block's scale, in the (rotated) basis sent."""
    if q.codec.fp8 is None:
        return (q.scales / 2)[:, None].expand_as(scaled)
    return q.scales[:, None] * half_ulp(scaled, q.codec.fp8)


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}/{c.block_size}")
def test_round_trip_error_is_within_the_bound_of_the_block_scales(codec, distribution):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for numel in SIZES:
            x = draw(distribution, numel, seed=numel).to(dtype)
            q = quantize(x, codec)
            exact = dequantize(q)
            assert exact.shape == (numel,) and torch.equal(dequantize(q, dtype), exact.to(dtype)), \
                "dequantize computes in fp32 and casts once"
            blocks = blocks_of(x, codec)
            error = blocks_of(exact, codec) - blocks
            if codec.hadamard:
                rotated = (blocks.double() @ sylvester(codec.block_size)).float()
                torch.testing.assert_close(q.scales, rotated.abs().amax(1) / codec.qmax, rtol=1e-5, atol=0)
                # fp8: the values sent; half their ulp is at least half the ulp of the value rounded to them
                sent = q.payload.view(codec.fp8).float() if codec.fp8 else rotated / q.scales[:, None]
                rounding = (4 * (math.log2(codec.block_size) + 1) + 3) * U32 * blocks.norm(dim=1)
                bound = element_bounds(q, sent).norm(dim=1) * (1 + 2 * U32) + rounding
                found = error.norm(dim=1)
            else:
                assert torch.equal(q.scales, blocks.abs().amax(1) / codec.qmax), "scale = max|x| / qmax"
                bound = element_bounds(q, blocks / q.scales[:, None]) * (1 + 2 * U32) + 3 * U32 * blocks.abs()
                found = error.abs()
            assert (found <= bound).all(), f"{dtype} numel {numel}: worst error / bound {(found / bound).max():.4f}"


@pytest.mark.parametrize("rotate", (False, True))
@pytest.mark.parametrize("fmt", FP8_DTYPES)
def test_fp8_payload_is_torchs_own_float8_cast(fmt, rotate):
    codec, fp8 = BlockCodec(fmt, BLOCK, hadamard=rotate), FP8_DTYPES[fmt]
    for distribution in DISTRIBUTIONS:
        for numel in SIZES:
            x = draw(distribution, numel, seed=numel)
            q = quantize(x, codec)
            blocks = blocks_of(x, codec)
            blocks = hadamard(blocks) if rotate else blocks  # the rotation itself: test_quantize.py
            scales = blocks.abs().amax(1) / torch.finfo(fp8).max
            assert torch.equal(q.scales, scales) and (scales > 0).all()
            cast = (blocks / scales[:, None]).to(fp8)
            assert q.payload.dtype == torch.uint8 and torch.equal(q.payload, cast.view(torch.uint8)), (numel,)
            if not rotate:
                assert torch.equal(dequantize(q), (cast.float() * scales[:, None]).view(-1)[:numel])


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}/{c.block_size}")
def test_message_bytes_are_payload_and_scales(codec):
    for numel in (0, *SIZES, 100_003):
        q = quantize(torch.randn(numel), codec)
        assert q.payload.dtype == codec.payload_dtype and q.scales.dtype == torch.float32
        assert q.payload.shape == (codec.blocks(numel), codec.payload_bytes_per_block)
        assert q.scales.shape == (codec.blocks(numel),)
        assert message_bytes(numel, codec) == q.payload.nbytes + q.scales.nbytes
    # By hand: blocks of block * bits / 8 bytes, and a 4-byte scale each.
    assert message_bytes(1000, BlockCodec("int4", 64)) == 16 * (32 + 4)
    assert message_bytes(1000, BlockCodec("int8", 256)) == 4 * (256 + 4)
    assert message_bytes(1000, BlockCodec("fp8_e5m2", 256, hadamard=True)) == 4 * (256 + 4)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}/{c.block_size}")
def test_encoded_rows_are_each_row_quantized_alone(codec):
    rows = draw("student-t3", 3 * 101, seed=5).view(3, 101)
    encoded = encode_rows(rows, codec)
    assert encoded.dtype == torch.uint8 and encoded.shape == (3, message_bytes(101, codec))
    alone = torch.stack([dequantize(quantize(row, codec), torch.bfloat16) for row in rows])
    assert torch.equal(decode_rows(encoded, 101, codec, torch.bfloat16), alone)


def test_codecs_by_name_and_their_levels():
    assert BlockCodec.named("int4+hadamard", 128) == BlockCodec("int4", 128, hadamard=True)
    assert BlockCodec.named("fp8_e4m3", 32, hadamard=True, compiled=True) == BlockCodec("fp8_e4m3", 32, True, True)
    assert all(BlockCodec.named(c.name, c.block_size) == c for c in CODECS)
    assert encoding(BlockCodec("fp8_e5m2", 128, hadamard=True)) == "fp8_e5m2/128+hadamard"
    assert encoding(BlockCodec("int8", 64)) == "int8/64"
    # (bits, qmax, level_gap): e4m3's top binade [256, 448] steps by 2^8 * 2^-3, e5m2's [32768, 57344] by 2^15 * 2^-2
    levels = {f: (c.bits, c.qmax, c.level_gap) for f in WIRE_FORMATS for c in [BlockCodec(f)]}
    assert levels == {"int8": (8, 127, 1), "int4": (4, 7, 1), "fp8_e4m3": (8, 448, 32), "fp8_e5m2": (8, 57344, 8192)}


@pytest.mark.parametrize("name, words", [
    ("int2", "a codec's format is one of int8, int4, fp8_e4m3, fp8_e5m2, not 'int2'"),
    ("int8+rotate", "optionally followed by '\\+hadamard', not 'int8\\+rotate'"),
    ("fp8", "not 'fp8'"),
])
def test_unknown_names_are_refused(name, words):
    with pytest.raises(CodecError, match=words):
        BlockCodec.named(name)
