"""`zeroshard train --offload cpu|nvme [--offload-params] [--nvme-path DIR]`: the demo with ZeRO-Offload.

The flags set `zero_optimization.offload_optimizer` (each rank's fp32 master
shard and AdamW state in host memory or in swap files, stepped on the CPU)
and, at stage 3, `offload_param` on the same device (ZeRO-Infinity's
parameter shards). The report then shows each rank's three memory pools
(device, host, disk) from `engine.memory_stats(pool)` beside
`estimate.offload_pool_bytes`, the layout the engine implements.

Without --nvme-path, disk offload writes under a directory of the system's
temp dir named after the torchrun run (every rank of a run on this machine
names the same one, and each rank has its own files there): made before the
engine, removed after it once every rank's files are gone.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch.distributed as dist

import zeroshard
from zeroshard.app.errors import UsageError
from zeroshard.app.flags import true_or_false
from zeroshard.estimate.offload import offload_pool_bytes

_STEP_COUNTER_BYTES = 4  # torch's AdamW keeps one fp32 `step` per master, beside it in memory (host for a disk one)


def add_offload(parser: argparse.ArgumentParser) -> None:
    """--offload, --offload-params, --nvme-path."""
    parser.add_argument("--offload", choices=("none", "cpu", "nvme"), default=None,
                        help="ZeRO-Offload: each rank's fp32 master shard and AdamW state in host memory (cpu) or "
                             "in swap files on disk (nvme), stepped on the CPU; stages 1-3 (default: none, or the "
                             "config's)")
    parser.add_argument("--offload-params", type=true_or_false, nargs="?", const=True, default=False,
                        metavar="true|false",
                        help="with --offload and --stage 3: the parameter shards too, on the same device, read "
                             "back before each gather (ZeRO-Infinity); with nvme every shard goes to disk "
                             "(max_in_cpu 0) unless --config sets max_in_cpu")
    parser.add_argument("--nvme-path", metavar="DIR", default=None,
                        help="with --offload nvme: the directory each rank's swap files go under (default: a new "
                             "one in the system temp dir, named in the output and removed at the end)")


def default_nvme_path() -> Path:
    """The default --nvme-path: one directory per torchrun run (its run id and rendezvous port: torchrun's run id
    is "none" for every run without --rdzv-id; the process id outside torchrun)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    run = f"{run}-{os.environ.get('MASTER_PORT', '')}" if run else str(os.getpid())
    return Path(tempfile.gettempdir()) / f"zeroshard-offload-{run}"


def offload_keys(args: argparse.Namespace, zero: dict, file: str | None) -> None:
    """Set `zero` (zero_optimization, flags applied) from the offload flags; the file's other keys stay.

    Raises UsageError, naming the flag to change, for flags that cannot work together.
    """
    if args.offload_params and args.offload in (None, "none"):
        raise UsageError("--offload-params puts the parameter shards on the device --offload names: "
                                    "give --offload cpu or --offload nvme with it")
    if args.offload is not None:
        if args.offload != "none" and zero["stage"] == 0:
            raise UsageError(f"--offload {args.offload} needs --stage 1, 2 or 3: stage 0 shards "
                                        "nothing, so every rank steps all parameters on the device; add --stage 1 "
                                        "or more, or drop --offload")
        zero["offload_optimizer"] = dict(zero.get("offload_optimizer") or {}, device=args.offload)
    if args.offload_params:
        if zero["stage"] != 3:
            raise UsageError(f"--offload-params needs --stage 3: only stage 3 shards the parameters "
                                        f"(stage {zero['stage']} keeps them whole on every rank); add --stage 3, "
                                        "or drop --offload-params")
        block = dict(zero.get("offload_param") or {}, device=args.offload)
        if args.offload == "nvme" and file is None:  # the demo's shards on disk, not all kept in host memory
            block.setdefault("max_in_cpu", 0)
        zero["offload_param"] = block
    on_disk = [name for name in ("offload_optimizer", "offload_param")
               if (zero.get(name) or {}).get("device") == "nvme"]
    if args.nvme_path is not None and not on_disk:
        raise UsageError("--nvme-path is where disk offload writes: give --offload nvme with it")
    for name in on_disk:
        if args.nvme_path is not None or not zero[name].get("nvme_path"):
            zero[name]["nvme_path"] = args.nvme_path or str(default_nvme_path())


def make_default_nvme_path(config: zeroshard.Config) -> Path | None:
    """Create the default swap directory if the config's disk offload uses it; returns it (None if not used)."""
    zero = config.zero_optimization
    default = str(default_nvme_path())
    if default not in (zero.offload_optimizer.nvme_path, zero.offload_param.nvme_path):
        return None
    os.makedirs(default, exist_ok=True)
    return Path(default)


def remove_default_nvme_path(path: Path | None) -> None:
    """Remove the default swap directory once it is empty (each rank's engine removes its own files; the
    last rank to get here removes the directory)."""
    if path is None:
        return
    try:
        path.rmdir()
    except OSError:  # another rank's files are still there (it removes the directory), or it is gone already
        pass


# -- the report -----------------------------------------------------------------------------

def offloaded(config: zeroshard.Config) -> bool:
    zero = config.zero_optimization
    return zero.offload_optimizer.enabled or zero.offload_param.enabled


def pool_formula(engine: zeroshard.Engine, per_element: dict[str, int]) -> dict:
    """`estimate.offload_pool_bytes` for this engine's layout, with AdamW's step counters added where each
    master's counters live, and to the host's staging the disk buffers' alignment and bounce buffers:
    {"device", "host", "disk": {kind: bytes}, "pinned": bytes}."""
    zero = engine.config.zero_optimization
    opt, param = zero.offload_optimizer, zero.offload_param
    psi = sum(b.flat.padded_numel for b in engine.buckets)
    pools = offload_pool_bytes(
        psi, dist.get_world_size(), zero.stage, **per_element, offload_optimizer=opt.device,
        offload_param=param.device, offloaded_numel=sum(b.flat.shard_numel for b in engine.buckets if b.offload),
        reduce_bucket_size=zero.reduce_bucket_size, reduce_bytes=engine.precision.reduce_dtype.itemsize,
        buffer_count=opt.buffer_count, sub_group_size=zero.sub_group_size, param_buffer_count=param.buffer_count,
        param_buffer_size=param.buffer_size, max_in_cpu=param.max_in_cpu, pin_memory=opt.pin_memory,
        param_pin_memory=param.pin_memory, largest_shard=engine.offload.largest_shard(engine.units))
    for bucket in engine.buckets:
        pools["host" if bucket.offload else "device"]["optimizer"] += _STEP_COUNTER_BYTES
    pools["host"]["staging"] += engine.offload.buffer_overhead()  # alignment and bounce buffers: rank 0's
    return pools
