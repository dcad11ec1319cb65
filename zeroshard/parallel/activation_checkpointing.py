"""ActivationCheckpointing: DeepSpeed's activation checkpointing over `torch.utils.checkpoint` (non-reentrant),
with ZeRO-R's partitioned checkpoints (Pa) and their host copies (Pa+cpu).

`checkpoint(function, *args)` runs `function` under
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: the forward
keeps only the region's inputs, and backward recomputes the region when it
first needs one of its activations. torch's checkpoint saves those inputs
through the saved-tensor hooks active around it; this module puts its own
there for the length of the call (handing what it keeps on to any hooks
around it, such as the engine's ActivationMeter, so memory_stats counts
what is really kept). They keep, per floating-point input:

- partition_activations, on a tp group of N > 1 ranks: the input flattened,
  padded to a multiple of N, and this rank's 1/N of it (ZeRO-R's Pa); the
  recompute all-gathers the parts over tp (comm_stats("tp")) into the
  whole input. The region's input is replicated over tp (the output of a
  row-parallel layer), so the gathered input is the forward's, exactly. A
  DTensor input is kept as it is (its local part is what this rank holds).
- cpu_checkpointing: what is kept lives in host memory, copied back to the
  input's device for the recompute.
- contiguous_memory_optimization: what is kept is copied into the next slot
  of a buffer of number_checkpoints slots (one buffer per input position and
  size); a forward the engine runs starts new buffers.

At stage 3 the recompute runs the units' forward pre-hooks inside backward
(stage3/schedule.py): each unit is gathered for it, and kept for the unit's
own backward, which follows. The output hook of a unit checkpointed whole
(or holding the region) has already gathered it for that backward, so the
recompute adds no gather; a region spanning several units gathers each unit
when the recompute reaches it, which is that unit's backward gather, made
earlier. A unit gathered again after it was reduced (a module used twice)
is gathered again, and the gathers show in comm_stats() either way.

The engine makes its own settings (the config's `activation_checkpointing`
block) and tp group the current ones during each forward it runs
(`running_forward`); `zeroshard.deepspeed.checkpointing` reads them there.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from zeroshard.comm import Comm, all_gather
from zeroshard.config.activation import ActivationCheckpointingConfig
from zeroshard.core.local import is_dtensor

log = logging.getLogger(__name__)


class ContiguousBuffers:
    """contiguous_memory_optimization's buffers: per (input position, size, dtype, device), `slots` rows."""

    def __init__(self, slots: int):
        self.slots = slots
        self._open: dict[tuple, tuple[torch.Tensor, int]] = {}  # key -> (buffer, rows used)

    def take(self, position: int, part: torch.Tensor) -> torch.Tensor:
        """A copy of `part` (1-D) in the next free row of its buffer; a full buffer is left to its rows' users."""
        key = (position, part.numel(), part.dtype, part.device)
        buffer, used = self._open.get(key, (None, self.slots))
        if used == self.slots:
            buffer, used = torch.empty(self.slots, part.numel(), dtype=part.dtype, device=part.device), 0
        self._open[key] = (buffer, used + 1)
        return buffer[used].copy_(part)

    def clear(self) -> None:
        self._open.clear()


@dataclass
class _Kept:
    """One checkpointed input as kept: this rank's part (or the whole), and how to make the input again."""

    part: torch.Tensor
    shape: torch.Size
    numel: int
    device: torch.device
    gathered: bool  # the part is 1/tp of the padded flat input


@dataclass(frozen=True)
class ActivationCheckpointing:
    """One configuration of activation checkpointing: the block's settings and the tp group Pa splits over."""

    settings: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    tp: Comm | None = None  # None, or one rank: checkpoints are kept whole

    def no_effect(self, device: torch.device) -> list[tuple[str, str]]:
        """(key, why) for each key set that changes nothing here: logged once at start-up."""
        s, why = self.settings, []
        if s.partition_activations and (self.tp is None or self.tp.world_size == 1):
            why.append(("partition_activations", "there is no tensor parallelism (tp = 1): ZeRO-R's Pa splits a "
                        "checkpoint over the tp ranks, which all hold it; each rank keeps it whole"))
        if s.cpu_checkpointing and device.type == "cpu":
            why.append(("cpu_checkpointing", "the model runs on the CPU: its checkpoints are in host memory already"))
        if s.synchronize_checkpoint_boundary and device.type != "cuda":
            why.append(("synchronize_checkpoint_boundary", f"work on a {device.type} device is not asynchronous: "
                        "there is nothing to synchronize"))
        if s.number_checkpoints is not None and not s.contiguous_memory_optimization:
            why.append(("number_checkpoints", "it sizes contiguous_memory_optimization's buffers only"))
        return why

    def checkpoint(self, function: Callable, *args: Any, buffers: ContiguousBuffers | None = None,
                   rng: Any = None) -> Any:
        """`function(*args)`, checkpointed. `buffers`: contiguous_memory_optimization's (None: off); `rng`: an
        object with get_states() and set_states() (DeepSpeed's model-parallel RNG tracker) whose states the
        recompute starts from, as the forward did (torch's checkpoint restores the CPU and CUDA generators)."""
        states = rng.get_states() if rng is not None else None
        calls = [0]

        def run(*inputs):
            recompute = calls[0] > 0
            calls[0] += 1
            held = None
            if recompute and rng is not None:
                held = rng.get_states()
                rng.set_states(dict(states))
            try:
                with self._boundary("recompute" if recompute else "forward", inputs):
                    return function(*inputs)
            finally:
                if held is not None:
                    rng.set_states(held)

        if not torch.is_grad_enabled():
            return function(*args)
        with self._keeping(buffers):
            return torch_checkpoint(run, *args, use_reentrant=False)

    @contextmanager
    def _boundary(self, what: str, inputs: tuple) -> Iterator[None]:
        """synchronize_checkpoint_boundary and profile around one run of the region."""
        s = self.settings
        cuda = [t.device for t in inputs if isinstance(t, torch.Tensor) and t.device.type == "cuda"]
        sync = bool(cuda) and (s.synchronize_checkpoint_boundary or s.profile)
        if sync:
            torch.cuda.synchronize(cuda[0])
        start = time.perf_counter()
        try:
            yield
        finally:  # torch's checkpoint ends a recompute early (an exception) once it has what backward needs
            if sync:
                torch.cuda.synchronize(cuda[0])
            if s.profile and (not dist.is_initialized() or dist.get_rank() == 0):
                log.info("activation checkpoint %s: %.3f ms", what, 1e3 * (time.perf_counter() - start))

    @contextmanager
    def _keeping(self, buffers: ContiguousBuffers | None) -> Iterator[None]:
        s = self.settings
        split = s.partition_activations and self.tp is not None and self.tp.world_size > 1
        if not (split or s.cpu_checkpointing):
            yield  # torch's checkpoint keeps its inputs as they are (through any hooks around it)
            return
        position = [0]
        outer_pack, outer_unpack = torch._C._autograd._top_saved_tensors_default_hooks(False) or (None, None)

        def pack(tensor: torch.Tensor):
            kept = tensor
            if tensor.is_floating_point() and not is_dtensor(tensor) and tensor.numel() > 0:
                kept = self._keep(tensor, split, buffers if split else None, position[0])
                position[0] += 1
            if outer_pack is None:  # else what is kept goes on to the hooks around (the engine's meter)
                return kept
            if isinstance(kept, _Kept):
                return _Kept(outer_pack(kept.part), kept.shape, kept.numel, kept.device, kept.gathered)
            return outer_pack(kept)

        def unpack(packed):
            if isinstance(packed, _Kept):
                part = packed.part if outer_unpack is None else outer_unpack(packed.part)
                return self._restore(packed, part)
            return packed if outer_unpack is None else outer_unpack(packed)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def _keep(self, tensor: torch.Tensor, split: bool, buffers: ContiguousBuffers | None,
              position: int) -> _Kept | torch.Tensor:
        if not split and tensor.device.type == "cpu":
            return tensor  # on the host already: kept as torch's checkpoint keeps it
        flat = tensor.detach().reshape(-1)
        part = flat
        if split:
            n, rank = self.tp.world_size, self.tp.rank
            size = math.ceil(flat.numel() / n)
            part = flat.new_zeros(size)  # the last rank's part is padded
            mine = flat[rank * size: (rank + 1) * size]
            part[: mine.numel()].copy_(mine)
        if self.settings.cpu_checkpointing:
            part = part.to("cpu")
        if buffers is not None:
            part = buffers.take(position, part)
        return _Kept(part, tensor.shape, tensor.numel(), tensor.device, split)

    def _restore(self, kept: _Kept, part: torch.Tensor) -> torch.Tensor:
        """The input `kept` stands for, from its part (as the hooks around gave it back)."""
        part = part.to(kept.device)
        if not kept.gathered:
            return part.reshape(kept.shape)
        full = part.new_empty(part.numel() * self.tp.world_size)
        full[self.tp.rank * part.numel(): (self.tp.rank + 1) * part.numel()].copy_(part)
        all_gather(self.tp, full, what="partitioned activation checkpoint").wait()
        return full[: kept.numel].view(kept.shape)


@dataclass
class Forward:
    """One forward the engine runs: its activation checkpointing, and the contiguous buffers it started."""

    checkpointing: ActivationCheckpointing
    _buffers: dict[int, ContiguousBuffers] = field(default_factory=dict)  # by slots

    def buffers(self, settings: ActivationCheckpointingConfig) -> ContiguousBuffers | None:
        """This forward's contiguous buffers for `settings` (None: contiguous_memory_optimization is off)."""
        if not settings.contiguous_memory_optimization:
            return None
        slots = settings.number_checkpoints
        return self._buffers.setdefault(slots, ContiguousBuffers(slots))


_forward: ContextVar[Forward | None] = ContextVar("zeroshard_forward", default=None)


def running() -> Forward | None:
    """The engine forward running now, if any."""
    return _forward.get()


@contextmanager
def running_forward(checkpointing: ActivationCheckpointing) -> Iterator[Forward]:
    """Make `checkpointing` the current one for the forward run inside, with buffers of its own."""
    token = _forward.set(Forward(checkpointing))
    try:
        yield _forward.get()
    finally:
        _forward.reset(token)
