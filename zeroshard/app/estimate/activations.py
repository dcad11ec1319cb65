"""`zeroshard estimate`'s activation part: --micro-batch, --seq, --checkpoint-activations, and the table.

The count is `zeroshard.app.estimate.activation_count.count_activations`: the model's
training forward run on the meta device, what autograd saves counted per
block and in total. Beside it, where the model is a transformer with a
hidden size and heads, Korthikanti et al. 2022's per-layer formula (16-bit
activations, one-byte dropout masks). With --gpus, the step's peak per
stage (`zeroshard.estimate.step_peak`): model states + activations + staging
buffers + stage 3's gathered units + one parameter's gradient + with full
checkpointing the largest block's recompute, or the optimizer step's
temporaries when they are larger (docs/memory.md).
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from zeroshard.app.estimate.activation_count import count_activations
from zeroshard.app.flags import positive_int
from zeroshard.app.estimate.model_count import ParamCount, hf_config
from zeroshard.app.models import PRESETS
from zeroshard.app.estimate.step_peak import peak_of
from zeroshard.app.units import human_bytes
from zeroshard.estimate import STAGES
from zeroshard.estimate.activations import CHECKPOINTING, korthikanti_layer_bytes


def add_activations(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("activations (with --model)")
    group.add_argument("--micro-batch", type=positive_int, default=None, metavar="B",
                       help="sequences per micro-batch: count the activations of one training forward")
    group.add_argument("--seq", type=positive_int, default=None, metavar="S", help="tokens per sequence")
    group.add_argument("--checkpoint-activations", choices=CHECKPOINTING, default="none",
                       help="full: every block checkpointed, as the model's own checkpointing does it "
                            "(default: %(default)s)")
    group.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                       help="with --gpus: the collectives' backend, for the peak: gloo (CPU ranks) runs each "
                            "reduce-scatter as an all-to-all into a scratch buffer of the bucket's size "
                            "(default: %(default)s)")


def wants_activations(args: argparse.Namespace) -> bool:
    """Whether the flags ask for activations; an error names the flag that is missing."""
    if args.micro_batch is None and args.seq is None:
        return False
    if args.micro_batch is None or args.seq is None or args.model is None:
        args.command_parser.error("activations need --model, --micro-batch and --seq together")
    return True


def activations(args: argparse.Namespace) -> dict:
    """The "activations" object of `--json`: bytes per rank of one micro-batch's forward."""
    try:
        counted = count_activations(args.model, args.micro_batch, args.seq, args.checkpoint_activations, args.dtype)
        plain = count_activations(args.model, args.micro_batch, args.seq, "none", args.dtype)
        # the block the backward recomputes at once, with full checkpointing: its activations without it
        recompute = 0 if args.checkpoint_activations == "none" else max(plain.per_layer, default=0)
    except ValueError as error:
        args.command_parser.error(f"argument --model: {error}")
    shape = _transformer_shape(args.model)
    formula = None if shape is None else korthikanti_layer_bytes(
        args.seq, args.micro_batch, *shape, args.checkpoint_activations)
    return {**counted.as_dict(), "micro_batch": args.micro_batch, "seq": args.seq, "dtype": args.dtype,
            "checkpointing": args.checkpoint_activations, "recompute": recompute,
            "largest_gradient": plain.largest,  # the largest activation's, made in backward while it is held
            "korthikanti_per_layer": formula}


def _transformer_shape(name: str) -> tuple[int, int] | None:
    """(hidden size, attention heads) of a preset or a transformers config; None where it has neither."""
    if name in PRESETS:
        return PRESETS[name].n_embd, PRESETS[name].n_head
    config = hf_config(name)
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    return None if hidden is None or heads is None else (hidden, heads)


def peak_bytes(counted: ParamCount, saved: dict, args: argparse.Namespace) -> dict:
    """`"peak_bytes"` per stage (the step's peak per GPU: `zeroshard.estimate.step_peak`) and `"peak_by_part"`
    per stage (its parts, and which moment peaks)."""
    peaks = {str(stage): peak_of(counted, saved["total"], saved["recompute"], saved["largest_gradient"], stage,
                                 args.gpus, args.dtype, scratch=args.backend == "gloo") for stage in STAGES}
    return {"peak_bytes": {s: p.total for s, p in peaks.items()},
            "peak_by_part": {s: p.as_dict() for s, p in peaks.items()}}


def print_activations(console: Console, counted: dict, peak: dict[str, dict] | None) -> None:
    console.print(f"[bold]activations[/] of one training forward: micro-batch {counted['micro_batch']} x "
                  f"{counted['seq']} tokens, {counted['dtype']}, checkpointing {counted['checkpointing']}")
    table = Table(show_edge=False)
    table.add_column("part")
    table.add_column("saved", justify="right")
    for index, nbytes in enumerate(counted["per_layer"]):
        table.add_row(f"layer {index}", human_bytes(nbytes))
    table.add_row("outside layers", human_bytes(counted["outside_layers"]))
    table.add_row("total", human_bytes(counted["total"]), end_section=True)
    if counted["recompute"]:
        table.add_row("recompute (one layer)", human_bytes(counted["recompute"]))
    if counted["korthikanti_per_layer"] is not None:
        table.add_row("Korthikanti, per layer", human_bytes(counted["korthikanti_per_layer"]))
    console.print(table)
    if peak is not None:
        print_peak(console, peak)
    console.print("[dim]saved: what autograd keeps for backward, counted on the meta device (each storage once, "
                  "parameters and the batch excluded); Korthikanti: s·b·h·(34 + 5·a·s/h) in 16-bit[/]")


def print_peak(console: Console, by_part: dict[str, dict]) -> None:
    """The step's peak per GPU and stage, by part (`StepPeak.as_dict()` per stage; --json has every part)."""
    table = Table(show_edge=False, title="the step's peak per GPU")
    for column in ("stage", "model states", "activations", "buffers", "step temps", "peak", "at"):
        table.add_column(column, justify="left" if column in ("stage", "at") else "right", no_wrap=True)
    for stage, p in by_part.items():
        buffers = sum(p[k] for k in ("staging", "gathered", "param_grad", "activation_grad", "recompute"))
        table.add_row(stage, *(human_bytes(n) for n in (p["model_states"], p["activations"], buffers,
                                                        p["step_temporaries"], p["total"])), p["phase"])
    console.print(table)
    console.print("[dim]buffers: staging, stage 3's gathered units, the gradients backward makes while the "
                  "activations are held, the recompute; step temps: the optimizer step's fp32 gradient copies; "
                  "at: the moment that peaks (docs/memory.md)[/]")
