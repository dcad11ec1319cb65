"""Reports: what the engine reports of itself: traffic, memory, where the parameters live."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from zeroshard.comm import Comm, OpStats
from zeroshard.config import Config
from zeroshard.core.activation_meter import ActivationMeter
from zeroshard.core.bucket import Bucket
from zeroshard.core.flat import FlatParams
from zeroshard.core.memory import MemoryStats, model_state_bytes, total, with_activations
from zeroshard.core.staging import StagingPool
from zeroshard.engine.offload import Offload
from zeroshard.engine.offload_states import OffloadStates
from zeroshard.engine.placement import ParamPlacement, param_placement
from zeroshard.engine.step_update import StepUpdate
from zeroshard.stage3.unit import Unit

if TYPE_CHECKING:  # imported by the engine only with a mesh: `import zeroshard` stays free of DTensor
    from zeroshard.parallel.cross import CrossParallel


class Reports:
    """The engine's reports, counted from what this rank holds."""

    def __init__(self, config: Config, comm: Comm, cross: CrossParallel | None, module: nn.Module,
                 optimizer: torch.optim.Optimizer, buckets: list[Bucket], units: list[Unit],
                 frozen: list[FlatParams], pool: StagingPool, offload: Offload, activations: ActivationMeter,
                 names: dict[int, str], update: StepUpdate, states: OffloadStates):
        self.config, self.comm, self.cross, self.module, self.optimizer = config, comm, cross, module, optimizer
        self.buckets, self.units, self.frozen, self.pool, self.offload = buckets, units, frozen, pool, offload
        self.activations, self.names, self.update, self.states = activations, names, update, states

    def comm_stats(self, dim: str = "dp") -> dict[str, OpStats]:
        """Per logical collective: calls, bytes (logical full buffer), blocked seconds, algorithms.

        `dim`: ZeRO's data-parallel traffic ("dp"); on a mesh also "tp" (partial gradients summed), "pp"
        (ties across stages) and "mesh" (the step check over every rank)."""
        if dim == "dp":
            return self.comm.recorder.snapshot()
        if self.cross is None or dim not in self.cross.recorders:
            raise ValueError(f"comm_stats({dim!r}): this engine records "
                             f"{['dp'] + (list(self.cross.recorders) if self.cross else [])}")
        return self.cross.recorders[dim].snapshot()

    def memory_stats(self, pool: str | None = None) -> dict[str, int]:
        """Bytes this rank holds of each kind: params, grads, master, optimizer, staging, hpz_secondary,
        compression (a compressed reduction's error feedback); and
        `activations`, what autograd saved in the last training forward (each storage once, the parameters'
        and the forward's arguments left out), and `peak`, the step's peak: what is held now plus the largest
        forward's activations since the last optimizer step (docs/memory.md). `.held()` sums the kinds held.

        `pool`: "device", "host" or "disk" (offload), each by the same kinds; None: all pools together.
        A delayed update in flight is waited for first (its optimizer state is being made)."""
        self.update.wait()  # a delayed update in flight: its optimizer state is being made
        held = model_state_bytes(self.module, self.buckets, self.optimizer, self.pool, self.frozen,
                                 self.offload.tiers, self.offload.param_tier, self.offload.buffers())
        copies = self.states.host_bytes()  # engine.offload_states(): the device's bytes in host memory
        held["host"] = MemoryStats({kind: n + copies.get(kind, 0) for kind, n in held["host"].items()})
        by_pool = with_activations(held, self.activations.last, self.activations.window_peak)
        if pool is None:
            return total(by_pool)
        if pool not in by_pool:
            raise ValueError(f"memory_stats(pool={pool!r}): the pools are {', '.join(map(repr, by_pool))}")
        return by_pool[pool]

    def placement(self) -> ParamPlacement:
        """Where this rank's parameters live, in elements and bytes: sharded (stage 3's units, gathered on
        demand), persistent (kept whole: at stage 3 each parameter under stage3_param_persistence_threshold,
        below stage 3 every trained one), frozen (stage 3's sharded frozen flat buffers, and parameters left
        as they are), and stage 3's units one by one (engine/placement.py). Counted on this rank, no
        collective; `.total.bytes` equals `memory_stats()["params"]` while no unit is gathered."""
        zero = self.config.zero_optimization
        return param_placement(self.config.stage, self.comm.world_size, self.comm.rank, self.module, self.buckets,
                               self.units, self.names, zero.stage3_param_persistence_threshold)
