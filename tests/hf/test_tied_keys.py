"""Tied weights written once (issue 28, acceptance 5): the files of `engine.save_pretrained` and of `zeroshard
consolidate` hold exactly the keys of transformers' own `save_pretrained` in one process, for GPT-2 (its head
tied to the embedding) and Llama with and without tied embeddings, at stage 3 on 2 ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed import run_ranks
from tests.hf.models import STAGE3, config_of, layer_class

MODELS = {"gpt2": {}, "llama tied": {"tie_word_embeddings": True}, "llama untied": {"tie_word_embeddings": False}}


def _model(name: str):
    import transformers as tf

    config = config_of(name.split()[0])
    for key, value in MODELS[name].items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config)


def _save_both_ways(rank, world, device, out: Path) -> None:
    import zeroshard

    for name in MODELS:
        model = _model(name).to(device)
        engine = zeroshard.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), STAGE3,
                                      wrap=[layer_class(model)])
        engine.save_pretrained(out / name / "save_pretrained")
        engine.save_checkpoint(out / name / "checkpoint")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tied")
    run_ranks(_save_both_ways, 2, out)
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_keys_are_transformers_own(saved, name):
    import transformers as tf

    from zeroshard.checkpoint.consolidate import write  # `zeroshard consolidate CHECKPOINT OUT`

    model = _model(name)
    model.save_pretrained(saved / name / "transformers")
    want = load_file(saved / name / "transformers" / "model.safetensors")
    write(saved / name / "checkpoint", saved / name / "consolidated")
    assert ("lm_head.weight" in want) == (name == "llama untied")  # the case is what it says
    for way in ("save_pretrained", "consolidated"):
        got = load_file(saved / name / way / "model.safetensors")
        assert sorted(got) == sorted(want), (way, sorted(set(got) ^ set(want)))
        for key, tensor in want.items():
            torch.testing.assert_close(got[key], tensor, rtol=0, atol=0, msg=f"{way} {key}")
        loaded = tf.AutoModelForCausalLM.from_pretrained(saved / name / way)
        for key, tensor in model.state_dict().items():  # the tied head comes back tied, with its values
            torch.testing.assert_close(loaded.state_dict()[key], tensor, rtol=0, atol=0, msg=f"{way} {key}")
