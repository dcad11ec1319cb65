"""`zeroshard estimate`: model-state memory and communication per ZeRO stage, without a GPU.

The figures come from `zeroshard.estimate.summarize`; this module reads the
flags, counts Ψ and the largest unit when given a model (a demo preset or any
`transformers` model, built on the meta device: `zeroshard.app.model_count`),
and prints either that object as JSON or a table.
"""

from __future__ import annotations

import argparse
import json
import re

from rich.console import Console
from rich.table import Table

from zeroshard import estimate
from zeroshard.app.flags import add_command, add_dtype, positive_int
from zeroshard.app.model_count import AUTO_WRAP_MIN_PARAMS, DEMO_WRAP, count_model

EXAMPLES = """\
examples:
  zeroshard estimate --params 7.5e9 --gpus 64              the ZeRO paper's Figure 1
  zeroshard estimate --model llama/config.json --gpus 16 --gpu-mem 80GB
  zeroshard estimate --model gpt2 --gpus 8 --wrap GPT2Block   a transformers model type, a unit per block
  zeroshard estimate --model demo --gpus 2 --dtype fp32 --json
"""

_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def count(text: str) -> int:
    """argparse type: a whole number of elements, such as 7.5e9, 124439808 or 7B."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMBT]?)\s*", text)
    try:
        value = float(match.group(1)) * _SUFFIXES[match.group(2)] if match else -1.0
    except ValueError:
        value = -1.0
    if value < 1 or not value.is_integer():
        raise argparse.ArgumentTypeError(f"expected a whole number of elements such as 7.5e9 or 7B, "
                                         f"got '{text}'")
    return int(value)


def memory_size(text: str) -> int:
    """argparse type: bytes with a unit, decimal (80GB = 80e9) or binary (80GiB = 80 × 2^30)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?I?B)\s*", text.upper())
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a size with a unit such as 80GB or 40GiB, got '{text}'")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `zeroshard estimate` and its flags."""
    parser = add_command(
        commands, "estimate", help="model-state memory and communication per GPU for ZeRO stages 0-3",
        description="Per-GPU model-state memory (the ZeRO paper's formulas, decimal GB), bytes\n"
                    "communicated per optimizer step, the cross-node volume with and without ZeRO++,\n"
                    "and the largest model that fits a GPU, for stages 0-3. Activations, buffers and\n"
                    "fragmentation come on top.",
        epilog=EXAMPLES)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=count, metavar="Ψ", help="parameter count, e.g. 7.5e9 or 7B")
    model.add_argument("--model", metavar="NAME_OR_CONFIG",
                       help="count Ψ and the largest unit on the model built on the meta device: a preset, a "
                            "transformers model type (gpt2, llama, ...), a config.json or a save_pretrained "
                            "directory")
    parser.add_argument("--largest-unit", type=count, metavar="ELEMENTS", default=None,
                        help="parameters of the largest unit stage 3 gathers; default: from --model, else 0")
    parser.add_argument("--wrap", nargs="+", default=None, metavar="CLASS",
                        help="with --model: stage3_wrap_classes, class names that each form a unit (default: "
                             f"{' '.join(DEMO_WRAP)} for a preset, by size for another model)")
    parser.add_argument("--auto-wrap-min-params", type=count, default=AUTO_WRAP_MIN_PARAMS, metavar="ELEMENTS",
                        help="with --model and no --wrap: stage3_auto_wrap_min_params (default: %(default)s)")
    parser.add_argument("--gpus", type=positive_int, required=True, metavar="N", help="GPUs (ranks) in all")
    parser.add_argument("--gpus-per-node", type=positive_int, default=None, metavar="G",
                        help="GPUs per node (default: 8, or --gpus if fewer)")
    add_dtype(parser, "bf16", "training dtype: 16-bit params and grads with an fp32 master copy, or "
                              "fp32 throughout (default: %(default)s)")
    parser.add_argument("--optimizer-bytes", type=positive_int, default=None, metavar="K",
                        help="optimizer-state bytes per parameter, master copy included (default: "
                             "Adam's, 12 with bf16/fp16, 8 with fp32)")
    parser.add_argument("--gpu-mem", type=memory_size, default=None, metavar="SIZE",
                        help="memory per GPU, e.g. 80GB or 80GiB: also print the largest model that fits")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (bytes; see zeroshard.estimate.summarize)")


def run(args: argparse.Namespace, console: Console | None = None) -> int:
    """Compute and print the estimate; returns the exit status."""
    name, largest_unit = None, args.largest_unit
    if args.model is not None:
        try:
            counted = count_model(args.model, None if args.wrap is None else tuple(args.wrap),
                                  args.auto_wrap_min_params)
        except ValueError as error:
            args.command_parser.error(f"argument --model: {error}")
        name, args.params = counted.name, counted.numel
        largest_unit = counted.largest_unit if largest_unit is None else largest_unit
    try:
        summary = estimate.summarize(args.params, args.gpus, args.gpus_per_node, args.dtype,
                                     args.optimizer_bytes, largest_unit or 0, args.gpu_mem)
    except ValueError as error:
        args.command_parser.error(str(error))
    console = console or Console()
    if args.json:
        console.out(json.dumps(summary if name is None else {"model": name, **summary}, indent=2))
        return 0
    print_summary(console, summary, name)
    return 0


def human_bytes(n: float) -> str:
    """Decimal units with three significant digits, as the paper prints: 31.4 GB, 1.88 GB, 120 GB."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def human_count(n: int) -> str:
    for suffix, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {suffix}"
    return str(n)


def _formulas(summary: dict) -> dict[str, str]:
    """Each stage's memory formula with this setup's bytes per element."""
    p, g, k = (*estimate.DTYPE_BYTES[summary["dtype"]][:2], summary["optimizer_bytes"])
    return {"0": f"{p + g + k}Ψ", "1": f"{p + g}Ψ + {k}Ψ/N", "2": f"{p}Ψ + {g + k}Ψ/N",
            "3": f"{p + g + k}Ψ/N + {2 * p}U"}


def print_summary(console: Console, summary: dict, name: str | None = None) -> None:
    """The estimate as a rich table, one row per stage, and the conventions under it."""
    n, nodes = summary["gpus"], summary["nodes"]
    console.print(f"[bold]Ψ = {summary['params']:,}[/] parameters ({human_count(summary['params'])})"
                  + (f" from {name}" if name else "") + f", largest unit {summary['largest_unit']:,}")
    console.print(f"N = {n} GPUs, {nodes} node{'s' if nodes > 1 else ''} of {summary['gpus_per_node']}; "
                  f"{summary['dtype']}, K = {summary['optimizer_bytes']} optimizer bytes per parameter")
    table = Table(show_edge=False)
    columns = ("stage", "memory", "formula", "comm", "sent") + ("cross-node",) * (nodes > 1)
    for column in columns:
        table.add_column(column, justify="left" if column in ("stage", "formula") else "right", no_wrap=True)
    fits = summary["max_params"]
    if fits is not None:
        table.add_column("max Ψ", justify="right", no_wrap=True)
    formulas = _formulas(summary)
    for stage in summary["memory_bytes"]:
        row = [stage, human_bytes(summary["memory_bytes"][stage]), formulas[stage],
               human_bytes(summary["comm_bytes"][stage]), human_bytes(summary["wire_bytes_per_rank"][stage])]
        row += [human_bytes(summary["cross_node_bytes"][stage])] * (nodes > 1)
        table.add_row(*row, *([human_count(fits[stage])] if fits is not None else []))
    console.print(table)
    if nodes > 1:
        console.print(f"stage 3 with ZeRO++ (qwZ + hpZ + qgZ): cross-node "
                      f"{human_bytes(summary['cross_node_bytes_zeropp'])} per GPU per step instead of "
                      f"{human_bytes(summary['cross_node_bytes']['3'])} (3M -> 0.75M)")
    notes = ["memory: model states per GPU (no activations or buffers); U: the largest unit",
             "comm: logical bytes per step summed over collectives, as engine.comm_stats() records "
             "them (an all-reduce counts its buffer once)",
             "sent: bytes each rank sends on rings, the paper's 2Ψ (stages 0-2) or 3Ψ (stage 3) "
             "elements × (N-1)/N"]
    notes += ["cross-node: per GPU, in the papers' M units"] * (nodes > 1)
    if fits is not None:
        notes.append(f"max Ψ: the largest model whose states fit {human_bytes(summary['gpu_mem_bytes'])} per GPU")
    console.print("[dim]" + "\n".join(notes) + "[/]")
