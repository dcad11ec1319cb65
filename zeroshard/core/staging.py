"""Staging memory: reusable blocks for collectives (gradients staged for a reduce-scatter, scratch).

Blocks are kept for the engine's lifetime rather than allocated per step:
on CPU a fresh large allocation is fresh pages, and faulting them in every
step costs more than the collective's own copy. Their bytes are what
`memory_stats()["staging"]` reports. Which block serves a request, and how
large a new one is, is the plan's rule (plan/staging.py's `Blocks`, by
sizes, which the estimate counts); this pool holds the tensors, one set of
blocks per dtype and device.
"""

from __future__ import annotations

import torch

from zeroshard.plan.staging import Blocks


class StagingPool:
    """Hands out 1-D tensors from reusable blocks (of at least `block_numel` elements each:
    plan/staging.py's `block_numel`)."""

    def __init__(self, block_numel: int = 0) -> None:
        self.block_numel = block_numel
        self._blocks: dict[tuple[torch.dtype, torch.device], Blocks] = {}
        self._made: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}  # by block number
        self._all: list[torch.Tensor] = []

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of exactly `numel` elements, contents undefined."""
        key = (dtype, device)
        blocks = self._blocks.setdefault(key, Blocks(self.block_numel))
        made = self._made.setdefault(key, [])
        block = blocks.acquire(numel)
        if block == len(made):
            made.append(torch.empty(blocks.sizes[block], dtype=dtype, device=device))
            self._all.append(made[block])
        return made[block][:numel]

    def release(self, tensor: torch.Tensor) -> None:
        base = tensor._base if tensor._base is not None else tensor
        for key, made in self._made.items():
            for block, held in enumerate(made):
                if held is base:
                    self._blocks[key].release(block)
                    return
        raise ValueError("released a tensor this pool did not hand out")

    def tensors(self) -> list[torch.Tensor]:
        return list(self._all)

    def free_tensors(self) -> list[torch.Tensor]:
        """The blocks no one holds now: their contents are undefined, so they may be freed without a copy."""
        return [made[b] for key, made in self._made.items() for b in range(len(made)) if self._blocks[key].is_free(b)]
