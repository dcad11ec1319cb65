"""The calls every rank must make (their entry checks: entry.py), in words, and the fix for each one made alone.

A rank that makes such a call alone (`if rank == 0: ...`) leaves a position
in the store naming it (positions.py): `call`, the name its entry check
goes by (every rank compares it), and, where the user made another call
that led there, `made`, that call in words (transformers'
`save_pretrained`, which calls the model's `state_dict()`) with `fix`, the
fix for it. The entering rank's error and the other ranks' (a collective
that sees the rank in the call) name the call and the fix from there.
"""

from __future__ import annotations

from typing import Any

_EVERY_RANK = "call it on every rank of the group, in the same order as the other collective calls"
_FIXES = {
    "save_checkpoint": ("call engine.save_checkpoint(...) on every rank: every rank writes its own shard; "
                        "`if rank == 0: engine.save_checkpoint(...)` is the usual cause"),
    "load_checkpoint": "call engine.load_checkpoint(...) on every rank: every rank reads its own shard",
    "save_pretrained": "call engine.save_pretrained(dir) on every rank: every rank gathers, rank 0 alone writes",
    "save_16bit_model": "call engine.save_16bit_model(dir) on every rank: every rank gathers, rank 0 alone writes",
    "full_state_dict": ("call engine.full_state_dict(rank0_only=True) on every rank (the full tensors on rank 0, "
                        "{} on the others), then save on rank 0 alone"),
    "module.state_dict": ("call model.state_dict() on every rank, or engine.full_state_dict(rank0_only=True) on "
                          "every rank (the full tensors on rank 0, {} on the others), then save on rank 0 alone"),
    "module.load_state_dict": ("call model.load_state_dict(sd if rank == 0 else {}) on every rank: rank 0's sd "
                               "is loaded on every rank"),
    "gathered_parameters": "enter zeroshard.gathered_parameters(...) on every rank, with the same parameters",
}


def named(position: dict[str, Any]) -> str:
    """The call a rank at `position` (a `call` position) made, in words."""
    return position.get("made") or position["call"]


def fix(position: dict[str, Any]) -> str:
    """How to make the call of a rank at `position` (a `call` position) right."""
    return position.get("fix") or _FIXES.get(position["call"], _EVERY_RANK)


def advice(position: dict[str, Any]) -> str:
    """The sentence that ends an error about a call made on some ranks only: what it is and the fix."""
    return (f"{named(position)} is a collective call, which every rank must make: {fix(position)}. The ranks' "
            "collectives are out of step now: restart the job from a checkpoint")
