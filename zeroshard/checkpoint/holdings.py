"""What one rank holds of the model states, as runs of named parameters' elements.

A checkpoint stores each parameter's elements by name, whatever flat buffer,
shard or stage they lived in; this module says, for one engine, which
elements of which parameters each of its tensors holds. A `Span` is a 1-D
window of a flat buffer's coordinates; its runs are the pieces of the
parameters that fall inside it. Each rank writes only the elements of its
own shard, so the pieces of all ranks cover every element exactly once, and
reads back whatever range its tensors hold in the new job.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator

import torch
import torch.nn as nn

from zeroshard.core.bucket import Bucket
from zeroshard.core.flat import FlatParams
from zeroshard.core.local import local
from zeroshard.core.optim import steps_whole
from zeroshard.dtypes import torch_name


@dataclass(frozen=True)
class Run:
    name: str
    start: int  # first element, in the parameter's flattened elements
    at: int  # where it lies in the span's tensor
    numel: int


@dataclass(frozen=True)
class Span:
    """Elements [lo, lo + length) of a flat buffer whose parameters are `names`."""

    names: tuple[str, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    lo: int
    length: int

    @classmethod
    def of(cls, flat: FlatParams, names: dict[int, str], shard: bool) -> "Span":
        """The rank's shard of `flat` (`shard`), or all of it."""
        lo, length = (flat.rank * flat.shard_numel, flat.shard_numel) if shard else (0, flat.padded_numel)
        return cls(tuple(names[id(p)] for p in flat.params), tuple(flat.offsets), tuple(flat.numels), lo, length)

    @classmethod
    def whole(cls, name: str, numel: int) -> "Span":
        return cls((name,), (0,), (numel,), 0, numel)

    def runs(self) -> Iterator[Run]:
        for name, offset, numel in zip(self.names, self.offsets, self.numels):
            a, b = max(offset, self.lo), min(offset + numel, self.lo + self.length)
            if a < b:
                yield Run(name, a - offset, a - self.lo, b - a)


@dataclass(frozen=True)
class Trained:
    """A bucket's master and what its optimizer state is laid out like.

    `held` matches the master (the whole buffer at stage 0, the shard
    above); `own` is the rank's shard, the part it writes.
    """

    bucket: Bucket
    held: Span
    own: Span

    def own_part(self, tensor: torch.Tensor) -> torch.Tensor:
        """The rank's shard of a tensor laid out like the master."""
        return tensor if self.bucket.switches.shard_optimizer else self.bucket.flat.shard(tensor)

    def owned(self, writing: bool = False) -> list[tuple[str, torch.Tensor]]:
        """(name, the tensor the optimizer steps) of each parameter this rank steps whole, where the bucket's
        optimizer needs tensors whole (`core/optim.py` `owned_views`); else empty. At stage 0 every rank
        steps every tensor, and (`writing`) rank 0 alone writes their state."""
        bucket = self.bucket
        if not steps_whole(bucket):
            return []
        flat = bucket.flat
        if bucket.switches.shard_optimizer:
            names = [n for n, owner in zip(self.held.names, flat.owners) if owner == flat.rank]
        else:
            names = list(self.held.names) if flat.rank == 0 or not writing else []
        return list(zip(names, bucket.stepped))


@dataclass(frozen=True)
class Holdings:
    """Everything of the model one rank holds, by kind."""

    trained: list[Trained]
    frozen: list[tuple[FlatParams, Span]]  # stage 3's frozen flats: this rank's `shard_data`
    whole: list[tuple[str, torch.Tensor]]  # parameters in no flat buffer (frozen): replicated; their local tensors
    buffers: list[tuple[str, torch.Tensor]]  # the module's persistent buffers: replicated
    order: tuple[str, ...]  # parameter names as the module registers them, for tables and messages
    # Frozen parameters a checkpoint leaves out (`exclude_frozen_parameters=True`, `frozen.py`): a save does
    # not write them, a load keeps the engine's own values of them.
    not_stored: frozenset[str] = frozenset()

    @classmethod
    def of(cls, module: nn.Module, buckets: list[Bucket], frozen_flats: list[FlatParams],
           names: dict[int, str]) -> "Holdings":
        trained = [Trained(b, Span.of(b.flat, names, b.switches.shard_optimizer), Span.of(b.flat, names, True))
                   for b in buckets]
        frozen = [(f, Span.of(f, names, True)) for f in frozen_flats]
        in_flats = {id(p) for f in [b.flat for b in buckets] + frozen_flats for p in f.params}
        whole = [(n, local(p)) for n, p in module.named_parameters() if id(p) not in in_flats]
        params = {id(p) for p in module.parameters()}
        buffers = [(k, t) for k, t in module.state_dict(keep_vars=True).items() if id(t) not in params]
        return cls(trained, frozen, whole, buffers, tuple(names[id(p)] for p in module.parameters()))

    def without_frozen(self, names: frozenset[str] | None = None) -> "Holdings":
        """These holdings with the frozen parameters `names` (default: every frozen one) not stored."""
        frozen = frozenset(n for n, p in self.param_table().items() if p["group"] is None)
        return replace(self, not_stored=frozen if names is None else names)

    def stored_runs(self, span: Span) -> list[Run]:
        """The runs of `span` a checkpoint holds: not those of the frozen parameters it leaves out."""
        return [run for run in span.runs() if run.name not in self.not_stored]

    def param_table(self) -> dict[str, dict]:
        """name -> shape, dtype and param group (None: frozen) of every parameter, in the module's order."""
        table = {}
        for t in self.trained:
            for name, shape in zip(t.held.names, t.bucket.flat.shapes):
                table[name] = {"shape": list(shape), "dtype": torch_name(t.bucket.flat.dtype),
                               "group": t.bucket.param_group}
        for flat, span in self.frozen:
            for name, shape in zip(span.names, flat.shapes):
                table[name] = {"shape": list(shape), "dtype": torch_name(flat.dtype), "group": None}
        for name, p in self.whole:
            table[name] = {"shape": list(p.shape), "dtype": torch_name(p.dtype), "group": None}
        return {name: table[name] for name in self.order}

    def buffer_table(self) -> dict[str, dict]:
        return {name: {"shape": list(b.shape), "dtype": torch_name(b.dtype)} for name, b in self.buffers}

