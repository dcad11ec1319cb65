"""Compressed gradient reductions: a codec on the wire at every stage, with error feedback.

A reduce-scatter (stages 1-3) sends each peer its chunk quantized and sums
what it receives in fp32 (`qgz_reduce_scatter`: one hop over the group, or
ZeRO++'s two over the node topology). An all-reduce (stage 0) is that
reduce-scatter followed by an all-gather of each rank's mean chunk, quantized
again; every rank, the sender included, dequantizes the same bytes, so the
replicas stay equal. Both return the mean over the ranks, not the sum.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019) lives with the
sender, per message: each rank keeps, for each bucket, what its last
quantized messages left out (fp32, one element per element sent) and adds it
to the next ones. So a rank holds 4 bytes per padded gradient element of each
bucket for hop 1, 4 per element of its hop-2 rows (two hops), and 4 per
element of its chunk for the all-reduce's gather. At stage 2 this is as large
as a full fp32 gradient: the price of sending 8x fewer bytes with int4 and
still applying, over the steps, the updates the exact mean would have given.
A receiver-side error (per shard) cannot stand in for it: the receiver never
sees the exact values, only their quantized sum. `error_feedback: false`
costs nothing in memory and leaves each step's rounding in place. With fp16
the residuals are in loss-scaled units, like the gradients they come from:
when the loss scale changes the engine rescales them (`ErrorFeedback.rescale`).

Recorded: the reduce-scatter as `reduce_scatter` of the encoded bytes sent
(message_bytes of each chunk, scales included), the all-reduce as that plus
an `all_gather` of the encoded chunks; the estimate (estimate/compression.py)
gives the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroshard.comm.collectives import Comm, Pending, all_gather
from zeroshard.comm.compress.messages import decode_rows, encode_rows, encoding
from zeroshard.comm.compress.qgz import Hops, HopsPending, qgz_reduce_scatter
from zeroshard.comm.compress.quantize import BlockCodec, message_bytes
from zeroshard.estimate.formulas import shard_numel


@dataclass
class ErrorFeedback:
    """What one bucket's quantized messages from this rank left out, by message (fp32, zeros at first)."""

    hop1: torch.Tensor | None  # (N, S): the chunks sent to each peer (flat, or inside the node)
    hop2: torch.Tensor | None  # (K, S): the node's partial sums sent across nodes
    gathered: torch.Tensor | None  # (1, S): this rank's mean chunk in the all-reduce's gather

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: t for name, t in (("hop1", self.hop1), ("hop2", self.hop2), ("gathered", self.gathered))
                if t is not None}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps: each message's residuals, 1-D."""
        return {name: t.reshape(-1) for name, t in self.tensors().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, t in self.tensors().items():
            t.reshape(-1).copy_(state[name])

    def rescale(self, factor: float) -> None:
        """The gradients the residuals will be added to changed units by `factor` (fp16's loss scale moved from
        S to factor x S): the residuals, loss-scaled by S, follow, or the next message would add them back off by
        the ratio. A power of two here, so no value rounds."""
        for t in self.tensors().values():
            t.mul_(factor)

    def reset(self, step: int) -> None:
        """Start over with nothing left out (a checkpoint's residuals that cannot be this job's)."""
        for t in self.tensors().values():
            t.zero_()


@dataclass(frozen=True)
class CompressedReduction:
    """How a bucket's gradients travel compressed: the group, its hops, the codec, whether errors feed back."""

    comm: Comm  # the data-parallel group
    hops: Hops  # Hops.flat(comm), or qgZ's two hops over the node topology
    codec: BlockCodec
    error_feedback: bool

    def feedback_for(self, numel: int, all_reduce: bool, device: torch.device) -> ErrorFeedback | None:
        """The error feedback of a bucket of `numel` (padded) elements, zeros; None without error feedback."""
        if not self.error_feedback or self.comm.world_size == 1:
            return None
        first, second = self.hops.error_shapes(numel)
        size = shard_numel(numel, self.comm.world_size)
        make = lambda shape: None if shape is None else torch.zeros(shape, dtype=torch.float32, device=device)
        return ErrorFeedback(make(first), make(second), make((1, size) if all_reduce else None))

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, feedback: ErrorFeedback | None,
                       what: str = "") -> HopsPending:
        """This rank's chunk of the mean of `full` over the ranks, into `shard` (`qgz_reduce_scatter`)."""
        errors = (None, None) if feedback is None else (feedback.hop1, feedback.hop2)
        return qgz_reduce_scatter(self.hops, shard, full, self.codec, what=what, errors=errors)

    def all_reduce(self, full: torch.Tensor, feedback: ErrorFeedback | None, what: str = "") -> Pending:
        """The mean of `full` (1-D, N x S elements) over the ranks, in place: a compressed reduce-scatter,
        then an all-gather of each rank's quantized mean chunk, dequantized by every rank alike."""
        n, size = self.comm.world_size, full.numel() // self.comm.world_size
        mean = torch.empty(size, dtype=torch.float32, device=full.device)

        def gather() -> Pending:  # the mean chunk landed: launched at the wait, as qgZ's hop 2
            gathered = torch.empty(n, message_bytes(size, self.codec), dtype=torch.uint8, device=full.device)
            error = None if feedback is None else feedback.gathered
            gathered[self.comm.rank] = encode_rows(mean.view(1, size), self.codec, error)[0]
            pending = all_gather(self.comm, gathered.view(-1), what=what, encoding=encoding(self.codec),
                                 uncompressed=full.numel() * full.element_size())
            return pending.then(lambda: full.view(n, size).copy_(decode_rows(gathered, size, self.codec,
                                                                             full.dtype)))

        return HopsPending(self.reduce_scatter(mean, full, feedback, what), gather)
