"""Stage 3's collectives per step by op and scope (estimate/zeropp.py), with and without ZeRO++, by hand.

The figures are the recording convention the engine implements
(`stage3_comm_bytes`' docstring); the engine's own test holds its measured
`comm_stats()` by scope against the same function, through
`app.model_count.stage3_flats`.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from zeroshard import estimate
from zeroshard.app.cli import main
from zeroshard.app.estimate.model_count import count_model, stage3_flats
from zeroshard.estimate import FROZEN, PERSISTENT, SHARDED, Flat, ZeroPP

PSI = 4 * 128 * 1000  # divisible by N x B: no padding anywhere
M = 2 * PSI  # bf16 parameters
ALL = ZeroPP(qwz=True, hpz=True, qgz=True, gradient_bits=4)  # the paper's


def q(numel: int, bits: int, block: int = 128) -> int:
    """A quantized message by hand: ceil(numel / block) blocks of block * bits / 8 bytes and a 4-byte scale."""
    return -(-numel // block) * (block * bits // 8 + 4)


def test_issue_acceptance_2x2_plain():
    # N = 4 as 2 nodes x 2, bf16, one flat of Ψ, A = 1: forward and backward gathers 2M, the reduction M.
    got = estimate.stage3_comm_bytes([Flat(PSI)], 4, 2, 2)
    assert got == {"all_gather": {"cross_node": 2 * M}, "reduce_scatter": {"cross_node": M}}
    assert estimate.stage3_comm_calls([Flat(PSI)], 4, 2, 2) == {
        "all_gather": {"cross_node": 2}, "reduce_scatter": {"cross_node": 1}}


def test_issue_acceptance_2x2_all_three():
    got = estimate.stage3_comm_bytes([Flat(PSI)], 4, 2, 2, zeropp=ALL)
    assert got == {"all_gather": {"cross_node": 4 * q(PSI // 4, 8), "node": M},
                   "reduce_scatter": {"node": 4 * q(PSI // 4, 4), "cross_node": 2 * q(PSI // 4, 4)}}
    # qwZ's int8 forward gather: 132 bytes per 128 elements, 0.5156M; the backward's M stays in the node.
    assert got["all_gather"]["cross_node"] == M * 132 // 256
    # Per rank, qgZ's hop 2 carries 1/D of the node's int4 buffer: 2 shards of 68 bytes per 128 elements.
    assert got["reduce_scatter"]["cross_node"] == 2 * (PSI // 4) * 68 // 128
    assert estimate.by_scope(got) == {"cross_node": 4 * q(PSI // 4, 8) + 2 * q(PSI // 4, 4),
                                      "node": M + 4 * q(PSI // 4, 4)}


def test_accumulation_with_hpz_crosses_nodes_once():
    # A = 3: 2A = 6 gathers; with hpZ only the first forward's crosses, the other 5 stay in the node.
    flats, a = [Flat(PSI)], 3
    plain = estimate.stage3_comm_calls(flats, 4, 2, 2, accumulation=a)
    assert plain == {"all_gather": {"cross_node": 6}, "reduce_scatter": {"cross_node": 3}}
    got = estimate.stage3_comm_bytes(flats, 4, 2, 2, accumulation=a, zeropp=ZeroPP(hpz=True))
    assert got == {"all_gather": {"cross_node": M, "node": 5 * M}, "reduce_scatter": {"cross_node": 3 * M}}
    calls = estimate.stage3_comm_calls(flats, 4, 2, 2, accumulation=a, zeropp=ALL)
    assert calls == {"all_gather": {"cross_node": 1, "node": 5}, "reduce_scatter": {"node": 3, "cross_node": 3}}


def test_padding_persistent_and_frozen_flats():
    # N = 4 in 2 x 2, fp32 parameters (e = 4) reduced in bf16 (r = 2).
    # sharded 10 elements: S = 3, P = 12; persistent 5: P = 8; frozen 1000: S = 250, P = 1000.
    flats = [Flat(10, SHARDED), Flat(5, PERSISTENT), Flat(1000, FROZEN)]
    got = estimate.stage3_comm_bytes(flats, 4, 2, 4, reduce_bytes=2)
    assert got == {"all_gather": {"cross_node": 2 * 12 * 4 + 8 * 4 + 2 * 1000 * 4},
                   "reduce_scatter": {"cross_node": 12 * 2 + 8 * 2}}  # frozen: never reduced
    got = estimate.stage3_comm_bytes(flats, 4, 2, 4, reduce_bytes=2, zeropp=ALL)
    # qwZ: 4 shards of 3 (one block each, 132 bytes) and of 250 (two blocks); the persistent one plainly.
    assert got == {"all_gather": {"cross_node": 4 * 132 + 8 * 4 + 4 * 264, "node": 12 * 4 + 1000 * 4},
                   "reduce_scatter": {"cross_node": 8 * 2 + 2 * 68, "node": 4 * 68}}
    calls = estimate.stage3_comm_calls(flats, 4, 2, 4, zeropp=ALL)
    assert calls == {"all_gather": {"cross_node": 3, "node": 2}, "reduce_scatter": {"cross_node": 2, "node": 1}}


@pytest.mark.parametrize("gpus_per_node, expected", [
    # Forward and backward gather 4 int8 shards of 250 elements (2 blocks, 264 bytes) each; qgZ's one hop sends
    # 4 int4 shards (2 blocks of 68 bytes).
    (4, {"all_gather": {"node": 2 * 4 * 264}, "reduce_scatter": {"node": 4 * 2 * 68}}),  # K = 1: no hop 2
    (1, {"all_gather": {"cross_node": 2 * 4 * 264}, "reduce_scatter": {"cross_node": 4 * 2 * 68}}),  # D = 1
])
def test_a_hop_over_one_rank_is_skipped(gpus_per_node, expected):
    parts = ZeroPP(qwz=True, qgz=True, gradient_bits=4)
    assert estimate.stage3_comm_bytes([Flat(1000)], 4, gpus_per_node, 2, zeropp=parts) == expected


def test_int8_gradients_and_other_block_sizes():
    parts = ZeroPP(qgz=True, gradient_bits=8, block_size=64)
    got = estimate.stage3_comm_bytes([Flat(1000)], 4, 2, 2, zeropp=parts)
    assert got["reduce_scatter"] == {"node": 4 * q(250, 8, 64), "cross_node": 2 * q(250, 8, 64)}
    assert got["reduce_scatter"] == {"node": 4 * 4 * 68, "cross_node": 2 * 4 * 68}


def test_hpz_secondary_memory():
    flats = [Flat(10, SHARDED), Flat(5, PERSISTENT), Flat(1000, FROZEN)]
    # 1/D of each gathered flat's padded buffer: (12 + 1000) / 2 elements of 4 bytes; persistent ones none.
    assert estimate.hpz_secondary_bytes(flats, 4, 2, 4) == (6 + 500) * 4
    states = estimate.model_state_bytes(PSI, 4, 3, param_bytes=2, hpz_partition_size=2)
    assert states["hpz_secondary"] == M // 2 == estimate.hpz_secondary_bytes([Flat(PSI)], 4, 2, 2)
    assert "hpz_secondary" not in estimate.model_state_bytes(PSI, 4, 3, param_bytes=2)
    assert "hpz_secondary" not in estimate.model_state_bytes(PSI, 4, 2, param_bytes=2, hpz_partition_size=2)


def test_summary_keys_with_and_without_zeropp():
    plain = estimate.summarize(PSI, 4, 2)
    assert "hpz_secondary" not in plain["memory_by_state"]["3"] and plain["zeropp"] is None
    assert plain["stage3_comm_by_scope"] == {"plain": estimate.stage3_comm_bytes([Flat(PSI)], 4, 2, 2)}
    assert plain["cross_node_bytes_zeropp"] == 4 * q(PSI // 4, 8) + 2 * q(PSI // 4, 4)
    on = estimate.summarize(PSI, 4, 2, zeropp=ALL)
    assert on["stage3_comm_by_scope"]["zeropp"] == estimate.stage3_comm_bytes([Flat(PSI)], 4, 2, 2, zeropp=ALL)
    assert on["memory_by_state"]["3"]["hpz_secondary"] == M // 2
    assert on["memory_bytes"]["3"] == plain["memory_bytes"]["3"] + M // 2
    assert on["zeropp"] == {"qwz": True, "hpz": True, "qgz": True, "block_size": 128, "gradient_bits": 4,
                            "weight_bits": 8}
    # Nodes that do not divide N: no ZeRO++ figure, the plain ones stay.
    assert estimate.summarize(PSI, 12)["cross_node_bytes_zeropp"] is None


@pytest.mark.parametrize("call, message", [
    (lambda: estimate.stage3_comm_bytes([Flat(8)], 4, 1, 2, zeropp=ZeroPP(hpz=True)), "at least 2 ranks"),
    (lambda: estimate.stage3_comm_bytes([Flat(8)], 6, 4, 2, zeropp=ZeroPP(qgz=True)), "whole nodes"),
    (lambda: estimate.stage3_comm_bytes([Flat(8, "lost")], 4, 2, 2), "kind in"),
    (lambda: estimate.stage3_comm_bytes([Flat(0)], 4, 2, 2), "numel >= 1"),
    (lambda: estimate.stage3_comm_bytes([Flat(8)], 4, 2, 2, accumulation=0), "accumulation"),
])
def test_bad_setups(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_stage3_flats_reads_built_units():
    def bucket(numel, shard):
        return SimpleNamespace(flat=SimpleNamespace(numel=numel), switches=SimpleNamespace(shard_params=shard))
    units = [SimpleNamespace(buckets=[bucket(100, True), bucket(7, False)], frozen=[]),
             SimpleNamespace(buckets=[], frozen=[SimpleNamespace(numel=50)])]
    assert stage3_flats(units) == [Flat(100, SHARDED), Flat(7, PERSISTENT), Flat(50, FROZEN)]


def test_model_flats_follow_the_unit_plan():
    # The demo preset: a unit per Block, persistence threshold 0: one sharded flat per unit, Ψ in all.
    counted = count_model("demo")
    assert {f.kind for f in counted.flats} == {SHARDED} and sum(f.numel for f in counted.flats) == counted.numel
    # Under a threshold, each unit's small parameters form a persistent flat of their own.
    split = count_model("demo", persistence_threshold=10**4)
    assert len(split.flats) == 2 * len(counted.flats) and sum(f.numel for f in split.flats) == counted.numel


def test_cli_by_scope_json_and_table(capsys):
    assert main(["estimate", "--params", str(PSI), "--gpus", "4", "--gpus-per-node", "2", "--zeropp", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stage3_comm_by_scope"]["zeropp"]["all_gather"] == {"cross_node": 4 * q(PSI // 4, 8), "node": M}
    assert out["memory_by_state"]["3"]["hpz_secondary"] == M // 2 and out["stage3_model_bytes"] == M
    assert main(["estimate", "--model", "demo", "--gpus", "4", "--gpus-per-node", "2", "--qgz",
                 "--gradient-bits", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    flats = count_model("demo").flats
    assert out["stage3_flats"] == len(flats) and "hpz_secondary" not in out["memory_by_state"]["3"]
    assert out["stage3_comm_by_scope"]["zeropp"] == estimate.stage3_comm_bytes(
        flats, 4, 2, 2, zeropp=ZeroPP(qgz=True, gradient_bits=8))
    assert main(["estimate", "--params", str(PSI), "--gpus", "4", "--gpus-per-node", "2", "--qwz", "--hpz"]) == 0
    table = capsys.readouterr().out
    assert "qwZ+hpZ" in table and "0.5156M" in table and "hpZ secondary shards" in table


def test_cli_refuses_hpz_on_nodes_of_one(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--params", "1e9", "--gpus", "8", "--gpus-per-node", "1", "--hpz"])
    assert exit_info.value.code == 2 and "at least 2 ranks" in capsys.readouterr().err
