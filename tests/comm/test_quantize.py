"""The block quantizers: error within the bound the block scales give, exact packing, rotation, exact bytes."""

import itertools
import math

import pytest
import torch

from zeroshard.comm.quantize import (
    BlockCodec,
    CodecError,
    dequantize,
    hadamard,
    message_bytes,
    pack_int4,
    quantize,
    unpack_int4,
)
from zeroshard.errors import ZeroshardError

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [1, 2, 7, 31, 97, 256, 1009, 4099]  # 1-element, odd, prime, a whole number of blocks
CODECS = [BlockCodec(8, 64), BlockCodec(4, 64), BlockCodec(8, 32, hadamard=True), BlockCodec(4, 128, hadamard=True),
          BlockCodec(8, 7), BlockCodec(4, 10)]  # block sizes that are not powers of two, without the rotation
U32 = 2.0 ** -24  # fp32 unit roundoff


def _data(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _fp32_error_bound(q) -> torch.Tensor:
    """Per block: |x - q*s| <= s/2 from rounding to the nearest level, plus fp32 rounding of x/s and of q*s.

    fl(x/s) is off by at most qmax*u levels and fl(q*s) by at most qmax*s*u, u = 2^-24.
    """
    return q.scales * (0.5 + 2 * q.codec.qmax * U32)


def _cast_error(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rounding of fp32 values to `dtype`: half an ulp, relative, with a floor for fp16 subnormals."""
    if dtype == torch.float32:
        return torch.zeros_like(exact)
    info = torch.finfo(dtype)
    return exact.abs() * info.eps / 2 + info.smallest_normal * info.eps / 2


def _blocks(flat: torch.Tensor, codec: BlockCodec) -> torch.Tensor:
    pad = codec.blocks(flat.numel()) * codec.block_size - flat.numel()
    return torch.nn.functional.pad(flat.float(), (0, pad)).view(-1, codec.block_size)


@pytest.mark.parametrize("codec", [c for c in CODECS if not c.hadamard], ids=repr)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_error_per_element_is_at_most_half_a_scale(codec, dtype):
    for numel in SIZES:
        x = _data(numel, dtype, seed=numel)
        q = quantize(x, codec)
        blocks = _blocks(x, codec)
        assert torch.equal(q.scales, blocks.abs().amax(dim=1) / codec.qmax), "scale = max|x| / qmax per block"
        exact = dequantize(q, torch.float32)
        out = dequantize(q, dtype)
        assert out.dtype == dtype and out.shape == (numel,)
        bound = _fp32_error_bound(q).repeat_interleave(codec.block_size)[:numel] + _cast_error(exact, dtype)
        error = (x.float() - out.float()).abs()
        assert (error <= bound).all(), f"numel {numel}: worst error / bound {(error / bound).max():.4f}"
        assert torch.equal(out, exact.to(dtype)), "dequantize computes in fp32 and casts once"


@pytest.mark.parametrize("codec", [c for c in CODECS if c.hadamard], ids=repr)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotated_error_per_block_is_at_most_half_a_scale_in_l2(codec, dtype):
    """The bound holds per element in the rotated basis; H is orthonormal, so per block in L2: s/2 * sqrt(n)."""
    for numel in SIZES:
        x = _data(numel, dtype, seed=numel)
        q = quantize(x, codec)
        out = dequantize(q, dtype)
        assert out.dtype == dtype and out.shape == (numel,)
        exact = dequantize(q, torch.float32)
        error = _blocks(x.float() - exact, codec).norm(dim=1)
        # Each of the log2(n) butterfly stages and the final scaling rounds once, relative u in L2, both in
        # quantize's rotation and in dequantize's; counted twice for the margin.
        rounding = 4 * (math.log2(codec.block_size) + 1) * U32 * _blocks(x, codec).norm(dim=1)
        bound = _fp32_error_bound(q) * codec.block_size ** 0.5 + rounding
        assert (error <= bound).all(), f"numel {numel}: worst error / bound {(error / bound).max():.4f}"
        assert ((x.float() - out.float()).abs() <= (x.float() - exact).abs() + _cast_error(exact, dtype)).all()


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_zero_and_constant_blocks(codec):
    n = codec.block_size
    zeros = torch.zeros(2 * n + 1)
    q = quantize(zeros, codec)
    assert torch.equal(q.scales, torch.zeros(3)), "a zero block has scale 0"
    assert torch.equal(dequantize(q), zeros), "and dequantizes to zeros exactly, not nan"
    constant = torch.full((n,), -2.5)
    q = quantize(constant, codec)
    out = dequantize(q)
    if not codec.hadamard:
        assert torch.equal(q.scales, torch.tensor([2.5 / codec.qmax]))
    assert (out - constant).abs().max() <= _fp32_error_bound(q).max() * n ** 0.5
    assert out.max() - out.min() <= 1e-6 * 2.5, "a constant block stays constant"


def test_non_finite_values_stay_non_finite():
    """The overflow check after the reduction must still see an inf or nan that was sent quantized."""
    for codec, bad in itertools.product(CODECS, [float("inf"), float("-inf"), float("nan")]):
        x = torch.ones(2 * codec.block_size)
        x[3] = bad
        out = dequantize(quantize(x, codec))
        assert not torch.isfinite(out[: codec.block_size]).any(), "the block holding it is non-finite"
        assert torch.isfinite(out[codec.block_size:]).all(), "the other blocks are untouched"


def test_int4_packing_round_trip_is_bit_exact():
    every = torch.arange(-8, 8, dtype=torch.int8)
    pairs = torch.cartesian_prod(every, every).flatten()  # every (low, high) pair of values
    packed = pack_int4(pairs)
    assert packed.dtype == torch.uint8 and packed.shape == (256,)
    assert torch.equal(unpack_int4(packed), pairs)
    assert sorted(packed.tolist()) == list(range(256)), "each byte is one pair: nothing is lost"
    assert pack_int4(torch.tensor([1, -1], dtype=torch.int8)).item() == 0xF1, "low nibble first, two's complement"
    batched = torch.randint(-8, 8, (3, 5, 8), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_int4(pack_int4(batched)), batched)
    assert unpack_int4(pack_int4(torch.zeros(0, 4, dtype=torch.int8))).shape == (0, 4)


def test_int4_payload_holds_the_rounded_values():
    codec = BlockCodec(4, 8)
    x = torch.tensor([0.0, 0.5, 1.0, 3.5, -3.5, 7.0, -7.0, 2.25])  # scale 1: exactly the levels, ties to even
    q = quantize(x, codec)
    assert torch.equal(q.scales, torch.tensor([1.0]))
    assert unpack_int4(q.payload).tolist() == [[0, 0, 1, 4, -4, 7, -7, 2]]
    assert torch.equal(dequantize(q), torch.tensor([0.0, 0.0, 1.0, 4.0, -4.0, 7.0, -7.0, 2.0]))


@pytest.mark.parametrize("n", [1, 2, 32, 256])
def test_hadamard_is_sylvesters_orthonormal_matrix(n):
    sylvester = torch.ones(1, 1, dtype=torch.float64)
    while sylvester.shape[0] < n:
        sylvester = torch.cat([torch.cat([sylvester, sylvester], 1), torch.cat([sylvester, -sylvester], 1)])
    matrix = hadamard(torch.eye(n, dtype=torch.float64))  # row i: the transform of e_i, so H itself
    torch.testing.assert_close(matrix, sylvester / n ** 0.5, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(matrix @ matrix.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 32, 64, 128, 256, 2048])
def test_hadamard_is_its_own_inverse(n):
    x = torch.randn(5, n, generator=torch.Generator().manual_seed(n))
    torch.testing.assert_close(hadamard(hadamard(x)), x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hadamard(x).norm(dim=1), x.norm(dim=1), rtol=1e-5, atol=0)


def test_hadamard_helps_heavy_tailed_blocks():
    """Why the rotation exists: in Student-t(3) data a few large values set each block's scale.

    Rotated, a block's largest value follows its norm, so at int4 the relative
    error drops from about 0.27 to 0.12 with 256-element blocks (0.13 either
    way on Gaussian data, which needs no rotation).
    """
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(64 * 256, generator=g)
    chi2 = torch.randn(3, 64 * 256, generator=g).square().sum(0)
    x = normal / (chi2 / 3).sqrt()  # Student-t with 3 degrees of freedom
    plain = (dequantize(quantize(x, BlockCodec(4, 256))) - x).norm() / x.norm()
    rotated = (dequantize(quantize(x, BlockCodec(4, 256, hadamard=True))) - x).norm() / x.norm()
    assert rotated < 0.6 * plain, (plain, rotated)


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_message_bytes_equal_the_real_tensors(codec):
    for numel in [0, *SIZES, 100_003]:
        q = quantize(torch.randn(numel), codec)
        assert q.payload.dtype == (torch.uint8 if codec.bits == 4 else torch.int8)
        assert q.scales.dtype == torch.float32 and q.scales.shape == (codec.blocks(numel),)
        assert message_bytes(numel, codec) == q.payload.nbytes + q.scales.nbytes
    assert message_bytes(1000, BlockCodec(4, 64)) == 16 * (32 + 4)  # 16 blocks of 32 bytes and a scale
    assert message_bytes(1000, BlockCodec(8, 256)) == 4 * (256 + 4)


def test_any_shape_is_read_flattened():
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(1))
    codec = BlockCodec(8, 16)
    assert torch.equal(dequantize(quantize(x, codec)), dequantize(quantize(x.reshape(-1), codec)))
    transposed = x.permute(2, 0, 1)  # not contiguous: read in its own element order
    assert torch.equal(dequantize(quantize(transposed, codec)), dequantize(quantize(transposed.reshape(-1), codec)))


@pytest.mark.parametrize("kwargs, words", [
    ({"bits": 2}, "8 or 4"),
    ({"block_size": 0}, "positive"),
    ({"bits": 4, "block_size": 9}, "even"),
    ({"block_size": 96, "hadamard": True}, "power-of-two"),
])
def test_bad_settings_are_refused(kwargs, words):
    with pytest.raises(CodecError, match=words) as raised:
        BlockCodec(**kwargs)
    assert isinstance(raised.value, ZeroshardError) and isinstance(raised.value, ValueError)


def test_bad_inputs_are_refused():
    with pytest.raises(CodecError, match="floating-point"):
        quantize(torch.arange(4), BlockCodec())
    with pytest.raises(CodecError, match="even"):
        pack_int4(torch.zeros(3, dtype=torch.int8))
    with pytest.raises(CodecError, match="uint8"):
        unpack_int4(torch.zeros(3, dtype=torch.int8))
    with pytest.raises(CodecError, match="power-of-two"):
        hadamard(torch.zeros(2, 6))


def test_compiled_quantizers_give_the_eager_values_bit_for_bit():
    # torch.compile's fused kernels must change the speed only: every rank dequantizes qwZ's gather alike.
    x = torch.randn(10_007, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    eager, compiled = BlockCodec(8, 128), BlockCodec(8, 128, compiled=True)
    q_eager, q_compiled = quantize(x, eager), quantize(x, compiled)
    assert torch.equal(q_compiled.payload, q_eager.payload) and torch.equal(q_compiled.scales, q_eager.scales)
    assert torch.equal(dequantize(q_compiled, torch.bfloat16), dequantize(q_eager, torch.bfloat16))
