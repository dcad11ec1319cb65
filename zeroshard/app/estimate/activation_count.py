"""The activations of a named model's training forward, counted on the meta device.

`zeroshard estimate --model NAME --micro-batch B --seq S` builds the model as
`model_count` does (a preset, a transformers model type, a config.json or a
save_pretrained directory), in the training dtype, and runs one training
forward on a batch of B sequences of S tokens, the loss included, under
`zeroshard.estimate.count_saved`. Checkpointing "full" checkpoints every
block as training would: the built-in GPT's `checkpointing="non_reentrant"`,
a transformers model's own `gradient_checkpointing_enable()` (`activation_checkpointing_enable()`
in transformers 5).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace

import torch

from zeroshard.app.estimate.model_count import build_hf_model
from zeroshard.app.models import GPT, PRESETS
from zeroshard.dtypes import DTYPES
from zeroshard.estimate.activations import CHECKPOINTING, ActivationCount, count_saved


def training_forward(name: str, micro_batch: int, seq: int, checkpointing: str = "none", dtype: str = "bf16",
                     device: str = "meta") -> tuple[torch.nn.Module, torch.Tensor, Callable[[], torch.Tensor]]:
    """(model in training mode, the batch of token ids, a call that runs the forward and returns the loss).

    Raises ValueError when `seq` exceeds the model's positions or `checkpointing` is unknown.
    """
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing '{checkpointing}': give one of {', '.join(CHECKPOINTING)}")
    full = checkpointing == "full"
    if name in PRESETS:
        cfg = replace(PRESETS[name], checkpointing="non_reentrant" if full else "")
        _check_positions(name, seq, cfg.block_size)
        with torch.device(device):
            model = GPT(cfg)
    else:
        model = build_hf_model(name, device)
        model.config.use_cache = False  # a training forward keeps no key/value cache
        _check_positions(name, seq, getattr(model.config, "max_position_embeddings", None)
                         or getattr(model.config, "n_positions", None))
        if full:  # transformers 5 renames it; the older name stays for older versions
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.to(DTYPES[dtype]).train()
    batch = torch.zeros(micro_batch, seq, dtype=torch.long, device=device)
    return model, batch, _loss_call(model, batch, name in PRESETS)


def _loss_call(model: torch.nn.Module, batch: torch.Tensor, preset: bool) -> Callable[[], torch.Tensor]:
    """The training forward: the loss on `batch` as its own labels, or the output where the model takes none."""
    if preset:
        return lambda: model(batch, batch)
    if "labels" in inspect.signature(model.forward).parameters:
        return lambda: model(input_ids=batch, labels=batch).loss
    return lambda: model(input_ids=batch)[0]


def _check_positions(name: str, seq: int, positions: int | None) -> None:
    if positions is not None and seq > positions:
        raise ValueError(f"--seq {seq} exceeds the {positions} positions of {name}: give --seq {positions} or less")


def count_activations(name: str, micro_batch: int, seq: int, checkpointing: str = "none",
                      dtype: str = "bf16") -> ActivationCount:
    """What autograd saves in one training forward of `name` (bytes per rank, each storage once)."""
    model, batch, forward = training_forward(name, micro_batch, seq, checkpointing, dtype)
    return count_saved(forward, model, batch)
