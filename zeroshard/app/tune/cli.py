"""`zeroshard tune`: the fastest configuration that fits the memory given, found by estimate and by measurement.

It lists the candidate configurations (tune/candidates.py), predicts each
one's peak memory per rank and step time (tune/step_time.py) after one
calibration launch, rejects those that do not fit with their reason,
measures the best few in real trials of the demo's training program under
the memory limit (tune/trials.py), and writes the fastest that ran as a
DeepSpeed-style config (tune/config.py). The search is tune/search.py, the
table tune/report.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from rich.console import Console

from zeroshard.app.flags import add_command, add_dtype, positive_float, positive_int
from zeroshard.app.models import PRESETS
from zeroshard.app.tune.candidates import Setup
from zeroshard.app.tune.config import ds_config, write_config
from zeroshard.app.tune.report import print_search, search_dict
from zeroshard.app.tune.search import TuneError, search
from zeroshard.app.tune.trials import choose_limit
from zeroshard.app.units import memory_size

EXAMPLES = """\
examples:
  zeroshard tune --device-mem 350MB --global-batch 64    the demo GPT on 2 ranks: the fastest of stages 0-3,
                                                          micro-batches and checkpointing that fits 350 MB a rank
  zeroshard tune --model 100m --device-mem 1.8GB --global-batch 8 --micro-batches 1 2 4 --top 4
  zeroshard tune --model 100m --nproc-per-node 4 --nodes 2 --device-mem 3GB    ZeRO++ among the candidates
  zeroshard tune --model gpt2 --seq 512 --device-mem 40GB --top 0 --json       by the estimate alone
"""


def memory_bytes(text: str) -> int:
    """argparse type: bytes, as a whole number or with a unit (9.5GB, 8GiB); under 1 MiB is taken for a
    forgotten unit (no training step fits in it)."""
    size = int(text) if text.strip().isdigit() and int(text) > 0 else memory_size(text)
    if size < 1 << 20:
        fix = f"give a unit, as in {text.strip()}MB or {text.strip()}GB" if text.strip().isdigit() else \
            "give the memory per rank"
        raise argparse.ArgumentTypeError(f"{text!r} is {size} bytes, less than any training step needs: {fix}")
    return size


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register `zeroshard tune` and its flags."""
    parser = add_command(
        commands, "tune", help="find the fastest ZeRO configuration that fits a memory limit, and write it",
        description="List the configurations of a model on N ranks (ZeRO stage, micro-batch and accumulation,\n"
                    "activation checkpointing, offload and ZeRO++ where they apply), predict each one's peak\n"
                    "memory per rank and step time, reject those that do not fit the memory given (saying\n"
                    "why), run the best few for a few steps under that limit, and write the fastest that ran\n"
                    "as a DeepSpeed-style config for `zeroshard train --config`.", epilog=EXAMPLES)
    parser.add_argument("--model", default="demo", metavar="NAME_OR_CONFIG",
                        help="a demo preset, or (with --top 0) a transformers model type, config.json or "
                             "save_pretrained directory (default: %(default)s)")
    parser.add_argument("--nproc-per-node", "--nproc", dest="nproc", type=positive_int, default=2, metavar="N",
                        help="ranks on this machine (default: %(default)s)")
    parser.add_argument("--nodes", type=positive_int, default=1, metavar="K",
                        help="declare the ranks K nodes, as `zeroshard train --nodes` (ZeRO++ becomes a candidate)")
    add_dtype(parser, "fp32", "training dtype (default: %(default)s)")
    parser.add_argument("--device-mem", type=memory_bytes, required=True, metavar="SIZE",
                        help="memory per rank: a GPU's, or without GPUs each rank's share of host memory "
                             "(bytes, or 9.5GB, 8GiB)")
    parser.add_argument("--host-mem", type=memory_bytes, default=None, metavar="SIZE",
                        help="with GPUs: host memory per node, for offload to the CPU")
    parser.add_argument("--disk-mem", type=memory_bytes, default=None, metavar="SIZE",
                        help="disk per node under --nvme-path, for offload to nvme")
    parser.add_argument("--nvme-path", default=None, metavar="DIR", help="where offload to nvme writes")
    parser.add_argument("--micro-batches", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                        metavar="B", help="micro-batches to try (default: 1 2 4 8 16 32)")
    parser.add_argument("--global-batch", type=positive_int, default=None, metavar="ROWS",
                        help="rows per optimizer step to keep: accumulation = ROWS / (micro-batch x ranks) "
                             "(default: none, accumulation 1, ranked by rows per second)")
    parser.add_argument("--seq", type=positive_int, default=None, metavar="S",
                        help="tokens per row (default: a preset's block size, which its trials train at)")
    _add_search(parser)


def _add_search(parser: argparse.ArgumentParser) -> None:
    search = parser.add_argument_group("search")
    search.add_argument("--top", type=int, default=3, metavar="T",
                        help="measure the T fastest predicted in trials (0: choose by the estimate alone) "
                             "(default: %(default)s)")
    search.add_argument("--steps", type=positive_int, default=3, metavar="K",
                        help="optimizer steps per trial; its step time is the median after the first "
                             "(default: %(default)s)")
    search.add_argument("--trial-timeout", type=positive_float, default=300.0, metavar="SECONDS",
                        help="kill a trial's ranks after this long (default: %(default)s)")
    search.add_argument("--limit-with", choices=("auto", "cgroup", "rlimit"), default="auto",
                        help="how trials are held to --device-mem: a memory cgroup per rank (root, cgroup v1), "
                             "RLIMIT_DATA, or auto: the cgroup where possible (default: %(default)s)")
    search.add_argument("--out", default="ds_config.json", metavar="FILE",
                        help="the chosen config (default: %(default)s)")
    search.add_argument("--trials-dir", default=None, metavar="DIR",
                        help="keep each trial's config and rank logs here (default: a temporary directory)")
    search.add_argument("--json", action="store_true", help="print one JSON object (bytes, seconds)")


def make_setup(args: argparse.Namespace) -> Setup:
    """The Setup of the flags; a flag that cannot work is a usage error naming it."""
    error = args.command_parser.error
    if args.nproc % args.nodes:
        error(f"argument --nodes: {args.nodes} nodes must divide the {args.nproc} ranks of --nproc-per-node")
    on_gpu = torch.cuda.is_available()
    if args.host_mem is not None and not on_gpu:
        error("argument --host-mem: without a GPU the ranks' device memory is host memory: --device-mem is "
              "each rank's limit; drop --host-mem")
    if (args.disk_mem is None) != (args.nvme_path is None):
        error("--disk-mem and --nvme-path go together: offload to nvme needs the directory and its size")
    if args.model not in PRESETS and args.top > 0:
        error(f"argument --model: trials train the built-in presets ({', '.join(sorted(PRESETS))}), not "
              f"'{args.model}': give one of them, or --top 0 (with --seq) to rank a transformers model type, "
              "config.json or save_pretrained directory by the estimate alone")
    if args.top > 0 and args.steps < 2:
        error("argument --steps: a trial's step time is the median of its steps after the first (which "
              "compiles, allocates and warms up): give 2 or more")
    if args.trials_dir is not None and Path(args.trials_dir).exists():
        if not Path(args.trials_dir).is_dir():
            error(f"argument --trials-dir: {args.trials_dir} is a file; give a directory (it is made if missing)")
        if any(Path(args.trials_dir).iterdir()):  # an earlier search's trials would sit beside this one's
            error(f"argument --trials-dir: {args.trials_dir} is not empty; give a new or empty directory")
    seq = args.seq
    if args.model in PRESETS:
        block = PRESETS[args.model].block_size
        if seq not in (None, block):
            error(f"argument --seq: the trials train '{args.model}' at its block size of {block} tokens; "
                  f"drop --seq or give {block}")
        seq = block
    elif seq is None:
        error(f"argument --seq: give the tokens per row for '{args.model}'")
    batches = tuple(sorted(set(args.micro_batches)))
    if args.global_batch is not None:
        _check_global_batch(error, args.global_batch, batches, args.nproc)
    return Setup(args.model, args.nproc, args.nodes, args.dtype, seq, args.device_mem, batches, args.global_batch,
                 args.host_mem, args.disk_mem, args.nvme_path, on_gpu)


def _check_global_batch(error, rows: int, batches: tuple[int, ...], ranks: int) -> None:
    """Every rank takes micro-batch rows per micro-step, so the global batch must be a multiple of the ranks
    and of some micro-batch x ranks."""
    if rows % ranks:
        error(f"argument --global-batch: {rows} rows cannot be split over {ranks} ranks; give a multiple of "
              f"{ranks}")
    if all(rows % (b * ranks) for b in batches):
        fitting = [b for b in range(1, rows // ranks + 1) if (rows // ranks) % b == 0]
        error(f"argument --global-batch: no micro-batch of {' '.join(map(str, batches))} x {ranks} ranks "
              f"divides {rows} rows; micro-batches that do: {' '.join(map(str, fitting))}")


def run(args: argparse.Namespace, console: Console | None = None) -> int:
    """Search, write the choice, print the table (or JSON); returns the exit status (1: nothing ran)."""
    setup = make_setup(args)
    console = console or Console()
    _log_progress()
    workdir = Path(args.trials_dir or tempfile.mkdtemp(prefix="zeroshard-tune-"))
    workdir.mkdir(parents=True, exist_ok=True)
    keep = args.trials_dir is not None
    try:
        limit = choose_limit(args.limit_with, None if setup.on_gpu else setup.device_mem)
        found = search(setup, limit, args.top, args.steps, args.trial_timeout, workdir)
    except ValueError as error:  # a model that cannot be counted or trained, a limit that cannot be set
        args.command_parser.error(str(error))
    except TuneError as error:
        keep = True  # the message names the logs in it
        print(f"zeroshard tune: {error}", file=sys.stderr)
        return 1
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    config = ds_config(found.choice.candidate, setup) if found.choice else None
    out = Path(args.out) if config is not None else None
    if config is not None:
        write_config(out, config)
    if args.json:
        console.out(json.dumps(search_dict(found, config, out), indent=2))
    else:
        print_search(console, found, out)
    return 0 if config is not None else 1


def _log_progress() -> None:
    """The search's progress lines (each trial as it starts and ends) on stderr."""
    logger = logging.getLogger("zeroshard.app.tune.search")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
