"""Activation memory: what autograd saves for backward in a training forward, counted, and the transformer formula.

`count_saved` runs a forward (any callable; on meta tensors it allocates
nothing) under `torch.autograd.graph.saved_tensors_hooks` and sums the bytes
of every storage autograd saves, each storage once (a saved view holds its
whole storage, so the storage is what costs memory), leaving out the storages
that existed before the forward: the model's parameters and buffers and the
batch the caller holds. Dropout masks, softmax outputs, normalization
statistics, the inputs a checkpointed region keeps for its recompute: whatever
the model's code saves is counted, so there is no formula to keep in step with
the model. With activation checkpointing the count is what the forward keeps
(the checkpointed regions' inputs); the recompute of one region during
backward adds that region's own activations for a moment (see `peak`).

Which kernel runs decides what is saved. On meta tensors the forward takes
the CPU kernels' paths: dropout keeps a mask in the input's dtype (CUDA's
fused dropout keeps one byte per element) and scaled_dot_product_attention
takes the backend the meta device reports; a count for a GPU may differ by
those terms.

`korthikanti_layer_bytes` is the per-layer formula of Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models", section 4.1):
s·b·h·(34 + 5·a·s/h) bytes per transformer layer with 16-bit activations and
one-byte dropout masks, 2·s·b·h with full recomputation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

CHECKPOINTING = ("none", "full")


@dataclass(frozen=True)
class ActivationCount:
    """Bytes autograd saved in one forward (each storage once), by where they were first saved."""

    per_layer: tuple[int, ...]  # bytes first saved inside each layer (or as its checkpointed input)
    outside: int  # bytes saved outside the layers: embeddings, final norm, head, loss
    storages: int  # distinct storages saved
    largest: int = 0  # bytes of the largest storage saved: backward makes a gradient of its size while it is held

    @property
    def total(self) -> int:
        """Every saved storage once, in bytes."""
        return sum(self.per_layer) + self.outside

    def as_dict(self) -> dict:
        return {"total": self.total, "per_layer": list(self.per_layer), "outside_layers": self.outside,
                "storages": self.storages, "largest": self.largest}


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of a tensor's storage (views of one storage share it; meta tensors have distinct ones)."""
    return tensor.untyped_storage()._cdata


def tensors_in(values: Any) -> Iterable[torch.Tensor]:
    """The tensors in a nest of tuples, lists and dicts (a forward's arguments or a batch)."""
    if isinstance(values, torch.Tensor):
        yield values
    elif isinstance(values, dict):
        for value in values.values():
            yield from tensors_in(value)
    elif isinstance(values, (tuple, list)):
        for value in values:
            yield from tensors_in(value)


def find_layers(model: nn.Module) -> tuple[nn.Module, ...]:
    """The model's list of blocks: the `nn.ModuleList` of same-class modules holding the most parameters
    (GPT's `blocks`, GPT-2's `transformer.h`, Llama's `model.layers`, BERT's `encoder.layer`); empty if none."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0
             and len({type(child) for child in m}) == 1]
    if not lists:
        return ()
    return tuple(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


class _Frame:
    """One layer's forward while it runs: its inputs' storages, and whether it saved anything else."""

    def __init__(self, index: int, inputs: dict[int, torch.UntypedStorage]):
        self.index = index
        self.inputs = inputs  # storage key -> storage, of the tensors among its args and kwargs
        self.computed = False  # it saved a storage other than its inputs: it was not checkpointed


class _Saved:
    """The pack hook's bookkeeping: each saved storage's bytes and the layer running when it was first saved.

    A checkpointed layer (torch.utils.checkpoint, reentrant or not, around the layer or inside its forward)
    saves nothing of its own in the forward, at most its inputs; the checkpoint keeps all its tensor inputs
    (positional ones as saved tensors, keyword ones in the recompute's closure, as transformers passes its
    position embeddings) until the recompute. Those inputs are counted as the layer's.
    """

    def __init__(self, excluded: set[int], layers: Sequence[nn.Module]):
        self.excluded = excluded
        self.first = {}  # storage key -> (bytes, layer index or None)
        self.held = []  # the storages counted or entering a layer: their keys stay unique while counted
        self.inputs = {}  # storage key -> the first layer it was an input of
        self.running = []  # _Frame of each running layer, innermost last
        self.layers = layers

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._keep(tensor.untyped_storage(), self.running[-1].index if self.running else None)
        return tensor

    def _keep(self, storage: torch.UntypedStorage, layer: int | None) -> None:
        key = storage._cdata
        if self.running and key not in self.running[-1].inputs:
            self.running[-1].computed = True
        if key not in self.excluded and key not in self.first:
            self.first[key] = (storage.nbytes(), layer)
            self.held.append(storage)

    def hooks(self) -> list:
        handles = []
        for index, layer in enumerate(self.layers):
            handles.append(layer.register_forward_pre_hook(self._enter(index), with_kwargs=True))
            handles.append(layer.register_forward_hook(self._leave, always_call=True))
        return handles

    def _enter(self, index: int) -> Callable:
        def enter(module, args, kwargs):
            inputs = {}
            for tensor in tensors_in((args, kwargs)):
                storage = tensor.untyped_storage()
                inputs[storage._cdata] = storage
                self.inputs.setdefault(storage._cdata, index)
            self.held.extend(inputs.values())
            self.running.append(_Frame(index, inputs))
        return enter

    def _leave(self, module, args, output) -> None:
        frame = self.running.pop()
        if not frame.computed and torch.is_grad_enabled():
            for storage in frame.inputs.values():
                self._keep(storage, frame.index)

    def count(self) -> ActivationCount:
        per_layer, outside = [0] * len(self.layers), 0
        for key, (nbytes, layer) in self.first.items():
            # a checkpoint around a layer saves its inputs before the layer's own hooks run: they are that layer's
            layer = self.inputs.get(key) if layer is None else layer
            if layer is None:
                outside += nbytes
            else:
                per_layer[layer] += nbytes
        return ActivationCount(tuple(per_layer), outside, len(self.first),
                               max((nbytes for nbytes, _ in self.first.values()), default=0))


class MetaAsCpu(TorchFunctionMode):
    """On meta tensors, run scaled_dot_product_attention with the kernel the CPU would choose.

    The meta device always takes the math path (it saves the a·s² softmax
    matrix), where the CPU takes its flash kernel (it saves the output and
    a·s fp32 log-sum-exp) whenever that kernel applies. The choice reads only
    shapes, dtypes and flags, so it is made on CPU fake tensors (no memory) and
    the chosen kernel then runs on the meta tensors. Any other call runs as is.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args[0].is_meta:
            return _attention_as_on_cpu(*args, **kwargs)
        if func is torch.Tensor.__bool__ and args[0].is_meta:
            return True
        return func(*args, **kwargs)


def _attention_as_on_cpu(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False):
    # the probe's own saves are no activations: a no-op pack hook, innermost, takes them
    with FakeTensorMode(), torch.autograd.graph.saved_tensors_hooks(lambda tensor: tensor, lambda tensor: tensor):
        fake = [None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu",
                                                           requires_grad=t.requires_grad)
                for t in (query, key, value, attn_mask)]
        probe = F.scaled_dot_product_attention(*fake[:3], attn_mask=fake[3], dropout_p=dropout_p, is_causal=is_causal,
                                               scale=scale, enable_gqa=enable_gqa)
    if type(probe.grad_fn).__name__.startswith("ScaledDotProductFlashAttentionForCpu"):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


def count_saved(forward: Callable[[], Any], model: nn.Module, batch: Any = (),
                layers: Sequence[nn.Module] | None = None) -> ActivationCount:
    """Run `forward()` (the model in training mode, gradients on) and count the bytes autograd saves for
    backward: each storage once, without the model's parameters and buffers or the tensors in `batch`.

    `layers`: the blocks to count one by one (None: `find_layers(model)`). A storage belongs to the layer
    running when it is first saved, or to the first layer it is an input of when saved outside every
    layer (a checkpointed layer's input); else to `outside`. The forward's result is dropped.
    """
    layers = find_layers(model) if layers is None else tuple(layers)
    excluded = {storage_key(t) for t in (*model.parameters(), *model.buffers(), *tensors_in(batch))}
    saved = _Saved(excluded, layers)
    handles = saved.hooks()
    try:
        with torch.enable_grad(), MetaAsCpu(), \
                torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return saved.count()


def korthikanti_layer_bytes(seq: int, micro_batch: int, hidden: int, heads: int, checkpointing: str = "none") -> int:
    """Activation bytes of one transformer layer by Korthikanti et al. 2022, with 16-bit activations:
    s·b·h·(34 + 5·a·s/h) without recomputation (section 4.1, equation 1), 2·s·b·h (the layer's input)
    with full recomputation ("full").

    The 34·s·b·h: attention 11 (the QKV input 2, Q and K 4, V 2, the output projection's input 2, its
    dropout mask 1), MLP 19 (input 2, the GeLU's input 8 and output 8, dropout mask 1), two LayerNorms'
    inputs 4. The 5·a·s²·b: the softmax output 2, its dropout mask 1, the dropout's output 2.

    The built-in GPT (zeroshard.app.models.GPT) keeps 32·s·b·h + 4·a·s·b + 16·s·b per layer, as
    `count_saved` finds: no dropout (the two s·b·h masks and the a·s²·b one absent); the flash attention
    kernel, which keeps no softmax or dropout output (4·a·s²·b) but an fp32 log-sum-exp (4·a·s·b), and
    whose output is the projection's input (one storage); two LayerNorms' fp32 mean and reciprocal
    standard deviation (16·s·b), which the formula leaves out. With full recomputation: 2·s·b·h exactly.
    """
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing '{checkpointing}': give one of {', '.join(CHECKPOINTING)}")
    sbh = seq * micro_batch * hidden
    return 2 * sbh if checkpointing == "full" else 34 * sbh + 5 * heads * seq * seq * micro_batch
