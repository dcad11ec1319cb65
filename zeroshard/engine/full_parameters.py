"""`engine.iter_full_parameters`: the trained weights streamed to a generator (a vLLM weight sync) in batches.

Each batch is a list of (name, tensor): full shapes, the training dtype (the
parameters' own: the 16-bit dtype under bf16 or fp16), on the engine's
device, each tensor a copy, the batch's tensors totalling at most
`max_bytes` (a tensor larger than that comes alone). What the stream holds
beyond the engine's own memory is the batch the consumer has, plus at stage
3, while a batch is made, the units it reads (`stage3/weight_stream.py`):
never the whole model, unlike `full_state_dict()` on every rank.

The names and tensors are the entries of `full_state_dict()` (parameters
and persistent buffers; a tied tensor under each of its names), or for a
PEFT model (`peft`): "merged", the base model's as `merge_and_unload()`
gives them (`peft_weights.py`); "adapter", the adapters' as PEFT saves
them; "unmerged", the PEFT model's own (`full_state_dict()`'s). At stage 3
they come unit by unit (the tensors outside units first), elsewhere in the
state dict's order.

At stage 3 the stream is collective: every rank calls it with the same
arguments (the entry check compares them) and iterates it to its end or
stops it (`break`, `close()`); a rank that stops early still runs the
gathers the others will, as its generator closes. Below stage 3 it runs no
collective. With a delayed update in flight the weights are
`full_state_dict()`'s: every update but that one (`engine.flush_update()`
first, for it).
"""

from __future__ import annotations

from collections.abc import Iterator

from zeroshard.comm import CollectiveError
from zeroshard.engine.peft_weights import adapter_pieces, is_peft_model, merged_pieces
from zeroshard.errors import ModelError
from zeroshard.stage3.weight_stream import Batch, Piece, batches, copy_piece, full_shapes, stream

PEFT_MODES = ("merged", "adapter", "unmerged")
_FIX = ("call engine.iter_full_parameters(...) on every rank with the same arguments, and iterate it to its end "
        "on every rank (or stop it: a break or close() joins the gathers the others still run)")


def iter_full_parameters(engine, max_bytes: int | None, peft: str, rank0_only: bool) -> Iterator[Batch]:
    """The generator of `engine.iter_full_parameters` (module docstring); the arguments are checked now."""
    _check(max_bytes, peft)
    module, schedule = engine.module, engine.schedule
    if peft == "adapter" and not is_peft_model(module):
        raise ModelError(f"iter_full_parameters(peft='adapter') streams a PEFT model's adapters, but this model is "
                         f"a {type(module).__name__}, which has none: drop the argument")
    shapes = {} if schedule is None else full_shapes(schedule)
    pieces = _pieces(module, peft, shapes)
    if schedule is not None:  # unit by unit: a unit is gathered for as few batches as its pieces take
        pieces.sort(key=lambda piece: min(piece.units, default=-1))
    planned = batches(pieces, max_bytes)
    keep = not rank0_only or engine.comm.rank == 0
    return _started(engine, planned, keep, f"iter_full_parameters(max_bytes={max_bytes!r}, peft={peft!r})")


def _started(engine, planned: list[list[Piece]], keep: bool, call: str) -> Iterator[Batch]:
    engine.post_step.wait()  # stages 1-2: the last step's gathers in flight (overlap_param_gather)
    schedule = engine.schedule
    if schedule is not None:
        engine._check_usable()
        engine._enter(call, CollectiveError, fix=_FIX)
    try:
        yield from stream(planned, schedule, keep)
    except CollectiveError as exc:
        engine._fail(f"a gather failed in iter_full_parameters ({exc})")
        raise


def _pieces(module, peft: str, shapes: dict) -> list[Piece]:
    if is_peft_model(module) and peft == "merged":
        return merged_pieces(module, shapes)
    if is_peft_model(module) and peft == "adapter":
        return adapter_pieces(module, shapes)
    return [copy_piece(name, t, shapes) for name, t in module.state_dict(keep_vars=True).items()]


def _check(max_bytes: int | None, peft: str) -> None:
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
        raise ModelError(f"iter_full_parameters(max_bytes=...) takes a number of bytes (an int >= 1), or None for "
                         f"one tensor a batch; got {max_bytes!r}")
    if peft not in PEFT_MODES:
        raise ModelError(f"iter_full_parameters(peft=...) is one of {', '.join(map(repr, PEFT_MODES))}; got {peft!r}")
