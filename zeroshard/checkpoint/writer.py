"""Writing a rank file: the safetensors format, streamed through a checksum, without a copy of the tensors.

A rank file is a plain safetensors file (`safetensors.safe_open` reads it):
an 8-byte little-endian header length, a JSON header (each tensor's dtype,
shape and `data_offsets`, and the `__metadata__` strings), padded with
spaces to a multiple of 8 bytes, then the tensors' raw bytes back to back.

Why not `safetensors.torch.save_file`: it writes the file itself, with no
way to see the bytes as they go, so a checksum would mean reading the file
back (twice the I/O of a save); and `safetensors.torch.save` returns the
whole file as one `bytes` object (a copy of every tensor: the save's peak
memory would grow by the file's size). Writing the format here streams each
tensor's own storage (a zero-copy view of its bytes) through `zlib.crc32`
and into the file, so a save of a CPU shard copies nothing and the
checksum costs one pass over memory that is being written anyway, in a
second thread beside the writes.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from zeroshard.checkpoint.files import CheckpointError, crc_hex

# safetensors' names of the dtypes it stores (its `Dtype` enum).
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_CHUNK = 64 << 20  # bytes per write and checksum update: large enough to run at memory speed


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict:
    """Write 1-D `tensors` to a safetensors file at `path` and fsync it.

    Returns the file's manifest entry: its size in bytes, the crc32 of its
    bytes (computed while writing) and each tensor's [safetensors dtype, elements].
    """
    if sys.byteorder != "little":
        raise CheckpointError("checkpoints are written little-endian, as safetensors stores them; this machine "
                              "is big-endian: save from a little-endian machine")
    unstorable = [key for key, t in tensors.items() if t.dtype not in SAFETENSORS_DTYPES]
    if unstorable:
        raise CheckpointError(f"'{unstorable[0]}' is a {tensors[unstorable[0]].dtype} tensor, which safetensors "
                              f"cannot store; checkpoints hold {', '.join(map(str, SAFETENSORS_DTYPES))}")
    # Wider dtypes first, as safetensors orders them, so every tensor's bytes stay aligned to its dtype.
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict = {"__metadata__": metadata}
    offset = 0
    for key in order:
        end = offset + tensors[key].numel() * tensors[key].element_size()
        header[key] = {"dtype": SAFETENSORS_DTYPES[tensors[key].dtype], "shape": [tensors[key].numel()],
                       "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = len(text).to_bytes(8, "little") + text
    crc, hashed = _RunningCrc(head), []
    with open(path, "wb") as f, ThreadPoolExecutor(max_workers=1) as hasher:
        f.write(head)  # the mode follows the umask, as every file of a checkpoint does
        for key in order:  # one tensor's bytes at a time: a GPU tensor is copied to the host alone
            block = _bytes_of(tensors[key])
            for start in range(0, len(block), _CHUNK):
                piece = block[start : start + _CHUNK]
                hashed.append(hasher.submit(crc.update, piece))  # in order, in one thread, beside the writes
                f.write(piece)
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
        for done in hashed:
            done.result()  # (raises what the hashing thread raised)
    return {"size": size, "crc32": crc_hex(crc.value),
            "tensors": {key: [SAFETENSORS_DTYPES[t.dtype], t.numel()] for key, t in sorted(tensors.items())}}


class _RunningCrc:
    """A crc32 updated piece by piece (zlib releases the GIL on large pieces, so it runs beside the writes)."""

    def __init__(self, first: bytes):
        self.value = zlib.crc32(first)

    def update(self, piece: memoryview) -> None:
        self.value = zlib.crc32(piece, self.value)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as a flat memoryview of its own storage (no copy for a contiguous CPU tensor)."""
    flat = tensor.detach().reshape(-1).cpu().contiguous()
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def bytes_entry(data: bytes) -> dict:
    """The manifest entry of a file written from `data` in memory (state.pt): size and crc32."""
    return {"size": len(data), "crc32": crc_hex(zlib.crc32(data))}
