"""Activation bytes counted on the meta device against what a real CPU forward keeps alive for backward,
and the built-in GPT against Korthikanti et al. 2022.

The reference is independent of the saved-tensor hooks the count uses: a
dispatch mode holds a weak reference to every storage the real forward
creates, and after the forward the storages still alive, other than the
loss the test holds, are exactly what autograd keeps for backward.
"""

from __future__ import annotations

import gc
import json
from dataclasses import replace

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.hf.models import config_of
from zeroshard.app.estimate.activation_count import count_activations, training_forward
from zeroshard.app.cli import main
from zeroshard.app.estimate.model_count import count_model
from zeroshard.app.estimate.step_peak import peak_of
from zeroshard.app.models import PRESETS, GPTConfig
from zeroshard.estimate.activations import count_saved, korthikanti_layer_bytes

SHAPES = ((1, 8), (3, 16))  # (micro-batch, sequence length)
TINY = replace(PRESETS["tiny"], n_layer=3)


class _Created(TorchDispatchMode):
    """Every storage an op returns during the forward: a weak reference and its bytes."""

    def __init__(self):
        super().__init__()
        self.storages = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                self.storages.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        return out


def kept_for_backward(forward, model: torch.nn.Module, batch: torch.Tensor) -> list[int]:
    """Bytes of each storage a real forward creates that is still alive once only its loss is held (an
    op's output may be a view of a parameter, a buffer or the batch: those storages are not the forward's)."""
    before = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers(), batch)}
    with _Created() as created:
        loss = forward()
    gc.collect()
    before.add(loss.untyped_storage()._cdata)
    return [nbytes for key, (ref, nbytes) in created.storages.items() if key not in before and not ref.expired()]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """Model names `training_forward` takes: the built-in GPT, and tiny transformers configs as config.json."""
    folder = tmp_path_factory.mktemp("configs")
    names = {}
    for kind in ("gpt2", "llama", "bert"):
        path = folder / f"{kind}.json"
        path.write_text(json.dumps(config_of(kind).to_dict()))
        names[kind] = str(path)
    return names


@pytest.mark.parametrize("checkpointing", ["none", "full"])
@pytest.mark.parametrize("kind", ["gpt", "gpt2", "llama", "bert"])
def test_meta_count_equals_what_a_cpu_forward_keeps(kind, checkpointing, models, monkeypatch):
    monkeypatch.setitem(PRESETS, "test-tiny", TINY)  # three blocks: a middle one between two others
    name = "test-tiny" if kind == "gpt" else models[kind]
    for micro_batch, seq in SHAPES:
        meta = count_activations(name, micro_batch, seq, checkpointing, "fp32")
        torch.manual_seed(0)
        model, batch, forward = training_forward(name, micro_batch, seq, checkpointing, "fp32", "cpu")
        kept = kept_for_backward(forward, model, batch)
        assert (meta.total, meta.largest) == (sum(kept), max(kept)), (micro_batch, seq)
        assert meta == count_saved(forward, model, batch), (micro_batch, seq)  # per layer too
        assert len(meta.per_layer) == (3 if kind == "gpt" else 2)
        if checkpointing == "full":  # each block keeps its input only: the hidden states, b·s·h fp32
            hidden = TINY.n_embd if kind == "gpt" else 32
            assert meta.per_layer[-1] == 4 * micro_batch * seq * hidden


def test_dropout_masks_are_counted(tmp_path):
    # GPT-2's residual and embedding dropouts (p = 0.1) keep a mask each in training mode, in the input's dtype
    # on the CPU's path; the attention dropout stays off both ways (it would change the attention kernel)
    def count(p: float):
        config = {**config_of("gpt2").to_dict(), "resid_pdrop": p, "embd_pdrop": p, "attn_pdrop": 0.0}
        (tmp_path / f"{p}.json").write_text(json.dumps(config))
        return count_activations(str(tmp_path / f"{p}.json"), 2, 8, "none", "fp32")
    with_dropout, without = count(0.1), count(0.0)
    bsh = 2 * 8 * 32
    assert [w - o for w, o in zip(with_dropout.per_layer, without.per_layer)] == [2 * 4 * bsh] * 2
    assert with_dropout.outside - without.outside == 4 * bsh


@pytest.mark.parametrize("micro_batch, seq", [(1, 32), (4, 128)])
def test_builtin_gpt_against_korthikanti(micro_batch, seq, monkeypatch):
    cfg = GPTConfig(block_size=128, n_layer=2, n_head=4, n_embd=64)
    monkeypatch.setitem(PRESETS, "test-gpt", cfg)
    s, b, h, a = seq, micro_batch, cfg.n_embd, cfg.n_head
    counted = count_activations("test-gpt", b, s, "none", "bf16")
    # The formula's 34·s·b·h + 5·a·s²·b, less what the built-in GPT does not keep: no dropout (two b·s·h
    # one-byte masks, and the a·s²·b attention-dropout mask), flash attention (no softmax output or dropout
    # output, 4·a·s²·b; instead an fp32 log-sum-exp, 4·a·s·b bytes); its output is the projection's input
    # (one storage, counted once, as in the formula). Beyond the formula: two LayerNorms' fp32 mean and
    # reciprocal standard deviation, 16·s·b bytes.
    expected = korthikanti_layer_bytes(s, b, h, a) - 2 * s * b * h - 5 * a * s * s * b + 4 * a * s * b + 16 * s * b
    assert counted.per_layer == (expected, expected)
    full = count_activations("test-gpt", b, s, "full", "bf16")
    assert full.per_layer == (korthikanti_layer_bytes(s, b, h, a, "full"),) * 2
    assert full.outside == counted.outside  # the embeddings, head and loss are not checkpointed


def test_cli_prints_activations_and_the_peak(capsys, monkeypatch):
    monkeypatch.setitem(PRESETS, "test-tiny", TINY)
    flags = ["estimate", "--model", "test-tiny", "--micro-batch", "2", "--seq", "16", "--json"]
    assert main([*flags, "--checkpoint-activations", "full"]) == 0  # no --gpus: activations only
    alone = json.loads(capsys.readouterr().out)["activations"]
    full = count_activations("test-tiny", 2, 16, "full", "bf16")
    assert (alone["total"], alone["per_layer"]) == (full.total, list(full.per_layer))
    assert alone["recompute"] == max(count_activations("test-tiny", 2, 16, "none", "bf16").per_layer)
    assert alone["korthikanti_per_layer"] == 2 * 2 * 16 * TINY.n_embd
    assert main([*flags, "--gpus", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    saved = out["activations"]
    assert saved["total"] == count_activations("test-tiny", 2, 16, "none", "bf16").total and saved["recompute"] == 0
    counted = count_model("test-tiny")
    for stage, peak in out["peak_by_part"].items():  # the step's peak: estimate.step_peak on the model's counts
        assert peak == peak_of(counted, saved["total"], 0, saved["largest_gradient"], int(stage), 2, "bf16",
                               scratch=False).as_dict()
        assert out["peak_bytes"][stage] == peak["total"] >= peak["model_states"] + saved["total"]
    assert main([*flags, "--gpus", "2", "--backend", "gloo"]) == 0  # its reduce-scatter takes a scratch block
    gloo = json.loads(capsys.readouterr().out)["peak_by_part"]
    assert [gloo[s]["staging"] > out["peak_by_part"][s]["staging"] for s in "0123"] == [False, True, True, True]
