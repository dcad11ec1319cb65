"""`zeroshard train --tp T --pp P`: the demo GPT on a pp x dp x tp mesh (3D parallelism).

Every rank builds the whole GPT from the seed, keeps its pipeline stage
(`GPTStage`), splits that stage's blocks over `tp` (`parallelize_gpt`: whole
heads and slices of the MLP) and trains it with ZeRO over `dp`. At pp > 1
torch's 1F1B schedule runs each step, a dp rank's rows split into
--micro-batches micro-batches (`PipelineStage` hands their gradients to the
engine); at pp = 1 the plain loop runs, with --accumulation.

The data is the demo's (app/demo/data.py): step s's global batch is the one the
plain demo draws with as many micro-steps as the mesh has micro-batches, and
each dp rank feeds its rows of each micro-step, so a mesh trains on what the
plain demo trains on. Rank 0 logs the loss every step (the last stage's, the
mean over its dp ranks) and closes with the mesh, every rank's model-state
bytes and its last step's bytes by mesh dimension.

train.py imports this module (not the other way round): `engine_config` and
`lr_schedule` come in as arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

import zeroshard
from zeroshard.app.errors import UsageError
from zeroshard.app.demo.data import CharCorpus, load_text, micro_batch
from zeroshard.app.demo.config import demo_model_config
from zeroshard.app.models import GPT, PRESETS, GPTStage, lm_loss
from zeroshard.app.demo.run_log import StepLog
from zeroshard.comm.group import this_rank_gpu
from zeroshard.parallel.mesh import Mesh, build_mesh

log = logging.getLogger("zeroshard.app.demo.train")

DIMS = ("dp", "tp", "pp", "mesh")  # engine.comm_stats(dim): what each records is in the report's caption


def on_mesh(args: argparse.Namespace) -> bool:
    """Whether `zeroshard train` runs on a mesh: --tp or --pp above 1."""
    return args.tp * args.pp > 1


def resolve_defaults(args: argparse.Namespace) -> None:
    """Fill in the defaults that follow from the mesh: --model (tiny on a mesh, else demo), --micro-batches
    (2 x pp) and, before the launch, --nproc (2 x tp x pp: dp = 2; the plain demo's 2 at tp = pp = 1)."""
    if args.model is None:
        args.model = "tiny" if on_mesh(args) else "demo"
    if args.micro_batches is None and args.pp > 1:
        args.micro_batches = 2 * args.pp
    if getattr(args, "nproc", 0) is None:
        args.nproc = 2 * args.tp * args.pp


# flag -> why a mesh run refuses it, and what to do instead
_NOT_ON_A_MESH = {
    "zeropp": "--zeropp (ZeRO++) is not supported on a mesh (--tp/--pp): drop --zeropp, or --tp and --pp",
    "nodes": "--nodes declares nodes for ZeRO++ and the plain demo's bytes by scope; a mesh run takes neither: "
             "drop --nodes, or --tp and --pp",
    "report": "--report writes the plain demo's figures next to the ZeRO formulas; a mesh run (--tp/--pp) prints "
              "its own report: drop --report (--log-csv keeps each step's loss)",
    "save_every": "--save-every: the mesh demo (--tp/--pp) saves no checkpoints yet: drop --save-every "
                  "(engine.save_checkpoint saves one per model part in a script of your own)",
    "resume": "--resume: the mesh demo (--tp/--pp) saves no checkpoints yet, so it resumes none: drop --resume",
    "offload": "--offload: the mesh demo (--tp/--pp) does not report offload's memory pools: drop --offload, "
               "or --tp and --pp",
}


def flag_error(args: argparse.Namespace, world: int | None = None) -> str | None:
    """Why these flags cannot run (the cause and the fix), or None; `world`: the ranks launched, if known.

    Call it after `resolve_defaults`.
    """
    tp, pp = args.tp, args.pp
    if pp == 1 and args.micro_batches is not None:
        return ("--micro-batches splits a pipeline's step: give --pp 2 or more with it "
                "(without a pipeline, --accumulation splits a step)")
    if not on_mesh(args):
        return None
    for flag, why in _NOT_ON_A_MESH.items():
        if getattr(args, flag, None) not in (None, False):
            return why
    cfg, model = PRESETS[args.model], args.model
    if pp > cfg.n_layer:
        return (f"--pp {pp}: GPT '{model}' has {cfg.n_layer} blocks and a pipeline stage holds at least one: "
                f"give --pp {cfg.n_layer} or less, or a --model with more blocks")
    if cfg.n_head % tp:
        return (f"--tp {tp}: GPT '{model}' has {cfg.n_head} attention heads, split whole among the tp ranks: "
                f"give a --tp that divides {cfg.n_head}")
    if pp > 1 and args.micro_batches < pp:
        return (f"--micro-batches {args.micro_batches}: 1F1B needs at least one micro-batch per pipeline stage: "
                f"give --micro-batches {pp} or more")
    if pp > 1 and args.accumulation not in (None, 1):
        return (f"gradient accumulation over {args.accumulation} micro-steps (--accumulation or the config): "
                "with --pp a step's micro-batches are --micro-batches; give those instead, and --accumulation 1")
    if world is not None and world % (tp * pp):
        return (f"{world} ranks do not split into pp={pp} x tp={tp} = {tp * pp} per data-parallel rank: "
                f"give --nproc a multiple of {tp * pp} (its default with --tp/--pp: {2 * tp * pp}, dp = 2)")
    return None


def build_part(args: argparse.Namespace, corpus: CharCorpus, mesh: Mesh) -> tuple[GPTStage, torch.optim.Optimizer]:
    """This rank's stage of the seeded GPT, split over tp, and AdamW over it (no decay on biases and norms)."""
    device = this_rank_gpu() if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(args.seed)
    gpt = GPT(demo_model_config(args, corpus.vocab_size))
    from zeroshard.parallel.plans import parallelize_gpt  # torch.distributed.tensor: only for a mesh run

    part = parallelize_gpt(GPTStage(gpt, mesh.rank("pp"), mesh.pp).to(device), mesh)
    decay = [p for p in part.parameters() if p.dim() >= 2]
    no_decay = [p for p in part.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    return part, optimizer


def train_on_mesh(args: argparse.Namespace, config: zeroshard.Config,
                  lr_schedule: Callable[[torch.optim.Optimizer, int], torch.optim.lr_scheduler.LRScheduler],
                  console: Console | None = None) -> list[float]:
    """Train this rank's part (under torchrun); rank 0 logs each step's loss and prints the report.

    `config`: the engine config of the flags (train.engine_config); `lr_schedule`: the demo's
    (train.lr_schedule). Returns the loss of each step (the last stage's, mean over its dp ranks).
    """
    if (why := flag_error(args, int(os.environ.get("WORLD_SIZE", 1)))) is not None:
        raise UsageError(why)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    mesh = build_mesh(pp=args.pp, tp=args.tp)
    corpus = CharCorpus.from_text(load_text(args.data))
    part, optimizer = build_part(args, corpus, mesh)
    engine = zeroshard.initialize(part, optimizer, config=config, mesh=mesh, tied=part.tied())
    schedule = lr_schedule(optimizer, args.steps)  # the engine keeps the optimizer's param groups
    last = f"ranks {dist.get_world_size() - mesh.dp * mesh.tp}-{dist.get_world_size() - 1}"
    log.info("mesh %s: GPT '%s' (%d blocks) in %d pipeline stage(s); loss: the last stage's (%s), mean over its %d dp "
             "rank(s)", mesh.describe(), args.model, part.cfg.n_layer, mesh.pp, last, mesh.dp)
    step = _pipeline_step(engine, args) if mesh.pp > 1 else _plain_step(engine, args)
    losses, seconds, comm = _train_loop(engine, step, mesh, part, corpus, args, schedule)
    layers = f"{part.layers.start}-{part.layers.stop - 1}"
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mesh.coordinate, layers, engine.memory_stats(), comm))
    if dist.get_rank() == 0:
        print_mesh_report(console or Console(), mesh, args, losses, seconds, everyone)
    return losses


def _pipeline_step(engine: zeroshard.Engine, args: argparse.Namespace):
    """One optimizer step through 1F1B: returns this stage's mean loss over the micro-batches (last stage) or None."""
    from torch.distributed.pipelining import Schedule1F1B  # pipelining brings torch's compiler: only for pp

    from zeroshard.parallel.stage import PipelineStage

    stage = PipelineStage(engine)
    schedule = Schedule1F1B(stage, n_microbatches=args.micro_batches, loss_fn=lm_loss)
    return lambda x, y: stage.train_step(schedule, x, y)


def _plain_step(engine: zeroshard.Engine, args: argparse.Namespace):
    """One optimizer step of --accumulation micro-steps (pp = 1): returns the mean loss."""
    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        total = 0.0
        for xs, ys in zip(x.chunk(args.accumulation), y.chunk(args.accumulation)):
            loss = lm_loss(engine(xs), ys)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        return total / args.accumulation
    return step


def _train_loop(engine: zeroshard.Engine, step_fn, mesh: Mesh, part: GPTStage, corpus: CharCorpus,
                args: argparse.Namespace, schedule: torch.optim.lr_scheduler.LRScheduler):
    """Run --steps steps; returns (the loss per step, seconds per step, the last step's comm by dimension)."""
    splits = args.micro_batches if mesh.pp > 1 else args.accumulation
    rows, block, device = args.micro_batch * mesh.dp * splits, part.cfg.block_size, engine.device
    holds_loss = part.last and mesh.rank("tp") == 0  # tp ranks compute the same loss: count one
    losses, seconds = [], []
    step_log = StepLog(args.log_csv if dist.get_rank() == 0 else None, args.log_every or 1, args.steps)
    with step_log:
        for step in range(args.steps):
            before, start, lr = _comm(engine), time.perf_counter(), schedule.get_last_lr()[0]
            batch = corpus.global_batch(step, rows, block, args.seed)
            parts = [micro_batch(batch, mesh.rank("dp"), mesh.dp, m, splits) for m in range(splits)]
            x, y = (torch.cat(rows_).to(device) for rows_ in zip(*parts))  # this dp rank's, micro-step by micro-step
            loss = step_fn(x, y)
            schedule.step()
            after = _comm(engine)
            # Through torch directly: the engine's comm log stays its own.
            total = torch.tensor(loss if holds_loss else 0.0, dtype=torch.float64, device=device)
            dist.all_reduce(total)
            losses.append(total.item() / mesh.dp)
            seconds.append(time.perf_counter() - start)
            step_log(step + 1, losses[-1], lr, seconds[-1], rows * block / seconds[-1])
    comm = {dim: {op: (after[dim][op][0] - before[dim][op][0], after[dim][op][1] - before[dim][op][1])
                  for op in after[dim] if after[dim][op][1] > before[dim][op][1]} for dim in DIMS}
    return losses, seconds, comm


def _comm(engine: zeroshard.Engine) -> dict[str, dict[str, tuple[int, int]]]:
    """dimension -> op -> (calls, bytes) so far."""
    return {dim: {op: (s.calls, s.bytes) for op, s in engine.comm_stats(dim).items()} for dim in DIMS}


def print_mesh_report(console: Console, mesh: Mesh, args: argparse.Namespace, losses: list[float],
                      seconds: list[float], everyone: list) -> None:
    """The run summary, then per rank: its model-state bytes and its last step's bytes by mesh dimension."""
    splits = args.micro_batches if mesh.pp > 1 else args.accumulation
    tokens = args.micro_batch * mesh.dp * splits * PRESETS[args.model].block_size
    median = statistics.median(seconds[1:] or seconds)  # step 1 warms up
    how = (f"1F1B, {splits} micro-batches of {args.micro_batch} rows per dp rank" if mesh.pp > 1
           else f"{splits} micro-step(s) of {args.micro_batch} rows per dp rank")
    console.print()
    console.print(f"[bold]mesh {mesh.describe()}[/], {dist.get_world_size()} ranks on {dist.get_backend()}: "
                  f"ZeRO stage {args.stage} over dp, {args.dtype}, GPT '{args.model}', {how}")
    console.print(f"{args.steps} steps of {tokens:,} tokens; loss [bold]{losses[0]:.3f}[/] (first step) -> "
                  f"[bold]{losses[-1]:.3f}[/] (last step)")
    console.print(f"median step {median:.3f} s, {tokens / median:,.0f} tokens/s")
    console.print(_memory_table(everyone))
    console.print(_comm_table(everyone))


def _coordinate(coordinate: dict[str, int]) -> str:
    return " ".join(f"{dim}{coordinate[dim]}" for dim in ("pp", "dp", "tp"))


def _memory_table(everyone: list) -> Table:
    table = Table(title="Model states per rank (bytes, engine.memory_stats())", title_justify="left",
                  show_edge=False, caption="blocks: the pipeline stage's; params: this rank's tp slice of "
                  "them; grads, master, optimizer: its ZeRO shard over dp", caption_justify="left")
    for name in ("rank", "coordinate", "blocks", "params", "grads", "master", "optimizer"):
        table.add_column(name, justify="left" if name in ("coordinate", "blocks") else "right", no_wrap=True)
    for rank, (coordinate, layers, memory, _) in enumerate(everyone):
        table.add_row(str(rank), _coordinate(coordinate), layers,
                      *(f"{memory[k]:,}" for k in ("params", "grads", "master", "optimizer")))
    return table


def _comm_table(everyone: list) -> Table:
    ops = {dim: sorted({op for *_, comm in everyone for op in comm[dim]}) for dim in DIMS}
    table = Table(title="Communication per rank by mesh dimension (bytes, last step, engine.comm_stats(dim))",
                  title_justify="left", show_edge=False, caption_justify="left",
                  caption="dp: ZeRO's gradients and parameters; tp: partial gradients summed; pp: the tied "
                          "embedding's gradient summed across stages; mesh: the step check. Ops: "
                          + "; ".join(f"{dim} = {', '.join(ops[dim]) or '-'}" for dim in DIMS)
                          + ". Not recorded: DTensor's tp activations, the pipeline's sends")
    for name in ("rank", "coordinate", *(f"{dim} bytes" for dim in DIMS)):
        table.add_column(name, justify="left" if name == "coordinate" else "right", no_wrap=True)
    for rank, (coordinate, _, _, comm) in enumerate(everyone):
        table.add_row(str(rank), _coordinate(coordinate),
                      *(f"{sum(b for _, b in comm[dim].values()):,}" for dim in DIMS))
    return table
