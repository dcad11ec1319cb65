"""The block quantizers: zero, constant and non-finite blocks, exact int4 packing, the rotation, misuse, compiled.

Each codec's error bound and bytes: tests/comm/compress/test_codecs.py.
"""

import itertools

import pytest
import torch

from tests.comm.compress.test_codecs import draw, sylvester
from zeroshard.comm.compress.quantize import (
    BlockCodec,
    CodecError,
    dequantize,
    hadamard,
    pack_int4,
    quantize,
    unpack_int4,
)
from zeroshard.errors import ZeroshardError

CODECS = [BlockCodec("int8", 64), BlockCodec("int4", 64), BlockCodec("int8", 32, hadamard=True),
          BlockCodec("int4", 128, hadamard=True), BlockCodec("fp8_e4m3", 64), BlockCodec("fp8_e5m2", 32, hadamard=True),
          BlockCodec("int8", 7), BlockCodec("int4", 10)]  # block sizes that are not powers of two, without the rotation
U32 = 2.0 ** -24  # fp32 unit roundoff


def _fp32_error_bound(q) -> torch.Tensor:
    """Per block: |x - q*s| <= s * level_gap / 2 from rounding to the nearest level (tests/comm/compress/test_codecs.py
    has each format's own, per element), plus fp32 rounding of x/s and of q*s: each at most qmax*s*u, u = 2^-24.
    """
    return q.scales * (q.codec.level_gap / 2 + 2 * q.codec.qmax * U32)


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
    codec = BlockCodec("int4", 8)
    x = torch.tensor([0.0, 0.5, 1.0, 3.5, -3.5, 7.0, -7.0, 2.25])  # scale 1: exactly the levels, ties to even
    q = quantize(x, codec)
    assert torch.equal(q.scales, torch.tensor([1.0]))
    assert unpack_int4(q.payload).tolist() == [[0, 0, 1, 4, -4, 7, -7, 2]]
    assert torch.equal(dequantize(q), torch.tensor([0.0, 0.0, 1.0, 4.0, -4.0, 7.0, -7.0, 2.0]))


@pytest.mark.parametrize("n", [1, 2, 32, 256])
def test_hadamard_is_sylvesters_orthonormal_matrix(n):
    matrix = hadamard(torch.eye(n, dtype=torch.float64))  # row i: the transform of e_i, so H itself
    torch.testing.assert_close(matrix, sylvester(n), rtol=1e-12, atol=1e-12)
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
    x = draw("student-t3", 64 * 256, seed=0)
    plain = (dequantize(quantize(x, BlockCodec("int4", 256))) - x).norm() / x.norm()
    rotated = (dequantize(quantize(x, BlockCodec("int4", 256, hadamard=True))) - x).norm() / x.norm()
    assert rotated < 0.6 * plain, (plain, rotated)


def test_any_shape_is_read_flattened():
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(1))
    codec = BlockCodec("int8", 16)
    assert torch.equal(dequantize(quantize(x, codec)), dequantize(quantize(x.reshape(-1), codec)))
    transposed = x.permute(2, 0, 1)  # not contiguous: read in its own element order
    assert torch.equal(dequantize(quantize(transposed, codec)), dequantize(quantize(transposed.reshape(-1), codec)))


@pytest.mark.parametrize("kwargs, words", [
    ({"format": "int2"}, "one of int8, int4, fp8_e4m3, fp8_e5m2"),
    ({"block_size": 0}, "positive"),
    ({"format": "int4", "block_size": 9}, "even"),
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


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_compiled_quantizers_give_the_eager_values_bit_for_bit(fmt):
    # torch.compile's fused kernels must change the speed only: every rank dequantizes qwZ's gather alike.
    x = torch.randn(10_007, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x[:128], x[300] = 0, float("inf")  # a zero block and an overflowed one, which fp8's saturating cast meets
    eager, compiled = BlockCodec(fmt, 128), BlockCodec(fmt, 128, compiled=True)
    q_eager, q_compiled = quantize(x, eager), quantize(x, compiled)
    # A non-finite block's payload is the cast of nan (int8: 0 eager, -128 compiled); its scale makes it decode
    # non-finite either way, which is all the overflow check needs.
    finite = q_eager.scales.isfinite()
    assert torch.equal(q_compiled.scales, q_eager.scales) and (~finite).sum() == 1
    assert torch.equal(q_compiled.payload[finite], q_eager.payload[finite])
    out_eager, out_compiled = dequantize(q_eager, torch.bfloat16), dequantize(q_compiled, torch.bfloat16)
    kept = out_eager.isfinite()
    assert torch.equal(out_compiled.isfinite(), kept) and torch.equal(out_compiled[kept], out_eager[kept])


def test_a_failed_compile_falls_back_to_the_eager_values_and_bad_input_keeps_compiling(monkeypatch, caplog):
    # A compiler that fails (none installed, a crash in it) is stood in for by a torch.compile whose kernels
    # raise; the reference is the eager codec's output.
    import zeroshard.comm.compress.quantize as quantize_module

    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    want = quantize(x, BlockCodec("int8", 64))
    calls = []

    def broken_compile(kernel, dynamic=None):
        def run(*args):
            calls.append(kernel.__name__)
            raise RuntimeError("no working C++ compiler")
        return run

    monkeypatch.setattr(quantize_module.torch, "compile", broken_compile)
    quantize_module._compiled.cache_clear()
    try:
        kernel = quantize_module._compiled(quantize_module._quantize_blocks)
        with pytest.raises(IndexError):  # input the kernel cannot take: its own error, and no fallback for it
            kernel(torch.ones(64), 127.0, None, False, False)
        assert not caplog.records and calls == ["_quantize_blocks"]
        got = quantize(x, BlockCodec("int8", 64, compiled=True))  # the compiler fails: a warning, eager values
        assert torch.equal(got.payload, want.payload) and torch.equal(got.scales, want.scales)
        assert "runs eagerly from now on" in caplog.text and calls == ["_quantize_blocks"] * 2
        quantize(x, BlockCodec("int8", 64, compiled=True))  # not tried again
        assert calls == ["_quantize_blocks"] * 2
    finally:
        quantize_module._compiled.cache_clear()
