"""Checkpoints of optimizers that need tensors whole, and of several optimizers: the owned layout is not a
format. A run saved at one world size and stage resumes at another and continues as the uninterrupted run."""

import pytest
import torch

from tests.distributed import run_ranks
from tests.optim import whole

STEPS, SAVED_AT, ROWS, ACCUMULATION, CLIP = 6, 3, 16, 2, 1.0


def _run(rank, world, device, kind, stage, steps, save_dir, load_dir):
    return whole.train(rank, world, device, kind, stage, steps, ROWS, ACCUMULATION, CLIP, "fp32", None,
                       save_dir, load_dir)


@pytest.mark.parametrize("kind, saved, resumed", [
    ("muon", (4, 2), (2, 3)),  # (world, stage) of the save, then of the resumed run
    ("adafactor", (2, 3), (4, 1)),
    ("lamb", (2, 1), (1, 2)),
    ("adamw_sgd", (2, 2), (4, 3)),
])
def test_resumed_run_continues_as_the_uninterrupted_one(kind, saved, resumed, tmp_path):
    uninterrupted = run_ranks(_run, resumed[0], kind, resumed[1], STEPS, None, None)
    run_ranks(_run, saved[0], kind, saved[1], SAVED_AT, str(tmp_path), None)
    continued = run_ranks(_run, resumed[0], kind, resumed[1], STEPS, None, str(tmp_path))
    for whole_run, resumed_run in zip(uninterrupted, continued):
        for got, want in zip(resumed_run[0], whole_run[0][SAVED_AT:]):
            assert abs(got - want) <= 2e-5 * abs(want), (got, want)
        assert (resumed_run[1] - whole_run[1]).abs().max() <= 1e-4


@pytest.mark.parametrize("kind, world, stage, key", [("muon", 4, 2, "momentum_buffer"), ("adafactor", 2, 3, "row_var"),
                                                     ("adamw_sgd", 2, 1, "exp_avg")])
def test_verify_and_consolidate_read_the_state_of_a_mix(kind, world, stage, key, tmp_path):
    """`zeroshard checkpoint verify` finds nothing wrong; `consolidate` gives the saved weights, and each
    tensor's state of `key` in the shape its optimizer keeps (only for the tensors whose optimizer has it)."""
    from zeroshard.checkpoint.consolidate import consolidate, full_tensors
    from zeroshard.checkpoint.verify import verify

    saved = run_ranks(_run, world, kind, stage, SAVED_AT, str(tmp_path), None)
    path, problems = verify(tmp_path)
    assert path is not None and problems == []
    weights = consolidate(tmp_path)
    model = whole.make_model()
    assert set(weights) == set(model.state_dict())  # the tied head included, as state_dict has it
    names = [n for n, _ in model.named_parameters()]
    assert (torch.cat([weights[n].reshape(-1) for n in names]) - saved[0][1]).abs().max() == 0
    state = full_tensors(tmp_path, kind="optim." + key)
    optimizers = whole.make_optimizers(kind, model)
    first = optimizers[0] if isinstance(optimizers, list) else optimizers
    holders = {id(p) for g in first.param_groups for p in g["params"]
               if key != "row_var" or p.dim() >= 2}  # Adafactor: a vector keeps "variance" instead
    assert set(state) == {n for n, p in model.named_parameters() if id(p) in holders}
    for name, p in model.named_parameters():
        if name in state and key == "row_var" and p.dim() == 2:
            assert list(state[name].shape) == [p.shape[0], 1]
        elif name in state:
            assert state[name].shape == p.shape


def _save_with_nan_on_rank1(rank, world, device, save_dir):
    import zeroshard

    model = whole.make_model()
    engine = zeroshard.initialize(model, whole.make_optimizers("muon", model), {
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}})
    x, y = whole.batch(0, 2 * world)
    engine.backward(whole.loss_of(engine, x.chunk(world)[rank], y.chunk(world)[rank]))
    engine.step()
    if rank == 1:  # one owned tensor's momentum diverged on this rank alone
        view = next(t for b in engine.buckets for t in b.stepped if t is not b.master and engine.optimizer.state[t])
        engine.optimizer.state[view]["momentum_buffer"].view(-1)[0] = float("nan")
    try:
        engine.save_checkpoint(save_dir)
    except zeroshard.CheckpointError as error:
        return str(error)
    return None


def test_a_nonfinite_owned_state_on_one_rank_stops_every_rank(tmp_path):
    errors = run_ranks(_save_with_nan_on_rank1, 2, str(tmp_path), timeout_s=120)
    assert all(e is not None and "momentum_buffer" in e and "nan" in e for e in errors), errors
