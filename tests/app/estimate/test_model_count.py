"""`zeroshard estimate --model` on transformers models: counted on the meta device, equal to the eager model.

The reference is the model transformers builds eagerly from the same config:
Ψ = sum(p.numel()) over its parameters, and the largest unit is the largest
that stage 3's wrapping rule (`unit_modules` + `plan_units`, as the engine
calls them) produces on that real model.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from zeroshard.app.cli import main
from zeroshard.app.estimate.model_count import count_model, model_class
from zeroshard.stage3.wrapping import plan_units, unit_modules

TINY = {  # model_type -> sizes small enough to build eagerly in milliseconds
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 96, "n_positions": 16},
    "bert": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
             "vocab_size": 96, "max_position_embeddings": 16},
    "llama": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 64, "vocab_size": 96},
    "qwen2": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 64, "vocab_size": 96, "tie_word_embeddings": True},
    "mistral": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "intermediate_size": 64, "vocab_size": 96},
    "t5": {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4, "vocab_size": 96},
}


def eager_largest_unit(model: torch.nn.Module, wrap: tuple[str, ...], min_numel: int) -> int:
    return max(sum(p.numel() for p in plan.params) for plan in plan_units(model, unit_modules(model, wrap, min_numel)))


def layer_class(model: torch.nn.Module) -> str:
    """The model's repeated block class (GPT2Block, BertLayer, LlamaDecoderLayer, T5Block, ...)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    return type(lists[0][0]).__name__


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_counts_equal_the_eager_model(model_type, tmp_path):
    config = transformers.AutoConfig.for_model(model_type, **TINY[model_type])
    torch.manual_seed(0)
    eager = model_class(config).from_config(config)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": model_type, **TINY[model_type]}))
    assert count_model(str(path)).numel == sum(p.numel() for p in eager.parameters())
    for wrap, min_numel in ((), 2_000), ((layer_class(eager),), 1):
        counted = count_model(str(path), wrap, min_numel)
        assert counted.largest_unit == eager_largest_unit(eager, wrap, min_numel), (wrap, counted)


def test_every_way_to_name_a_model(tmp_path, capsys):
    """A save_pretrained directory, a model type's default config (gpt2: 124M), and the CLI's --wrap."""
    config = transformers.LlamaConfig(**TINY["llama"], architectures=["LlamaForSequenceClassification"],
                                      num_labels=3, pad_token_id=0)
    torch.manual_seed(0)
    eager = transformers.LlamaForSequenceClassification(config)
    eager.save_pretrained(tmp_path / "saved")
    counted = count_model(str(tmp_path / "saved"))
    assert counted.name == f"LlamaForSequenceClassification ({tmp_path / 'saved'})"  # `architectures` chosen
    assert counted.numel == sum(p.numel() for p in eager.parameters())

    assert count_model("gpt2").numel == 124_439_808  # GPT-2 small as published: transformers' default config
    assert main(["estimate", "--model", str(tmp_path / "saved"), "--gpus", "2", "--json",
                 "--wrap", "LlamaDecoderLayer"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == counted.numel
    assert out["largest_unit"] == eager_largest_unit(eager, ("LlamaDecoderLayer",), 1)
