"""Bytes per optimizer step from comm_stats() equal DESIGN.md section 1's formulas (fp32).

Logical bytes of the padded flat buffers: 4 bytes x sum of the units'
padded sizes, which exceeds 4 Psi by fewer than N elements per unit. At
stage 3 (persistence threshold 0, so every parameter is sharded) each
micro-step all-gathers every unit twice (forward, backward) and
reduce-scatters it once: 2 x 4 Psi + 4 Psi, and nothing after the step.
On gloo, stage 3 agrees on each of those collectives first: one 8-byte
checksum per rank, all-gathered. Before each optimizer step, at every stage,
the step check all-gathers four float64 figures per rank (gradient norm,
non-finite flag, counters), clipping or not: 32 N bytes, and no all-reduce
of a scalar.
"""

import pytest

from tests import distributed
from tests.distributed import run_ranks
from tests.recipes import Case, make_model, make_optimizer, micro_batch

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "order_check", "step_check")


def _per_step(rank, world, device, cases):
    import zeroshard

    out = []
    for case in cases:
        model = make_model(device=device)
        psi = sum(p.numel() for p in model.parameters())
        engine = zeroshard.initialize(model, make_optimizer(case.optimizer, model), case.config())
        padded = sum(u.flat.padded_numel for u in engine.buckets)
        deltas = []
        for step in range(2):
            before = engine.comm_stats()
            for micro in range(case.accumulation):
                x, y = (t.to(device) for t in micro_batch(step, case, world, rank, micro))
                engine.backward(engine(x, y))
                engine.step()
            after = engine.comm_stats()
            deltas.append({op: (after[op].calls - before[op].calls, after[op].bytes - before[op].bytes)
                           for op in OPS})
        out.append((psi, padded, len(engine.buckets), deltas))
    return out


CASES = [
    Case(stage=0, accumulation=3),
    Case(stage=1, accumulation=3),
    Case(stage=2, accumulation=3),
    Case(stage=1, reduce_scatter=False),
    Case(stage=2, accumulation=2, reduce_scatter=False),
    Case(stage=2, clip=0.5),
    Case(stage=3, accumulation=2),
    Case(stage=3, clip=0.5),
]


def expected(case: Case, padded: int, units: int, world: int) -> dict:
    want = _expected_collectives(case, padded, units)
    want["step_check"] = (1, 32 * world)  # once per optimizer step: 4 float64 per rank, clipping or not
    if case.stage == 3 and distributed.test_device(world).type == "cpu":
        calls = sum(calls for calls, _ in want.values())
        want["order_check"] = (calls, 8 * world * calls)
    return want


def _expected_collectives(case: Case, padded: int, units: int) -> dict:
    """(calls, bytes) per optimizer step for each collective."""
    b, acc = 4 * padded, case.accumulation
    reductions = units * (acc if case.stage >= 2 else 1)  # stages 2-3 reduce every micro-step
    volume = b * (acc if case.stage >= 2 else 1)
    want = {op: (0, 0) for op in OPS}
    if case.stage == 3:
        want["all_gather"] = (2 * units * acc, 2 * b * acc)
    if case.stage == 0:
        want["all_reduce"] = (reductions, volume)
        return want
    op = "reduce_scatter" if case.reduce_scatter else "all_reduce"
    want[op] = (reductions, volume)
    if case.stage < 3:
        want["all_gather"] = (units, b)
    return want


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_per_step_match_formula(world):
    for rank_results in run_ranks(_per_step, world, CASES):
        for case, (psi, padded, units, deltas) in zip(CASES, rank_results):
            assert units > 1, "the test model should span several buckets"
            assert 0 <= padded - psi < world * units  # padding: fewer than N elements per unit
            for delta in deltas:
                assert delta == expected(case, padded, units, world), case
