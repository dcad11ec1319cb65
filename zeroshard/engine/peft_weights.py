"""A PEFT model's weights as a generator loads them: LoRA merged into the base, or the adapters alone.

`merged_pieces`: the base model's names and tensors as `merge_and_unload().
state_dict()` has them, without changing the model: a LoRA layer's base
weight is W + the delta of each active adapter not merged yet (peft's own
`get_delta_weight`: B @ A times the scaling, transposed for fan_in_fan_out,
added in place as peft's merge adds it), its bias + B's bias times the
scaling under `lora_bias`; a `modules_to_save` module is its active
adapter's copy (the original when no adapter of it is active); the adapter
tensors are left out. LoRA variants (DoRA and the others peft keeps in
`lora_variant`) and tuners other than LoRA merge otherwise: `ModelError`,
naming the module, with the other modes as the fix.

`adapter_pieces`: the active adapter's tensors under the names PEFT saves
them (`get_peft_model_state_dict`, what `save_pretrained` writes to
`adapter_model.safetensors` and what a generator loads as a LoRA adapter).
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from zeroshard.errors import ModelError
from zeroshard.stage3.weight_stream import Piece, copy_piece

_UNSUPPORTED = "stream it with peft='adapter' (the adapters alone) or peft='unmerged' (the PEFT model's own tensors)"


def is_peft_model(module: nn.Module) -> bool:
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def adapter_pieces(model: nn.Module, shapes: dict) -> list[Piece]:
    """The active adapter's tensors under PEFT's saved names."""
    from peft.utils import get_peft_model_state_dict

    live = model.state_dict(keep_vars=True)
    ids = {id(t) for t in live.values()}
    saved = get_peft_model_state_dict(model, state_dict=live, adapter_name=model.active_adapter)
    made = [name for name, t in saved.items() if id(t) not in ids]
    if made:  # a tensor peft made itself: its values are not the model's to gather
        raise ModelError(f"peft's adapter state dict holds {made[0]!r}, which is no tensor of the model, so it "
                         "cannot be gathered: stream the PEFT model's own tensors with peft='unmerged'")
    return [copy_piece(name, t, shapes) for name, t in saved.items()]


def merged_pieces(model: nn.Module, shapes: dict) -> list[Piece]:
    """The base model's tensors with every LoRA layer merged, under the base model's names."""
    base = model.get_base_model()
    prefix = next(name for name, m in model.named_modules() if m is base)
    pieces = []
    for key, tensor in model.state_dict(keep_vars=True).items():
        if not key.startswith(f"{prefix}."):
            raise ModelError(f"{key!r} of the PEFT model lies outside its base model (a prompt-learning method?): "
                             f"it has no merged form; {_UNSUPPORTED}")
        name, layer = _merged_name(base, key[len(prefix) + 1:])
        if name is None:
            continue
        leaf = name.rsplit(".", 1)[-1]
        adapters = _unmerged_adapters(layer, name) if layer is not None and leaf in ("weight", "bias") else []
        if leaf == "bias":
            adapters = [a for a in adapters if layer.lora_bias[a]]
        piece = copy_piece(name, tensor, shapes)
        if adapters:
            piece = _merged_piece(piece, layer, adapters, leaf, shapes)
        pieces.append(piece)
    return pieces


def _merged_name(base: nn.Module, rel: str) -> tuple[str | None, nn.Module | None]:
    """`rel` (a key under the base model) as `merge_and_unload` names it, and the LoRA layer whose base layer
    holds it (None: none); (None, None) for an adapter's own tensor, which the merged model has not."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

    *path, leaf = rel.split(".")
    module, kept, layer = base, [], None
    parts = iter(path)
    for part in parts:
        if isinstance(module, BaseTunerLayer):
            if not isinstance(module, LoraLayer):
                raise ModelError(f"{'.'.join(kept)} is a {type(module).__name__} tuner layer, which merges otherwise "
                                 f"than LoRA; {_UNSUPPORTED}")
            if part in module.adapter_layer_names:
                return None, None
            if part == "base_layer":
                module, layer = module.base_layer, module
                continue
        elif isinstance(module, ModulesToSaveWrapper):
            active = module.active_adapter if module.active_adapters else None
            if part == "original_module" and active is not None:
                return None, None
            if part == "modules_to_save":
                if next(parts) != active:
                    return None, None
                module = module.modules_to_save[active]
                continue
        elif isinstance(module, AuxiliaryTrainingWrapper):
            raise ModelError(f"{'.'.join(kept)} is a {type(module).__name__}, which merge_and_unload merges "
                             f"otherwise; {_UNSUPPORTED}")
        kept.append(part)
        module = getattr(module, part)
    return ".".join([*kept, leaf]), layer


def _unmerged_adapters(layer: nn.Module, name: str) -> list[str]:
    """The active adapters of LoRA layer `layer` that merging adds (peft's `check_adapters_to_merge`)."""
    adapters = [a for a in layer.active_adapters if a not in layer.merged_adapters
                and (a in layer.lora_A or a in layer.lora_embedding_A)]
    variants = [a for a in adapters if a in layer.lora_variant]
    if variants:
        raise ModelError(f"{name}: adapter {variants[0]!r} is a LoRA variant "
                         f"({type(layer.lora_variant[variants[0]]).__name__}), whose merge is not W + B @ A; "
                         f"{_UNSUPPORTED}")
    return adapters


def _merged_piece(piece: Piece, layer: nn.Module, adapters: list[str], leaf: str, shapes: dict) -> Piece:
    """`piece` (the base layer's weight or bias) with `adapters` merged, reading the adapters' units too."""
    sources = [p for a in adapters for d in (layer.lora_A, layer.lora_B, layer.lora_embedding_A,
                                             layer.lora_embedding_B) if a in d
               for p in (d[a].parameters() if isinstance(d[a], nn.Module) else [d[a]])]
    units = piece.units | {shapes[id(p)][0] for p in sources if id(p) in shapes}

    def make() -> torch.Tensor:
        merged = piece.make()
        for a in adapters:  # in place, in the base's dtype, as peft's merge(safe_merge=False) adds
            merged += layer.get_delta_weight(a) if leaf == "weight" else layer.lora_B[a].bias * layer.scaling[a]
        return merged

    return Piece(piece.name, piece.shape, piece.dtype, make, frozenset(units))
