"""The front doors' parity figures: the largest differences from the peer in the tests' own runs.

    python scripts/front_door_parity.py

Lightning: `tests/lightning/test_strategy.py`'s runs on 2 ranks (and the resume on 1), ZeroshardStrategy at
stages 1-3 against strategy="ddp". Accelerate: `tests/accelerate/test_accelerate.py`'s script under
`accelerate launch` on 2 CPU processes, zeroshard at stages 1-3 against plain Accelerate. Prints relative
differences (weights: absolute); the tests assert the bounds, this says how far inside them the runs are.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rel(got, want) -> float:
    assert len(got) == len(want)
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def lightning(out: Path) -> None:
    from tests.distributed import run_ranks
    from tests.lightning.test_strategy import _on_2_ranks, _resumed_on_1_process

    runs = run_ranks(_on_2_ranks, 2, out)[0]
    one = run_ranks(_resumed_on_1_process, 1, out)[0]
    ddp = runs["ddp"]
    for stage in (1, 2, 3):
        got = runs[stage]
        predicted = float(((got["predicted"] - ddp["predicted"]).abs() / ddp["predicted"].abs()).max())
        print(f"lightning stage {stage}: losses {_rel(got['first'] + got['losses'], ddp['losses']):.1e}, validation "
              f"{_rel(got['first_val'] + got['val'], ddp['val']):.1e}, predictions {predicted:.1e}, "
              f"global_step {got['step']} of {ddp['step']}")
    print(f"lightning resumed on 1 process {_rel(one['losses'], ddp['losses'][8:]):.1e}, configure_model on meta "
          f"{_rel(runs['configured']['losses'], ddp['losses'][:8]):.1e}, validated from a checkpoint "
          f"{_rel(runs['validated'], ddp['val'][:2]):.1e}")
    print(f"lightning bf16-mixed against ddp's bf16-mixed {_rel(runs['bf16'], runs['ddp_bf16']):.1e} (ddp bf16 "
          f"against ddp fp32 {_rel(runs['ddp_bf16'], ddp['losses'][:8]):.1e})")


def accelerate(out: Path) -> None:
    import torch

    from tests.accelerate.test_accelerate import launch

    ddp = launch(out / "ddp.json")
    for stage in (1, 2, 3):
        run = launch(out / f"stage{stage}.json", "--stage", str(stage))
        weights = max(float((torch.tensor(run["weights"][k]) - torch.tensor(v)).abs().max())
                      for k, v in ddp["weights"].items())
        print(f"accelerate stage {stage}: losses {_rel(run['losses'], ddp['losses']):.1e}, learning rates "
              f"{_rel(run['lrs'], ddp['lrs']):.1e}, clip norms {_rel(run['norms'], ddp['norms']):.1e}, weights "
              f"(absolute) {weights:.1e}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "lightning").mkdir()
        lightning(Path(tmp) / "lightning")
        accelerate(Path(tmp))
