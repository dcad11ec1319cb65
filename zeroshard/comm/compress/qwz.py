"""qwZ (ZeRO++, Wang et al. 2023, section 3.1): the quantized weight all-gather of a flat buffer.

Each rank quantizes its shard (symmetric, per block, an fp32 scale a block:
`BlockCodec`, int8 in the paper), the ranks all-gather the encoded shards
(scales and payload in one buffer: one collective, `messages.py`), and every
rank dequantizes all of them into the output's dtype (fp32, bf16 or fp16).
Only what travels is quantized: the shard a rank holds (its master copy)
is never touched. This rank's own chunk is dequantized too, so every rank
computes with the same weights: chunk r of the output is exactly
`dequantize(quantize(shard of rank r))` on every rank.

Recorded as one `all_gather` of the encoded buffer, N messages of
`message_bytes(S)` bytes (`estimate.qwz_all_gather_bytes`), with the
algorithm named "<backend algorithm> of int8/<block>".
"""

from __future__ import annotations

import torch

from zeroshard.comm.collectives import Comm, Pending, all_gather
from zeroshard.comm.compress.messages import decode_rows, encode_rows, encoding
from zeroshard.comm.compress.quantize import BlockCodec, CodecError, message_bytes


def qwz_all_gather(comm: Comm, full: torch.Tensor, shard: torch.Tensor, codec: BlockCodec,
                   async_op: bool = True, what: str = "") -> Pending:
    """Fill `full` (1-D, N chunks of S elements, fp32 / bf16 / fp16) with every rank's quantized `shard`.

    `shard` (S elements, any floating dtype) is read at the call and left
    unchanged; it may be this rank's chunk of `full`. `full` is written once
    the gather lands (at `wait`). Logical bytes: N x message_bytes(S).
    """
    n, size = comm.world_size, shard.numel()
    if full.dim() != 1 or full.numel() != n * size:
        raise CodecError(f"qwZ gathers {n} shards of {size} elements into a 1-D buffer of {n * size} elements, "
                         f"not {tuple(full.shape)}")
    if not full.is_floating_point():
        raise CodecError(f"qwZ dequantizes into a floating-point buffer, not {full.dtype}")
    row = message_bytes(size, codec)
    gathered = torch.empty(n, row, dtype=torch.uint8, device=full.device)
    gathered[comm.rank] = encode_rows(shard.reshape(1, size), codec)[0]
    pending = all_gather(comm, gathered.view(-1), async_op=True, what=what, encoding=encoding(codec),
                         uncompressed=full.numel() * full.element_size())
    pending.then(lambda: full.view(n, size).copy_(decode_rows(gathered, size, codec, full.dtype)))
    if not async_op:
        pending.wait()
    return pending
