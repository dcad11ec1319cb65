"""The training dtypes by name ("fp32", "bf16", "fp16"), their torch dtypes and sizes, in one leaf module.

The names are the ones of the config (`bf16`, `fp16`, `communication_data_type`)
and of the CLI's `--dtype`. A torch dtype's own name ("bfloat16", "int64": its
`str` without "torch.") is what checkpoint manifests and `ConfigFacts` store,
for any dtype. A leaf: it imports torch only, so every layer may read it.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

TrainingDtype = Literal["fp32", "bf16", "fp16"]
TRAINING_DTYPES: tuple[str, ...] = get_args(TrainingDtype)  # ("fp32", "bf16", "fp16")

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}  # torch.bfloat16 -> "bf16"
BYTES: dict[str, int] = {name: dtype.itemsize for name, dtype in DTYPES.items()}  # bytes per element

# What the optimizer updates, and its state: fp32 whatever the training dtype.
MASTER_DTYPE = torch.float32


def torch_name(dtype: torch.dtype) -> str:
    """torch's name of any dtype, without the module: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def from_torch_name(name: str) -> torch.dtype:
    """The torch dtype `torch_name` wrote: "bfloat16" -> torch.bfloat16; ValueError for another name."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"'{name}' is not the name of a torch dtype (such as float32 or bfloat16)")
    return dtype
