"""Bytes per optimizer step from comm_stats() equal DESIGN.md section 1's formulas (fp32).

Logical bytes of the padded flat buffers: 4 bytes x sum of the units'
padded sizes, which exceeds 4 Psi by fewer than N elements per unit. At
stage 3 (persistence threshold 0, so every parameter is sharded) each
micro-step all-gathers every unit twice (forward, backward) and
reduce-scatters it once: 2 x 4 Psi + 4 Psi, and nothing after the step.
Before each optimizer step, at every stage, the step check all-gathers five
float64 figures per rank (gradient norm, non-finite flag, counters, the
checksum of the rank's collectives), clipping or not: 40 N bytes, and no
all-reduce of a scalar.

The second reference is the backend itself: the calls into torch.distributed
during each step, counted under the engine, are exactly the collectives
comm_stats() records (the model's own and the step check): no collective runs
to check the ranks' order, on gloo or NCCL. At stage 3 the ranks' rounds on
the units of a step (`unit_check`, stage3/agreement.py) come on top: 1 + 2U
bytes per rank each (U units), at most one per unit's need in forward and in
backward and one at the end of each, and at least those two.
"""

import pytest

import zeroshard.comm
from tests import distributed
from tests.distributed import run_ranks
from tests.recipes import Case, make_model, make_optimizer, micro_batch

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "step_check")
# What the engine may call in torch.distributed; a batch of sends and receives (gloo's all-gather and
# reduce-scatter) is one call. (isend and irecv stay unwrapped: P2POp checks them by identity, and they run
# only inside batch_isend_irecv.)
BACKEND = ("all_reduce", "all_gather_single", "all_to_all_single", "reduce_scatter_single", "batch_isend_irecv",
           "broadcast", "all_gather", "all_gather_object", "send", "recv", "barrier")


def _count_backend_calls(calls: list[str]):
    """Wrap torch.distributed's collectives so that each call is appended to `calls`; returns the undo."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in BACKEND}

    def counted(name, fn):
        return lambda *args, **kwargs: (calls.append(name), fn(*args, **kwargs))[1]

    for name, fn in originals.items():
        setattr(dist, name, counted(name, fn))
    return lambda: [setattr(dist, name, fn) for name, fn in originals.items()]


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
            before, calls = engine.comm_stats(), []
            undo = _count_backend_calls(calls)
            try:
                for micro in range(case.accumulation):
                    x, y = (t.to(device) for t in micro_batch(step, case, world, rank, micro))
                    engine.backward(engine(x, y))
                    engine.step()
            finally:
                undo()
            after = engine.comm_stats()
            deltas.append({op: (after[op].calls - before[op].calls, after[op].bytes - before[op].bytes)
                           for op in after} | {"backend": sorted(calls)})
        out.append((psi, padded, len(engine.buckets), deltas, len(engine.units)))
    return out


CASES = [
    Case(stage=0, accumulation=3),
    Case(stage=1, accumulation=3),
    Case(stage=2, accumulation=3),
    Case(stage=1, reduce_scatter=False),
    Case(stage=2, accumulation=2, reduce_scatter=False),
    Case(stage=2, clip=0.5),
    # The post-step gathers waited in the next forward: launched in the step's window all the same.
    Case(stage=1, accumulation=3, overlap_gather=True),
    Case(stage=2, clip=0.5, overlap_gather=True),
    Case(stage=3, accumulation=2),
    Case(stage=3, clip=0.5),
]


def expected(case: Case, padded: int, units: int, world: int) -> dict:
    want = _expected_collectives(case, padded, units)
    want["step_check"] = (1, 40 * world)  # once per optimizer step: 5 float64 per rank, clipping or not
    want = {op: want.get(op, (0, 0)) for op in zeroshard.comm.OPS if op != "unit_check"}
    want["backend"] = _backend_calls(want, distributed.test_device(world).type == "cpu")
    return want


def _backend_calls(want: dict, gloo: bool) -> list[str]:
    """The torch.distributed calls that run the collectives of `want`, one each: nothing else."""
    runs = {"all_reduce": "all_reduce", "step_check": "all_gather_single",
            "all_gather": "batch_isend_irecv" if gloo else "all_gather_single",
            "reduce_scatter": "batch_isend_irecv" if gloo else "reduce_scatter_single"}
    return sorted(runs[op] for op, (calls, _) in want.items() for _ in range(calls))


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
        for case, (psi, padded, units, deltas, stage3_units) in zip(CASES, rank_results):
            assert units > 1, "the test model should span several buckets"
            assert 0 <= padded - psi < world * units  # padding: fewer than N elements per unit
            for delta in deltas:
                rounds, nbytes = delta.pop("unit_check")
                assert nbytes == rounds * world * (1 + 2 * stage3_units), case
                passes = 2 * case.accumulation  # a forward and a backward per micro-step
                assert passes <= rounds <= passes * (stage3_units + 1) if case.stage == 3 else rounds == 0, case
                for _ in range(rounds):  # each a batch of sends and receives on gloo, an all-gather on NCCL
                    delta["backend"].remove("batch_isend_irecv" if distributed.test_device(world).type == "cpu"
                                            else "all_gather_single")
                assert delta == expected(case, padded, units, world), case
