"""The demo after a torchrun restart: where it resumes from, and the global batch on another number of ranks.

References: the restart count torchrun sets (TORCHELASTIC_RESTART_COUNT),
the files of the save directory, and the batch arithmetic rows = micro-batch
x ranks x accumulation.
"""

import argparse

import pytest
import torch

import zeroshard
from zeroshard.app.demo.restart import completed, keep_global_batch, resume, resume_source, save
from zeroshard.app.demo.train import lr_schedule
from zeroshard.app.errors import UsageError


def _checkpoint(directory, **client_state):
    """A tag directory as far as these functions read it: a manifest to resolve, state.pt's client_state."""
    directory.mkdir(parents=True)
    (directory / "manifest.json").write_text("{}")
    torch.save({"client_state": client_state}, directory / "state.pt")
    return directory


def _args(tmp_path, **kw):
    return argparse.Namespace(**({"save_every": 2, "save_dir": str(tmp_path / "ck"), "resume": None, "steps": 6,
                                  "micro_batch": 2, "accumulation": 1} | kw))


def test_a_restart_resumes_from_the_save_directory_once_it_has_a_latest(tmp_path, monkeypatch):
    args = _args(tmp_path, resume="first")
    assert resume_source(args) == "first"  # a first start: --resume only
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resume_source(args) == "first"  # restarted before any checkpoint was complete
    _checkpoint(tmp_path / "ck" / ".global_step2.partial")  # a save cut short is no checkpoint
    assert resume_source(args) == "first"
    _checkpoint(tmp_path / "ck" / "global_step4", demo_step=4)
    (tmp_path / "ck" / "latest").write_text("global_step4\n")
    assert resume_source(args) == args.save_dir and not completed(args)
    assert completed(_args(tmp_path, steps=4))  # the run had ended: nothing to train again


def test_fewer_ranks_keep_the_global_batch_by_accumulation_or_say_which_flag_to_change(tmp_path):
    source = str(_checkpoint(tmp_path / "ck", global_batch=8))
    same = _args(tmp_path)
    assert not keep_global_batch(same, source, 4) and same.accumulation == 1  # 2 x 4 x 1 = 8 already
    fewer = _args(tmp_path)
    assert keep_global_batch(fewer, source, 2) and fewer.accumulation == 2  # 2 x 2 x 2 = 8
    with pytest.raises(UsageError, match=r"global batch of 8 rows per step; --micro-batch 2 x 3 ranks = 6 rows "
                                         r"does not divide it"):
        keep_global_batch(_args(tmp_path), source, 3)


def test_resuming_with_other_steps_says_the_lr_schedule_changes(tmp_path, caplog):
    """Reference: the schedule the first run saved (its step count), against the --steps of the resumed run."""
    def engine_and_schedule():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return zeroshard.initialize(model, optimizer, {"train_micro_batch_size_per_gpu": 1}), optimizer

    engine, optimizer = engine_and_schedule()
    args = argparse.Namespace(save_every=2, steps=4, save_dir=str(tmp_path))
    save(engine, lr_schedule(optimizer, 4), args, 2, global_batch=1)
    for steps, warned in ((4, False), (6, True)):
        caplog.clear()
        engine, optimizer = engine_and_schedule()
        assert resume(engine, lr_schedule(optimizer, steps), str(tmp_path), steps) == 2
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert bool(said) == warned, said
    assert "over 4 steps; with --steps 6 its steps from 3 on follow a schedule over 6" in said[0]
    assert "give --steps 4 to continue it unchanged" in said[0]
