"""Reading single tensors out of safetensors files with plain file reads: exactly the bytes asked for.

`safetensors.safe_open` maps a whole file into the process (private and
writable: it counts against RLIMIT_DATA, and a 10 GB shard is a 10 GB
mapping); `zeroshard.pretrained` needs one unit's tensors at a time, so it
reads the format directly: an 8-byte little-endian header length, a JSON
header (name -> dtype, shape, data_offsets from the end of the header), then
the raw little-endian data.
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from zeroshard.errors import ModelError

WEIGHTS_FILE = "model.safetensors"  # the name transformers reads in a directory

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: where its bytes are."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset in the file
    nbytes: int


def entries(path: Path) -> dict[str, Entry]:
    """Name -> `Entry` for every tensor of the safetensors file at `path` (reads the header only)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    found = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ModelError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which zeroshard cannot read; "
                             f"convert the checkpoint to one of {', '.join(_DTYPES)}")
        begin, end = info["data_offsets"]
        found[name] = Entry(_DTYPES[info["dtype"]], tuple(info["shape"]), 8 + length + begin, end - begin)
    return found


def read(path: Path, wanted: list[tuple[Entry, torch.Tensor]]) -> None:
    """Copy each entry's tensor into its target (cast to the target's dtype, moved to its device)."""
    if sys.byteorder != "little":
        raise ModelError("reading safetensors files needs a little-endian machine")
    with open(path, "rb") as f:
        for entry, target in wanted:
            raw = torch.empty(entry.nbytes, dtype=torch.uint8)
            f.seek(entry.start)
            if f.readinto(memoryview(raw.numpy())) != entry.nbytes:
                raise ModelError(f"{path} ends before its tensors do: the file is truncated; save it again")
            target.copy_(raw.view(entry.dtype).view(entry.shape))
