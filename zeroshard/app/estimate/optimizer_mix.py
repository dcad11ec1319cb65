"""`zeroshard estimate --optimizer`: the optimizer state per rank of a mix that steps some tensors whole.

An optimizer that needs tensors whole (Muon, Adafactor, LAMB) keeps each
tensor's state on the one rank that owns it (plan/owners.py), so the ranks
no longer hold the same bytes, and each flat buffer of owned tensors is
padded to N x S elements. This module builds the model on the meta device,
splits its parameters into the mix's param groups, takes the flat buffers
the engine would build at each stage from the engine's own planning
(`model_count.flat_shapes`), and prices them with `zeroshard.estimate.owned`:
per stage the smallest and largest rank's bytes, their gap, and the padding.

The mixes: "muon" is DeepSpeed's `"optimizer": {"type": "Muon"}` split
(`zeroshard.config.muon_block.takes_muon`: Muon for the matrices whose
names hold neither "embed" nor "lm_head", AdamW for the rest); "adafactor"
and "lamb" step every parameter; "adamw" every parameter, element-wise.
"""

from __future__ import annotations

import argparse
import math

import torch
from rich.console import Console
from rich.table import Table

from zeroshard.app.estimate.model_count import AUTO_WRAP_MIN_PARAMS, build_model, flat_shapes
from zeroshard.app.units import human_bytes
from zeroshard.config.muon_block import takes_muon
from zeroshard.estimate.owned import STATE_BYTES, WHOLE, owned_bytes, segment_numel, sharded_bytes

MIXES = ("adamw", "muon", "adafactor", "lamb")
STAGES = (1, 2, 3)
# State an element-wise optimizer keeps once per flat buffer: the group steps each flat shard as one tensor,
# and torch's AdamW keeps a 0-dim fp32 step beside each tensor's moments.
PER_BUFFER_BYTES = {"adamw": 4}


def add_optimizer_mix(parser: argparse.ArgumentParser) -> None:
    """Register --optimizer."""
    parser.add_argument("--optimizer", choices=MIXES, default=None,
                        help="with --model: also print the optimizer-state bytes per rank at stages 1-3 of this "
                             "mix, tensors owned whole by one rank where the optimizer needs them whole (muon: "
                             "DeepSpeed's split, Muon on the hidden matrices and AdamW on the rest)")


def mix_groups(kind: str, model: torch.nn.Module) -> list[tuple[str, list[torch.nn.Parameter]]]:
    """(optimizer name, parameters) of each param group of the mix, in the engine's group order; a group that
    would be empty is left out, as `muon_block.build_muon` leaves it out."""
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if kind != "muon":
        return [(kind, [p for _, p in trained])]
    muon = [p for n, p in trained if takes_muon(n, p)]
    rest = [p for n, p in trained if not takes_muon(n, p)]
    return [(name, params) for name, params in (("muon", muon), ("adamw", rest)) if params]


def stage_bytes(flats: list[tuple[int, list[tuple[str, tuple[int, ...]]]]], optimizers: list[str],
                world_size: int) -> dict:
    """Per-rank optimizer bytes of one stage's flat buffers ((group, tensors) in build order) and the padding
    (elements) the owned layout adds over them."""
    per_rank, padding = [0] * world_size, 0
    for g, optimizer in enumerate(optimizers):
        shapes = [[shape for _, shape in tensors] for group, tensors in flats if group == g]
        if optimizer in WHOLE:
            per_rank = [a + b for a, b in zip(per_rank, owned_bytes(shapes, optimizer, world_size))]
            padding += sum(world_size * segment - sum(map(math.prod, flat))
                           for segment, flat in zip(segment_numel(shapes, world_size), shapes))
        else:
            each = sharded_bytes(shapes, optimizer, world_size) + PER_BUFFER_BYTES.get(optimizer, 0) * len(shapes)
            per_rank = [b + each for b in per_rank]
    return {"per_rank": per_rank, "min": min(per_rank), "max": max(per_rank),
            "imbalance": max(per_rank) - min(per_rank), "padding_elements": padding}


def mix_summary(name: str, kind: str, world_size: int, wrap: tuple[str, ...] | None = None,
                min_numel: int = AUTO_WRAP_MIN_PARAMS, persistence_threshold: int | None = None,
                bucket_size: int | None = None) -> dict:
    """The "optimizer_mix" object of `zeroshard estimate --json`: the mix's groups, its largest tensor owned
    whole, and per stage the bytes per rank (`stage_bytes`)."""
    built = build_model(name, wrap, min_numel, persistence_threshold, bucket_size)
    groups = mix_groups(kind, built.model)
    optimizers = [optimizer for optimizer, _ in groups]
    names = {id(p): n for n, p in built.model.named_parameters()}
    owned = [(optimizer, p) for optimizer, params in groups if optimizer in WHOLE for p in params]
    stepper, largest = max(owned, key=lambda owned: owned[1].numel(), default=(None, None))
    return {
        "optimizer": kind,
        "groups": [{"optimizer": optimizer, "tensors": len(params), "numel": sum(p.numel() for p in params)}
                   for optimizer, params in groups],
        "largest_owned": None if largest is None else {
            "name": names[id(largest)], "shape": list(largest.shape),
            "state_bytes": STATE_BYTES[stepper](tuple(largest.shape))},
        "by_stage": {str(stage): stage_bytes(flat_shapes(built, [params for _, params in groups], stage),
                                             optimizers, world_size) for stage in STAGES},
    }


def optimizer_mix(args: argparse.Namespace) -> dict:
    """`mix_summary` for the flags; --optimizer needs --model (a model's tensors, not a count)."""
    if args.model is None:
        args.command_parser.error("--optimizer needs --model: which tensors a rank owns whole depends on their "
                                  "shapes; give --model instead of --params, or drop --optimizer")
    try:
        return mix_summary(args.model, args.optimizer, args.gpus, None if args.wrap is None else tuple(args.wrap),
                           args.auto_wrap_min_params, args.persistence_threshold, args.bucket_size)
    except ValueError as error:
        args.command_parser.error(f"argument --model: {error}")


def print_optimizer_mix(console: Console, mix: dict) -> None:
    """One row per stage: the smallest and largest rank's optimizer state, their gap, and the padding."""
    groups = " + ".join(f"{g['optimizer']} on {g['tensors']} tensors ({g['numel']:,} elements)"
                        for g in mix["groups"])
    console.print(f"[bold]optimizer state per rank, --optimizer {mix['optimizer']}[/]: {groups}")
    table = Table(show_edge=False)
    for column in ("stage", "min/rank", "max/rank", "imbalance", "padding"):
        table.add_column(column, justify="left" if column == "stage" else "right", no_wrap=True)
    for stage, row in mix["by_stage"].items():
        table.add_row(stage, human_bytes(row["min"]), human_bytes(row["max"]), human_bytes(row["imbalance"]),
                      f"{row['padding_elements']:,}")
    console.print(table)
    largest = mix["largest_owned"]
    notes = ["optimizer state only (no master copy), fp32, as engine.memory_stats()['optimizer'] counts it",
             "imbalance: max - min over the ranks; each tensor stepped whole lives on one rank"]
    if largest is not None:
        notes.append(f"largest tensor owned whole: {largest['name']} {tuple(largest['shape'])}, "
                     f"{human_bytes(largest['state_bytes'])} of state")
    notes.append("padding: elements the owned layout adds, N x S - elements over the owned flat buffers")
    console.print("[dim]" + "\n".join(notes) + "[/]")
