"""`zeroshard estimate`: model-state memory and communication per ZeRO stage, without a GPU.

The figures come from `zeroshard.estimate.summarize`; this module reads the
flags, counts Ψ and the largest unit when given a model (a demo preset or any
`transformers` model, built on the meta device: `zeroshard.app.estimate.model_count`),
and prints either that object as JSON or a table. With `--tp`/`--pp` above 1
(a preset only) it prints each model part's model-state bytes per rank
instead (`zeroshard.estimate.parallel.mesh_summary`). With `--offload-optimizer`
or `--offload-params` it adds the three memory pools of ZeRO-Offload and
ZeRO-Infinity (`zeroshard.estimate.offload_summary`).
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from zeroshard import estimate
from zeroshard.app.estimate.activations import (
    activations,
    add_activations,
    peak_bytes,
    print_activations,
    wants_activations,
)
from zeroshard.app.estimate.compress import add_compress, check_compress, compression, print_compression
from zeroshard.app.estimate.offload import add_offload, offload_setup, print_offload
from zeroshard.app.estimate.optimizer_mix import add_optimizer_mix, optimizer_mix, print_optimizer_mix
from zeroshard.app.flags import add_command, add_dtype, positive_int
from zeroshard.app.estimate.model_count import (
    AUTO_WRAP_MIN_PARAMS,
    DEMO_WRAP,
    PERSISTENCE_THRESHOLD,
    count_model,
    count_parts,
)
from zeroshard.app.models import PRESETS
from zeroshard.app.units import count, human_bytes, human_count, memory_size, threshold
from zeroshard.estimate.parallel import mesh_summary

EXAMPLES = """\
examples:
  zeroshard estimate --params 7.5e9 --gpus 64              the ZeRO paper's Figure 1
  zeroshard estimate --model llama/config.json --gpus 16 --gpu-mem 80GB
  zeroshard estimate --model gpt2 --gpus 8 --wrap GPT2Block   a transformers model type, a unit per block
  zeroshard estimate --model demo --gpus 2 --dtype fp32 --json
  zeroshard estimate --params 7B --gpus 32 --gpus-per-node 8 --zeropp    stage 3 by scope, with ZeRO++
  zeroshard estimate --model gpt2 --gpus 4 --gpus-per-node 2 --hpz --qgz --gradient-bits 8
  zeroshard estimate --model demo --gpus 8 --tp 2 --pp 2      per model part on a pp x dp x tp mesh
  zeroshard estimate --params 13B --gpus 1 --dtype fp16 --gpu-mem 32GiB --host-mem 1.5TB --offload-optimizer cpu
  zeroshard estimate --model 4m --gpus 2 --dtype fp32 --compress --step-seconds 0.5
                                                             bytes per codec and the link speed where each pays
  zeroshard estimate --model tiny --gpus 2 --optimizer muon   optimizer state per rank, Muon's tensors owned whole
  zeroshard estimate --params 1T --gpus 16 --gpus-per-node 16 --dtype fp16 --offload-optimizer nvme \\
      --offload-params nvme --gpu-mem 32GiB --host-mem 1.5TB --disk-mem 28TB     ZeRO-Infinity on one DGX-2 node
"""


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
    parser.add_argument("--gpus", type=positive_int, default=None, metavar="N",
                        help="GPUs (ranks) in all; without it, with --micro-batch and --seq, activations only")
    parser.add_argument("--gpus-per-node", type=positive_int, default=None, metavar="G",
                        help="GPUs per node (default: 8, or --gpus if fewer)")
    add_dtype(parser, "bf16", "training dtype: 16-bit params and grads with an fp32 master copy, or "
                              "fp32 throughout (default: %(default)s)")
    parser.add_argument("--optimizer-bytes", type=positive_int, default=None, metavar="K",
                        help="optimizer-state bytes per parameter, master copy included (default: "
                             "Adam's, 12 with bf16/fp16, 8 with fp32)")
    parser.add_argument("--gpu-mem", type=memory_size, default=None, metavar="SIZE",
                        help="memory per GPU, e.g. 80GB or 80GiB: also print the largest model that fits")
    parser.add_argument("--persistence-threshold", type=threshold, default=None, metavar="ELEMENTS",
                        help="with --model: stage3_param_persistence_threshold, parameters under it stay whole "
                             f"(default: 0 for a preset, {PERSISTENCE_THRESHOLD} for another model)")
    parser.add_argument("--tp", type=positive_int, default=1, metavar="T",
                        help="tensor-parallel ranks (gpt_tp_plan; a preset only): --gpus = pp x dp x tp "
                             "(default: %(default)s)")
    parser.add_argument("--pp", type=positive_int, default=1, metavar="P",
                        help="pipeline stages (GPTStage; a preset only) (default: %(default)s)")
    _add_zeropp(parser)
    add_offload(parser)
    add_compress(parser)
    add_activations(parser)
    add_optimizer_mix(parser)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (bytes; see zeroshard.estimate.summarize)")


def _add_zeropp(parser: argparse.ArgumentParser) -> None:
    """ZeRO++'s parts (stage 3), as the config's zero_quantized_weights, zero_hpz_partition_size and
    zero_quantized_gradients turn them on; a node is --gpus-per-node ranks."""
    zeropp = parser.add_argument_group("ZeRO++ (stage 3)")
    zeropp.add_argument("--zeropp", action="store_true", help="all three parts: --qwz --hpz --qgz")
    zeropp.add_argument("--qwz", action="store_true", help="int8 block-quantized weights in the forward all-gather")
    zeropp.add_argument("--hpz", action="store_true",
                        help="a secondary shard per node: later all-gathers stay inside the node "
                             "(zero_hpz_partition_size = --gpus-per-node)")
    zeropp.add_argument("--qgz", action="store_true", help="hierarchical block-quantized gradient reduce-scatter")
    zeropp.add_argument("--gradient-bits", type=int, choices=(4, 8), default=8,
                        help="qgZ's bits per gradient element (zeropp_gradient_bits; default: %(default)s)")
    zeropp.add_argument("--block-size", type=positive_int, default=128, metavar="B",
                        help="elements per quantization block (zeropp_block_size, and the codecs' block_size "
                             "with --compress; default: %(default)s)")


def zeropp_parts(args: argparse.Namespace) -> estimate.ZeroPP:
    """The ZeRO++ parts the flags ask for (none: plain stage 3)."""
    return estimate.ZeroPP(qwz=args.zeropp or args.qwz, hpz=args.zeropp or args.hpz, qgz=args.zeropp or args.qgz,
                           block_size=args.block_size, gradient_bits=args.gradient_bits)


def run(args: argparse.Namespace, console: Console | None = None) -> int:
    """Compute and print the estimate; returns the exit status."""
    setup = offload_setup(args)  # before the mesh: a flag that needs another is refused on both paths
    check_compress(args)
    saved = activations(args) if wants_activations(args) else None
    if args.gpus is None:
        if saved is None or args.compress is not None:
            args.command_parser.error("give --gpus for model states, or --model with --micro-batch and --seq "
                                      "for activations")
        return _print_activations_only(args, saved, console or Console())
    if saved is not None and args.tp * args.pp > 1:
        args.command_parser.error("activations with --tp/--pp are not counted per model part yet: drop "
                                  "--micro-batch/--seq, or use --tp 1 --pp 1")
    if args.tp * args.pp > 1:
        return run_mesh(args, console)
    name, largest_unit, flats, counted = None, args.largest_unit, None, None
    if args.model is not None:
        try:
            counted = count_model(args.model, None if args.wrap is None else tuple(args.wrap),
                                  args.auto_wrap_min_params, args.persistence_threshold, args.bucket_size)
        except ValueError as error:
            args.command_parser.error(f"argument --model: {error}")
        name, args.params, flats = counted.name, counted.numel, list(counted.flats)
        largest_unit = counted.largest_unit if largest_unit is None else largest_unit
    try:
        summary = estimate.summarize(args.params, args.gpus, args.gpus_per_node, args.dtype,
                                     args.optimizer_bytes, largest_unit or 0, args.gpu_mem, flats,
                                     zeropp_parts(args), setup)
    except ValueError as error:
        args.command_parser.error(str(error))
    if saved is not None:
        summary |= {"activations": saved, **peak_bytes(counted, saved, args)}
    if args.compress is not None:
        summary["compression"] = compression(args, counted, estimate.DTYPE_BYTES[args.dtype][:2])
    if args.optimizer is not None:
        summary["optimizer_mix"] = optimizer_mix(args)
    console = console or Console()
    if args.json:
        console.out(json.dumps(summary if name is None else {"model": name, **summary}, indent=2))
        return 0
    print_summary(console, summary, name)
    if saved is not None:
        print_activations(console, saved, summary["peak_by_part"])
    if args.compress is not None:
        print_compression(console, summary["compression"])
    if args.optimizer is not None:
        print_optimizer_mix(console, summary["optimizer_mix"])
    return 0


def _print_activations_only(args: argparse.Namespace, saved: dict, console: Console) -> int:
    if args.json:
        console.out(json.dumps({"model": args.model, "activations": saved}, indent=2))
    else:
        print_activations(console, saved, None)
    return 0


# Flags whose figures the per-part estimate does not model: refused rather than ignored.
_NOT_ON_MESH = (("zeropp", "--zeropp"), ("qwz", "--qwz"), ("hpz", "--hpz"), ("qgz", "--qgz"),
                ("gpu_mem", "--gpu-mem"), ("largest_unit", "--largest-unit"),
                ("persistence_threshold", "--persistence-threshold"), ("gpus_per_node", "--gpus-per-node"),
                ("offload_optimizer", "--offload-optimizer"), ("offload_params", "--offload-params"),
                ("optimizer", "--optimizer"))


def run_mesh(args: argparse.Namespace, console: Console | None = None) -> int:
    """Each model part's model-state bytes per rank on a pp x dp x tp mesh; returns the exit status."""
    error = args.command_parser.error
    if args.model not in PRESETS:
        error(f"--tp/--pp split the built-in GPT (GPTStage, gpt_tp_plan): give --model with a preset "
              f"({', '.join(sorted(PRESETS))}), or --tp 1 --pp 1 for --params or a transformers model")
    refused = [flag for key, flag in _NOT_ON_MESH if getattr(args, key)] + ["--compress"] * (args.compress is not None)
    if refused:
        error(f"{' '.join(refused)} with --tp/--pp: the per-part estimate covers model states only, without "
              "ZeRO++, persistent parameters, nodes, offload, codecs or a memory limit; drop those flags, or use "
              "--tp 1 --pp 1")
    replica = args.tp * args.pp  # the ranks of one data-parallel replica
    if args.gpus % replica:
        error(f"--gpus {args.gpus} is not a multiple of --pp {args.pp} x --tp {args.tp} = {replica} ranks "
              f"(dp = gpus / (pp x tp)): give --gpus a multiple of {replica}, or change --tp or --pp")
    try:
        parts = count_parts(args.model, args.pp, args.tp, None if args.wrap is None else tuple(args.wrap),
                            args.auto_wrap_min_params)
        summary = mesh_summary({key: (c.numel, c.largest_unit) for key, c in parts.items()}, args.gpus,
                               args.pp, args.tp, args.dtype, args.optimizer_bytes)
    except ValueError as why:
        error(f"--model {args.model} --tp {args.tp} --pp {args.pp}: {why}")
    summary = {"model": args.model, "params": count_model(args.model).numel, **summary}
    console = console or Console()
    if args.json:
        console.out(json.dumps(summary, indent=2))
    else:
        print_mesh(console, summary)
    return 0


def print_mesh(console: Console, summary: dict) -> None:
    """One row per model part and ZeRO stage: bytes per rank by model state."""
    console.print(f"[bold]Ψ = {summary['params']:,}[/] parameters ({human_count(summary['params'])}) from "
                  f"{summary['model']}")
    console.print(f"{summary['gpus']} GPUs as pp={summary['pp']} x dp={summary['dp']} x tp={summary['tp']}: "
                  f"{summary['replica_numel']:,} elements in one replica's {len(summary['parts'])} parts")
    console.print(f"{summary['dtype']}, K = {summary['optimizer_bytes']} optimizer bytes per parameter")
    table = Table(show_edge=False)
    for column in ("part", "elements", "stage", "params", "grads", "master", "optimizer", "memory"):
        table.add_column(column, justify="left" if column in ("part", "stage") else "right", no_wrap=True)
    for name, part in summary["parts"].items():
        for stage, states in part["memory_by_state"].items():
            head = (name, f"{part['numel']:,}") if stage == "0" else ("", "")
            table.add_row(*head, stage, *(human_bytes(states[k]) for k in ("params", "grads", "master", "optimizer")),
                          human_bytes(part["memory_bytes"][stage]), end_section=stage == "3")
    console.print(table)
    console.print("[dim]memory: model states per GPU of the part, ZeRO over dp (no activations)\n"
                  "elements: local, tp chunks + whole replicated tensors + the tied head copy\n"
                  "stage 3: with the largest unit gathered, its parameters and gradients[/]")


def _formulas(summary: dict) -> dict[str, str]:
    """Each stage's memory formula with this setup's bytes per element."""
    p, g, k = (*estimate.DTYPE_BYTES[summary["dtype"]][:2], summary["optimizer_bytes"])
    hpz = f" + {p}Ψ/D" if "hpz_secondary" in summary["memory_by_state"]["3"] else ""  # D: GPUs per node
    return {"0": f"{p + g + k}Ψ", "1": f"{p + g}Ψ + {k}Ψ/N", "2": f"{p}Ψ + {g + k}Ψ/N",
            "3": f"{p + g + k}Ψ/N + {2 * p}U{hpz}"}


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
    if nodes > 1 and summary["cross_node_bytes_zeropp"] is not None and summary["zeropp"] is None:
        # The paper's claim, on one flat of Ψ; with parts chosen, the table below gives them exactly.
        model = summary["stage3_model_bytes"]
        console.print(f"stage 3 with ZeRO++ (qwZ + hpZ + qgZ): cross-node "
                      f"{human_bytes(summary['cross_node_bytes_zeropp'])} per GPU per step instead of "
                      f"{human_bytes(summary['cross_node_bytes']['3'])} "
                      f"(3M -> {summary['cross_node_bytes_zeropp'] / model:.3g}M)")
    print_stage3(console, summary)
    if summary["offload"] is not None:
        print_offload(console, summary["offload"])
    notes = ["memory: model states per GPU (no activations or buffers); U: the largest unit",
             "comm: logical bytes per step summed over collectives, as engine.comm_stats() records "
             "them (an all-reduce counts its buffer once)",
             "sent: bytes each rank sends on rings, the paper's 2Ψ (stages 0-2) or 3Ψ (stage 3) "
             "elements × (N-1)/N"]
    notes += ["cross-node: per GPU, in the papers' M units"] * (nodes > 1)
    notes.append("stage 3 by scope: logical bytes per step (one micro-step) as engine.comm_stats() records them "
                 "by scope; M = parameter bytes of the model")
    if fits is not None:
        notes.append(f"max Ψ: the largest model whose states fit {human_bytes(summary['gpu_mem_bytes'])} per GPU")
    console.print("[dim]" + "\n".join(notes) + "[/]")


def _parts_name(parts: dict) -> str:
    return "+".join(name for key, name in (("qwz", "qwZ"), ("hpz", "hpZ"), ("qgz", "qgZ")) if parts[key])


def print_stage3(console: Console, summary: dict) -> None:
    """Stage 3's logical bytes per step by op and scope, plain and with the chosen ZeRO++ parts, in M too."""
    setups = summary["stage3_comm_by_scope"]
    model = summary["stage3_model_bytes"] or 1
    flats, parts = summary["stage3_flats"], summary["zeropp"]
    caption = f"[bold]stage 3 per step by scope[/], {flats} flat buffer{'s' * (flats != 1)}"
    if parts:
        caption += (f"; ZeRO++ blocks of {parts['block_size']}"
                    + f", int{parts['gradient_bits']} gradients" * parts["qgz"])
    console.print(caption)
    table = Table(show_edge=False)
    table.add_column("op")
    table.add_column("scope")
    names = {"plain": "plain", "zeropp": _parts_name(parts) if parts else ""}
    for setup in setups:
        table.add_column(names[setup], justify="right", no_wrap=True)
    rows = [(op, scope) for op in ("all_gather", "reduce_scatter") for scope in ("node", "cross_node")
            if any(scope in setups[s][op] for s in setups)]
    cell = lambda b: f"{human_bytes(b)} ({b / model:.4g}M)"
    for op, scope in rows:
        table.add_row(op, scope, *[cell(setups[s][op].get(scope, 0)) for s in setups])
    for scope in ("node", "cross_node"):
        totals = [estimate.by_scope(setups[s]).get(scope, 0) for s in setups]
        if any(totals):
            table.add_row("total", scope, *map(cell, totals))
    console.print(table)
    secondary = summary["memory_by_state"]["3"].get("hpz_secondary")
    if secondary is not None:
        console.print(f"hpZ secondary shards: {human_bytes(secondary)} per GPU from the first forward to the step "
                      f"({secondary / model:.4g}M, 1/D of the parameters; in stage 3's memory above)")
