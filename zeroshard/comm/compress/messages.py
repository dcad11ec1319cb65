"""Quantized messages as bytes for the wire: rows of values, each row one message of payload and scales.

ZeRO++'s collectives send one shard per message (qwZ: this rank's shard to
every rank; qgZ: one shard to each peer). Each row is quantized on its own,
padded to whole blocks, so blocks never straddle two shards, and encoded as
one uint8 row: its fp32 scales, then its payload. One buffer of such rows
goes in one collective, so a quantized gather or all-to-all costs one launch,
not one for the payload and one for the scales, on gloo and NCCL alike.
The row's length in bytes is `message_bytes(row numel, codec)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zeroshard.comm.compress.quantize import HADAMARD, SCALE_DTYPE, BlockCodec, Quantized, dequantize, quantize


def encode_rows(rows: torch.Tensor, codec: BlockCodec, error: torch.Tensor | None = None) -> torch.Tensor:
    """(m, L) floating-point values as (m, message_bytes(L)) uint8: each row's scales, then its payload.

    With `error` ((m, L) fp32, error feedback), the rows sent are `rows + error`, and `error` becomes what
    that message left out: `rows + error - decoded`, which the next message adds back. A block that held
    inf or nan (a step about to be skipped) leaves zeros there, not a residual that would poison every
    later message.
    """
    if error is not None:
        fed = rows.float() + error
        encoded = encode_rows(fed, codec)
        torch.sub(fed, decode_rows(encoded, fed.shape[1], codec), out=error)
        error.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        return encoded
    m, length = rows.shape
    blocks = codec.blocks(length)
    padded = F.pad(rows, (0, blocks * codec.block_size - length))  # rows of whole blocks: no block spans two
    q = quantize(padded, codec)
    scales = q.scales.view(torch.uint8).view(m, blocks * SCALE_DTYPE.itemsize)
    payload = q.payload.view(torch.uint8).view(m, blocks * codec.payload_bytes_per_block)
    return torch.cat((scales, payload), dim=1)


def decode_rows(encoded: torch.Tensor, length: int, codec: BlockCodec,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (m, `length`) values of `encode_rows`' (m, bytes) rows, computed in fp32 and cast once to `dtype`.

    Element for element the same as `dequantize(quantize(row))` of each row.
    """
    m = encoded.shape[0]
    blocks = codec.blocks(length)
    split = blocks * SCALE_DTYPE.itemsize
    scales = encoded[:, :split].contiguous().view(SCALE_DTYPE).reshape(-1)
    payload = encoded[:, split:].contiguous().view(m * blocks, codec.payload_bytes_per_block)
    payload = payload.view(codec.payload_dtype)
    values = dequantize(Quantized(payload, scales, m * blocks * codec.block_size, codec), dtype)
    return values.view(m, blocks * codec.block_size)[:, :length]


def encoding(codec: BlockCodec) -> str:
    """How a codec's messages are named in the recorded algorithm, e.g. "int4/128+hadamard", "fp8_e4m3/128"."""
    return f"{codec.format}/{codec.block_size}" + (HADAMARD if codec.hadamard else "")
