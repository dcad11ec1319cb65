"""The engine's DeepSpeed methods (zeroshard/deepspeed/engine.py), each against its reference: torch itself
(schedulers, clip_grad_norm_), a run without the call, or DeepSpeed's documented value. One rank, in process."""

import argparse
import logging
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import zeroshard
import zeroshard.deepspeed as deepspeed
from zeroshard.deepspeed.engine import AccumulationSteps


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _config(stage=0, accumulation=1, **extra):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accumulation,
            "optimizer": {"type": "Adam", "params": {"lr": 0.1}}, "zero_optimization": {"stage": stage}, **extra}


def _engine(stage=0, accumulation=1, seed=0, **kwargs):
    model = _model(seed)
    return deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                config=_config(stage, accumulation), **kwargs)[0]


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(2, 4, generator=g), torch.randn(2, 1, generator=g)


def _micro_step(engine, i, between=None):
    x, y = _batch(i)
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    if between is not None:
        between()
    engine.step()
    return loss.item()


def _weights(engine):
    return torch.cat([v.reshape(-1) for v in engine.full_state_dict().values()])


def test_gradient_accumulation_steps_is_an_int_and_a_method():
    engine = _engine(accumulation=3)
    steps = engine.gradient_accumulation_steps
    assert isinstance(steps, AccumulationSteps) and isinstance(steps, int)
    assert steps() == 3 and type(steps()) is int  # DeepSpeed's call
    assert steps == 3 and steps * 2 == 6 and 7 % steps == 1 and steps > 2 and 1.0 / steps == 1 / 3  # the attribute
    assert (engine.train_micro_batch_size_per_gpu(), engine.train_batch_size()) == (2, 6)


def test_get_lr_follows_the_scheduler_as_torch_does():
    model = _model()
    groups = [{"params": [model[0].weight, model[0].bias]}, {"params": list(model[2].parameters()), "lr": 0.01}]
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        model=model, model_parameters=groups, config=_config(1),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
    assert optimizer is engine.optimizer and scheduler is engine.lr_scheduler and loader is None
    plain_model = _model()
    plain = torch.optim.Adam([{"params": list(plain_model[0].parameters())},
                              {"params": list(plain_model[2].parameters()), "lr": 0.01}], lr=0.1)
    reference = torch.optim.lr_scheduler.StepLR(plain, step_size=2, gamma=0.5)
    assert engine.get_lr() == [0.1, 0.01]
    for i in range(5):
        _micro_step(engine, i)
        plain.step()
        reference.step()
        assert engine.get_lr() == reference.get_last_lr(), i
    assert engine.get_mom() == [(0.9, 0.999), (0.9, 0.999)]  # Adam's betas, per group


def test_grad_norm_step_applied_and_samples():
    """The counters through two windows of 2 and a window with nan, against DeepSpeed's documented semantics:
    is_gradient_accumulation_boundary() is true before a window's last step(); was_step_applied() is cleared
    by every step() and set by an applied update (false mid-window and after a skipped step); global_steps
    and global_samples count skipped steps, skipped_steps only those; micro_steps counts every step()."""
    engine = _engine(accumulation=2)
    assert (engine.get_global_grad_norm(), engine.was_step_applied(), engine.global_samples) == (None, False, 0)
    reference = _model()
    losses = []
    for i in range(2):
        x, y = _batch(i)
        losses.append(nn.functional.mse_loss(reference(x), y) / 2)
        _micro_step(engine, i)
    sum(losses).backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf")).item()
    assert math.isclose(engine.get_global_grad_norm(), norm, rel_tol=1e-6)
    assert engine.was_step_applied() and engine.global_samples == 4 and engine.global_steps == 1

    def counters():
        return (engine.micro_steps, engine.global_steps, engine.skipped_steps, engine.global_samples,
                engine.is_gradient_accumulation_boundary(), engine.was_step_applied())

    assert counters() == (2, 1, 0, 4, False, True)
    _micro_step(engine, 2)  # mid-window: no update, and the last step() applied nothing
    assert counters() == (3, 1, 0, 4, True, False)
    before = _weights(engine)
    x, y = _batch(3)
    engine.backward(nn.functional.mse_loss(engine(x * float("nan")), y))  # nan gradients: the window is skipped
    engine.step()
    assert counters() == (4, 2, 1, 8, False, False)
    assert engine.get_global_grad_norm() == math.inf and torch.equal(_weights(engine), before)
    _micro_step(engine, 4)
    assert counters() == (5, 2, 1, 8, True, False)
    _micro_step(engine, 5)
    assert counters() == (6, 3, 1, 12, False, True) and not torch.equal(_weights(engine), before)


def test_where_the_engine_runs_and_what_it_is():
    engine = _engine(stage=2)
    assert engine.device == next(engine.module.parameters()).device
    assert (engine.global_rank, engine.local_rank, engine.world_size) == (0, 0, 1)
    assert isinstance(engine.module, nn.Sequential) and isinstance(engine, deepspeed.DeepSpeedEngine)
    assert engine.eval() is engine and not engine.module.training
    assert engine.train() is engine and engine.module.training
    assert (engine.zero_optimization_stage(), engine.zero_optimization()) == (2, True)
    assert (engine.fp16_enabled(), engine.bfloat16_enabled(), engine.gradient_clipping()) == (False, False, 0.0)
    with pytest.raises(zeroshard.EngineStateError, match="set_train_batch_size.*not supported yet"):
        engine.set_train_batch_size(16)


def test_zero_grad_has_no_effect():
    plain, called = _engine(), _engine()
    for i in range(4):
        _micro_step(plain, i)
        called.zero_grad()
        _micro_step(called, i, between=called.zero_grad)
    assert torch.equal(_weights(plain), _weights(called))


def test_no_sync_at_every_stage_reduces_the_window_once_at_its_step():
    """DDP's no_sync around a whole window: the step reduces what the ranks held (DeepSpeed refuses it at 2-3)."""
    for stage in (0, 1, 2, 3):
        plain, synced = _engine(stage, accumulation=2), _engine(stage, accumulation=2)
        for i in range(4):
            _micro_step(plain, i)
            with synced.no_sync():
                _micro_step(synced, i)
        torch.testing.assert_close(_weights(synced), _weights(plain), rtol=1e-6, atol=1e-7)
        with synced.no_sync():
            with pytest.raises(zeroshard.EngineStateError, match="re-entry"), synced.no_sync():
                pass


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_load_checkpoint_with_nothing_to_load(tmp_path):
    engine = _engine()
    records, logger = _Records(), logging.getLogger("zeroshard.checkpoint.loading")
    logger.addHandler(records)  # on the logger itself: whatever zeroshard's logging set-up propagates
    try:
        assert engine.load_checkpoint(tmp_path / "missing") == (None, None)
        assert engine.load_checkpoint(tmp_path) == (None, None)  # exists, empty
    finally:
        logger.removeHandler(records)
    assert len(records.messages) == 2 and all(m.startswith("rank 0: no checkpoint in") and
                                              "pass must_exist=True" in m for m in records.messages)
    with pytest.raises(zeroshard.CheckpointError, match="does not exist"):
        engine.load_checkpoint(tmp_path / "missing", must_exist=True)
    with pytest.raises(zeroshard.CheckpointError, match="has no checkpoint 'best'"):
        engine.load_checkpoint(tmp_path, "best")  # a tag asked for must exist
    _micro_step(engine, 0)
    engine.save_checkpoint(tmp_path, "a", save_latest=False)
    with pytest.raises(zeroshard.CheckpointError, match="no 'latest' file"):  # tags but no latest: not "empty"
        engine.load_checkpoint(tmp_path)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(zeroshard.CheckpointError, match="DeepSpeed checkpoint"):  # another kind: not "empty"
        engine.load_checkpoint(tmp_path / "other")


def test_checkpoint_arguments_as_deepspeed_passes_them(tmp_path):
    engine = _engine()
    _micro_step(engine, 0)
    assert engine.save_checkpoint(tmp_path, 5) == tmp_path / "5"
    assert engine.save_checkpoint(tmp_path, 0.25, {"step": 1}) == tmp_path / "0.25"
    assert engine.save_checkpoint(tmp_path, 0) == tmp_path / "0"  # a falsy tag is still the tag
    other = _engine(seed=1)
    # DeepSpeed's positional order: load_dir, tag, load_module_strict, load_optimizer_states, ...
    path, client = other.load_checkpoint(tmp_path, 0.25, True, False)
    assert (path, client) == (tmp_path / "0.25", {"step": 1}) and not other.optimizer.state
    assert torch.equal(_weights(other), _weights(engine))
    for kwargs, match in (({"load_module_strict": False}, "load_module_strict=False is not supported yet"),
                          ({"custom_load_fn": print}, "custom_load_fn is not supported yet")):
        with pytest.raises(zeroshard.CheckpointError, match=match):
            other.load_checkpoint(tmp_path, **kwargs)
    # DeepSpeed's keyword; with nothing frozen both hold every parameter (tests/checkpoint/test_exclude_frozen.py)
    assert engine.save_checkpoint(tmp_path, "lean", exclude_frozen_parameters=True) == tmp_path / "lean"
    assert engine.save_checkpoint(tmp_path, "kept", exclude_frozen_parameters=False) == tmp_path / "kept"


def test_client_state_keeps_paths_and_namespaces(tmp_path):
    engine = _engine()
    _micro_step(engine, 0)
    args = argparse.Namespace(lr=0.1, out=Path("runs/a"), layers=[1, 2], nested=argparse.Namespace(seed=3))
    state = {"args": args, "dir": tmp_path, "paths": (Path("x"), Path("/y")), "plain": {"n": 1}}
    engine.save_checkpoint(tmp_path / "ckpt", client_state={**state, "accumulation": engine.gradient_accumulation_steps})
    _, loaded = _engine(seed=1).load_checkpoint(tmp_path / "ckpt")
    assert type(loaded.pop("accumulation")) is int
    assert loaded == state
    assert type(loaded["args"]) is argparse.Namespace and type(loaded["args"].nested) is argparse.Namespace
    assert isinstance(loaded["dir"], Path) and all(isinstance(p, Path) for p in loaded["paths"])
    with pytest.raises(zeroshard.CheckpointError, match=r"client_state\['bad'\] \(a dict with the key "
                                                         r"'__zeroshard_type__', which zeroshard reserves\)"):
        engine.save_checkpoint(tmp_path / "ckpt", client_state={"bad": {"__zeroshard_type__": 1}})
    with pytest.raises(zeroshard.CheckpointError, match=r"client_state\['mode'\] \(a zeroshard.engine.state."
                                                         r"TrainingState\)"):
        engine.save_checkpoint(tmp_path / "ckpt", client_state={"mode": zeroshard.engine.state.TrainingState.IDLE})
