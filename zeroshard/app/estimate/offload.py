"""`zeroshard estimate`'s offload part: the flags of ZeRO-Offload and ZeRO-Infinity and the three pools' table.

The figures are `zeroshard.estimate.offload_summary`'s: per stage, bytes per
GPU (rank) in the device, host and disk pools by kind, the host memory that
pinning takes, host and disk per node (a node's ranks share its memory and
disks), and the largest model that fits the three.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from zeroshard.app.flags import positive_float
from zeroshard.app.units import count, human_bytes, human_count, memory_size
from zeroshard.config.zero import ZeroConfig
from zeroshard.estimate import offload as off

# Offload flags that only mean something with another: (dest, flag, what it needs, the test of args).
_NEEDS = (
    ("offload_ratio", "--offload-ratio", "--offload-optimizer", lambda a: a.offload_optimizer),
    ("reduce_bucket_size", "--reduce-bucket-size", "--offload-optimizer", lambda a: a.offload_optimizer),
    ("pin_memory", "--pin-memory", "--offload-optimizer or --offload-params",
     lambda a: a.offload_optimizer or a.offload_params),
    ("host_mem", "--host-mem", "--offload-optimizer or --offload-params",
     lambda a: a.offload_optimizer or a.offload_params),
    ("disk_mem", "--disk-mem", "an nvme offload", lambda a: "nvme" in (a.offload_optimizer, a.offload_params)),
    ("buffer_count", "--buffer-count", "--offload-optimizer nvme", lambda a: a.offload_optimizer == "nvme"),
    ("sub_group_size", "--sub-group-size", "--offload-optimizer nvme", lambda a: a.offload_optimizer == "nvme"),
    ("param_buffer_count", "--param-buffer-count", "--offload-params nvme", lambda a: a.offload_params == "nvme"),
    ("param_buffer_size", "--param-buffer-size", "--offload-params nvme", lambda a: a.offload_params == "nvme"),
    ("max_in_cpu", "--max-in-cpu", "--offload-params nvme", lambda a: a.offload_params == "nvme"),
)
# The layout flags' defaults: DeepSpeed's offload blocks (estimate/offload.py), zeroshard's reduce bucket.
_LAYOUT_DEFAULTS = {"buffer_count": off.BUFFER_COUNT, "sub_group_size": off.SUB_GROUP_SIZE,
                    "param_buffer_count": off.PARAM_BUFFER_COUNT, "param_buffer_size": off.PARAM_BUFFER_SIZE,
                    "max_in_cpu": off.MAX_IN_CPU,
                    "reduce_bucket_size": ZeroConfig.model_fields["reduce_bucket_size"].default}


def add_offload(parser: argparse.ArgumentParser) -> None:
    """ZeRO-Offload and ZeRO-Infinity, as the config's offload_optimizer and offload_param blocks."""
    group = parser.add_argument_group("offload (ZeRO-Offload, ZeRO-Infinity): pools per GPU, host and disk per node")
    group.add_argument("--offload-optimizer", choices=("cpu", "nvme"), default=None,
                       help="fp32 master and optimizer state on the host or on disk (stages 1-3)")
    group.add_argument("--offload-params", choices=("cpu", "nvme"), default=None,
                       help="stage 3's parameter shards on the host or on disk (stage 3 only)")
    group.add_argument("--offload-ratio", type=positive_float, default=None, metavar="R",
                       help="the fraction of the optimizer state offloaded (offload_optimizer.ratio), in (0, 1] "
                            "(default: 1)")
    group.add_argument("--pin-memory", action="store_true", help="pin the host buffers the GPU copies from and to")
    group.add_argument("--host-mem", type=memory_size, default=None, metavar="SIZE",
                       help="host memory per node, e.g. 1.5TB: with --gpu-mem, bounds the largest model")
    group.add_argument("--disk-mem", type=memory_size, default=None, metavar="SIZE",
                       help="NVMe space per node, e.g. 3TB: with --gpu-mem, bounds the largest model")
    for flag, key in (("--reduce-bucket-size", "reduce_bucket_size: the gradient elements in flight to the host"),
                      ("--buffer-count", "offload_optimizer.buffer_count"), ("--sub-group-size", "sub_group_size"),
                      ("--param-buffer-count", "offload_param.buffer_count"),
                      ("--param-buffer-size", "offload_param.buffer_size"),
                      ("--max-in-cpu", "offload_param.max_in_cpu")):
        default = _LAYOUT_DEFAULTS[flag[2:].replace("-", "_")]
        group.add_argument(flag, type=count, default=None, metavar="N", help=f"{key} (default: {default:.3g})")


def offload_setup(args: argparse.Namespace) -> off.OffloadSetup | None:
    """The offload the flags ask for (None: none); a flag that needs another is an argparse error."""
    for dest, flag, needs, given in _NEEDS:
        if getattr(args, dest) not in (None, False) and not given(args):
            args.command_parser.error(f"{flag} needs {needs}: without it the flag changes nothing")
    if args.offload_ratio is not None and args.offload_ratio > 1:
        args.command_parser.error(f"--offload-ratio must be in (0, 1]: the fraction of the optimizer state "
                                  f"offloaded; got {args.offload_ratio}")
    if not (args.offload_optimizer or args.offload_params):
        return None
    if args.zeropp or args.hpz:
        args.command_parser.error("--hpz (or --zeropp) with --offload-optimizer or --offload-params: the offload "
                                  "pools leave out hpZ's secondary shards; drop --hpz, or the offload flags")
    sizes = {key: default if getattr(args, key) is None else getattr(args, key)
             for key, default in _LAYOUT_DEFAULTS.items()}
    return off.OffloadSetup(optimizer=args.offload_optimizer or "none", param=args.offload_params or "none",
                       ratio=1.0 if args.offload_ratio is None else args.offload_ratio,
                       pin_memory=args.pin_memory, host_mem=args.host_mem, disk_mem=args.disk_mem, **sizes)


_KINDS = ("params", "grads", "master", "optimizer", "staging")  # offload.KINDS, in the table's order


def print_offload(console: Console, offload: dict) -> None:
    """One row per stage and pool (disk only when used): bytes per GPU by kind, the total, and per node;
    then the pinned host memory and the largest model that fits."""
    where = {"none": "on the GPU", "cpu": "in host memory", "nvme": "on disk"}
    share = "" if offload["ratio"] == 1 else f" ({offload['ratio']:g} of it, {offload['offloaded_numel']:,} elements)"
    console.print(f"[bold]offload[/]: optimizer state {where[offload['optimizer']]}{share}, parameters "
                  f"{where[offload['params']]}; per GPU, and per node of {offload['ranks_per_node']}")
    disk = any(offload["disk_per_node"].values())
    pools = [pool for pool in off.POOLS if pool != "disk" or disk]
    table = Table(show_edge=False)
    for column in ("stage pool", "params", "grads", "master", "optim", "staging", "total", "per node"):
        table.add_column(column, justify="left" if column == "stage pool" else "right", no_wrap=True)
    for stage in offload["device"]:
        for pool in pools:
            kinds = offload[pool][stage]
            node = "" if pool == "device" else human_bytes(offload[f"{pool}_per_node"][stage])
            table.add_row(f"{stage} {pool}", *(human_bytes(kinds[k]) for k in _KINDS),
                          human_bytes(sum(kinds.values())), node, end_section=pool == pools[-1])
    console.print(table)
    by_value: dict[int, list[str]] = {}  # stages with the same figure share a clause
    for stage, rank_bytes in offload["pinned"].items():
        by_value.setdefault(rank_bytes, []).append(stage)
    pinned = "; ".join(f"{human_bytes(b)} per GPU, {human_bytes(offload['pinned_per_node'][s[0]])} per node "
                       f"(stage{'s' * (len(s) > 1)} {', '.join(s)})" for b, s in by_value.items())
    console.print(f"pinned host memory: {pinned}" if offload["layout"]["pin_memory"]
                  else "pinned host memory: none (no --pin-memory)")
    fits = offload["largest_model"]
    if fits is not None:
        limits = [f"{human_bytes(offload['gpu_mem_bytes'])} per GPU"] + [
            f"{_limit(offload[f'{p}_mem_bytes'])} of {p} per node" for p in ("host", "disk")[:1 + disk]]
        console.print(f"max Ψ with the pools within {', '.join(limits)}: "
                      + ", ".join(f"stage {s} {_fit(n)}" for s, n in fits.items()))
    console.print("[dim]offload: model states only (no activations, CUDA context or allocator); device staging: the "
                  "gradient bucket in flight to the host; host staging: the disk buffers; optim: optimizer state"
                  + "; max Ψ -: no limit bounds it" * (fits is not None and None in fits.values()) + "[/]")


def _limit(size: int | None) -> str:
    return "no limit" if size is None else human_bytes(size)


def _fit(numel: int | None) -> str:
    return "-" if numel is None else human_count(numel)
