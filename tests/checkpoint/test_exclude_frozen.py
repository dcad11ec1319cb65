"""`save_checkpoint(exclude_frozen_parameters=True)`: a PEFT LoRA checkpoint of the trainable state only.

A tiny Llama (tests/hf/models.py) with LoRA adapters on q_proj and v_proj
(peft): 2 x 2 x 128 = 512 trained elements on a frozen base of ~75K. The
reference is the uninterrupted zeroshard run of the same world size and
stage (a resume of the same job continues bit for bit), and for another
world size or stage that run's losses within the resharding tolerance of
test_checkpoint.py. Each resumed engine is built again from the same seed,
as a script does with `from_pretrained`: the checkpoint brings the adapters,
their optimizer state and the counters, the engine its own base.

Acceptance 5: the files of a checkpoint without the frozen base (every rank
file, state.pt, manifest.json) hold at most the trainable state's bytes
(elements x 12: the fp32 master and Adam's two moments) plus a fixed
allowance for what is no tensor (see `_metadata_allowance`), while the
frozen base alone is larger than that bound: a checkpoint holding it fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.hf.models import batch, config_of

STEPS, SAVE_AT = 6, 3
LR = 1e-2
MASTER_AND_ADAM = 4 + 4 + 4  # bytes per trained element: fp32 master, exp_avg, exp_avg_sq


def _lora(seed: int = 0, base_seed: int = 0):
    """The base from `base_seed` (a from_pretrained stand-in), the adapters from `seed`."""
    import peft
    import transformers as tf

    torch.manual_seed(base_seed)
    base = tf.LlamaForCausalLM(config_of("llama"))
    torch.manual_seed(seed)
    return peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                     target_modules=["q_proj", "v_proj"]))


def _engine(stage: int, model=None, dtype: str = "fp32"):
    import zeroshard

    model = _lora() if model is None else model
    zero = {"stage": stage} | ({"stage3_param_persistence_threshold": 0} if stage == 3 else {})
    config = {"train_batch_size": 4, "gradient_accumulation_steps": 2, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": LR}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    wrap = [type(model.base_model.model.model.layers[0])] if stage == 3 else None
    return zeroshard.initialize(model, config=config, wrap=wrap)


def _train(engine, rank: int, world: int, device, steps) -> list[float]:
    """Each step's global batch of 4 rows, split by rank and into the window's micro-batches; its loss over
    the 4 rows (every row has the same number of tokens), the same on every rank."""
    losses = []
    for step in steps:
        ids = batch(100 + step, rows=4)[rank::world].to(device)
        total = torch.zeros((), dtype=torch.float64)
        for micro in ids.split(engine.config.train_micro_batch_size_per_gpu):
            loss = engine(input_ids=micro, labels=micro).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach().cpu().double() * len(micro)
        torch.distributed.all_reduce(total)
        losses.append(total.item() / 4)
    return losses


def _trainable(engine) -> dict[str, torch.Tensor]:
    full = engine.full_state_dict()
    return {n: full[n].cpu() for n, p in engine.module.named_parameters() if p.requires_grad}


def _saving_run(rank, world, device, root: Path, stage: int) -> dict:
    """The uninterrupted run, saving without its frozen base at SAVE_AT (and with it, for the sizes)."""
    engine = _engine(stage)
    losses = _train(engine, rank, world, device, range(SAVE_AT))
    engine.save_checkpoint(root / "lean", exclude_frozen_parameters=True)
    engine.save_checkpoint(root / "full")
    losses += _train(engine, rank, world, device, range(SAVE_AT, STEPS))
    return {"losses": losses, "trainable": _trainable(engine), "steps": engine.global_steps}


def _resumed_run(rank, world, device, root: Path, stage: int) -> dict:
    """A fresh engine over the base built again (new adapters: the load replaces them), resumed at SAVE_AT."""
    engine = _engine(stage, _lora(seed=5))
    engine.load_checkpoint(root / "lean")
    at = engine.global_steps
    losses = _train(engine, rank, world, device, range(SAVE_AT, STEPS))
    return {"at": at, "losses": losses, "trainable": _trainable(engine)}


def _stage_sweep(rank, world, device, root: Path) -> dict:
    """At each stage on this world size: the saving run, then the resumed one."""
    out = {}
    for stage in (0, 1, 2, 3):
        where = root / f"w{world}s{stage}"
        out[stage] = (_saving_run(rank, world, device, where, stage), _resumed_run(rank, world, device, where, stage))
    return out


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    root = tmp_path_factory.mktemp("lean")
    return root, {world: run_ranks(_stage_sweep, world, root)[0] for world in (1, 2)}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_without_the_frozen_base_continues_bit_for_bit(sweeps, world, stage):
    """`engine.save_checkpoint(dir, exclude_frozen_parameters=True)` at step 3, loaded by a fresh engine over the
    base built again: the losses and adapters of steps 4-6 are the uninterrupted run's, bit for bit."""
    _, runs = sweeps
    saved, resumed = runs[world][stage]
    assert resumed["at"] == SAVE_AT and saved["steps"] == STEPS
    assert resumed["losses"] == saved["losses"][SAVE_AT:]
    for name, tensor in saved["trainable"].items():
        assert torch.equal(resumed["trainable"][name], tensor), name


def _metadata_allowance(names: int, world: int) -> int:
    """Bytes of a checkpoint that are no tensor element, bounded by counts, never by the model's size: per file
    (a rank file's safetensors header and format entries; state.pt's pickle frame with the counters, scheduler
    and param-group settings; the manifest's job description, hf_config and file entries: 1-2 KiB each here)
    4 KiB; per parameter of the model 384 bytes (its name, ~70 characters under PEFT, in the manifest's table,
    state-dict keys and, if frozen, fingerprints; if trained, its runs in the rank files' metadata and its
    scalar optimizer state in state.pt). Measured here: ~130 bytes a parameter beyond the per-file part."""
    return 4096 * (world + 2) + 384 * names


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [0, 3])
def test_the_checkpoint_holds_the_trainable_state_and_metadata_only(sweeps, world, stage):
    root, _ = sweeps
    params = list(_lora().named_parameters())  # the model as built, before any engine shards it
    trained = sum(p.numel() for _, p in params if p.requires_grad)
    frozen_numel = sum(p.numel() for _, p in params if not p.requires_grad)
    assert trained == 2 * (2 * 32 * 2 + 2 * (32 + 16))  # 2 layers x (q_proj A, B + v_proj A, B), r = 2
    tag = root / f"w{world}s{stage}" / "lean" / f"global_step{SAVE_AT}"
    size = sum(f.stat().st_size for f in tag.iterdir())
    bound = trained * MASTER_AND_ADAM + _metadata_allowance(len(params), world)
    assert size <= bound, (size, bound)
    assert frozen_numel * 4 > bound  # the frozen base alone would not fit: the test can fail
    full = sum(f.stat().st_size for f in (tag.parent.parent / "full" / tag.name).iterdir())
    assert full - size >= frozen_numel * 4  # the full checkpoint holds the base on top
    manifest = json.loads((tag / "manifest.json").read_text())
    frozen = [n for n, p in manifest["params"].items() if p["group"] is None]
    assert sorted(manifest["frozen_excluded"]) == sorted(frozen) and len(frozen) > 0
    assert all(len(f) == 8 for f in manifest["frozen_excluded"].values())
    files = [f for f in tag.iterdir() if f.suffix == ".safetensors"]
    from safetensors import safe_open
    for file in files:
        with safe_open(str(file), "pt") as handle:
            runs_of = json.loads(handle.metadata()["runs"])
        held = {name for entries in runs_of.values() for name, *_ in entries}
        assert not held & set(frozen), file


def _across(rank, world, device, root: Path, written: str, stage: int, dtype: str = "fp32") -> dict:
    """The 2-rank stage-3 checkpoint (or the 1-rank stage-0 one) resumed on this world size and stage."""
    engine = _engine(stage, _lora(seed=5), dtype)
    engine.load_checkpoint(root / written / "lean")
    return {"losses": _train(engine, rank, world, device, range(SAVE_AT, STEPS))}


@pytest.mark.parametrize("written,world,stage", [("w2s3", 1, 2), ("w1s0", 2, 3), ("w2s3", 2, 1)])
def test_resume_on_another_world_size_and_stage(sweeps, written, world, stage):
    root, runs = sweeps
    want = runs[int(written[1])][int(written[3])][0]["losses"][SAVE_AT:]
    got = run_ranks(_across, world, root, written, stage)[0]["losses"]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)


def _other_base(rank, world, device, root: Path) -> list[str]:
    """Loads refused before anything changes: another base, another dtype, an excluded parameter trained here."""
    import zeroshard

    messages = []
    other = _engine(2, _lora(seed=5, base_seed=1))
    bf16 = _engine(2, _lora(seed=5), dtype="bf16")
    unfrozen = _lora(seed=5)
    unfrozen.base_model.model.lm_head.weight.requires_grad_(True)
    trained_here = _engine(2, unfrozen)
    for engine in (other, bf16, trained_here):
        before = _trainable(engine)
        with pytest.raises(zeroshard.CheckpointError) as caught:
            engine.load_checkpoint(root / "w2s3" / "lean")
        assert all(torch.equal(before[n], t) for n, t in _trainable(engine).items())
        messages.append(str(caught.value))
    return messages


def test_a_load_onto_another_base_is_refused_naming_what_differs(sweeps):
    root, _ = sweeps
    for messages in run_ranks(_other_base, 2, root):
        other, bf16, trained_here = messages
        assert "this engine's frozen parameters are not the ones it was trained on: 16 of 21 differ" in other
        assert "'base_model.model.model.embed_tokens.weight' (" in other and "Load the same base model" in other
        assert "held in bfloat16 here, float32 when saved" in bf16
        assert "parameters frozen then are trained here: base_model.model.lm_head.weight" in trained_here


def test_verify_and_consolidate_say_they_hold_the_trainable_state_only(sweeps, tmp_path):
    import safetensors.torch

    from zeroshard.checkpoint.consolidate import consolidate

    root, runs = sweeps
    lean = root / "w2s3" / "lean"
    verified = subprocess.run([sys.executable, "-m", "zeroshard.app.cli", "checkpoint", "verify", str(lean)],
                              capture_output=True, text=True, check=True)
    assert "every file is whole" in verified.stdout
    assert "it holds the trainable state only (8 trained parameters" in verified.stdout
    assert "frozen parameters (" in verified.stdout and "exclude_frozen_parameters=True" in verified.stdout
    done = subprocess.run([sys.executable, "-m", "zeroshard.app.cli", "consolidate", str(lean), str(tmp_path / "out")],
                          capture_output=True, text=True, check=True)
    assert "model.load_state_dict(state, strict=False); no config.json was written" in done.stdout
    assert not (tmp_path / "out" / "config.json").exists()
    written = safetensors.torch.load_file(tmp_path / "out" / "model.safetensors")
    state = consolidate(lean)
    assert written.keys() == state.keys()
    saved_at = runs[2][3][1]  # the resumed run's adapters at the end are not the saved ones: reload them
    model = _lora(seed=5)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lora_" not in key for key in missing)
    assert sorted(k for k in state if "lora_" in k) == sorted(saved_at["trainable"])
    full = consolidate(root / "w2s3" / "full")
    for key, tensor in state.items():
        assert torch.equal(tensor, full[key]), key


def _asynchronous(rank, world, device, root: Path) -> dict:
    """An asynchronous save without the frozen base, of the same step as the synchronous one."""
    from zeroshard.checkpoint.consolidate import full_tensors

    engine = _engine(3)
    _train(engine, rank, world, device, range(SAVE_AT))
    engine.save_checkpoint(root / "async", exclude_frozen_parameters=True, asynchronous=True)
    engine.wait_for_checkpoint()
    return {kind: full_tensors(root / "async", kind=kind) for kind in ("param", "optim.exp_avg")}


def test_an_asynchronous_save_leaves_the_frozen_base_out_too(sweeps):
    from zeroshard.checkpoint.consolidate import full_tensors

    root, _ = sweeps
    got = run_ranks(_asynchronous, 2, root / "w2s3")[0]
    manifest = json.loads((root / "w2s3" / "async" / f"global_step{SAVE_AT}" / "manifest.json").read_text())
    assert sorted(manifest["frozen_excluded"]) == sorted(n for n, p in manifest["params"].items() if p["group"] is None)
    for kind, tensors in got.items():
        want = full_tensors(root / "w2s3" / "lean", kind=kind)
        assert tensors.keys() == want.keys() and all("lora_" in name for name in tensors)
        assert all(torch.equal(tensors[name], want[name]) for name in want), kind
