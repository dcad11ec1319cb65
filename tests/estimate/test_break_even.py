"""When compression pays (estimate/break_even.py, `zeroshard estimate --compress`): bytes by hand and by the
other formulas, the break-even bandwidth plugged back into the step-time model, the CLI's table and JSON.

The bytes against what a real engine records are in tests/engine/test_compression.py
(`test_step_bytes_equal_comm_stats`)."""

from __future__ import annotations

import json
import math

import pytest

from zeroshard import estimate
from zeroshard.app.estimate import compress as cli_estimate_compress
from zeroshard.app.cli import main
from zeroshard.app.estimate.model_count import count_model
from zeroshard.estimate import PERSISTENT, SHARDED, Flat

BUCKETS = [1000, 777, 13]  # odd and prime sizes: padding to N shards and to whole blocks


def test_bytes_by_hand():
    # 1000 elements over 2 ranks, int8, blocks of 128: 2 shards of 500 = 4 blocks of 128 bytes + a 4-byte scale
    plan = estimate.step_bytes([1000], 2, 2, bits=8, block_size=128)
    assert plan.reduction == {"reduce_scatter": 2 * 4 * 132}
    assert plan.rest == {"step_check": 2 * 40, "all_gather": 1000 * 4}
    assert plan.error_feedback == 4 * 1000 and plan.coded_elements == 1000
    # int4: 68 bytes a block; stage 0 adds the all-reduce's gather of the mean chunks, and its error feedback
    plan = estimate.step_bytes([1000], 2, 0, bits=4, block_size=128)
    assert plan.reduction == {"reduce_scatter": 2 * 4 * 68, "all_gather": 2 * 4 * 68}
    assert plan.error_feedback == 4 * (1000 + 500) and plan.coded_elements == 2 * 1000


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("world", [2, 4])
def test_exact_bytes_are_the_paper_formula_over_padded_buckets(stage, world):
    padded = sum(estimate.shard_numel(n, world) * world for n in BUCKETS)
    plan = estimate.step_bytes(BUCKETS, world, stage, param_bytes=2, reduce_bytes=4, accumulation=3)
    formula = estimate.comm_bytes_per_step(padded, stage, elem_bytes=2, accumulation=3, reduce_bytes=4)
    assert plan.by_op() == {op: b for op, b in formula.items() if b} | {"step_check": estimate.step_check_bytes(world)}
    assert plan.coded_elements == plan.error_feedback == 0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("bits", [8, 4])
def test_codec_bytes_are_the_compressed_reductions_summed(stage, bits):
    world, accumulation = 4, 2
    flats = [Flat(n) for n in BUCKETS] + [Flat(50, PERSISTENT)] * (stage == 3)
    plan = estimate.step_bytes(flats, world, stage, bits=bits, block_size=64, accumulation=accumulation)
    reductions = accumulation if stage >= 2 else 1
    coded = [f.numel for f in flats if f.kind == SHARDED]
    expected = {"reduce_scatter": 0, "all_gather": 0}
    for numel in coded:
        for op, b in estimate.compressed_reduction_bytes(numel, world, bits, 64, stage == 0).items():
            expected[op] += reductions * b
    expected["reduce_scatter"] += 4 * 52 * reductions * (stage == 3)  # the persistent flat: exact, padded to 52
    exact = estimate.step_bytes(flats, world, stage, accumulation=accumulation)
    assert plan.reduction == (expected if stage == 0 else {"reduce_scatter": expected["reduce_scatter"]})
    assert plan.rest == exact.rest  # gathers and the step check stay exact
    assert plan.error_feedback == sum(estimate.error_feedback_bytes(n, world, stage == 0) for n in coded)
    if stage == 3:  # the gathers: stage 3's own formula, plain
        gathers = estimate.stage3_comm_bytes(flats, world, world, 4, accumulation=accumulation)["all_gather"]
        assert plan.rest["all_gather"] == sum(gathers.values())


# (overlap O, codec seconds per element): both reductions stick out; only the exact one; no overlap
@pytest.mark.parametrize("overlap, per_element", [(0.001, 1e-9), (0.5, 1e-9), (0.0, 1e-8), (0.2, 1e-7)])
def test_break_even_solves_the_model(overlap, per_element):
    world = 2
    exact = estimate.step_bytes([25_000_000] * 4, world, 2)
    int8 = estimate.step_bytes([25_000_000] * 4, world, 2, bits=8)
    bandwidth = estimate.break_even_bandwidth(exact, int8, world, overlap, per_element)
    assert 0 < bandwidth < math.inf

    def faster_by(bw: float) -> float:  # exact's step time minus the compressed one's
        return (estimate.step_seconds(exact, world, bw, 1.0, overlap)
                - estimate.step_seconds(int8, world, bw, 1.0, overlap, per_element))

    assert faster_by(bandwidth) == pytest.approx(0, abs=1e-9)
    assert faster_by(bandwidth / 1.5) > 0 > faster_by(bandwidth * 1.5)  # pays below, loses above


def test_break_even_edges():
    exact, int8 = (estimate.step_bytes([10**6], 2, 2, bits=b) for b in (None, 8))
    assert estimate.break_even_bandwidth(exact, int8, 2, 0.0, 0.0) == math.inf  # free codec, nothing hidden
    # a free codec pays while the exact reduction sticks out past the overlap: below R / O
    assert estimate.break_even_bandwidth(exact, int8, 2, 0.5, 0.0) == exact.wire(2)[0] / 0.5
    # bf16 gradients against int8 at blocks of 2 (2 bytes a value + a 4-byte scale per 2): never pays
    bf16 = estimate.step_bytes([10**6], 2, 2, param_bytes=2)
    assert estimate.break_even_bandwidth(bf16, estimate.step_bytes([10**6], 2, 2, 8, 2, 2), 2, 0.1, 1e-9) == 0.0


@pytest.fixture(autouse=True)
def few_measured_elements(monkeypatch):
    """The codec's time measured on 2^14 values, not 2^20: the figure matters to the tests, not its precision."""
    monkeypatch.setattr(cli_estimate_compress, "MEASURED_ELEMENTS", 2**14)


def _estimate(capsys, *flags: str) -> str:
    assert main(["estimate", *flags]) == 0
    return " ".join(capsys.readouterr().out.split())  # rich wraps at 80 columns


def test_cli_json_carries_each_codecs_bytes_and_break_even(capsys):
    out = json.loads(_estimate(capsys, "--model", "tiny", "--gpus", "2", "--dtype", "fp32", "--compress", "int8",
                               "int4", "--step-seconds", "0.3", "--bucket-size", "5000", "--json"))
    table = out["compression"]
    buckets = count_model("tiny", bucket_size=5000).buckets
    assert len(buckets) > 1 and sum(buckets) == out["params"]
    assert table["stage"] == 2 and table["overlap_seconds"] == pytest.approx(0.3 * estimate.BACKWARD_SHARE)
    exact = estimate.step_bytes(buckets, 2, 2)
    assert table["exact"]["bytes"] == exact.by_op()
    assert list(table["codecs"]) == ["int8", "int4"]
    for name, bits in (("int8", 8), ("int4", 4)):
        row, plan = table["codecs"][name], estimate.step_bytes(buckets, 2, 2, bits=bits)
        assert row["bytes"] == plan.by_op() and row["error_feedback_bytes"] == plan.error_feedback
        assert row["ratio"] == sum(plan.by_op().values()) / sum(exact.by_op().values())
        per_element = row["codec_seconds_per_element"]
        assert 0 < per_element < 1e-5  # measured: a quantize and dequantize take nanoseconds a value
        assert row["break_even_bytes_per_second"] == estimate.break_even_bandwidth(
            exact, plan, 2, table["overlap_seconds"], per_element)


def test_cli_table(capsys):
    text = _estimate(capsys, "--params", "2e6", "--gpus", "4", "--compress", "fp8_e4m3", "--stage", "1")
    assert "gradient codecs at stage 1, 4 GPUs" in text
    assert "fp8_e4m3" in text and "pays below" in text and "bit/s" in text
    assert "no --step-seconds: C = 0 and nothing overlaps" in text
    assert "quantize with error feedback + dequantize of 16,384 values on one thread" in text


@pytest.mark.parametrize("flags, message", [
    (["--params", "1e6", "--gpus", "2", "--stage", "2"], "--stage needs --compress"),
    (["--params", "1e6", "--gpus", "2", "--compress", "--overlap", "0.5"], "--overlap needs --step-seconds"),
    (["--params", "1e6", "--gpus", "2", "--compress", "int2"], "--compress int2: not a codec"),
    (["--params", "1e6", "--gpus", "2", "--compress", "--step-seconds", "1", "--overlap", "2"], "in [0, 1]"),
    (["--model", "tiny", "--gpus", "4", "--tp", "2", "--compress"], "--compress with --tp/--pp"),
])
def test_cli_errors(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
