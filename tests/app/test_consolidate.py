"""`zeroshard consolidate` of a Hugging Face model: a directory `from_pretrained` loads, created if missing.

The reference is transformers itself: the directory written from a stage-3
checkpoint loads with `GPT2LMHeadModel.from_pretrained`, and the loaded
model's tensors and logits equal the engine's full state dict and a plain
model holding it.
"""

from __future__ import annotations

import json

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import zeroshard
from zeroshard.app.cli import main as cli_main


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def test_consolidate_writes_a_hugging_face_directory(tmp_path, capsys):
    model = tiny_gpt2()
    engine = zeroshard.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    ids = torch.randint(0, 64, (2, 8))
    engine.backward(engine(ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    full = engine.full_state_dict()

    out = tmp_path / "not" / "yet" / "there"
    assert cli_main(["consolidate", str(tmp_path / "ckpt"), str(out)]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert "config.json beside it" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"

    loaded = GPT2LMHeadModel.from_pretrained(out)
    loading_sets = {"_name_or_path": "", "dtype": "float32"}  # what from_pretrained records of the loading
    assert loaded.config.to_dict() | loading_sets == model.config.to_dict() | loading_sets
    state = loaded.state_dict()
    assert state.keys() == full.keys()
    assert all(torch.equal(state[k], full[k]) for k in full)
    plain = tiny_gpt2()
    plain.load_state_dict(full)
    plain.eval()  # as from_pretrained leaves a model: no dropout
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, plain(ids).logits)

    # The same again into the same place is fine; another model's config.json there is refused, unchanged.
    assert cli_main(["consolidate", str(tmp_path / "ckpt"), str(out / "model.safetensors")]) == 0
    (out / "config.json").write_text('{"model_type": "bert"}')
    assert cli_main(["consolidate", str(tmp_path / "ckpt"), str(out)]) == 1
    assert "config.json exists and is not this checkpoint's model config" in capsys.readouterr().err
    assert json.loads((out / "config.json").read_text()) == {"model_type": "bert"}
