"""The estimate on a pp x dp x tp mesh (estimate/parallel.py, model_count.count_parts, `estimate --tp --pp`).

Each model part's local elements are checked by hand from the GPT's sizes
(split tensors once, replicated tensors tp times, the tied head copy on the
last stage) and at tp = pp = 1 against the existing ZeRO formulas. Against
the engines' real DTensor parts on a mesh: tests/parallel (check_memory).
"""

from __future__ import annotations

import json

import pytest

from zeroshard.app.cli import main
from zeroshard.app.estimate.model_count import count_model, count_parts, part_numels
from zeroshard.app.models import PRESETS
from zeroshard.estimate import STAGES, model_state_bytes, precision_bytes, summarize
from zeroshard.estimate.parallel import (
    dp_size,
    mesh_summary,
    part_state_bytes,
    replica_numel,
    tp_shard_numel,
)

MESHES = [(1, 2), (2, 1), (2, 2)]  # (pp, tp)


def by_hand(preset: str, pp: int, tp: int) -> tuple[dict[tuple[int, int], int], int, int, int]:
    """Per part local elements from the GPT's sizes, and the split, replicated and head-copy totals."""
    cfg = PRESETS[preset]
    e, v, b, layers = cfg.n_embd, cfg.vocab_size, cfg.block_size, cfg.n_layer
    # Per block. Split: qkv weight and bias, proj weight, mlp.0 weight and bias, mlp.2 weight.
    split_block = 3 * e * e + 3 * e + e * e + 4 * e * e + 4 * e + 4 * e * e
    replicated_block = 2 * e + 2 * e + e + e  # ln1, ln2, proj bias, mlp.2 bias
    head_copy = v * e if pp > 1 else 0
    parts = {}
    for p in range(pp):
        blocks = len(range(layers)[p * layers // pp:(p + 1) * layers // pp])  # the presets split evenly
        first, last = p == 0, p == pp - 1
        numel = blocks * (split_block // tp + replicated_block)
        numel += first * (v * e + b * e) + last * (2 * e + head_copy)  # wte, wpe; ln_f, head copy
        parts.update({(p, t): numel for t in range(tp)})
    replicated = layers * replicated_block + v * e + b * e + 2 * e
    return parts, layers * split_block, replicated, head_copy


@pytest.mark.parametrize("preset", ["tiny", "demo"])
def test_psi_by_hand(preset):
    parts, split, replicated, _ = by_hand(preset, 1, 1)
    assert count_model(preset).numel == split + replicated == parts[0, 0] == part_numels(preset)[0, 0]


@pytest.mark.parametrize("preset", ["tiny", "demo"])
@pytest.mark.parametrize("pp,tp", MESHES)
def test_parts_by_hand(preset, pp, tp):
    parts, split, replicated, head_copy = by_hand(preset, pp, tp)
    counted = part_numels(preset, pp, tp)
    assert counted == parts
    psi = count_model(preset).numel
    # Summed over a replica's parts: Ψ, plus tp - 1 more of every replicated tensor, plus the head copy tp times.
    assert sum(counted.values()) == psi + (tp - 1) * replicated + tp * head_copy
    assert sum(counted.values()) == replica_numel(split, replicated, tp, head_copy)
    # Summed over tp ranks, each stage holds its split tensors once and its replicated ones tp times.
    for p in range(pp):
        assert sum(counted[p, t] for t in range(tp)) == tp * counted[p, 0]  # the presets split evenly


def test_tp_shard_numel_is_dtensors_chunk_rule():
    from torch.distributed.tensor import Shard

    for size in (0, 1, 5, 10, 96, 97):
        for tp in (1, 2, 3, 4, 8):
            chunks = [tp_shard_numel(size, tp, t) for t in range(tp)]
            assert sum(chunks) == size
            if hasattr(Shard, "local_shard_size_and_offset"):
                assert chunks == [Shard.local_shard_size_and_offset(size, tp, t)[0] for t in range(tp)]
    assert [tp_shard_numel(10, 4, t) for t in range(4)] == [3, 3, 3, 1]
    with pytest.raises(ValueError, match="outside"):
        tp_shard_numel(10, 2, 2)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_part_is_the_existing_formula(dtype):
    per_element = precision_bytes(dtype)
    for psi, n, unit in ((818_048, 4, 99_520), (7_500_000_001, 64, 0), (5, 8, 3)):
        for stage in STAGES:
            assert part_state_bytes(psi, n, stage, largest_unit=unit, **per_element) == \
                model_state_bytes(psi, n, stage, largest_unit=unit, **per_element)
        one = mesh_summary({(0, 0): (psi, unit)}, n, 1, 1, dtype)
        flat = summarize(psi, n, dtype=dtype, largest_unit=unit)
        assert one["parts"]["pp0-tp0"]["memory_by_state"] == flat["memory_by_state"]
        assert one["parts"]["pp0-tp0"]["memory_bytes"] == flat["memory_bytes"]
    counted, parts = count_model("demo"), count_parts("demo")
    assert (parts[0, 0].numel, parts[0, 0].largest_unit) == (counted.numel, counted.largest_unit)


def test_dp_size():
    assert dp_size(8, 2, 2) == 2 and dp_size(3) == 3
    with pytest.raises(ValueError, match="multiple of 4"):
        dp_size(6, 2, 2)


def _estimate_json(capsys, *flags: str) -> dict:
    assert main(["estimate", *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cli_json_is_the_formula(capsys, dtype):
    out = _estimate_json(capsys, "--model", "demo", "--gpus", "8", "--tp", "2", "--pp", "2", "--dtype", dtype)
    assert (out["pp"], out["dp"], out["tp"]) == (2, 2, 2)
    parts = count_parts("demo", 2, 2)
    assert out == {"model": "demo", "params": count_model("demo").numel,
                   **mesh_summary({k: (c.numel, c.largest_unit) for k, c in parts.items()}, 8, 2, 2, dtype)}
    numels = part_numels("demo", 2, 2)
    for (p, t), numel in numels.items():
        part = out["parts"][f"pp{p}-tp{t}"]
        assert part["numel"] == numel
        for stage in STAGES:
            expected = part_state_bytes(numel, 2, stage, largest_unit=parts[p, t].largest_unit,
                                        **precision_bytes(dtype))
            assert part["memory_by_state"][str(stage)] == expected
    assert out["replica_numel"] == sum(numels.values())


def test_cli_table(capsys):
    assert main(["estimate", "--model", "tiny", "--gpus", "4", "--tp", "2"]) == 0
    text = capsys.readouterr().out
    assert "pp=1 x dp=2 x tp=2" in text and "pp0-tp1" in text and f"{part_numels('tiny', 1, 2)[0, 1]:,}" in text


@pytest.mark.parametrize("flags,message", [
    (["--model", "demo", "--gpus", "6", "--tp", "2", "--pp", "2"], "give --gpus a multiple of 4"),
    (["--params", "7B", "--gpus", "8", "--tp", "2"], "give --model with a preset"),
    (["--model", "demo", "--gpus", "8", "--tp", "2", "--zeropp"], "--zeropp with --tp/--pp"),
    (["--model", "demo", "--gpus", "8", "--pp", "2", "--qgz", "--gpu-mem", "80GB"], "--qgz --gpu-mem with"),
    (["--model", "demo", "--gpus", "24", "--tp", "3"], "does not divide the 4 heads"),
    (["--model", "tiny", "--gpus", "3", "--pp", "3"], "--pp 3: stage 0 of 3"),
])
def test_cli_errors(capsys, flags, message):
    with pytest.raises(SystemExit):
        main(["estimate", *flags])
    assert message in capsys.readouterr().err
