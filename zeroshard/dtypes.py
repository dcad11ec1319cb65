"""The training dtypes by name ("fp32", "bf16", "fp16"), their torch dtypes and sizes, in one leaf module.

The names are the ones of the config (`bf16`, `fp16`, `communication_data_type`)
and of the CLI's `--dtype`. A torch dtype's own name ("bfloat16", "int64": its
`str` without "torch.") is what checkpoint manifests and `ConfigFacts` store,
for any dtype. The codecs' formats on the wire ("int8", "int4", "fp8_e4m3",
"fp8_e5m2": `comm/compress/quantize.py`) are named here too, so the config, the
estimate's bytes and the codecs spell them alike. A leaf: it imports torch
only, so every layer may read it.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

TrainingDtype = Literal["fp32", "bf16", "fp16"]
TRAINING_DTYPES: tuple[str, ...] = get_args(TrainingDtype)  # ("fp32", "bf16", "fp16")

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}  # torch.bfloat16 -> "bf16"
BYTES: dict[str, int] = {name: dtype.itemsize for name, dtype in DTYPES.items()}  # bytes per element

# How a codec sends each value (comm/compress/quantize.py): symmetric integers, or torch's float8 dtypes, scaled per block.
WireFormat = Literal["int8", "int4", "fp8_e4m3", "fp8_e5m2"]
WIRE_FORMATS: tuple[str, ...] = get_args(WireFormat)
WIRE_BITS: dict[str, int] = {"int8": 8, "int4": 4, "fp8_e4m3": 8, "fp8_e5m2": 8}  # int4: two values a byte
FP8_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

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
