"""torch.compile before initialize (`initialize(torch.compile(model))`) and after (`engine.compile()`).

References: the same engine trained eagerly in the same process (the compiled
one must match it exactly with the aot_eager backend, which traces forward
and backward as inductor does; within rounding with inductor's kernels), and
single-process training on the global batch (tests/recipes.py). Checkpoints
of a compiled model carry the model's own names (no `_orig_mod.`) and load
into an engine built from the plain model.
"""

from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.recipes import (Case, loss_of, make_engine, make_model, micro_batch, relative_error, train_reference,
                           train_reversal)

STEPS = 3
# (stage, how): the tiny GPT with the aot_eager backend, after its eager run at the same stage.
CASES = [(0, "eager"), (2, "eager"), (3, "eager"), (0, "before"), (2, "before"), (2, "after"), (3, "before"),
         (3, "after"), (3, "torch.compile(engine.module)")]
MLP_CONFIG = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {
    "stage": 3, "stage3_wrap_classes": ["Linear"], "stage3_param_persistence_threshold": 0}}
RETRY_CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def _compiled_engine(case: Case, how: str, device):
    """(engine, what forward is called on)."""
    if how == "before":
        engine = make_engine(case, model=lambda: torch.compile(make_model(device=device), backend="aot_eager"))
        return engine, engine
    engine = make_engine(case, device=device)
    if how == "after":
        engine.compile(backend="aot_eager")
    return engine, torch.compile(engine.module, backend="aot_eager") if how.startswith("torch") else engine


def _gpt_case(rank, world, device, stage, how, out_dir):
    import zeroshard
    from zeroshard.errors import ModelError

    case = Case(stage=stage, optimizer="adamw1")
    engine, forward = _compiled_engine(case, how, device)
    losses = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in micro_batch(step, case, world, rank, 0))
        loss = loss_of(forward, x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    full = engine.full_state_dict()
    path = engine.save_checkpoint(Path(out_dir) / f"{stage}-{how}")
    plain = make_engine(case, device=device, seed=1)  # other values: the load must bring them
    plain.load_checkpoint(path.parent)
    loaded = plain.full_state_dict()
    compiled, twice = engine.is_compiled, None
    if compiled:
        try:
            engine.compile()
        except ModelError as exc:
            twice = str(exc)
    return {"losses": losses, "compiled": compiled, "twice": twice,
            "weights": torch.cat([full[n].reshape(-1).cpu() for n, _ in engine.module.named_parameters()]),
            "keys": sorted(full) + sorted(zeroshard.consolidate.consolidate(path) if rank == 0 else []),
            "loaded_equal": full.keys() == loaded.keys() and all(torch.equal(full[k], loaded[k]) for k in full)}


def _mlp_case(rank, world, device, compiled: bool):
    """Stage 3, each Linear a unit, compiled after initialize with DeepSpeed's default backend (inductor).

    An `nn.Sequential`: its forward is torch.nn code, which `nn.Module.compile()` would leave uncompiled.
    """
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    engine = make_engine(config=MLP_CONFIG, optimizer="adamw1", device=device, model=lambda: torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).to(device))
    if compiled:
        engine.compile()
    losses = train_reversal(engine, rank, device, STEPS)
    weights = torch.cat([t.reshape(-1).cpu() for t in engine.full_state_dict().values()])
    return losses, weights, counters["stats"]["unique_graphs"]


def _retry_after_failed_initialize(device) -> tuple[str, bool, bool]:
    """initialize(torch.compile(model)) failing in build leaves the module uncompiled; the retry succeeds."""
    import zeroshard

    model = make_model(device=device)
    compiled = torch.compile(model, backend="aot_eager")
    stranger = torch.nn.Parameter(torch.zeros(3, device=device))  # not the model's: the build refuses it
    try:
        zeroshard.initialize(compiled, torch.optim.SGD([*model.parameters(), stranger], lr=0.1), RETRY_CONFIG)
        error = "no error"
    except zeroshard.ZeroshardError as exc:
        error = type(exc).__name__
    left_as_it_was = model._compiled_call_impl is None
    engine = zeroshard.initialize(compiled, torch.optim.SGD(model.parameters(), lr=0.1), RETRY_CONFIG)
    return error, left_as_it_was, engine.is_compiled


def _train_compiled(rank, world, device, out_dir):
    from torch._dynamo.utils import counters

    out = {}
    for stage, how in CASES:
        torch._dynamo.reset()
        counters.clear()
        out[stage, how] = _gpt_case(rank, world, device, stage, how, out_dir)
        out[stage, how]["graphs"] = counters["stats"]["unique_graphs"]
    out["mlp", "eager"] = _mlp_case(rank, world, device, compiled=False)
    out["mlp", "inductor"] = _mlp_case(rank, world, device, compiled=True)
    out["retry"] = _retry_after_failed_initialize(device)
    torch._dynamo.reset()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_train_compiled, 2, str(tmp_path_factory.mktemp("compile")))


@pytest.mark.parametrize("stage,how", [c for c in CASES if c[1] != "eager"])
def test_compiled_training_equals_eager_and_checkpoints_carry_plain_names(results, stage, how):
    keys = sorted(make_model().state_dict())
    ref_losses, ref_weights = train_reference(Case(stage=stage, optimizer="adamw1"), 2, STEPS)
    ranks = [out[stage, how] for out in results]
    losses = [sum(r["losses"][s] for r in ranks) / 2 for s in range(STEPS)]  # each rank has half the batch
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 2e-5  # as tests/engine/test_parity.py
    for out, r in zip(results, ranks):
        eager = out[stage, "eager"]
        assert r["losses"] == eager["losses"] and torch.equal(r["weights"], eager["weights"])
        assert relative_error(r["weights"], ref_weights) <= 1e-4
        assert r["graphs"] > 0 and r["compiled"] == (how != "torch.compile(engine.module)")
        assert r["keys"][:len(keys)] == keys and not any("_orig_mod" in k for k in r["keys"])
        assert r["loaded_equal"]
        assert how.startswith("torch") or "compiled already" in r["twice"]
    assert ranks[0]["keys"] == keys + keys  # full_state_dict, then the consolidated checkpoint


def test_inductor_at_stage3_matches_eager(results):
    for out in results:
        (eager_losses, eager_weights, _), (losses, weights, graphs) = out["mlp", "eager"], out["mlp", "inductor"]
        assert graphs > 0
        assert torch.allclose(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-6, atol=0)
        assert relative_error(weights, eager_weights) <= 1e-5


def test_initialize_of_a_compiled_model_that_fails_leaves_it_uncompiled_for_the_retry(results):
    for out in results:
        assert out["retry"] == ("OptimizerError", True, True), out["retry"]
