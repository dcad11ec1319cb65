"""Exports: the engine's whole weights, as Hugging Face's `save_pretrained`, DeepSpeed's `save_16bit_model` and
`full_state_dict`.

Both are collective (every rank calls them; called on some ranks only they
raise `CheckpointError` naming the call and its fix, at once where the other
ranks are seen in a collective, else within `rank_check_timeout`:
`comm/watch/entry.py`) and work
at every stage: the full state dict is built on rank 0 only (at stage 3 by
gathering one unit at a time, `engine.full_state_dict(rank0_only=True)`), so
no other rank ever holds a full copy; rank 0 writes, then tells every rank
whether it succeeded, so all of them return or raise together.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from zeroshard.checkpoint import CheckpointError
from zeroshard.checkpoint.safetensors_files import WEIGHTS_FILE
from zeroshard.comm import CollectiveError, all_gather_object
from zeroshard.errors import ModelError
from zeroshard.stage3.gathered import full_state_dict


class Exports:
    """`engine`'s (a `zeroshard.Engine`'s) exports of its whole weights; every rank calls them."""

    def __init__(self, engine):
        self.engine = engine

    def save_pretrained(self, save_dir: str | os.PathLike, **kwargs) -> Path:
        """Write the model as `AutoModel*.from_pretrained(save_dir)` loads it; returns `save_dir`.

        A `transformers` model: its own `save_pretrained(save_dir, state_dict=<full state dict>, **kwargs)`
        on rank 0 (safetensors weights, sharded past `max_shard_size`, tied weights once, `config.json`,
        `generation_config.json` when the model has one). Any other module: `save_dir/model.safetensors`
        with every key of `module.state_dict()`, which `module.load_state_dict(safetensors.torch.load_file(
        path))` loads; keyword arguments are then an error. Weights are in the training dtype.
        """
        module = self.engine.module
        transformers = sys.modules.get("transformers")
        is_transformers = transformers is not None and isinstance(module, transformers.PreTrainedModel)
        if kwargs and not is_transformers:
            raise ModelError(f"save_pretrained keyword arguments {sorted(kwargs)} are passed to a transformers "
                             f"model's save_pretrained, but this model is a {type(module).__name__}; drop them")
        self.engine._enter("save_pretrained", CheckpointError)
        state = self.pretrained_state() if is_transformers else self._export_state(exclude_frozen=False)
        save_dir = Path(save_dir)

        def write() -> None:
            if is_transformers:
                module.save_pretrained(save_dir, state_dict=state, **kwargs)
            else:
                from safetensors.torch import save_file

                save_dir.mkdir(parents=True, exist_ok=True)
                save_file({k: v.contiguous() for k, v in state.items()}, save_dir / WEIGHTS_FILE,
                          metadata={"format": "pt"})

        self._on_rank0(write, f"save_pretrained({str(save_dir)!r})")
        return save_dir

    def pretrained_state(self) -> dict[str, torch.Tensor]:
        """The full state dict on rank 0 ({} elsewhere) as a transformers model's `save_pretrained` takes it:
        CPU copies, a tied parameter's names all holding the one tensor, so transformers writes it once, under
        the name it keeps (as from the model's own state dict). Every rank calls it (stage 3 gathers)."""
        state = self._export_state(exclude_frozen=False)
        names: dict[int, list[str]] = {}
        for name, param in self.engine.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        for first, *others in names.values():
            for other in others:
                if first in state and other in state:
                    state[other] = state[first]
        return state

    def save_16bit(self, path: Path, exclude_frozen: bool) -> bool:
        """`torch.save` the full state dict to `path` on rank 0 (DeepSpeed's `save_16bit_model`); True."""
        self.engine._enter("save_16bit_model", CheckpointError)
        state = self._export_state(exclude_frozen=exclude_frozen)

        def write() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, path)

        self._on_rank0(write, f"save_16bit_model({str(path)!r})")
        return True

    def _export_state(self, exclude_frozen: bool) -> dict[str, torch.Tensor]:
        """The full state dict on rank 0 (CPU copies), {} elsewhere."""
        self.engine._update.land()  # a delayed update in flight, first: the state written is the whole of it
        state = self.full_state_dict(rank0_only=True)
        if exclude_frozen:
            named = self.engine.module.named_parameters(remove_duplicate=False)
            frozen = {name for name, p in named if not p.requires_grad}
            state = {k: v for k, v in state.items() if k not in frozen}
        return {k: v.cpu() for k, v in state.items()}

    def _on_rank0(self, write, what: str) -> None:
        """Run `write` on rank 0; every rank raises `CheckpointError` if it failed there."""
        failure = None
        if self.engine.comm.rank == 0:
            try:
                write()
            except Exception as exc:  # sent to every rank, so none returns as if it had been written
                failure = f"{type(exc).__name__}: {exc}"
        failures = all_gather_object(self.engine.comm, failure)
        if failures[0] is not None:
            raise CheckpointError(f"{what} failed on rank 0, which writes it: {failures[0]}")

    def full_state_dict(self, rank0_only: bool) -> dict[str, torch.Tensor]:
        """The complete model state dict (full tensors, copies): on every rank, or on rank 0 only.

        At stage 3 every rank must call it: the units are gathered one at a time (called on some
        ranks only, they raise `CollectiveError` within `rank_check_timeout`). Below stage 3 it runs
        no collective and any rank may call it alone.
        """
        engine = self.engine
        keep = not rank0_only or engine.comm.rank == 0
        engine.post_step.wait()  # stages 1-2: the last step's gathers in flight (overlap_param_gather)
        if engine.schedule is None:
            return {k: v.detach().clone() for k, v in engine.module.state_dict().items()} if keep else {}
        engine._check_usable()
        engine._enter("full_state_dict", CollectiveError)
        try:
            return full_state_dict(engine.module, engine.schedule, keep)
        except CollectiveError as exc:
            engine._fail(f"a gather failed in full_state_dict ({exc})")
            raise
