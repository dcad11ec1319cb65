"""Checkpoints: a resumed run is the run that never stopped, on any world size, stage or dtype.

References: the uninterrupted zeroshard run (same world size: bit for bit),
single-process PyTorch on the same global batch (another world size or
stage: the parity bar of tests/engine/test_parity.py), and the saved values
themselves (weights, fp32 masters and optimizer state come back exactly,
whatever the reader's layout; `zeroshard.checkpoint.consolidate` reads them back
without a process group).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zeroshard
from tests.distributed import run_ranks
from tests.recipes import (
    Case,
    flat_weights,
    make_engine,
    make_engine_with_schedule,
    make_model,
    relative_error,
    train_reference,
    train_steps,
)
from zeroshard.checkpoint.consolidate import consolidate, full_tensors

STEPS, SAVE_AT = 6, 3
# fp16 from 2^18: the first steps overflow and are skipped, so the loss scale has a history to keep.
FP16_OVERFLOWING = {"fp16": {"enabled": True, "initial_scale_power": 18, "hysteresis": 1}}


def _weights(engine) -> torch.Tensor:
    full = engine.full_state_dict()
    return torch.cat([full[name].reshape(-1).float().cpu() for name, _ in engine.module.named_parameters()])


def _save(engine, schedule, directory) -> None:
    engine.save_checkpoint(directory, client_state={"schedule": schedule.state_dict() if schedule else None})


def _load(engine, schedule, directory, tag=None) -> None:
    _, client = engine.load_checkpoint(directory, tag)
    if schedule is not None:
        schedule.load_state_dict(client["schedule"])


def _counters(engine) -> tuple:
    return engine.global_steps, engine.micro_steps, engine.skipped_steps, engine.loss_scale


# -- the same job, stopped and resumed ------------------------------------------------

RESUMED = [
    (Case(stage=s, accumulation=2, clip=0.5, schedule=True), None) for s in (0, 1, 2, 3)
] + [
    (Case(stage=3, accumulation=2, freeze=True, persistence=100), None),  # frozen flat + persistent segments
    (Case(stage=1, optimizer="sgd", dtype="bf16"), None),
    (Case(stage=2, optimizer="adamw1_slow", dtype="fp16"), FP16_OVERFLOWING),
]


def _uninterrupted(rank, world, device, root):
    out = []
    for case, extra in RESUMED:
        engine, schedule = make_engine_with_schedule(case, config=case.config() | (extra or {}), device=device)
        losses = train_steps(engine, schedule, case, world, rank, device, range(SAVE_AT))
        at_save = _counters(engine)
        losses += train_steps(engine, schedule, case, world, rank, device, range(SAVE_AT, STEPS))
        out.append((losses, _weights(engine), at_save, _counters(engine)))
    return out


def _stop_at_save(rank, world, device, root):
    for i, (case, extra) in enumerate(RESUMED):
        engine, schedule = make_engine_with_schedule(case, config=case.config() | (extra or {}), device=device)
        train_steps(engine, schedule, case, world, rank, device, range(SAVE_AT))
        _save(engine, schedule, Path(root) / str(i))


def _resume(rank, world, device, root):
    out = []
    for i, (case, extra) in enumerate(RESUMED):
        # seed 7: other initial weights, the load replaces them
        engine, schedule = make_engine_with_schedule(case, config=case.config() | (extra or {}), seed=7, device=device)
        _load(engine, schedule, Path(root) / str(i))
        at_load = _counters(engine)
        losses = train_steps(engine, schedule, case, world, rank, device, range(SAVE_AT, STEPS))
        out.append((losses, _weights(engine), at_load, _counters(engine)))
    return out


def test_resume_is_bit_identical_to_the_run_that_never_stopped(tmp_path):
    whole = run_ranks(_uninterrupted, 2, str(tmp_path))
    run_ranks(_stop_at_save, 2, str(tmp_path))
    resumed = run_ranks(_resume, 2, str(tmp_path))
    for rank in range(2):
        for i, (case, _) in enumerate(RESUMED):
            losses, weights, at_save, at_end = whole[rank][i]
            r_losses, r_weights, at_load, r_end = resumed[rank][i]
            assert r_losses == losses[SAVE_AT:], f"{case}, rank {rank}: {r_losses} vs {losses[SAVE_AT:]}"
            assert torch.equal(r_weights, weights), f"{case}, rank {rank}: final weights differ"
            assert at_load == at_save and r_end == at_end, f"{case}: counters {at_load}/{r_end} vs {at_save}/{at_end}"
    fp16_steps, _, fp16_skipped, fp16_scale = whole[0][-1][2]
    assert fp16_skipped >= 1 and fp16_skipped < fp16_steps and fp16_scale < 2.0 ** 18, \
        "the fp16 case must overflow, then train"


# -- another world size, stage or dtype reads it -------------------------------------

WRITER = Case(stage=2, micro_rows=4, clip=0.5, schedule=True)  # 2 ranks x 4 rows: a global batch of 8
READERS = [  # (world, case): the same global batch of 8 rows
    (4, replace(WRITER, stage=3, micro_rows=2)),
    (1, replace(WRITER, stage=0, micro_rows=8)),
    (4, replace(WRITER, stage=1, micro_rows=1, accumulation=2, bucket=1500)),
]


def _write(rank, world, device, root, case):
    engine, schedule = make_engine_with_schedule(case, device=device)
    train_steps(engine, schedule, case, world, rank, device, range(SAVE_AT))
    _save(engine, schedule, Path(root) / "written")
    return _weights(engine)


def _read(rank, world, device, root, case, name):
    engine, schedule = make_engine_with_schedule(case, seed=7, device=device)
    _load(engine, schedule, Path(root) / "written")
    loaded = _weights(engine)
    _save(engine, schedule, Path(root) / name)  # what this layout holds, to compare with what was written
    losses = train_steps(engine, schedule, case, world, rank, device, range(SAVE_AT, STEPS))
    return loaded, losses, _weights(engine), engine.global_steps


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    root = tmp_path_factory.mktemp("ckpt")
    return root, run_ranks(_write, 2, str(root), WRITER)[0]


@pytest.mark.parametrize("world, case", READERS, ids=lambda v: str(v) if isinstance(v, int) else f"stage{v.stage}")
def test_another_world_size_and_stage_continue_the_run(written, world, case):
    root, saved = written
    name = f"read_{world}_{case.stage}"
    results = run_ranks(_read, world, str(root), case, name)
    ref_losses, ref_weights = train_reference(case, world, STEPS)
    losses = torch.tensor([r[1] for r in results]).mean(0)  # mean over ranks = the global batch
    for loaded, _, weights, steps in results:
        assert torch.equal(loaded, saved), "the loaded weights differ from the saved ones"
        assert torch.equal(weights, results[0][2]) and steps == STEPS
    loss_err = ((losses - torch.tensor(ref_losses[SAVE_AT:])).abs() / torch.tensor(ref_losses[SAVE_AT:])).max()
    assert loss_err <= 2e-5, f"loss error {loss_err:.2e} against single-process PyTorch"
    assert relative_error(results[0][2], ref_weights) <= 1e-4
    # Masters and optimizer state, re-cut for this layout and saved again, are the written ones exactly.
    for kind in ("param", "optim.exp_avg", "optim.exp_avg_sq"):
        before, after = full_tensors(root / "written", kind=kind), full_tensors(root / name, kind=kind)
        assert before.keys() == after.keys() and len(before) == len(list(make_model().parameters()))
        for key in before:
            assert torch.equal(before[key], after[key]), f"{kind} of {key} changed in the round trip"


def test_consolidated_state_dict_loads_into_the_plain_model(written, tmp_path):
    root, saved = written
    state = consolidate(root / "written")
    model = make_model(seed=7)
    model.load_state_dict(state)  # strict: every key, tied ones too
    assert torch.equal(flat_weights(model), saved)
    assert torch.equal(state["wte.weight"], state["head.weight"])
    out = tmp_path / "model.safetensors"
    done = subprocess.run([sys.executable, "-m", "zeroshard.app.cli", "consolidate", str(root / "written"), str(out),
                           "--dtype", "bf16"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"wrote {len(state)} tensors" in done.stdout
    from_file = load_file(out)
    assert from_file.keys() == state.keys()
    assert all(torch.equal(from_file[k], v.to(torch.bfloat16)) for k, v in state.items())


# -- 16-bit training: the fp32 masters carry over, the 16-bit parameters follow them ------


def _write_bf16(rank, world, device, root):
    case = Case(stage=2, optimizer="adamw1_slow", dtype="bf16")
    engine = make_engine(case, device=device)
    train_steps(engine, None, case, world, rank, device, range(2))
    engine.save_checkpoint(Path(root) / "bf16")


def _read_bf16(rank, world, device, root):
    case = Case(stage=3, optimizer="adamw1_slow", dtype="bf16")
    engine = make_engine(case, seed=7, device=device)
    engine.load_checkpoint(Path(root) / "bf16")
    engine.save_checkpoint(Path(root) / "bf16_stage3")
    return engine.full_state_dict()


def test_bf16_masters_survive_a_change_of_stage_and_dtype(tmp_path):
    run_ranks(_write_bf16, 2, str(tmp_path))
    masters = full_tensors(tmp_path / "bf16")
    params = run_ranks(_read_bf16, 2, str(tmp_path))[0]
    again = full_tensors(tmp_path / "bf16_stage3")
    for name, master in masters.items():
        assert master.dtype == torch.float32
        assert torch.equal(again[name], master), f"fp32 master of {name} changed"
        assert torch.equal(params[name].cpu(), master.to(torch.bfloat16)), f"{name} is not its master in bf16"
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters.values()), \
        "the masters must hold more than bf16 precision for this test to mean anything"
    # An fp32 job reads the masters as its weights, exactly.
    engine = make_engine(optimizer="adamw1_slow", config={}, seed=7)
    engine.load_checkpoint(tmp_path / "bf16")
    full = engine.full_state_dict()
    assert all(torch.equal(full[name], master) for name, master in masters.items())


# -- one process: what else a training state holds ------------------------------------


SMALL_CONFIG = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}}}


def _small_engine(seed: int):
    """A BatchNorm model (an int64 buffer) with the config's optimizer and scheduler, in this process."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    return zeroshard.initialize(model, None, SMALL_CONFIG)


def _small_train(engine, steps: int) -> float:
    for step in range(steps):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
    return loss.item()


def test_config_schedule_and_integer_buffers_come_back(tmp_path):
    """The config's scheduler block is restored with the optimizer; BatchNorm's int64 counter stays int64."""
    engine = _small_engine(0)
    _small_train(engine, 3)
    engine.save_checkpoint(tmp_path)
    saved_mean, saved_lr = engine.module[1].running_mean.clone(), engine.optimizer.param_groups[0]["lr"]
    expected_loss = _small_train(engine, 2)
    other = _small_engine(1)
    other.load_checkpoint(tmp_path)
    assert other.lr_scheduler.last_epoch == 3 and other.optimizer.param_groups[0]["lr"] == saved_lr > 0
    assert other.module[1].num_batches_tracked.item() == 3
    assert _small_train(other, 2) == expected_loss
    buffers = full_tensors(tmp_path, kind="buffer")
    assert buffers["1.num_batches_tracked"].dtype == torch.int64 and buffers["1.num_batches_tracked"].item() == 3
    assert torch.equal(buffers["1.running_mean"], saved_mean)


def test_weights_only_loads_as_deepspeed_does(tmp_path):
    """load_module_only: the weights alone; load_optimizer_states=False: all but the optimizer's state."""
    engine = _small_engine(0)
    _small_train(engine, 3)
    engine.save_checkpoint(tmp_path)
    saved = engine.full_state_dict()
    module_only, no_optimizer = _small_engine(1), _small_engine(1)
    module_only.load_checkpoint(tmp_path, load_module_only=True)
    no_optimizer.load_checkpoint(tmp_path, load_optimizer_states=False)
    for loaded in (module_only, no_optimizer):
        full = loaded.full_state_dict()
        assert all(torch.equal(full[k], v) for k, v in saved.items())
        assert not loaded.optimizer.state  # never stepped, and nothing loaded into it
    assert (module_only.global_steps, module_only.lr_scheduler.last_epoch) == (0, 0)
    assert (no_optimizer.global_steps, no_optimizer.lr_scheduler.last_epoch) == (3, 3)
    with pytest.raises(zeroshard.CheckpointError, match="load_module_strict=False is not supported yet"):  # 3rd: strict
        module_only.load_checkpoint(tmp_path, None, False)


def test_save_latest_false_leaves_latest_alone(tmp_path):
    engine = _small_engine(0)
    _small_train(engine, 1)
    assert engine.save_checkpoint(tmp_path) == tmp_path / "global_step1"
    _small_train(engine, 1)
    assert engine.save_checkpoint(tmp_path, "best", None, False) == tmp_path / "best"
    assert (tmp_path / "latest").read_text() == "global_step1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "global_step1", "latest"]
    assert engine.load_checkpoint(tmp_path, "best")[0] == tmp_path / "best" and engine.global_steps == 2


def test_rank_files_rank_0_cannot_see_mean_no_shared_filesystem(tmp_path):
    from zeroshard.checkpoint.saving import _check_shared

    (tmp_path / "rank_00000.safetensors").write_bytes(b"x" * 10)
    _check_shared(tmp_path, {"rank_00000.safetensors": {"size": 10}})
    with pytest.raises(OSError, match=r"rank_00001.safetensors, written by another rank, is not in rank 0's .*"
                                      r"save_dir must be on a filesystem every node shares"):
        _check_shared(tmp_path, {"rank_00000.safetensors": {"size": 10}, "rank_00001.safetensors": {"size": 10}})
