"""`module.state_dict()` and `module.load_state_dict()` of a stage-3 model: full tensors, never empty ones.

Between uses a sharded parameter is a 0-element tensor, so torch's own
`state_dict()` would hand out empty tensors (and `save_pretrained` would
write an empty model). The engine hooks the model's modules instead:

- `state_dict()` (of the model or any submodule) returns full copies of the
  sharded parameters, gathered one unit at a time (`gathered_copies` in
  `gathered.py`, as `engine.full_state_dict`). Every rank must call it,
  in the same order: called on some ranks only it raises `CollectiveError`
  instead of hanging (`comm/watch/entry.py`: at once where the other ranks are
  seen in a collective, else within `rank_check_timeout`). Its error names
  the call made: when a library called `state_dict()` for the user
  (transformers' or PEFT's `save_pretrained`), that library function, found
  on the stack, with its fix (`is_main_process=(rank == 0)` on every rank;
  for PEFT adapters that are all whole, the rank-0 save that gathers
  nothing). Each rank then holds the whole model's values: to save, prefer
  `engine.save_pretrained(dir)` or `engine.full_state_dict(rank0_only=True)`.
- `state_dict(keep_vars=True)` is not hooked: it returns the live
  parameters themselves, sharded, so 0-element tensors between uses (inside
  `zeroshard.gathered_parameters` or a forward, their full values). It is
  how code asks for the tensors themselves rather than their values:
  zeroshard's own checkpoint code (`engine.full_state_dict` included) maps
  keys to parameters with it and gathers unit by unit itself; a hook that
  gathered there would copy the whole model on every rank and hand out
  copies where the live tensors were asked for. For values, call
  `state_dict()` without it.
- `load_state_dict(sd)` of the model loads rank 0's `sd`: each unit is
  gathered, takes the values of rank 0's `sd`, and every rank keeps its
  shard (the fp32 master too; with 16-bit parameters it restarts from
  their rounded values); the other tensors (buffers, parameters in no unit)
  take rank 0's values too. Rank 0's `sd` alone counts: its missing and
  unexpected keys and shape mismatches are every rank's, so every rank
  returns the same result or raises the same error, and the other ranks may
  pass `{}` (`model.load_state_dict(sd if rank == 0 else {})`). Every rank
  must call it. Loading into a submodule that holds sharded parameters is a
  `ModelError`: load the whole model.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from zeroshard.comm import all_gather_object, broadcast
from zeroshard.comm.watch.entry import enter
from zeroshard.errors import ModelError
from zeroshard.stage3.gathered import gathered_copies, whole_unit


# Libraries whose functions call a model's state_dict() for the user (save_pretrained): the error names their call.
_LIBRARIES = ("transformers", "peft", "accelerate", "diffusers", "trl")


def _call_made() -> tuple[str, str, str] | None:
    """(in words, package, qualified name) of the outermost library function on the stack that led to this state_dict()
    (PeftModel.save_pretrained, through get_peft_model_state_dict); None when user code called it directly.
    Read when the state dict gathers: the entry check publishes it for every rank's error."""
    frame, made = sys._getframe(1), None
    while frame is not None:
        package = frame.f_globals.get("__name__", "").partition(".")[0]
        if package in _LIBRARIES:
            made = (package, frame.f_code.co_qualname)
        elif package not in ("torch", "zeroshard") or (made is not None and package == "zeroshard"):
            break  # the caller's own code (or zeroshard's above the library): the call made is below it
        frame = frame.f_back
    if made is None:
        return None
    package, function = made
    return f"{function} ({package}; it calls the model's state_dict(), which gathers at stage 3)", package, function


class ModuleStateHooks:
    """The state-dict hooks of one stage-3 model (`install`)."""

    def __init__(self, model: nn.Module, schedule):
        self.model, self.schedule = model, schedule
        self.unit_of = {id(p): i for i, unit in enumerate(schedule.units) for f in unit.flats for p in f.params}
        self.sharded = {id(p) for unit in schedule.units for f in unit.gathered_flats for p in f.params}
        self.names = {id(m): name for name, m in model.named_modules()}
        self._depth = 0  # nesting of the state_dict() calls under way: the outermost gathers
        self._keep_vars = False
        self._loading = False  # the model's load_state_dict() is under way
        self._loaded: list[str] = []
        self._errors: list[str] = []  # the error messages of the load under way (torch's list)

    def install(self) -> None:
        for module in self.model.modules():
            module.register_state_dict_pre_hook(self._before_state_dict)
            # torch marks a post-hook by setting an attribute on it, which a bound method refuses.
            module.register_state_dict_post_hook(lambda *args: self._after_state_dict(*args))
            if module is not self.model and any(id(p) in self.sharded for p in module.parameters()):
                module.register_load_state_dict_pre_hook(self._refuse_partial_load)
        self.model.register_load_state_dict_pre_hook(self._load)
        self.model.register_load_state_dict_post_hook(self._after_load)

    # -- state_dict ------------------------------------------------------------

    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if prefix == "" or self._depth == 0:  # an outermost call (a failed earlier one may have left depth up)
            self._depth, self._keep_vars = 0, keep_vars
        self._depth += 1

    def _after_state_dict(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
        self._depth -= 1
        if self._depth or self._keep_vars:
            return
        listed: dict[int, list[tuple[str, nn.Parameter]]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            if id(p) in self.sharded and prefix + name in state_dict:
                listed.setdefault(self.unit_of[id(p)], []).append((prefix + name, p))
        if listed:
            made = _call_made()
            enter(self.schedule.comm, "module.state_dict", made=made and made[0], fix=made and self._fix(*made[1:]))
            state_dict.update(gathered_copies(self.schedule, listed))

    def _fix(self, package: str, function: str) -> str:
        """The fix for `package`'s `function` (peft's PeftModel.save_pretrained, ...) called on some ranks only."""
        peft = package == "peft"
        if not function.endswith(".save_pretrained"):
            fix = f"call {function} on every rank"
        elif peft:  # engine.save_pretrained would write the whole model, not PEFT's adapter files
            fix = ("call peft_model.save_pretrained(dir, is_main_process=(rank == 0)) on every rank (every rank "
                   "gathers, rank 0 alone writes)")
        else:
            fix = ("call model.save_pretrained(dir, is_main_process=(rank == 0)) on every rank (every rank gathers, "
                   "rank 0 alone writes), or engine.save_pretrained(dir) on every rank")
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        if peft and trainable and not any(id(p) in self.sharded for p in trainable):
            fix += (f"; the trainable parameters (the adapters, {sum(p.numel() for p in trainable)} elements) are "
                    "whole on every rank (under stage3_param_persistence_threshold), so rank 0 alone can save them "
                    "with no gather: peft_model.save_pretrained(dir, state_dict={name: p.detach() for name, p in "
                    "peft_model.named_parameters() if p.requires_grad})")
        return fix

    # -- load_state_dict -------------------------------------------------------

    def _refuse_partial_load(self, module, state_dict, prefix, *args) -> None:
        if not self._loading:
            raise ModelError(f"load_state_dict() on the submodule '{self.names[id(module)]}' of a stage-3 model: its "
                             "parameters are sharded and only the whole model's load_state_dict() loads into "
                             "the shards; load the whole model's state dict (or use engine.load_checkpoint)")

    def _load(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs) -> None:
        """Load every unit's parameters from `state_dict` (rank 0's values) and drop their keys from it."""
        self._loading, self._loaded, self._errors = True, [], error_msgs
        enter(self.schedule.comm, "module.load_state_dict")
        names: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(prefix + name)
        for i in range(len(self.schedule.units)):
            with whole_unit(self.schedule, i) as unit, torch.no_grad():
                self._load_unit(unit, names, state_dict, error_msgs)
        for key in self._loaded:
            state_dict.pop(key, None)

    def _load_unit(self, unit, names: dict[int, list[str]], state_dict, error_msgs: list[str]) -> None:
        """One whole unit: this rank's values where `state_dict` has them, then rank 0's everywhere."""
        for p in (p for f in unit.flats for p in f.params):
            key = next((k for k in names[id(p)] if k in state_dict), None)
            if key is None:
                continue
            value = state_dict[key]
            if tuple(value.shape) != tuple(p.shape):
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}"
                                  f", the shape in the model is {tuple(p.shape)}")
                continue
            p.copy_(value)
            self._loaded.extend(k for k in names[id(p)] if k in state_dict)
        for flat in unit.flats:  # rank 0's values everywhere, then each rank keeps its shard
            broadcast(self.schedule.comm, flat.data, src=0)
        unit.scatter_edits()

    def _after_load(self, module, incompatible_keys) -> None:
        """Every rank ends as rank 0 did: its values (the rest of the model's tensors too), and its missing
        keys, unexpected keys and errors, so every rank returns the same result or raises the same error."""
        loaded = set(self._loaded)
        missing = [k for k in incompatible_keys.missing_keys if k not in loaded]
        outcome = (missing, list(incompatible_keys.unexpected_keys), list(self._errors))
        missing, unexpected, errors = all_gather_object(self.schedule.comm, outcome)[0]
        incompatible_keys.missing_keys[:], incompatible_keys.unexpected_keys[:] = missing, unexpected
        self._errors[:] = errors
        with torch.no_grad():
            for tensor in [*(p for p in module.parameters() if id(p) not in self.unit_of), *module.buffers()]:
                broadcast(self.schedule.comm, tensor.data, src=0)
        self._loading, self._loaded, self._errors = False, [], []
