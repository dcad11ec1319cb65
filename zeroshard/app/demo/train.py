"""The built-in demo: train a small character-level GPT with zeroshard on every rank.

Run one process per rank under torchrun (`zeroshard train` launches them):
`python -m zeroshard.app.demo.train --stage 2 ...`. Rank 0 shows a progress bar and,
at the end, a sample of generated text and a report that puts the measured
per-rank memory and per-step communication next to the formulas of
`zeroshard.estimate`.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

import zeroshard
from zeroshard.app.demo.data import CharCorpus, load_text, micro_batch
from zeroshard.app.demo.config import DEMO_CONFIG, demo_model_config
from zeroshard.app.flags import (
    add_data,
    add_dtype,
    add_mesh,
    add_micro_batch,
    add_model,
    add_steps,
    as_argv,
    positive_float,
    positive_int,
    true_or_false,
)
from zeroshard.app.models import GPT
from zeroshard.app.demo.report import print_report, report_figures
from zeroshard.app.errors import UsageError
from zeroshard.app.demo.restart import completed, keep_global_batch, resume, resume_source, save
from zeroshard.app.demo.run_log import StepLog, write_report
from zeroshard.app.demo.compress import add_compress, compress_keys
from zeroshard.app.demo.offload import add_offload, make_default_nvme_path, offload_keys, remove_default_nvme_path
from zeroshard.app.demo.mesh import on_mesh, resolve_defaults, train_on_mesh

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The training flags, shared by `zeroshard train` and `python -m zeroshard.app.demo.train`."""
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="zeroshard/DeepSpeed JSON config; the engine flags below override its keys "
                             "(default: the demo's settings)")
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=None,
                        help="ZeRO stage: 0 = plain data parallel, 1 = shard optimizer states, "
                             "2 = also shard gradients, 3 = also shard parameters (default: 2, or the config's)")
    add_steps(parser, 200)  # under a minute on two idle CPU cores; the loss falls from 4.2 to about 2.3
    add_data(parser)
    add_model(parser, None, "GPT size preset (default: demo; tiny with --tp or --pp)")
    add_micro_batch(parser, None, "sequences per rank per micro-step (default: 16, or the config's)")
    parser.add_argument("--accumulation", type=positive_int, default=None, metavar="STEPS",
                        help="micro-steps accumulated per optimizer step (default: 1, or the config's)")
    parser.add_argument("--bucket-size", type=positive_int, default=None, metavar="ELEMENTS",
                        help="parameter elements per communication bucket (default: 50000; with --config the "
                             "file's reduce_bucket_size, or the engine's own default where it sets none)")
    parser.add_argument("--reduce-scatter", type=true_or_false, default=None, metavar="true|false",
                        help="false: all-reduce the gradients and keep a slice, for comparison "
                             "(default: true, or the config's)")
    parser.add_argument("--zeropp", type=true_or_false, nargs="?", const=True, default=False, metavar="true|false",
                        help="with --stage 3: ZeRO++'s qwZ (int8 weight gathers), hpZ (backward gathers inside "
                             "the node) and qgZ (int8 gradients, reduced in two hops), on the nodes of --nodes")
    parser.add_argument("--nodes", type=positive_int, default=None, metavar="K",
                        help="declare this machine's ranks to be K nodes (emulated: for ZeRO++ and for bytes "
                             "inside / across nodes in the report); default: one node per machine")
    parser.add_argument("--lr", type=positive_float, default=6e-3,
                        help="peak AdamW learning rate, after a linear warm-up over the first 5%% "
                             "of steps and before a cosine decay to a tenth (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.add_argument("--sample", type=int, default=80, metavar="CHARS",
                        help="characters the trained model writes for the report (0: none) (default: %(default)s)")
    parser.add_argument("--report", metavar="DIR", default=None,
                        help="write report.json (every figure of the run), loss.png and memory.png here")
    parser.add_argument("--log-csv", metavar="FILE", default=None,
                        help="append one CSV row per step: step, loss, lr, step_seconds, tokens_per_second")
    parser.add_argument("--log-every", type=positive_int, default=None, metavar="STEPS",
                        help="print a log line every STEPS steps (default: a tenth of --steps)")
    parser.add_argument("--save-every", type=positive_int, default=None, metavar="STEPS",
                        help="save a sharded checkpoint every STEPS steps and after the last one, "
                             "in --save-dir (default: no checkpoints)")
    parser.add_argument("--save-dir", metavar="DIR", default="checkpoints",
                        help="where --save-every writes its checkpoints, one directory per step, and "
                             "'latest' names the newest (default: %(default)s)")
    parser.add_argument("--async-save", type=true_or_false, nargs="?", const=True, default=None, metavar="true|false",
                        help="write each checkpoint in the background from a copy in host memory; it becomes "
                             "'latest' once every rank's file is complete (default: false, or the config's)")
    parser.add_argument("--resume", metavar="PATH", default=None,
                        help="continue from a checkpoint: a --save-dir (its latest) or one step's directory; "
                             "any --nproc and --stage can read it. --steps counts from the first step and lays "
                             "out the LR schedule: give the first run's to reproduce it")
    add_dtype(parser, None, "training dtype: bf16 or fp16 train 16-bit parameters with fp32 master weights "
                            "(fp16 with dynamic loss scaling) (default: fp32, or the config's)")
    add_offload(parser)  # --offload, --offload-params, --nvme-path: app/demo/offload.py
    add_compress(parser)  # --compress: app/demo/compress.py
    add_mesh(parser)  # --tp, --pp, --micro-batches: a run on a mesh is app/demo/mesh.py's


_PATH_FLAGS = ("config", "data", "report", "log_csv", "save_dir", "resume", "nvme_path")  # made absolute: workers may start elsewhere


def to_argv(args: argparse.Namespace) -> list[str]:
    """The training flags of `args` as a command line for `python -m zeroshard.app.demo.train`."""
    flags = argparse.ArgumentParser(add_help=False)
    add_arguments(flags)
    return as_argv(args, vars(flags.parse_args([])), _PATH_FLAGS)  # every flag add_arguments declares


# flag -> the dotted config keys it sets.
_FLAG_KEYS = {
    "stage": ("zero_optimization.stage",),
    "micro_batch": ("train_micro_batch_size_per_gpu",),
    "accumulation": ("gradient_accumulation_steps",),
    # The engine buckets by the smaller of the two sizes; set both so the flag means it.
    "bucket_size": ("zero_optimization.reduce_bucket_size", "zero_optimization.allgather_bucket_size"),
    "reduce_scatter": ("zero_optimization.reduce_scatter",),
    "async_save": ("checkpoint.async_save",),
}


def engine_config(args: argparse.Namespace) -> zeroshard.Config:
    """The config: --config's file (or the demo's settings), with the engine flags given on top.

    A flag that changes a value the file sets is logged, so the run says
    which wins. Sets args.stage, .micro_batch, .accumulation, .reduce_scatter
    from the result. Raises zeroshard.ConfigError for a bad file.
    """
    if args.config is not None:
        raw = zeroshard.Config.load(args.config).to_dict()
        raw["train_micro_batch_size_per_gpu"] = raw["train_micro_batch_size_per_gpu"] or 16
    else:
        raw = json.loads(json.dumps(DEMO_CONFIG))  # a deep copy
    for flag, keys in _FLAG_KEYS.items():
        value = getattr(args, flag)
        for key in keys if value is not None else ():
            section, _, name = key.rpartition(".")
            target = raw.setdefault(section, {}) if section else raw
            if args.config is not None and target.get(name) != value:
                log.info("--%s %s overrides %s = %s from %s", flag.replace("_", "-"), value, key,
                         json.dumps(target.get(name)), args.config)
            target[name] = value
    if args.dtype is not None:  # one flag, two sections
        for dtype in ("bf16", "fp16"):
            raw.setdefault(dtype, {})["enabled"] = args.dtype == dtype
    raw["zero_optimization"] |= _zeropp_keys(args)
    offload_keys(args, raw["zero_optimization"], args.config)
    compress_keys(args, raw)
    config = zeroshard.Config.load(raw)
    args.stage, args.reduce_scatter = config.stage, config.zero_optimization.reduce_scatter
    args.micro_batch = config.train_micro_batch_size_per_gpu
    args.accumulation = config.gradient_accumulation_steps
    args.dtype = config.training_dtype
    return config


def _zeropp_keys(args: argparse.Namespace) -> dict:
    """The config keys of --nodes and --zeropp: the ranks per node, and ZeRO++'s three parts over them."""
    keys: dict = {}
    # In the ranks LOCAL_WORLD_SIZE counts this machine's ranks; before the launch, --nproc does.
    per_node = machine = int(os.environ.get("LOCAL_WORLD_SIZE", getattr(args, "nproc", 1)))
    if args.nodes is not None:
        if machine % args.nodes:
            raise zeroshard.ConfigError(f"--nodes {args.nodes} must divide the {machine} ranks on this machine")
        keys["zeropp_ranks_per_node"] = per_node = machine // args.nodes
    if args.zeropp:
        keys |= {"zero_quantized_weights": True, "zero_quantized_gradients": True}
        if per_node > 1:  # hpZ over one rank would be plain stage 3's gather
            keys["zero_hpz_partition_size"] = per_node
    return keys


def lr_schedule(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over 5% of `steps`, then cosine decay to 10% of the peak: fast on short runs."""
    warmup = max(1, steps // 20)

    def factor(step: int) -> float:
        decay = 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))
        return min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * decay)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _device() -> torch.device:
    """This rank's GPU when there is one for it (NCCL), else the CPU (gloo)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def build_model(args: argparse.Namespace, corpus: CharCorpus,
                device: torch.device) -> tuple[GPT, torch.optim.Optimizer]:
    """The GPT preset sized to the corpus's alphabet on `device`, and AdamW (no decay on biases and norms)."""
    torch.manual_seed(args.seed)
    model = GPT(demo_model_config(args, corpus.vocab_size)).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    return model, optimizer


@dataclass
class RunResult:
    """What one rank measured and, on rank 0, the sample it wrote."""

    first_step: int  # the first optimizer step of this run, from 1 (above 1 when resumed)
    losses: list[float]  # global mean loss per optimizer step
    lrs: list[float]  # learning rate of each optimizer step (first param group)
    step_seconds: list[float]  # wall time per optimizer step
    # op -> (calls, bytes, algorithms, bytes by scope), last step
    comm_last_step: dict[str, tuple[int, int, set[str], dict[str, int]]]
    memory: dict[str, int]  # memory_stats() after training, bytes
    pools: dict[str, dict[str, int]]  # memory_stats(pool) after training, bytes, by pool (device, host, disk)
    sample: str


def train(args: argparse.Namespace, console: Console | None = None) -> RunResult:
    """Train on this rank (under torchrun, or alone as world size 1); rank 0 prints the report."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    console = console or Console()
    corpus = CharCorpus.from_text(load_text(args.data))
    model, optimizer = build_model(args, corpus, _device())
    if len(corpus.ids) <= model.cfg.block_size:
        raise UsageError(f"the corpus has {len(corpus.ids)} characters, fewer than the model's "
                         f"context of {model.cfg.block_size} + 1; use a longer --data file")
    config = engine_config(args)
    source = resume_source(args)
    if source is not None and keep_global_batch(args, source, int(os.environ.get("WORLD_SIZE", 1))):
        config = engine_config(args)  # the accumulation that keeps the checkpoint's global batch
    swap_root = make_default_nvme_path(config)
    if swap_root is not None:
        log.info("offload: swap files under %s (removed at the end)", swap_root)
    engine = None
    try:
        engine = zeroshard.initialize(model, optimizer, config)
        return _train(engine, optimizer, corpus, config, args, console, source)
    finally:
        if engine is not None:
            engine.offload.close()  # this rank's swap files, now (not when the engine is collected)
        remove_default_nvme_path(swap_root)


def _train(engine: zeroshard.Engine, optimizer: torch.optim.Optimizer, corpus: CharCorpus, config: zeroshard.Config,
           args: argparse.Namespace, console: Console, source: str | None) -> RunResult:
    """The training loop, then every rank's figures and rank 0's report."""
    schedule = lr_schedule(optimizer, args.steps)  # the engine keeps the optimizer's param groups
    log.info("%s: %s characters, alphabet of %d; GPT '%s' with %s parameters",
             args.data or "King James Bible", f"{len(corpus.ids):,}", corpus.vocab_size,
             args.model, f"{engine.num_params:,}")
    start = resume(engine, schedule, source, args.steps) if source is not None else 0
    rank0 = dist.get_rank() == 0
    step_log = StepLog(args.log_csv if rank0 else None, args.log_every or max(1, args.steps // 10), args.steps)
    with _progress(console, rank0) as progress, step_log:
        losses, lrs, seconds, comm = _train_loop(engine, schedule, corpus, args, start, progress, step_log)
    memory = engine.memory_stats()
    pools = {pool: dict(engine.memory_stats(pool)) for pool in ("device", "host", "disk")}
    # Every rank generates (same seed, same text): at stage 3 each forward gathers on all ranks.
    sample = generate(engine.module, corpus, _prompt(corpus), args.sample, args.seed) if args.sample else ""
    result = RunResult(start + 1, losses, lrs, seconds, comm, memory, pools, sample if rank0 else "")
    # Every rank's figures, so the report can say whether all ranks match the formula.
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (result.memory, {op: (c, b, s) for op, (c, b, _, s) in comm.items()}, pools))
    if rank0:
        print_report(console, engine, args, result, everyone)
        if args.report is not None:
            paths = write_report(args.report, report_figures(engine, args, config, result, everyone))
            console.print("report: " + ", ".join(str(p) for p in paths))
    return result


def _progress(console: Console, enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[tps]:>7,.0f} tokens/s"),
        TimeRemainingColumn(), console=console, disable=not enabled,
    )


def _train_loop(engine: zeroshard.Engine, schedule: torch.optim.lr_scheduler.LRScheduler,
                corpus: CharCorpus, args: argparse.Namespace, start: int, progress: Progress, step_log: StepLog):
    """Run optimizer steps `start` .. `args.steps` - 1; returns (losses, lrs, step seconds, last step's comm delta)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = args.micro_batch * world * args.accumulation
    block = engine.module.cfg.block_size
    device = next(engine.module.parameters()).device
    task = progress.add_task("train", total=args.steps, completed=start, loss=float("nan"), tps=0.0)
    losses, lrs, seconds = [], [], []
    for step in range(start, args.steps):
        before = engine.comm_stats()
        start = time.perf_counter()
        lrs.append(schedule.get_last_lr()[0])
        batch = corpus.global_batch(step, rows, block, args.seed)
        loss_sum = torch.zeros((), device=device)
        for micro in range(args.accumulation):
            x, y = micro_batch(batch, rank, world, micro, args.accumulation)
            loss = engine(x.to(device), y.to(device))
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach()
        after = engine.comm_stats()
        schedule.step()
        # The global mean loss, through torch directly: the engine's comm log stays its own.
        dist.all_reduce(loss_sum)
        losses.append(loss_sum.item() / (world * args.accumulation))
        seconds.append(time.perf_counter() - start)
        progress.update(task, advance=1, loss=losses[-1], tps=rows * block / seconds[-1])
        step_log(step + 1, losses[-1], lrs[-1], seconds[-1], rows * block / seconds[-1])
        save(engine, schedule, args, step + 1, rows)
    engine.wait_for_checkpoint()  # an asynchronous save in flight lands (or fails) before the run ends
    delta = {op: (after[op].calls - before[op].calls, after[op].bytes - before[op].bytes, after[op].algorithms,
                  {s: b - before[op].by_scope.get(s, 0) for s, b in after[op].by_scope.items()})
             for op in after if op != "object_gather"}  # an asynchronous save's gathers: no step's traffic
    return losses, lrs, seconds, delta


def _prompt(corpus: CharCorpus) -> str:
    """The sample's prompt: a Bible opening when the alphabet has it, else the corpus's first characters."""
    if all(ch in corpus.alphabet for ch in "And God said"):
        return "And God said"
    return corpus.decode(corpus.ids[:12])


@torch.no_grad()
def generate(model: GPT, corpus: CharCorpus, prompt: str, length: int, seed: int,
             temperature: float = 0.8) -> str:
    """`prompt` continued by `length` sampled characters (prompt characters outside the alphabet dropped)."""
    ids = [corpus.alphabet.index(ch) for ch in prompt if ch in corpus.alphabet] or [0]
    idx = torch.tensor([ids], device=next(model.parameters()).device)
    gen = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    for _ in range(length):
        logits = model(idx[:, -model.cfg.block_size:])[0, -1].float() / temperature
        nxt = torch.multinomial(torch.softmax(logits, dim=-1).cpu(), 1, generator=gen)  # CPU generator
        idx = torch.cat([idx, nxt[None].to(idx.device)], dim=1)
    model.train(was_training)
    return corpus.decode(idx[0])


def main(argv: list[str] | None = None) -> None:
    """Entry point of one rank: `python -m zeroshard.app.demo.train [flags]` under torchrun."""
    parser = argparse.ArgumentParser(prog="python -m zeroshard.app.demo.train", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    resolve_defaults(args)
    console = Console()
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=console, show_path=False, show_time=False)])
    try:
        if completed(args):  # restarted after its last step: nothing to do again
            return
        if on_mesh(args):
            train_on_mesh(args, engine_config(args), lr_schedule, console)
        else:
            train(args, console)
    except zeroshard.ZeroshardError as error:  # UsageError among them
        # zeroshard's own errors name the cause and the fix: no traceback. Every rank says it: torchrun may
        # stop the others before rank 0 gets to print.
        console.print(f"[red]error[/] (rank {rank}): {error}", highlight=False)
        raise SystemExit(2) from None
    finally:
        # Free the engine (its hooks make reference cycles) while the group it holds is still
        # alive: a gloo group whose last reference goes at interpreter exit was seen to abort
        # the process ("terminate called without an active exception") in a few runs of a hundred.
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
