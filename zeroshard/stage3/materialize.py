"""Models built on the meta device: initialised unit by unit, each rank keeping only its shard.

`zeroshard.initialize(model_on_meta, optimizer, config, init=fn)` at stage 3:
each unit's parameters get their full buffer on the real device, `fn(module)`
initialises the modules of the unit, rank 0's values are broadcast and the
buffer is sharded before the next unit is made. A model whose full size
exceeds one rank's memory never exists whole on any rank.

Nothing is left silently uninitialised: before `fn` runs, every parameter
that was on the meta device is filled with a sentinel (NaN), and every
buffer still on the meta device is replaced by one; a parameter or buffer
`fn` did not set is a `ModelError` naming it. Without `init=`, a model built
under `zeroshard.meta_init()` uses its own initialisation (`meta.py`).
`init` may also be an object with `for_model(model) -> fn` (such as
`zeroshard.pretrained(path)`), for an initialisation that needs the names.

Edits made before `initialize` (`meta_edits.py`) are kept: a parameter's
pending value is written after `fn`, and a real parameter among meta ones
(assigned after `meta_init`, a resized head) is put on meta with its values
pending first, so it keeps them. An in-place change of a meta parameter
after `meta_init` went nowhere: `check_materializable` names it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from zeroshard.comm.group import this_rank_gpu
from zeroshard.core.flat import give_memory
from zeroshard.errors import ModelError
from zeroshard.stage3.meta import (
    built_by_meta_init,
    changed_on_meta,
    keep_as_pending,
    own_init,
    pending,
    recorded_init,
)


def on_meta(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def default_device() -> torch.device:
    """This rank's GPU (`comm/group.py` this_rank_gpu: asked for before the group is joined) when there is
    one, else the CPU; the CPU too under a gloo world (CPU ranks on a machine with a GPU)."""
    gloo = dist.is_initialized() and dist.get_backend() == "gloo"
    return this_rank_gpu() if torch.cuda.is_available() and not gloo else torch.device("cpu")


OWN_INIT = ("the model's own initialisation (transformers' _init_weights for what a PreTrainedModel holds, else "
            "each module's reset_parameters)")


class Materializer:
    """Initialises a unit's modules once its parameters have real memory, and checks that it did."""

    def __init__(self, model: nn.Module, init: Callable[[nn.Module], None], device: torch.device,
                 own: bool = False):
        self.init, self.device = init, device
        self.own = own  # `init` is the model's own initialisation (no init= given): the error names it
        self._meta_params = {id(p) for p in model.parameters() if p.is_meta}
        self._param_names = {id(p): name for name, p in model.named_parameters()}
        self._module_names = {id(m): name for name, m in model.named_modules()}
        # Read now: giving a parameter memory swaps its attributes out.
        self._pending = {id(p): pending(p) for p in model.parameters() if pending(p) is not None}
        # Children before parents, as nn.Module.apply and transformers' initialisation visit them; with
        # the parameters each holds directly and in its subtree.
        self._modules = [(m, {id(p) for p in m.parameters(recurse=False)}, {id(p) for p in m.parameters()})
                         for m in _post_order(model)]

    @classmethod
    def for_model(cls, model: nn.Module, init, device: torch.device, keep_real: bool = True) -> "Materializer":
        """`init` as given to `initialize`: a function of one module, an object with `for_model`, or None
        for a model built under `meta_init` (its own initialisation).

        The model's real buffers (a model built under `meta_init` keeps them on the CPU) move to `device`
        first, where the model will run: buffers are no unit's, so nothing else moves them. With
        `keep_real`, its real parameters go to meta with their values pending, so that they keep them.
        """
        _buffers_to(model, device)
        for p in model.parameters() if keep_real else []:
            if not p.is_meta:
                keep_as_pending(p, p.detach().cpu())
        own = init is None
        if own:
            init = own_init(model)
        elif hasattr(init, "for_model"):
            init = init.for_model(model)
        return cls(model, init, device, own)

    def __call__(self, owners: list[nn.Module], params: list[nn.Parameter], check: bool = True) -> None:
        """Give `params` still on meta their own memory, then run `init` on the unit's modules.

        The unit's modules: those whose parameters all belong to `params` (a block and its layers,
        for an init that reaches into children, as GPT-2's does), those holding some of `params`,
        and `owners`; children first. `check=False` leaves what init did not set at the sentinel, unnamed
        (a block before initialize, where the user may set it: initialize checks it then).
        """
        ids = {id(p) for p in params}
        chosen = {id(m) for m in owners}
        modules = [m for m, direct, subtree in self._modules
                   if id(m) in chosen or (subtree and (subtree <= ids or direct & ids))]
        with torch.no_grad():
            for p in params:
                if p.device.type == "meta":
                    give_memory(p, torch.empty_like(p, device=self.device))
                if id(p) in self._meta_params:
                    _fill_sentinel(p)
            buffers = [self._sentinel_buffer(m, name) for m in modules
                       for name, b in m.named_buffers(recurse=False) if b.is_meta]
            for module in modules:
                self.init(module)
            for p in params:  # edits made before initialize, after the model's own initialisation
                value = self._pending.pop(id(p), None)
                if value is not None:
                    p.copy_(value)
        if check:
            self._check(params, buffers)

    def _sentinel_buffer(self, module: nn.Module, name: str) -> tuple[nn.Module, str, torch.Tensor, int]:
        buffer = torch.empty_like(module._buffers[name], device=self.device)
        _fill_sentinel(buffer)
        module._buffers[name] = buffer
        return module, name, buffer, buffer._version

    def _check(self, params: list[nn.Parameter], buffers: list) -> None:
        left = [self._param_names[id(p)] for p in params if id(p) in self._meta_params and _holds_sentinel(p)]
        if left:
            fix = ("pass initialize(init=fn), fn(module) setting them (a module with a parameter of its own and no "
                   "reset_parameters)" if self.own else
                   "make it set every parameter (a custom nn.Parameter needs its own line), or build the model "
                   "under zeroshard.meta_init() and drop init= to use the model's own initialisation")
            raise ModelError(
                f"parameter(s) {', '.join(repr(n) for n in left)} of a model built on the meta device were not "
                f"initialised: {OWN_INIT if self.own else 'init='} left the sentinel (NaN) they were filled with. init(module) is "
                f"called on each module of a unit, children first; {fix}")
        unset = [f"{self._module_names[id(m)]}.{name}".lstrip(".") for m, name, buffer, version in buffers
                 if m._buffers.get(name) is buffer and (buffer._version == version or _holds_sentinel(buffer))]
        if unset:
            raise ModelError(
                f"buffer(s) {', '.join(repr(n) for n in unset)} were on the meta device and init= did not set "
                f"them: what a module's __init__ computes (a rotary inv_freq, position ids) is lost on the meta "
                f"device. Build the model under zeroshard.meta_init() instead of torch.device('meta'): "
                f"parameters go to meta, buffers stay real")


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_meta and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def _post_order(module: nn.Module) -> list[nn.Module]:
    seen: set[int] = set()
    order: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            visit(child)
        order.append(m)

    visit(module)
    return order


def _fill_sentinel(tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif tensor.dtype != torch.bool:
        tensor.fill_(torch.iinfo(tensor.dtype).min)


def _holds_sentinel(tensor: torch.Tensor) -> bool:
    """Any NaN left (a float tensor), or every element still the sentinel (an integer one; bool: never)."""
    with torch.no_grad():
        if tensor.is_floating_point() or tensor.is_complex():
            return bool(torch.isnan(tensor).any())
        if tensor.dtype == torch.bool or tensor.numel() == 0:
            return False
        return bool((tensor == torch.iinfo(tensor.dtype).min).all())


def materialize_whole(model: nn.Module, init, device: torch.device) -> None:
    """Below stage 3, where every rank holds the whole model: a model built on the meta device gets all its
    memory at once, initialised as stage 3 would initialise it unit by unit (the same `init`, or its own)."""
    materialize = Materializer.for_model(model, init, device)
    materialize(list(model.modules()), list(model.parameters()))


def check_materializable(model: nn.Module, init) -> None:
    if not on_meta(model):
        if init is not None:
            raise ModelError("init= initialises a model built on the meta device, but this model's "
                             "parameters are real; drop init= or build the model under "
                             "zeroshard.meta_init()")
        return
    changed = changed_on_meta(model)
    if changed:
        raise ModelError(
            f"parameter(s) {', '.join(repr(n) for n in changed)} were changed in place after "
            f"zeroshard.meta_init() (deepspeed.zero.Init) while on the meta device, which holds no values: the "
            f"change is lost. Make the edit inside zeroshard.gathered_parameters(param, modifier_rank=0) "
            f"(deepspeed.zero.GatheredParameters) before initialize, which keeps it, or assign a new "
            f"nn.Parameter after the block")
    if init is None and any(recorded_init(m) is not None for m in model.modules()):
        raise ModelError(
            "the model wraps one that from_pretrained loaded inside deepspeed.zero.Init (a PEFT model, a "
            "wrapper built after the block): the wrapper's own parameters (adapters) went to the meta device "
            "with the base and lost their values, and the files' names no longer fit. Not supported yet: load "
            "the base outside zero.Init (from_pretrained(path, dtype=torch.bfloat16) holds it in bf16) and "
            "wrap it, then initialize at any stage")
    if init is None and not built_by_meta_init(model):
        raise ModelError("the model is on the meta device but was not built under zeroshard.meta_init(), so "
                         "its buffers are lost and zeroshard cannot tell how to initialise it: build it under "
                         "`with zeroshard.meta_init():` (its own initialisation is used), or pass init=fn to "
                         "zeroshard.initialize, where fn(module) initialises the parameters and buffers a "
                         "module holds directly")
