"""Tensor-parallel plans: Megatron's column/row split of a transformer block, as a DTensor plan.

A block's first linear of each pair is split by output features
(`ColwiseParallel`: each tp rank computes its heads, its slice of the MLP's
hidden units) and the second by input features (`RowwiseParallel`: partial
sums, all-reduced over `tp` once per pair). Embeddings, norms, the output
head and the row-parallel biases stay replicated.

`gpt_tp_plan` is this plan for the built-in GPT (`zeroshard.app.models.gpt`),
whose attention lays its fused qkv projection out head by head (q, k, v of
head 0, then of head 1, ...), so that each tp rank's contiguous slice holds
whole heads. docs/parallel.md shows the plan for a Hugging Face Llama block.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from zeroshard.parallel.mesh import Mesh


def gpt_tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The plan for each GPT block the module holds (module names as `named_modules` gives them)."""
    plan: dict[str, ParallelStyle] = {}
    for name, module in model.named_modules():
        if hasattr(module, "attn") and hasattr(module, "mlp"):  # a transformer block
            prefix = f"{name}." if name else ""
            plan[f"{prefix}attn.qkv"] = ColwiseParallel()
            plan[f"{prefix}attn.proj"] = RowwiseParallel()
            plan[f"{prefix}mlp.0"] = ColwiseParallel()
            plan[f"{prefix}mlp.2"] = RowwiseParallel()
    return plan


def parallelize_gpt(model: nn.Module, mesh: Mesh) -> nn.Module:
    """Apply `gpt_tp_plan` over the mesh's `tp` dimension (nothing at tp=1); returns the model."""
    if mesh.tp > 1:
        parallelize_module(model, mesh.device_mesh["tp"], gpt_tp_plan(model))
    return model
