"""`deepspeed.checkpointing` on zeroshard: DeepSpeed's activation checkpointing API.

`checkpoint(function, *args)` checkpoints a region as DeepSpeed's does (its
inputs kept, the region recomputed in backward, its RNG states restored for
the recompute), over `torch.utils.checkpoint` with `use_reentrant=False`
(zeroshard/parallel/activation_checkpointing.py), so it composes with stage
3's gathers and with pipeline schedules. Its settings are, in this order:
those of `configure(...)`, if the script called it; else those of the
engine whose forward is running (the config's `activation_checkpointing`
block; its mesh's tp group partitions the checkpoints); else DeepSpeed's
defaults (inputs kept whole). DeepSpeed's module keeps its settings in
module globals, so this one does too (`_configured`, replaced by each
`configure`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.comm import Comm, CommRecorder
from zeroshard.config import Config
from zeroshard.deepspeed.unsupported import UnsupportedError
from zeroshard.parallel.activation_checkpointing import ActivationCheckpointing, ContiguousBuffers, running

log = logging.getLogger(__name__)

_MODEL_PARALLEL_RNG = "model-parallel-rng"  # DeepSpeed's (and Megatron's) name of the tp-region RNG state
# What configure() set: "settings", "mesh", "tp" (a comm over the mesh's tp group), "buffers".
_configured: dict[str, Any] = {}


def configure(mpu_=None, deepspeed_config=None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """DeepSpeed's `configure`: the `activation_checkpointing` block of `deepspeed_config` (a dict or a JSON
    file; none: the defaults), each argument given overriding its key. `mpu_`: None, or a zeroshard
    `Mesh` whose tp group partitions the checkpoints outside an engine's forward (inside one, the engine's
    mesh does). Raises `ConfigError` for bad values, `UnsupportedError` for another kind of `mpu_`."""
    from zeroshard.parallel.mesh import Mesh

    if mpu_ is not None and not isinstance(mpu_, Mesh):
        raise UnsupportedError(f"checkpointing.configure(mpu_={type(mpu_).__name__}): Megatron's mpu is not read; "
                               "pass None, or the zeroshard Mesh the model is parallelized over (docs/parallel.md)")
    block = {} if deepspeed_config is None else Config.load(deepspeed_config).activation_checkpointing.model_dump()
    given = {"partition_activations": partition_activations, "contiguous_memory_optimization": contiguous_checkpointing,
             "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
             "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    block |= {key: value for key, value in given.items() if value is not None}
    settings = Config.load({"activation_checkpointing": block}).activation_checkpointing
    tp = None
    if mpu_ is not None and mpu_.tp > 1:
        tp = Comm.create(mpu_.group("tp"), CommRecorder())
    _configured.clear()
    _configured.update(settings=settings, mesh=mpu_, tp=tp, buffers=ContiguousBuffers(settings.number_checkpoints)
                       if settings.contiguous_memory_optimization else None)
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info("activation checkpointing configured: %s", settings)


def is_configured() -> bool:
    """Whether `configure` was called (DeepSpeed's `is_configured`)."""
    return bool(_configured)


def reset() -> None:
    """DeepSpeed's `reset`: let go of contiguous_memory_optimization's buffers (between evaluation forwards
    without backward). An engine's forward starts buffers of its own anyway."""
    if _configured.get("buffers") is not None:
        _configured["buffers"].clear()


def checkpoint(function: Callable, *args: Any) -> Any:
    """`function(*args)` checkpointed: only its inputs are kept; backward recomputes it (DeepSpeed's
    `checkpoint`, over torch.utils.checkpoint with use_reentrant=False)."""
    forward = running()
    if _configured:
        engine_tp = forward.checkpointing.tp if forward is not None else None  # the engine's mesh first
        checkpointing = ActivationCheckpointing(_configured["settings"],
                                                engine_tp if engine_tp is not None else _configured["tp"])
    else:
        checkpointing = forward.checkpointing if forward is not None else ActivationCheckpointing()
    buffers = forward.buffers(checkpointing.settings) if forward is not None else _configured.get("buffers")
    return checkpointing.checkpoint(function, *args, buffers=buffers, rng=_TRACKER)


non_reentrant_checkpoint = checkpoint  # DeepSpeed's newer name: this checkpoint is non-reentrant already


class CudaRNGStatesTracker:
    """DeepSpeed's (Megatron's) named RNG states: `fork(name)` runs a block on the named state of the device's
    generator (CUDA when present, else the CPU's), and keeps where it left that state."""

    def __init__(self):
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def clear(self) -> None:
        """Forget every named state and seed."""
        self.states_, self.seeds_ = {}, set()

    def reset(self) -> None:
        """DeepSpeed's name for `clear`."""
        self.clear()

    def get_states(self) -> dict[str, torch.Tensor]:
        return copy.copy(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """Track the state a generator seeded with `seed` starts in, as `name`."""
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"the RNG state {name!r} or the seed {seed} is tracked already: reset() first, or "
                             "use another name and seed")
        self.seeds_.add(seed)
        held = _get_rng_state()
        _manual_seed(seed)
        self.states_[name] = _get_rng_state()
        _set_rng_state(held)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self.states_:
            raise ValueError(f"the RNG state {name!r} is not tracked: add(name, seed) it first "
                             "(model_parallel_cuda_manual_seed adds the model-parallel one)")
        held = _get_rng_state()
        _set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state()
            _set_rng_state(held)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """DeepSpeed's tracker of named RNG states (one per process)."""
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """DeepSpeed's (Megatron's) seeding: the device's generator gets `seed` (the same on a tp group's ranks,
    for dropout outside tp regions), the tracked model-parallel state `seed + 2718 + tp rank` (different on
    each tp rank). The tp rank is that of the Mesh given to `configure`, else 0."""
    mesh = _configured.get("mesh")
    tp_rank = mesh.rank("tp") if mesh is not None else 0
    _TRACKER.reset()
    _manual_seed(seed)
    _TRACKER.add(_MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)


def _get_rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


__all__ = ["CudaRNGStatesTracker", "checkpoint", "configure", "get_cuda_rng_tracker", "is_configured",
           "model_parallel_cuda_manual_seed", "non_reentrant_checkpoint", "reset"]
