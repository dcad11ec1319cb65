"""Checkpoint errors: every bad save or load is a CheckpointError that names the cause and the fix,
raised before anything changes (asserted message by message, and state by state).

Most cases run on a one-rank engine in the pytest process; a failed load must leave its weights,
optimizer state and counters bit-identical, and the engine must still train.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from tests.checkpoint.tamper import reseal
from tests.distributed import run_ranks
from tests.recipes import GPT_CFG, Case, loss_of, make_engine, make_model, micro_batch
from zeroshard import CheckpointError, EngineStateError, consolidate
from zeroshard.app.cli import main as cli_main
from zeroshard.app.models import GPT

CASE = Case(stage=2)
WRONG_MODEL_FIX = ("Build the model the checkpoint was saved from, or load the weights you want into this model "
                   "(model.load_state_dict(..., strict=False)) before zeroshard.initialize")
OPTIMIZER_FIX = ("; pass load_optimizer_states=False to keep this engine's optimizer state (or load_module_only=True "
                 "for the weights alone)")
DAMAGED_FIX = "restore it or load an earlier tag"


class GPTWithExtra(GPT):
    """The tiny GPT with one more trained parameter."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.extra = torch.nn.Parameter(torch.zeros(3))

    def forward(self, idx, targets=None):
        return super().forward(idx, targets) + 0 * self.extra.sum()


def train_step(e, step: int = 0, case: Case = CASE, rank: int = 0, world: int = 1, device="cpu") -> None:
    for micro in range(case.accumulation):
        x, y = (t.to(device) for t in micro_batch(step, case, world, rank, micro))
        e.backward(loss_of(e, x, y))
        e.step()


def snapshot(e) -> tuple:
    """Everything a load may change: full weights, optimizer state and settings, counters (copies)."""
    opt = e.optimizer.state_dict()
    state = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in opt["state"].items()}
    return e.full_state_dict(), state, copy.deepcopy(opt["param_groups"]), (
        e.global_steps, e.micro_steps, e.skipped_steps)


def assert_same(before: tuple, after: tuple) -> None:
    (w0, s0, g0, c0), (w1, s1, g1, c1) = before, after
    assert w0.keys() == w1.keys()
    changed = [k for k in w0 if not torch.equal(w0[k], w1[k])]
    assert changed == [], f"a failed load changed the weights {changed}"
    assert s0.keys() == s1.keys(), "a failed load changed which parameters have optimizer state"
    for i in s0:
        assert s0[i].keys() == s1[i].keys()
        for k, v in s0[i].items():
            assert torch.equal(v, s1[i][k]) if torch.is_tensor(v) else v == s1[i][k], (i, k)
    assert g0 == g1, "a failed load changed the optimizer's param groups"
    assert c0 == c1, "a failed load changed the step counters"


def assert_trains(e, step: int = 5) -> None:
    before = e.full_state_dict()
    train_step(e, step)
    after = e.full_state_dict()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before), "the engine did not train"


def load_fails(e, load_dir, match: str, **kwargs) -> str:
    """Train `e` a step (so it has optimizer state to lose), then assert the load raises `match`,
    changes nothing, and leaves an engine that trains; returns the message."""
    train_step(e, 3)
    before = snapshot(e)
    assert before[1], "no optimizer state to compare"
    with pytest.raises(CheckpointError, match=match) as info:
        e.load_checkpoint(load_dir, **kwargs)
    assert_same(before, snapshot(e))
    assert_trains(e)
    return str(info.value)


def assert_equal_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of the tiny GPT after one AdamW step (two param groups): (save_dir, its weights)."""
    save_dir = tmp_path_factory.mktemp("saved") / "ckpt"
    e = make_engine(CASE)
    train_step(e)
    e.save_checkpoint(save_dir, client_state={"note": "saved"})
    return save_dir, e.full_state_dict()


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    """A copy of the saved checkpoint this test may damage."""
    target = tmp_path / "ckpt"
    shutil.copytree(saved[0], target)
    return target


TAG = "global_step1"
RANK0 = "rank_00000.safetensors"


# -- another model -------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 3])
def test_load_into_a_gpt_of_another_width(saved, stage):
    model = GPT(dataclasses.replace(GPT_CFG, n_embd=48))
    mine = {k: list(v.shape) for k, v in model.state_dict().items()}  # stage 3 leaves the model's own empty
    message = load_fails(make_engine(Case(stage=stage), model=model), saved[0],
                         r"^the checkpoint was written for another model: shape in checkpoint vs model \(\d+\): ")
    listed = re.findall(r"'([\w.]+)' \[([\d, ]+)\] vs \[([\d, ]+)\]", message)
    count = len(list(model.parameters()))  # every parameter differs (the tied head once)
    assert len(listed) == 5 and f"vs model ({count}): " in message and f" and {count - 5} more." in message, message
    theirs = saved[1]
    for name, saved_shape, model_shape in listed:
        assert [int(d) for d in saved_shape.split(", ")] == list(theirs[name].shape), (name, message)
        assert [int(d) for d in model_shape.split(", ")] == mine[name], (name, message)
    assert "missing from the checkpoint" not in message and "not in this model" not in message
    assert message.endswith(". " + WRONG_MODEL_FIX)


def test_load_into_a_model_with_an_extra_parameter(saved):
    torch.manual_seed(0)
    message = load_fails(make_engine(CASE, model=GPTWithExtra(GPT_CFG)), saved[0],
                         r"^the checkpoint was written for another model: missing from the checkpoint \(1\): extra\. ")
    assert message.endswith(WRONG_MODEL_FIX)


def test_load_into_a_model_without_a_saved_parameter(tmp_path):
    torch.manual_seed(0)
    writer = make_engine(CASE, model=GPTWithExtra(GPT_CFG))
    train_step(writer)
    writer.save_checkpoint(tmp_path)
    message = load_fails(make_engine(CASE), tmp_path,
                         r"^the checkpoint was written for another model: not in this model \(1\): extra\. ")
    assert message.endswith(WRONG_MODEL_FIX)


# -- damaged checkpoints --------------------------------------------------------------------


def _truncate(tag_dir: Path) -> str:
    file = tag_dir / RANK0
    size = file.stat().st_size
    os.truncate(file, size // 2)
    return (rf"^checkpoint file {re.escape(str(file))} is {size // 2} bytes but was written as {size}: "
            rf"it is truncated or damaged; {DAMAGED_FIX}$")


def _delete(tag_dir: Path) -> str:
    (tag_dir / RANK0).unlink()
    return (rf"^checkpoint {re.escape(str(tag_dir))} is missing {RANK0}; it was copied or deleted in part: "
            r"restore the file or load an earlier tag$")


def _bad_json(tag_dir: Path) -> str:
    text = (tag_dir / "manifest.json").read_text()
    (tag_dir / "manifest.json").write_text(text[: len(text) // 2])  # cut off mid-write
    return (rf"^{re.escape(str(tag_dir / 'manifest.json'))} is not valid JSON \(.+\); "
            r"the file is damaged, load an earlier tag$")


def _edit_manifest(tag_dir: Path, **changes) -> None:
    manifest = json.loads((tag_dir / "manifest.json").read_text())
    (tag_dir / "manifest.json").write_text(json.dumps(manifest | changes))


def _other_version(tag_dir: Path) -> str:
    _edit_manifest(tag_dir, version=3, zeroshard="9.9.9")
    return (rf"^{re.escape(str(tag_dir))} is checkpoint format version 3; this zeroshard reads versions 1 and 2: "
            r"load it with the zeroshard that wrote it \(9\.9\.9\)$")


def _other_format(tag_dir: Path) -> str:
    _edit_manifest(tag_dir, format="something else")
    return rf"^{re.escape(str(tag_dir / 'manifest.json'))} is not a zeroshard checkpoint manifest"


def _lacking_keys(tag_dir: Path) -> str:
    manifest = json.loads((tag_dir / "manifest.json").read_text())
    del manifest["params"], manifest["files"]
    (tag_dir / "manifest.json").write_text(json.dumps(manifest))
    return rf"^{re.escape(str(tag_dir / 'manifest.json'))} lacks params, files: it is damaged; load an earlier tag$"


def _garbled_header(tag_dir: Path) -> str:
    file = tag_dir / RANK0
    data = bytearray(file.read_bytes())
    length = int.from_bytes(data[:8], "little")
    data[8 : 8 + length] = b"#" * length  # the same size: only reading the header can tell
    file.write_bytes(bytes(data))
    return rf"^checkpoint file {re.escape(str(file))} cannot be read \(.*header.*\); {DAMAGED_FIX}$"


def _garbled_state(tag_dir: Path) -> str:
    file = tag_dir / "state.pt"
    data = bytearray(file.read_bytes())
    data[:64] = b"#" * 64  # the same size: the manifest's size check passes
    file.write_bytes(bytes(data))
    return rf"^checkpoint file {re.escape(str(file))} cannot be read \(.+\); {DAMAGED_FIX}$"


@pytest.mark.parametrize("damage", [_truncate, _delete, _bad_json, _other_version, _other_format, _lacking_keys,
                                    _garbled_header, _garbled_state])
def test_damaged_checkpoint(ckpt, damage):
    match = damage(ckpt / TAG)
    load_fails(make_engine(CASE), ckpt, match)


@pytest.mark.parametrize("damage", [_truncate, _delete, _bad_json, _other_version, _garbled_header])
def test_consolidate_reports_the_same_damage(ckpt, damage):
    match = damage(ckpt / TAG)
    with pytest.raises(CheckpointError, match=match):
        consolidate.consolidate(ckpt)


def _drop_pieces(tag_dir: Path, kind: str, name: str) -> None:
    """Rewrite rank 0's file without the runs of (kind, name), as a rank file that lacks them would be."""
    file = tag_dir / RANK0
    with safe_open(str(file), framework="pt") as f:
        metadata = f.metadata()
    runs = {key: [r for r in entries if not (key.startswith(kind + ":") and r[0] == name)]
            for key, entries in json.loads(metadata["runs"]).items()}
    save_file(load_file(file), str(file), metadata=metadata | {"runs": json.dumps(runs)})
    reseal(tag_dir, RANK0)  # the manifest agrees: the missing runs are what the load must find


def test_missing_weight_pieces(ckpt):
    _drop_pieces(ckpt / TAG, "param", "wte.weight")
    why = "the checkpoint has no param for elements 0..2079 of 'wte.weight'"
    load_fails(make_engine(CASE), ckpt, rf"^{why}: the checkpoint is incomplete or damaged; load an earlier tag$")
    load_fails(make_engine(CASE), ckpt, rf"^{why}:", load_optimizer_states=False)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(ckpt / TAG))}: {why}: the checkpoint is incomplete "
                                              r"or damaged; load an earlier tag$"):
        consolidate.consolidate(ckpt)


def test_missing_frozen_parameter_rank_0_writes_whole(tmp_path):
    writer = make_engine(CASE, model=make_model(freeze=True))
    train_step(writer)
    writer.save_checkpoint(tmp_path)
    _drop_pieces(tmp_path / TAG, "param", "wpe.weight")  # frozen: replicated, written by rank 0 alone
    load_fails(make_engine(CASE, model=make_model(freeze=True)), tmp_path,
               r"^the checkpoint has no param for elements 0\.\.1023 of 'wpe\.weight': the checkpoint is "
               r"incomplete or damaged; load an earlier tag$")


def test_missing_optimizer_pieces_still_load_weights_only(ckpt, saved):
    _drop_pieces(ckpt / TAG, "optim.exp_avg", "wte.weight")
    load_fails(make_engine(CASE), ckpt, r"^the checkpoint has no optim\.exp_avg for elements 0\.\.2079 of 'wte\.weight': "
                               r"the checkpoint is incomplete or damaged; load an earlier tag$")
    e = make_engine(CASE)
    e.load_checkpoint(ckpt, load_optimizer_states=False)
    assert_equal_weights(e.full_state_dict(), saved[1])


# -- not a zeroshard checkpoint --------------------------------------------------------------


def _deepspeed(root: Path) -> tuple[Path, str]:
    (root / "global_step10").mkdir()
    (root / "latest").write_text("global_step10")
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (root / "global_step10" / name).write_bytes(b"\0" * 16)
    return root, (rf"^{re.escape(str(root / 'global_step10'))} is not a zeroshard checkpoint: it holds a DeepSpeed "
                  r"checkpoint \(mp_rank_\*/zero_pp_rank_\* files\)\. Consolidate it with DeepSpeed's "
                  r"zero_to_fp32\.py, load the state dict into the model with model\.load_state_dict\(\) before "
                  r"zeroshard\.initialize, then save with engine\.save_checkpoint$")


def _distcp(root: Path) -> tuple[Path, str]:
    (root / "__0_0.distcp").write_bytes(b"\0" * 16)
    (root / ".metadata").write_bytes(b"\0" * 16)
    return root, (rf"^{re.escape(str(root))} is not a zeroshard checkpoint: it holds a "
                  r"torch\.distributed\.checkpoint \(FSDP\) checkpoint\. Load it into the unwrapped model with "
                  r"torch\.distributed\.checkpoint before zeroshard\.initialize$")


def _state_dict_file(root: Path) -> tuple[Path, str]:
    torch.save(make_model().state_dict(), root / "pytorch_model.bin")
    return root, (rf"^{re.escape(str(root))} is not a zeroshard checkpoint: it has no manifest\.json and no "
                  r"'latest' file\. If it holds a plain state dict, load it with model\.load_state_dict\(\) "
                  r"before zeroshard\.initialize$")


def _empty(root: Path) -> tuple[Path, str]:
    return root, (rf"^{re.escape(str(root))} is not a zeroshard checkpoint: it has no manifest\.json and no "
                  r"'latest' file \(write one with engine\.save_checkpoint\)$")


def _nonexistent(root: Path) -> tuple[Path, str]:
    return root / "nope", rf"^checkpoint directory {re.escape(str(root / 'nope'))} does not exist$"


def _a_file(root: Path) -> tuple[Path, str]:
    """A file given for the directory (the consolidated .safetensors, say): the message must not say 'does not exist'."""
    file = root / "model.safetensors"
    save_file({"w": torch.zeros(2)}, str(file))
    return file, rf"^{re.escape(str(file))} is a file, not a checkpoint directory"


@pytest.mark.parametrize("layout", [_deepspeed, _distcp, _state_dict_file, _empty, _nonexistent, _a_file])
def test_not_a_zeroshard_checkpoint(tmp_path, layout):
    load_dir, match = layout(tmp_path)
    load_fails(make_engine(CASE), load_dir, match, must_exist=True)  # without it, "empty" ones return (None, None)
    with pytest.raises(CheckpointError, match=match):
        consolidate.consolidate(load_dir)


def test_deepspeed_tag_named_explicitly(tmp_path):
    _, match = _deepspeed(tmp_path)
    load_fails(make_engine(CASE), tmp_path, match, tag="global_step10")


# -- tags ------------------------------------------------------------------------------------


def test_unknown_tag_lists_the_tags_present(ckpt):
    e = make_engine(CASE)
    train_step(e)
    e.save_checkpoint(ckpt, tag="best")
    load_fails(make_engine(CASE), ckpt, rf"^{re.escape(str(ckpt))} has no checkpoint 'global_step7'; it has: best, {TAG}$",
               tag="global_step7")


def test_latest_naming_a_missing_tag(ckpt):
    shutil.rmtree(ckpt / TAG)  # `latest` still names it
    load_fails(make_engine(CASE), ckpt, rf"^{re.escape(str(ckpt / 'latest'))} names '{TAG}', which is not in "
                               rf"{re.escape(str(ckpt))}; pass tag= \(or the tag's directory\) to load another one$")


def test_save_dir_without_latest_lists_its_tags(ckpt):
    # A save whose process died between renaming the tag and writing `latest`, or a copy without it:
    # the directory holds zeroshard checkpoints, not "a plain state dict".
    (ckpt / "latest").unlink()
    message = load_fails(make_engine(CASE), ckpt, rf"^{re.escape(str(ckpt))} ")
    assert TAG in message and "tag=" in message, message
    assert "plain state dict" not in message, message


BAD_TAG = "checkpoint tag '{}' must be a plain directory name (no path separators, not starting with '.')"


@pytest.mark.parametrize("tag", ["a/b", "../global_step1", "..", ".hidden"])
def test_tag_that_is_not_a_plain_name(ckpt, tag):
    load_fails(make_engine(CASE), ckpt, f"^{re.escape(BAD_TAG.format(tag))}$", tag=tag)
    e = make_engine(CASE)
    train_step(e)
    before = sorted(p.relative_to(ckpt) for p in ckpt.rglob("*"))
    with pytest.raises(CheckpointError, match=f"^{re.escape(BAD_TAG.format(tag))}$"):
        e.save_checkpoint(ckpt, tag=tag)
    assert sorted(p.relative_to(ckpt) for p in ckpt.rglob("*")) == before
    assert sorted(os.listdir(ckpt.parent)) == ["ckpt"]


# -- saves that cannot be written ---------------------------------------------------------------


class Settings:
    """A user's own class (module level, so it pickles, but not plain data)."""

    lr = 0.1


def _lambda():
    return {"schedule": lambda step: 0.5 ** step}


def _local_class_instance():
    class Local:
        pass

    return {"cfg": Local()}


def _namespace_holding_a_function():
    return {"args": argparse.Namespace(lr=0.1, schedule=print)}  # a Namespace is stored; a function in it is not


def _module_class_instance():
    return {"settings": Settings()}


@pytest.mark.parametrize("client_state, key, names", [
    (_lambda, "schedule", "builtins.function"),
    (_local_class_instance, "cfg", "Local"),
    (_namespace_holding_a_function, "args", "builtin_function_or_method"),
    (_module_class_instance, "settings", "Settings"),
], ids=["lambda", "local_class", "function_in_a_namespace", "module_class"])
def test_client_state_that_is_not_plain_data_writes_nothing(ckpt, client_state, key, names):
    e = make_engine(CASE)
    e.load_checkpoint(ckpt)
    train_step(e, 1)  # global step 2: the save would write a new tag global_step2
    before = {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    fresh = ckpt.parent / "fresh"
    for save_dir in (ckpt, fresh):
        with pytest.raises(CheckpointError) as info:
            e.save_checkpoint(save_dir, client_state=client_state())
        message = str(info.value)
        assert message.startswith(f"client_state[{key!r}]"), message
        assert message.endswith(
            ") cannot be stored as plain data. client_state and the LR scheduler's state may hold only tensors, "
            "numbers, strings, None, and lists, tuples and dicts of them (and, in client_state, pathlib.Path and "
            "argparse.Namespace), so that checkpoints load without running pickled code; nothing was written"), message
        assert names in message, f"the message does not name the offending {names}: {message}"
        assert "\x1b" not in message, f"terminal escape codes in the message: {message!r}"
    # Nothing written: no tag, no `latest` change, no partial directory; the fresh dir was not even created.
    assert {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before
    assert sorted(os.listdir(ckpt)) == [TAG, "latest"]
    assert not fresh.exists()
    assert e.save_checkpoint(ckpt, client_state={"ok": [1, 2.0, "three", None, torch.ones(2)]}) == ckpt / "global_step2"


def test_save_dir_that_is_a_file(tmp_path):
    e = make_engine(CASE)
    train_step(e)
    file = tmp_path / "ckpt"
    file.write_text("not a directory")
    with pytest.raises(CheckpointError, match=(
            rf"^cannot create {re.escape(str(file))}/\.{TAG}\.partial \(\[Errno 17\] File exists: .*\); "
            r"the save was abandoned and earlier checkpoints are intact$")):
        e.save_checkpoint(file)
    assert file.read_text() == "not a directory"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


@pytest.mark.parametrize("target, error, match", [
    ("write_streamed", OSError(28, "No space left on device"),
     r"^cannot write its shard to {partial} \(\[Errno 28\] No space left on device\); "),
    ("write_streamed", SafetensorError("Error while serializing: IoError(No space left on device)"),  # not an OSError
     r"^cannot write its shard to {partial} \(Error while serializing: IoError\(No space left on device\)\); "),
    ("commit", OSError(28, "No space left on device"),
     r"^cannot complete {partial} \(\[Errno 28\] No space left on device\); "),
], ids=["shard", "shard_safetensors_error", "commit"])
def test_failed_write_keeps_the_earlier_checkpoint(ckpt, saved, monkeypatch, target, error, match):
    from zeroshard.checkpoint import saving as checkpoint

    e = make_engine(CASE)
    e.load_checkpoint(ckpt)
    train_step(e, 1)

    def disk_full(*args, **kwargs):
        raise error

    monkeypatch.setattr(checkpoint, target, disk_full)
    partial = re.escape(str(ckpt / ".global_step2.partial"))
    with pytest.raises(CheckpointError, match=match.format(partial=partial) +
                       r"the save was abandoned and earlier checkpoints are intact$"):
        e.save_checkpoint(ckpt)
    assert (ckpt / "latest").read_text() == TAG + "\n"
    assert not (ckpt / "global_step2").exists()
    reader = make_engine(CASE)
    reader.load_checkpoint(ckpt)
    assert_equal_weights(reader.full_state_dict(), saved[1])
    monkeypatch.undo()  # the disk has room again: the next save replaces the leftover partial directory
    assert e.save_checkpoint(ckpt) == ckpt / "global_step2"
    assert sorted(os.listdir(ckpt)) == [TAG, "global_step2", "latest"]


# -- inside an accumulation window ------------------------------------------------------------


def window_error(action: str, micro: int) -> str:
    return (rf"^{action} at micro-step {micro}, inside an accumulation window of 2: the window's partial "
            r"gradients are not part of a checkpoint\. Call it after the engine\.step\(\) that ends the window "
            r"\(engine\.is_gradient_accumulation_boundary\(\) was true before that step\)$")


def test_save_and_load_inside_an_accumulation_window(tmp_path, saved):
    case = Case(stage=2, accumulation=2)
    e, twin = make_engine(case), make_engine(case)
    for each in (e, twin):
        x, y = micro_batch(0, case, 1, 0, 0)
        each.backward(loss_of(each, x, y))
    with pytest.raises(CheckpointError, match=window_error("save_checkpoint", 0)):
        e.save_checkpoint(tmp_path / "pending")  # backward done, step not yet
    for each in (e, twin):
        each.step()
    before = snapshot(e)
    with pytest.raises(CheckpointError, match=window_error("save_checkpoint", 1)):
        e.save_checkpoint(tmp_path / "window")
    with pytest.raises(CheckpointError, match=window_error("load_checkpoint", 1)):
        e.load_checkpoint(saved[0])
    assert_same(before, snapshot(e))
    assert os.listdir(tmp_path) == []
    # The window's accumulated gradients survived: finishing it gives what the twin gets.
    for each in (e, twin):
        x, y = micro_batch(0, case, 1, 0, 1)
        each.backward(loss_of(each, x, y))
        each.step()
    assert_equal_weights(e.full_state_dict(), twin.full_state_dict())
    assert e.save_checkpoint(tmp_path / "boundary") == tmp_path / "boundary" / TAG


# -- another optimizer ------------------------------------------------------------------------


def _swapped_groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": no_decay, "weight_decay": 0.0}, {"params": decay}], lr=1e-2)


@pytest.mark.parametrize("optimizer, match", [
    ("sgd", r"^the checkpoint's optimizer state is AdamW's, this engine's optimizer is SGD"),
    ("adamw1", r"^the checkpoint's optimizer has 2 param groups, this engine's has 1"),
    (_swapped_groups, (r"^parameter '[\w.]+\.weight' is in param group 1 here but was in param group 0 when the "
                       r"checkpoint was saved, so its optimizer state and settings do not carry over")),
], ids=["sgd", "one_group", "swapped_groups"])
def test_another_optimizer_loads_weights_only(saved, optimizer, match):
    e = make_engine(CASE, optimizer=optimizer)
    load_fails(e, saved[0], match + re.escape(OPTIMIZER_FIX) + "$")
    _, state, groups, counters = snapshot(e)
    path, client_state = e.load_checkpoint(saved[0], load_module_only=True)
    assert path == saved[0] / TAG and client_state == {"note": "saved"}
    assert_equal_weights(e.full_state_dict(), saved[1])
    assert_same((e.full_state_dict(), state, groups, counters), snapshot(e))  # all but the weights as they were
    e.load_checkpoint(saved[0], load_optimizer_states=False)  # as DeepSpeed: the counters come back too
    assert_same((e.full_state_dict(), state, groups, (1, 1, 0)), snapshot(e))
    assert_trains(e)


def test_parameter_frozen_when_saved(tmp_path):
    writer = make_engine(CASE, model=make_model(freeze=True))
    train_step(writer)
    writer.save_checkpoint(tmp_path)
    e = make_engine(CASE)
    load_fails(e, tmp_path, r"^parameter 'wpe\.weight' is in param group 0 here but was frozen when the checkpoint "
                            r"was saved, so its optimizer state and settings do not carry over" +
               re.escape(OPTIMIZER_FIX) + "$")
    e.load_checkpoint(tmp_path, load_optimizer_states=False)
    assert_equal_weights(e.full_state_dict(), writer.full_state_dict())


# -- two ranks --------------------------------------------------------------------------------


def _two_ranks(rank, world, device, save_dir, empty_dir):
    """Save at 2 ranks; then two failing loads, each caught: (message, weights unchanged) per load."""
    e = make_engine(CASE, device=device)
    train_step(e, rank=rank, world=world, device=device)
    e.save_checkpoint(save_dir)
    results = {}
    # One rank cannot see the checkpoint (another node, no shared file system): every rank stops.
    before = e.full_state_dict()
    try:
        e.load_checkpoint(save_dir if rank == 0 else empty_dir)
    except CheckpointError as exc:
        results["one_rank"] = str(exc)
    results["one_rank_unchanged"] = all(torch.equal(v, e.full_state_dict()[k]) for k, v in before.items())
    torch.manual_seed(0)
    other = make_engine(CASE, model=GPT(dataclasses.replace(GPT_CFG, n_embd=48)).to(device))
    before = other.full_state_dict()
    try:
        other.load_checkpoint(save_dir)
    except CheckpointError as exc:
        results["other_model"] = str(exc)
    results["other_model_unchanged"] = all(torch.equal(v, other.full_state_dict()[k]) for k, v in before.items())
    train_step(other, rank=rank, world=world, device=device)  # both ranks still step together
    # Past the checks, rank 1 fails part-way through installing (its weights are loaded, its counters not).
    if rank == 1:
        from zeroshard.checkpoint import loading

        def lost(*args):
            raise OSError("the disk went away")
        loading._load_counters = lost
    try:
        e.load_checkpoint(save_dir)
    except CheckpointError as exc:
        results["part_way"] = str(exc)
    try:
        train_step(e, rank=rank, world=world, device=device)
    except EngineStateError as exc:
        results["after_part_way"] = str(exc)
    return results


def test_two_ranks_fail_together_with_the_same_message(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    ranks = run_ranks(_two_ranks, 2, str(tmp_path / "ckpt"), str(empty), timeout_s=120, collective_timeout_s=60)
    for results in ranks:
        assert results.get("other_model", "").startswith(
            "rank 0: the checkpoint was written for another model: shape in checkpoint vs model"), results
        assert results["other_model"].endswith(WRONG_MODEL_FIX)
        assert results.get("one_rank") == (f"rank 1: {empty} is not a zeroshard checkpoint: it has no manifest.json "
                                           "and no 'latest' file (write one with engine.save_checkpoint)"), results
        assert results["one_rank_unchanged"] and results["other_model_unchanged"], results
        assert results.get("part_way", "").startswith("rank 1: reading "), results
        assert "failed part-way (OSError: the disk went away)" in results["part_way"]
        assert "this engine cannot continue: " in results.get("after_part_way", ""), "a rank trains on"
    assert ranks[0] == ranks[1]


# -- the command line -------------------------------------------------------------------------


def _run(*argv: str, cwd: Path) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "COLUMNS": "400"}
    done = subprocess.run([sys.executable, "-m", "zeroshard.app.cli", *argv], capture_output=True, text=True,
                          check=False, timeout=180, cwd=cwd, env=env)
    return done.returncode, done.stdout + done.stderr


def test_cli_consolidate_not_a_directory(tmp_path):
    code, output = _run("consolidate", "NOTADIR", "out.safetensors", cwd=tmp_path)
    assert code == 1, output
    assert "zeroshard consolidate: checkpoint directory NOTADIR does not exist" in output.splitlines(), output
    assert "Traceback" not in output, output
    assert os.listdir(tmp_path) == []


def test_cli_consolidate_to_a_missing_directory(saved, tmp_path, capsys):
    out = tmp_path / "no" / "such" / "model.safetensors"
    assert cli_main(["consolidate", str(saved[0]), str(out)]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.safetensors"]  # created; no config.json


@pytest.mark.parametrize("layout, message", [
    (_empty, "is not a zeroshard checkpoint: it has no manifest.json and no 'latest' file"),
    (_deepspeed, "is not a zeroshard checkpoint: it holds a DeepSpeed checkpoint"),
    (_nonexistent, "does not exist"),
], ids=["empty", "deepspeed", "nonexistent"])
def test_cli_train_resume_checked_before_launching(tmp_path, monkeypatch, capsys, layout, message):
    def launch(args):
        raise AssertionError("the ranks were launched")

    monkeypatch.setattr("zeroshard.app.cli.run_train", launch)
    resume, _ = layout(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["train", "--resume", str(resume)])
    assert exit_info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "zeroshard train: error: argument --resume: " in err, err
    assert message in err, err


def test_resume_of_a_checkpoint_the_demo_did_not_write(saved):
    from zeroshard.app.demo.restart import resume

    e = make_engine(CASE)
    schedule = torch.optim.lr_scheduler.LambdaLR(e.optimizer, lambda step: 1.0)
    with pytest.raises(CheckpointError, match=(
            rf"^{re.escape(str(saved[0] / TAG))} was not written by the demo \(`zeroshard train --save-every`\), "
            r"so it does not say which step it ended; load it with engine\.load_checkpoint in your own script$")):
        resume(e, schedule, str(saved[0]), 5)


def test_cli_resume_with_nothing_left_to_train(tmp_path):
    save_dir = tmp_path / "D"
    code, output = _run("train", "--model", "tiny", "--steps", "2", "--save-every", "2", "--save-dir", str(save_dir),
                        cwd=tmp_path)
    assert code == 0, output
    assert (save_dir / "latest").read_text() == "global_step2\n"
    code, output = _run("train", "--model", "tiny", "--steps", "2", "--resume", str(save_dir), cwd=tmp_path)
    output = " ".join(output.split())  # the console wraps long lines
    assert code == 1, output
    assert (f"{save_dir / 'global_step2'} is at step 2 and --steps is 2: nothing left to train; "
            "give --steps above 2") in output, output
    assert "Traceback" not in output, output


def test_rank_file_that_does_not_say_what_it_holds(ckpt):
    """A safetensors file without zeroshard's runs (a plain state dict in its place, say)."""
    file = ckpt / TAG / RANK0
    save_file(load_file(file), str(file))  # the same tensors, no metadata
    reseal(ckpt / TAG, RANK0)
    load_fails(make_engine(CASE), ckpt, rf"^checkpoint file {re.escape(str(file))} does not say what it holds \(KeyError: "
                               r"'runs'\); it is damaged or not a zeroshard rank file: restore it or load an earlier tag$")
