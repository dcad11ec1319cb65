"""ReportMethods: what the engine reports of itself: traffic, memory, the full state dict."""

from __future__ import annotations

import torch

from zeroshard.comm import CollectiveError, OpStats
from zeroshard.core.memory import model_state_bytes, total, with_activations
from zeroshard.engine.placement import ParamPlacement, param_placement
from zeroshard.stage3.gathered import full_state_dict


class ReportMethods:
    """The engine's reports (mixed into `Engine`)."""

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
        self._wait_update()
        by_pool = with_activations(
            model_state_bytes(self.module, self.buckets, self.optimizer, self.pool, self.frozen_flats(),
                              self.offload.tiers, self.offload.param_tier, self.offload.buffers()),
            self.activations.last, self.activations.window_peak)
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
                               self.units, self._names, zero.stage3_param_persistence_threshold)

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """The complete model state dict (full tensors, copies): on every rank, or on rank 0 only.

        At stage 3 every rank must call it: the units are gathered one at a time (called on some
        ranks only, they raise `CollectiveError` within `rank_check_timeout`). Below stage 3 it runs
        no collective and any rank may call it alone.
        """
        keep = not rank0_only or self.comm.rank == 0
        self.wait_for_params()  # stages 1-2: the last step's gathers in flight (overlap_param_gather)
        if self.schedule is None:
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()} if keep else {}
        self._check_usable()
        self._enter("full_state_dict", CollectiveError)
        try:
            return full_state_dict(self.module, self.schedule, keep)
        except CollectiveError as exc:
            self.fail(f"a gather failed in full_state_dict ({exc})")
            raise
