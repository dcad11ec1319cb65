"""Muon + AdamW against AdamW alone: torch DDP against zeroshard stages 1-3, on gloo ranks on CPU.

    python benchmarks/optimizers.py --size 100m --steps 3 --warmup 1 --out BENCHMARKS.md

The Muon mix is the standard recipe (tests/optim/whole.py): `torch.optim.Muon` on the blocks' 2-D matrices,
AdamW on the embeddings, head, norms and biases, a list of two optimizers. DDP steps both on every rank, every
matrix; zeroshard owns each Muon matrix whole on one rank, so each rank runs the Newton-Schulz iterations only
on its own. Every variant runs in its own fresh process tree of `--world` ranks (bench.py's launcher), with
the same GPT preset, initial weights and batches. Per variant: the median step (forward + backward + step)
and the median optimizer step alone; the section is printed and, with `--out`, written into that markdown
file (replacing its earlier section for the same preset, else appended).

torch's Muon runs its Newton-Schulz iterations in bf16. On a CPU without bf16 matrix units (no avx512_bf16 or
amx_bf16: the report names the flags) a bf16 matmul is about 20x slower than an fp32 one, so the Muon step
dominates: about 10 s a step at 4m and 10 minutes at 100m under DDP, on one core per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench import BLOCK_SIZE, SIZES, command_line, machine, prepare_corpus, run_ranks, slowest_per_step, summarize
from report import _command_block, _machine_lines, write_section

# name -> (zeroshard stage, None for DDP; the optimizers); the report's order
VARIANTS = {
    "ddp_muon": (None, "muon"),
    **{f"zeroshard_s{stage}_muon": (stage, "muon") for stage in (1, 2, 3)},
    "ddp_adamw": (None, "adamw"),
    **{f"zeroshard_s{stage}_adamw": (stage, "adamw") for stage in (1, 2, 3)},
}
MUON = {"lr": 0.02, "momentum": 0.95}  # torch.optim.Muon's other arguments at their defaults
ADAMW = {"lr": 3e-4, "betas": (0.9, 0.95)}
PEER = "ddp_muon"  # the ratio column's denominator
HEADING = "## Muon + AdamW and AdamW alone: DDP against zeroshard stages 1-3"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=SIZES, default="100m", help="GPT preset (zeroshard/app/models/gpt.py)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--steps", type=int, default=3, help="timed steps (a 100m Muon step can take minutes)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step (bench.py's default)")
    p.add_argument("--bucket-elems", type=int, default=25 * 2**20 // 4, help="gradient bucket (DDP's 25 MiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--timeout", type=float, default=7200, help="seconds per variant")
    p.add_argument("--out", type=Path, help="write the section into this markdown file")
    p.add_argument("--json", type=Path, help="also keep the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a rank of --variant
    p.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    p.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if min(args.steps, args.micro_batch, args.world) < 1 or args.warmup < 0:
        p.error("--steps, --micro-batch and --world must be >= 1, --warmup >= 0")
    args.variants = [v for v in VARIANTS if v in args.variants]  # report order
    return args


# -- one rank ------------------------------------------------------------------------------


def is_hidden_matrix(name: str, p) -> bool:
    """Muon's tensors in the recipe: the blocks' matrices (not the embeddings, head, norms or biases)."""
    return p.dim() >= 2 and name.startswith("blocks.")


def make_optimizers(kind: str, model) -> list:
    import torch

    if kind == "adamw":
        return [torch.optim.AdamW(model.parameters(), **ADAMW)]
    named = list(model.named_parameters())
    return [torch.optim.Muon([p for n, p in named if is_hidden_matrix(n, p)], **MUON),
            torch.optim.AdamW([p for n, p in named if not is_hidden_matrix(n, p)], **ADAMW)]


class Chain:
    """DDP's optimizers, stepped one after the other, as one optimizer for variants._torch_step."""

    def __init__(self, optimizers: list):
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def time_step(owner, seconds: list[float]) -> None:
    """Append the wall time of every `owner.step()` call to `seconds`."""
    plain = owner.step

    def step(*args, **kwargs):
        start = time.perf_counter()
        try:
            return plain(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    owner.step = step


def train(args: argparse.Namespace) -> dict:
    import torch.distributed as dist
    from variants import Settings, _ddp, _torch_step, build_zeroshard
    from worker import build_model, load_corpus, model_config, peak_rss_bytes, train_steps

    import zeroshard  # noqa: F401 -- its import cost belongs to the baseline, as in worker.py

    stage, kind = VARIANTS[args.variant]
    corpus = load_corpus(args.corpus)
    cfg = model_config(args.size, corpus)
    settings = Settings(mode="plain", lr=ADAMW["lr"], micro_batch=args.micro_batch, bucket_elems=args.bucket_elems)
    base_rss = peak_rss_bytes()
    model, num_params = build_model(args.variant, cfg, settings, args.seed)
    muon = [p for n, p in model.named_parameters() if kind == "muon" and is_hidden_matrix(n, p)]
    if stage is None:
        chain = Chain(make_optimizers(kind, model))
        step, stepped = _torch_step(_ddp(model, settings), chain), chain
    else:
        def optimizer(m, _settings):
            opts = make_optimizers(kind, m)
            return opts if len(opts) > 1 else opts[0]

        step = build_zeroshard(stage, optimizer=optimizer)(model, settings)  # stage 3: wrap=[Block]
        stepped = step.engine
    optimizer_seconds: list[float] = []
    time_step(stepped, optimizer_seconds)
    times, losses = train_steps(step, corpus, cfg, settings, args.seed, range(args.warmup + args.steps))
    return {
        "rank": dist.get_rank(),
        "num_params": num_params,
        "muon_tensors": len(muon),
        "muon_numel": sum(p.numel() for p in muon),
        "step_seconds": times,  # warm-up steps included; the caller drops them
        "optimizer_seconds": optimizer_seconds,
        "losses": losses,
        "base_rss_bytes": base_rss,
        "peak_rss_bytes": peak_rss_bytes(),
    }


# -- the parent ----------------------------------------------------------------------------


def summary(rank_results: list[dict], warmup: int) -> dict:
    """bench.py's summary (step: per step the slowest rank, the median) and the optimizer step's, the same way."""
    optimizer = slowest_per_step(rank_results, warmup, "optimizer_seconds")
    r0 = rank_results[0]
    return summarize(rank_results, warmup) | {
        "optimizer_ms": 1000 * statistics.median(optimizer), "optimizer_ms_each": [1000 * t for t in optimizer],
        "muon_tensors": r0["muon_tensors"], "muon_numel": r0["muon_numel"],
    }  # fmt: skip


def run_variant(args: argparse.Namespace, variant: str, corpus: Path) -> dict:
    stem = HERE / "results" / "logs" / f"optimizers_{args.size}_{variant}"
    argv = [__file__, "--worker", "--variant", variant, "--size", args.size, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--micro-batch", str(args.micro_batch), "--bucket-elems",
            str(args.bucket_elems), "--seed", str(args.seed), "--corpus", str(corpus)]
    return run_ranks(args, argv, stem, summary=summary)


def _ok(run: dict | None) -> bool:
    return run is not None and run.get("ok", False)


def _ratio(runs: dict, num: str, den: str, key: str = "step_ms") -> str:
    if not (_ok(runs.get(num)) and _ok(runs.get(den))):
        return "–"
    return f"{runs[num][key] / runs[den][key]:.2f}x"


def _table(runs: dict[str, dict]) -> list[str]:
    lines = ["| variant | step s | optimizer step s | ratio to ddp_muon step | loss first → last (rank 0) |",
             "|---|---:|---:|---:|---|"]
    for name, run in runs.items():
        if not _ok(run):
            error = run["error"].replace("|", "\\|")  # a bare | would end the table cell
            lines.append(f"| {name} | failed: {error} | | | |")
            continue
        lines.append(f"| {name} | {run['step_ms'] / 1000:.4f} | {run['optimizer_ms'] / 1000:.4f} "
                     f"| {_ratio(runs, name, PEER)} | {run['loss_first']:.4f} → {run['loss_last']:.4f} |")
    return lines


def _derived(runs: dict[str, dict]) -> list[str]:
    vs_ddp = ", ".join(f"s{s} {_ratio(runs, f'zeroshard_s{s}_muon', PEER)} (optimizer step "
                       f"{_ratio(runs, f'zeroshard_s{s}_muon', PEER, 'optimizer_ms')})" for s in (1, 2))
    same = [("DDP", "ddp")] + [(f"s{s}", f"zeroshard_s{s}") for s in (1, 2, 3)]
    muon_adamw = ", ".join(f"{label} {_ratio(runs, f'{v}_muon', f'{v}_adamw')} (optimizer step "
                           f"{_ratio(runs, f'{v}_muon', f'{v}_adamw', 'optimizer_ms')})" for label, v in same)
    return [f"- zeroshard s1/s2 Muon step vs DDP Muon step: {vs_ddp}",
            f"- Muon step / AdamW step at the same stage: {muon_adamw}"]


def render(runs: dict[str, dict], meta: dict, command: str) -> str:
    m = meta
    ok = next((r for r in runs.values() if _ok(r)), None)
    params = f" ({ok['num_params'] / 1e6:.1f}M parameters)" if ok else ""
    muon = next((r for name, r in runs.items() if _ok(r) and name.endswith("_muon")), None)
    muon_part = (f" ({muon['muon_tensors']} matrices, {muon['muon_numel'] / 1e6:.1f}M elements)" if muon else "")
    lines = [
        f"{HEADING}, {m['size']}{params}",
        "",
        f"- Date: {m['date']}",
        *_machine_lines(m)[:1],
        f"- Software: Python {m['python']}, torch {m['torch']}; the CPU's bf16 matrix flags (torch's Muon "
        f"multiplies in bf16): {m['bf16_flags']}",
        f"- Ranks: {m['world']} processes on this machine, backend gloo, 1 thread per rank "
        "(`torch.set_num_threads(1)`), each variant a fresh process tree (bench.py's launcher)",
        f"- Workload: GPT preset {m['size']}, per-rank micro batch {m['micro_batch']} sequences × {BLOCK_SIZE} "
        f"tokens, fp32, seed {m['seed']} (the same initial weights and batches for every variant), "
        f"gradient bucket {m['bucket_elems']:,} elements (DDP `bucket_cap_mb`, zeroshard `reduce_bucket_size`, "
        "`overlap_comm: true`); zeroshard stage 3 with `wrap=[Block]`",
        f"- `_muon`: `[torch.optim.Muon(<the blocks' 2-D matrices>{muon_part}, lr={MUON['lr']}, "
        f"momentum={MUON['momentum']}), torch.optim.AdamW(<the rest>, lr={ADAMW['lr']}, betas={ADAMW['betas']})]` "
        "(Muon's other arguments at torch's defaults: Newton-Schulz in bf16, 5 steps); `_adamw`: "
        f"`torch.optim.AdamW(<all parameters>, lr={ADAMW['lr']}, betas={ADAMW['betas']})`. DDP gets the optimizers "
        "as they are, zeroshard the same list (`zeroshard.initialize(model, [muon, adamw], config)`)",
        f"- Timing: {m['warmup']} warm-up steps, then {m['steps']} timed steps; per step the slowest rank, "
        "median over the timed steps. step s: forward + backward + optimizer step. optimizer step s: for DDP the "
        "wall time of the optimizers' `.step()` calls (every rank steps every tensor; the gradient all-reduce "
        "ran in backward); for zeroshard the wall time of `engine.step()`: the gradient reduction ran in "
        "backward, and `engine.step()` holds the finite check and gradient norm, the optimizer on this rank's "
        "part (Muon: the matrices it owns whole; AdamW: its flat shard), the all-gather of the updated "
        "parameters (stages 1-2; at stage 3 the next forward gathers them) and clearing the gradients",
        "",
        *_command_block([command]),
        *_table(runs),
        "",
        *_derived(runs),
    ]
    return "\n".join(lines) + "\n"


def bf16_flags() -> str:
    """The CPU flags of bf16 matrix arithmetic this machine reports (without them bf16 matmuls are slow)."""
    flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("flags")), [])
    found = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return ", ".join(found) if found else "none (neither avx512_bf16 nor amx_bf16)"


def main() -> int:
    args = parse_args()
    # torch's Muon multiplies in bf16: see tests/conftest.py (AMX faults on some virtual machines)
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    if args.worker:
        from worker import run_rank

        return run_rank(lambda: train(args), args.result)
    (HERE / "results" / "logs").mkdir(parents=True, exist_ok=True)
    corpus = HERE / "results" / "corpus.pt"
    prepare_corpus(corpus)
    command = command_line()
    meta = machine() | {"size": args.size, "world": args.world, "micro_batch": args.micro_batch,
                        "bucket_elems": args.bucket_elems, "seed": args.seed, "steps": args.steps,
                        "warmup": args.warmup, "date": str(datetime.now(timezone.utc).date()),
                        "bf16_flags": bf16_flags()}
    runs: dict[str, dict] = {}
    for i, variant in enumerate(args.variants, 1):
        runs[variant] = entry = run_variant(args, variant, corpus)
        if entry["ok"]:
            status = f"{entry['step_ms'] / 1000:.4f} s/step, optimizer step {entry['optimizer_ms'] / 1000:.4f} s"
        else:
            status = f"FAILED: {entry['error']}"
        print(f"[{i}/{len(args.variants)}] {args.size} {variant}: {status} ({entry['launch_seconds']:.0f} s)",
              flush=True)
    text = render(runs, meta, command)
    print("\n" + text, end="")
    if args.out:
        write_section(args.out, text)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "command": command, "runs": runs}, indent=1))
    return 0 if all(_ok(r) for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
