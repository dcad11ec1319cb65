"""Staging memory: reusable blocks for collectives (gradients staged for a reduce-scatter, scratch).

Blocks are kept for the engine's lifetime rather than allocated per step:
on CPU a fresh large allocation is fresh pages, and faulting them in every
step costs more than the collective's own copy. Their bytes are what
`memory_stats()["staging"]` reports.
"""

from __future__ import annotations

import torch


class StagingPool:
    """Hands out 1-D tensors from reusable blocks (of at least `block_numel` elements each)."""

    def __init__(self, block_numel: int = 0) -> None:
        # Stages 0-2: every block is at least the largest request (the largest bucket), so any
        # free block serves any request and the pool holds one block per buffer in use. Stage 3
        # passes 0: blocks of exactly the size asked for, reused by the next unit of the same shape.
        self.block_numel = block_numel
        self._free: list[torch.Tensor] = []
        self._all: list[torch.Tensor] = []

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of exactly `numel` elements, contents undefined."""
        fits = [
            i for i, b in enumerate(self._free)
            if b.dtype == dtype and b.device == device and b.numel() >= numel
        ]
        if fits:
            best = min(fits, key=lambda i: self._free[i].numel())
            return self._free.pop(best)[:numel]
        block = torch.empty(max(numel, self.block_numel), dtype=dtype, device=device)
        self._all.append(block)
        return block[:numel]

    def release(self, tensor: torch.Tensor) -> None:
        base = tensor._base if tensor._base is not None else tensor
        if not any(base is block for block in self._all):
            raise ValueError("released a tensor this pool did not hand out")
        if any(base is block for block in self._free):
            raise ValueError("released a buffer twice; two holders would share it")
        self._free.append(base)

    def tensors(self) -> list[torch.Tensor]:
        return list(self._all)
