"""Stage 3 honours `zero_optimization.reduce_scatter: false` (DESIGN.md sections 1 and 6).

With the switch off, every gradient reduction of a unit is an all-reduce of
its padded flat buffer (then this rank keeps its slice): the communication
log shows all-reduces and no reduce-scatter, with bytes equal to the
formula; with it on, the same run shows reduce-scatters and no gradient
all-reduce. Either way training reproduces single-process training on the
global batch.

Formula (fp32, persistence threshold 0, so every bucket is sharded): per
micro-step each bucket of every unit is reduced once, 4 x its padded size,
and all-gathered twice (forward, backward); each optimizer step runs one
step check, an all-gather of 40 bytes per rank that also carries the
clipping norm; nothing else runs.
"""

import pytest
import torch

from tests.distributed import run_ranks
from tests.recipes import (
    Case,
    flat_weights,
    make_model,
    make_optimizer,
    relative_error,
    train_reference,
    train_steps,
)

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "step_check")
WORLD = 2
STEPS = 3

CASES = [
    Case(stage=3, reduce_scatter=False, accumulation=2),
    Case(stage=3, reduce_scatter=True, accumulation=2),
    Case(stage=3, reduce_scatter=False, clip=0.5, micro_rows=3),
    Case(stage=3, reduce_scatter=False, optimizer="sgd", overlap=False),
]


def _train(rank, world, device, cases, steps):
    import torch

    import zeroshard

    out = []
    for case in cases:
        model = make_model(device=device)
        engine = zeroshard.initialize(model, make_optimizer(case.optimizer, model), case.config())
        padded = sum(b.flat.padded_numel for b in engine.buckets)
        losses, deltas = [], []
        for step in range(steps):
            before = engine.comm_stats()
            losses += train_steps(engine, None, case, world, rank, device, [step])
            after = engine.comm_stats()
            deltas.append({op: (after[op].calls - before[op].calls, after[op].bytes - before[op].bytes)
                           for op in OPS})
        algorithms = {op: sorted(stats.algorithms) for op, stats in engine.comm_stats().items()}
        full = engine.full_state_dict()
        weights = torch.cat([full[name].reshape(-1).cpu() for name, _ in engine.module.named_parameters()])
        out.append({"padded": padded, "buckets": len(engine.buckets), "losses": losses, "weights": weights,
                    "deltas": deltas, "algorithms": algorithms})
    return out


def expected(case: Case, padded: int, buckets: int, world: int) -> dict:
    """(calls, bytes) per optimizer step for each collective, at stage 3."""
    b, acc = 4 * padded, case.accumulation
    want = {op: (0, 0) for op in OPS}
    want["all_gather"] = (2 * buckets * acc, 2 * b * acc)
    grads = "reduce_scatter" if case.reduce_scatter else "all_reduce"
    want[grads] = (buckets * acc, b * acc)
    want["step_check"] = (1, 40 * world)  # the norm (clipping or not), the non-finite flag, the counters
    return want


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_train, WORLD, CASES, STEPS)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_comm_log_shows_the_collective_that_ran(runs, index):
    case = CASES[index]
    for rank, results in enumerate(runs):
        result = results[index]
        assert result["buckets"] > 1, "the test model should span several units"
        want = expected(case, result["padded"], result["buckets"], WORLD)
        for step, delta in enumerate(result["deltas"]):
            assert delta == want, (case, rank, step)
        if case.reduce_scatter:
            assert delta["all_reduce"] == (0, 0), "a gradient all-reduce ran beside the reduce-scatter"
            assert result["algorithms"]["reduce_scatter"] != []
        else:
            assert delta["reduce_scatter"] == (0, 0), "reduce_scatter: false still reduce-scattered"
            assert delta["all_reduce"][0] == result["buckets"] * case.accumulation
            assert result["algorithms"]["reduce_scatter"] == []


@pytest.mark.parametrize("index", range(len(CASES)))
def test_matches_single_process_training(runs, index):
    case = CASES[index]
    ref_losses, ref_weights = train_reference(case, WORLD, STEPS)
    losses = torch.tensor([results[index]["losses"] for results in runs]).mean(0)  # mean over ranks = global batch
    loss_err = ((losses - torch.tensor(ref_losses)).abs() / torch.tensor(ref_losses)).max().item()
    assert loss_err <= 2e-5, f"{case}: loss error {loss_err:.2e}"
    weights = runs[0][index]["weights"]
    for rank in range(1, WORLD):
        assert torch.equal(runs[rank][index]["weights"], weights), f"{case}: rank {rank} weights differ from rank 0"
    weight_err = relative_error(weights, ref_weights)
    assert weight_err <= 1e-4, f"{case}: weight error {weight_err:.2e}"
    assert relative_error(weights, flat_weights(make_model())) > 1e-3, f"{case}: training did not move the weights"
