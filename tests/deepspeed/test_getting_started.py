"""Acceptance 1 of issue 13: DeepSpeed's getting-started loop runs on zeroshard with the import renamed,
at stages 0-3 on 2 ranks, and matches single-process training (fp32: losses and weights within 1e-6);
the first run's load_checkpoint finds nothing and returns (None, None), the second resumes exactly.

The reference is plain PyTorch in one process: the same model, `torch.optim.Adam` (DeepSpeed's "Adam"
block with no weight decay), each step on the concatenation of both ranks' micro-batches.
"""

import json
from pathlib import Path

import torch

from tests.deepspeed.getting_started import Net, main
from tests.distributed import run_ranks
from tests.distributed import test_device as rank_device

STAGES = (0, 1, 2, 3)
STEPS, STOP, MICRO, LR = 8, 4, 4, 1e-2
# fp32 on the CPU: within 1e-6 of the CPU reference. GPU kernels sum in other orders than the CPU's.
RTOL = 1e-6 if rank_device(2).type == "cpu" else 2e-5


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(2 * MICRO, 8, generator=g), torch.randn(2 * MICRO, 1, generator=g)


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def _rank_data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    return [tuple(t[rows] for t in _batch(step)) for step in range(STEPS)]


def _config(root: Path, stage: int) -> Path:
    path = root / f"ds_config_stage{stage}.json"
    path.write_text(json.dumps({"train_batch_size": 2 * MICRO, "gradient_accumulation_steps": 1,
                                "optimizer": {"type": "Adam", "params": {"lr": LR}},
                                "zero_optimization": {"stage": stage}}))
    return path


def _both_runs(rank, world, device, root):
    out = {}
    for stage in STAGES:
        save_dir = Path(root) / f"ckpt{stage}"
        argv = ["--deepspeed", "--deepspeed_config", str(Path(root) / f"ds_config_stage{stage}.json"),
                "--save_dir", str(save_dir), "--save_interval", "2"]
        first, losses, lrs, _ = main(argv + ["--steps", str(STOP)], _model(), _rank_data(rank))
        second, more, more_lrs, engine = main(argv + ["--steps", str(STEPS)], _model(), _rank_data(rank))
        weights = {k: v.cpu() for k, v in engine.full_state_dict().items()}
        tags = sorted(p.name for p in save_dir.iterdir())
        out[stage] = dict(first=first, second=(second[0].name, second[1]), losses=losses + more,
                          lrs=lrs + more_lrs, weights=weights, tags=tags, latest=(save_dir / "latest").read_text())
    return out


def _reference():
    """Each rank's loss per step and the final weights, in one process."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        halves = [model((x[r * MICRO:(r + 1) * MICRO], y[r * MICRO:(r + 1) * MICRO])) for r in range(2)]
        losses.append([h.item() for h in halves])
        opt.zero_grad()
        (sum(halves) / 2).backward()  # the mean over the global batch
        opt.step()
    return losses, model.state_dict()


def test_getting_started_loop_resumes_and_matches_one_process(tmp_path):
    for stage in STAGES:
        _config(tmp_path, stage)
    ranks = run_ranks(_both_runs, 2, str(tmp_path))
    ref_losses, ref_weights = _reference()
    for stage in STAGES:
        for rank, result in enumerate(r[stage] for r in ranks):
            assert result["first"] == (None, None), f"stage {stage}: a first run found a checkpoint"
            tag, client_sd = result["second"]
            rank0_loss_at_stop = ranks[0][stage]["losses"][STOP - 1]
            assert tag == str(rank0_loss_at_stop) and client_sd == {"step": STOP - 1}, (stage, tag, client_sd)
            torch.testing.assert_close(result["losses"], [pair[rank] for pair in ref_losses], rtol=RTOL, atol=0)
            assert result["lrs"] == [[LR]] * STEPS
            for name, ref in ref_weights.items():
                where = f"stage {stage} rank {rank} {name}"
                torch.testing.assert_close(result["weights"][name], ref, rtol=RTOL, atol=RTOL / 10,
                                           msg=lambda m, where=where: f"{where}: {m}")
        # saves at the odd steps (`if step % save_interval`), each tag rank 0's loss.item()
        saved = sorted(str(ranks[0][stage]["losses"][s]) for s in (1, 3, 5, 7))
        assert ranks[0][stage]["tags"] == sorted(saved + ["latest"])
        assert ranks[0][stage]["latest"].strip() == str(ranks[0][stage]["losses"][7])
