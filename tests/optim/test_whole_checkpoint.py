"""Checkpoints of optimizers that need tensors whole, and of several optimizers: the owned layout is not a
format. A run saved at one world size and stage resumes at another and continues as the uninterrupted run."""

import pytest

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
