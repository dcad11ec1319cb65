"""Render the benchmark results (the JSON that bench.py keeps) as a markdown report."""

from __future__ import annotations

import re
from pathlib import Path

LABELS = {
    "single": "no communication (each rank alone)",
    "ddp": "DDP",
    "zero_redundancy": "ZeroRedundancyOptimizer + DDP",
    "fsdp1_shard_grad_op": "FSDP1 SHARD_GRAD_OP",
    "fsdp2": "FSDP2 fully_shard(reshard_after_forward=False)",
    "fsdp1_full_shard": "FSDP1 FULL_SHARD",
    "fsdp2_reshard": "FSDP2 fully_shard(reshard_after_forward=True)",
    **{f"deepspeed_z{s}": f"DeepSpeed ZeRO-{s}" for s in range(4)},
    **{f"zeroshard_s{s}": f"zeroshard stage {s}" for s in range(4)},
    **{f"zeroshard_s{s}_overlap": f"zeroshard stage {s}, overlap_param_gather" for s in (1, 2)},
    "zeroshard_s3_reuse1": "zeroshard stage 3, stage3_max_reuse_distance 1",
    "zeroshard_s3_reuse": "zeroshard stage 3, stage3_max_reuse_distance 1e9 (DeepSpeed's default)",
}
# Peers that keep the same model states per rank as each zeroshard stage.
SAME_STAGE = {
    0: ["ddp", "deepspeed_z0"],
    1: ["zero_redundancy", "deepspeed_z1"],
    2: ["fsdp1_shard_grad_op", "fsdp2", "deepspeed_z2"],
    3: ["fsdp1_full_shard"],  # the stage-3 RSS target names FSDP1 FULL_SHARD; the others are in the ratios
}
RATIO_PEERS = ["ddp", "zero_redundancy", "fsdp1_shard_grad_op", "fsdp2", "fsdp1_full_shard", "fsdp2_reshard"]
TIME_TARGET = {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.5}  # zeroshard step time / DDP step time, fused mode
NO_COMM_TARGET = {1: 1.25, 2: 1.25}  # zeroshard step time / the step without communication (issue 23)
STAGES = tuple(TIME_TARGET)
MIB = 2**20
NOTES = [
    (
        "- no communication: each rank trains the plain model with `torch.optim.Adam` on its own micro batch, "
        "no collective (the ranks side by side, as in every other variant): the step the others add to."
    ),
    "- DDP: `DistributedDataParallel(model, bucket_cap_mb=<bucket>)`, `torch.optim.Adam`.",
    (
        "- ZeroRedundancyOptimizer + DDP: `ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=Adam)` "
        "over the same DDP, as the torch documentation shows it (optimizer state sharded: ZeRO-1)."
    ),
    (
        "- FSDP1 SHARD_GRAD_OP: `FullyShardedDataParallel(ShardingStrategy.SHARD_GRAD_OP, "
        "ModuleWrapPolicy({Block}), use_orig_params=True, device_id=cpu)` (ZeRO-2)."
    ),
    (
        "- FSDP2: `fully_shard(block, reshard_after_forward=False)` on each Block, then on the root, "
        "over a 1-D CPU device mesh (ZeRO-2); with `reshard_after_forward=True` it is ZeRO-3."
    ),
    "- FSDP1 FULL_SHARD: as SHARD_GRAD_OP with `ShardingStrategy.FULL_SHARD` (ZeRO-3).",
    (
        "- DeepSpeed ZeRO-0/1/2/3: `deepspeed.initialize(model=, optimizer=<the torch Adam>, config=, "
        "dist_init_required=False)` with `zero_allow_untested_optimizer`, `reduce_bucket_size` and "
        "`allgather_bucket_size` = <bucket>, `overlap_comm: true`, and `gradient_clipping: 0` "
        "(DeepSpeed clips to 1.0 by default; no other variant clips). ZeRO-0 all-reduces after backward "
        "in DeepSpeed's fixed 5e8-element buckets."
    ),
    (
        "- zeroshard stage 0/1/2/3: `zeroshard.initialize(model, <the torch Adam>, config)` with "
        "`reduce_bucket_size` = <bucket>, `overlap_comm: true`; stage 3 with `wrap=[Block]` (the FSDP "
        "peers' units) and its other keys at their defaults (DeepSpeed's persistence threshold 1e5)."
    ),
    (
        "- Same-stage peers for the RSS targets: stage 0: DDP, DeepSpeed ZeRO-0; stage 1: "
        "ZeroRedundancyOptimizer, DeepSpeed ZeRO-1; stage 2: FSDP1 SHARD_GRAD_OP, FSDP2, DeepSpeed ZeRO-2; "
        "stage 3: FSDP1 FULL_SHARD (the other stage-3 peers are in the ratio table)."
    ),
    (
        "- The loss column is rank 0's loss on its own micro batch at the first and last step: "
        "variants that compute the same update show the same numbers."
    ),
]


def _ok(run: dict | None) -> bool:
    return run is not None and run.get("ok", False)


def _ratio(num: float, den: float) -> str:
    return f"{num / den:.2f}x"


def _variant_table(runs: dict[str, dict]) -> list[str]:
    lines = [
        "| variant | step ms | vs DDP | peak RSS MiB | RSS before model MiB | loss first → last (rank 0) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    ddp = runs.get("ddp")
    for name, run in runs.items():
        if not _ok(run):
            error = run["error"].replace("|", "\\|")  # a bare | would end the table cell
            lines.append(f"| {LABELS[name]} | failed: {error} | | | | |")
            continue
        vs = _ratio(run["step_ms"], ddp["step_ms"]) if _ok(ddp) else "–"
        lines.append(
            f"| {LABELS[name]} | {run['step_ms']:.0f} | {vs} | {run['peak_rss_bytes'] / MIB:.0f}"
            f" | {run['base_rss_bytes'] / MIB:.0f} | {run['loss_first']:.4f} → {run['loss_last']:.4f} |"
        )
    return lines


def _ratio_table(runs: dict[str, dict]) -> list[str]:
    """zeroshard stage s against each peer: step time ratio / peak RSS ratio."""
    head = [LABELS[p] for p in RATIO_PEERS] + ["DeepSpeed same stage"]
    lines = ["| zeroshard (time / RSS) | " + " | ".join(head) + " |", "|---" + "|---:" * len(head) + "|"]
    for stage in STAGES:
        ours = runs.get(f"zeroshard_s{stage}")
        if not _ok(ours):
            continue
        cells = []
        for peer in RATIO_PEERS + [f"deepspeed_z{stage}"]:
            other = runs.get(peer)
            if _ok(other):
                t = _ratio(ours["step_ms"], other["step_ms"])
                cells.append(f"{t} / {_ratio(ours['peak_rss_bytes'], other['peak_rss_bytes'])}")
            else:
                cells.append("–")
        lines.append(f"| stage {stage} | " + " | ".join(cells) + " |")
    return lines if len(lines) > 2 else []


def _target_rows(runs: dict[str, dict]) -> list[str]:
    lines = ["| target | measured | status |", "|---|---|---|"]
    ddp = runs.get("ddp")
    for stage in STAGES:
        ours = runs.get(f"zeroshard_s{stage}")
        limit = TIME_TARGET[stage]
        name = f"stage {stage} step time <= {limit:.1f}x DDP"
        if not (_ok(ours) and _ok(ddp)):
            lines.append(f"| {name} | not measured | – |")
        else:
            r = ours["step_ms"] / ddp["step_ms"]
            lines.append(f"| {name} | {r:.2f}x | {'met' if r <= limit else 'not met'} |")
        peers = [p for p in SAME_STAGE[stage] if _ok(runs.get(p))]
        name = f"stage {stage} peak RSS <= every same-stage peer ({', '.join(LABELS[p] for p in SAME_STAGE[stage])})"
        if not (_ok(ours) and peers):
            lines.append(f"| {name} | not measured | – |")
            continue
        lowest = min(peers, key=lambda p: runs[p]["peak_rss_bytes"])
        r = ours["peak_rss_bytes"] / runs[lowest]["peak_rss_bytes"]
        status = "met" if r <= 1.0 else "not met"
        if len(peers) < len(SAME_STAGE[stage]):
            status += f" ({len(peers)} of {len(SAME_STAGE[stage])} peers measured)"
        lines.append(f"| {name} | {r:.2f}x of {LABELS[lowest]} | {status} |")
    return lines


def _no_comm_rows(runs: dict[str, dict]) -> list[str]:
    """Stages 1-2 (and their overlap_param_gather variants) against the step without communication."""
    single, lines = runs.get("single"), []
    for stage, limit in NO_COMM_TARGET.items():
        for name in (f"zeroshard_s{stage}", f"zeroshard_s{stage}_overlap"):
            ours = runs.get(name)
            if _ok(ours) and _ok(single):
                r = ours["step_ms"] / single["step_ms"]
                lines.append(f"| {LABELS[name]} step time <= {limit}x no communication | {r:.2f}x "
                             f"| {'met' if r <= limit else 'not met'} |")
    return lines


def _model_state_table(runs: dict[str, dict]) -> list[str]:
    keys = ("params", "grads", "master", "optimizer")
    lines = ["| variant | bytes/element (p+g+m+o) | " + " | ".join(keys) + " | formula | match |",
             "|---|---|" + "---:|" * len(keys) + "---:|---|"]
    for name, run in runs.items():
        states = run.get("model_states") if _ok(run) else None
        if not states:
            continue
        measured, formula, per = states["measured"], states["formula"], states["per_element"]
        split = "+".join(str(per[k]) for k in ("param_bytes", "grad_bytes", "master_bytes", "optimizer_bytes"))
        ok = all(measured[k] == formula[k] for k in keys)
        lines.append(f"| {LABELS[name]} | {split} | " + " | ".join(f"{measured[k]:,}" for k in keys)
                     + f" | {sum(formula[k] for k in keys):,} | {'yes' if ok else 'no'} |")
    return lines if len(lines) > 2 else []


def _machine_lines(m: dict, more_software: str = "") -> list[str]:
    return [
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']:.0f} GiB RAM, no GPU",
        f"- Software: Python {m['python']}, torch {m['torch']}, DeepSpeed {m['deepspeed']} (`DS_ACCELERATOR=cpu`)"
        + more_software,
    ]


def _header(results: dict) -> list[str]:
    m = results["meta"]
    commands = sorted({run["command"] for run in results["runs"].values()})
    dates = sorted({run["measured_at"][:10] for run in results["runs"].values()})
    return [
        "# Benchmarks",
        "",
        f"- Date: {', '.join(dates)}",
        *_machine_lines(m),
        (
            f"- Ranks: {m['world']} processes on this machine, backend {m['backend']}, "
            f"{m['threads']} thread per rank (`torch.set_num_threads(1)`)"
        ),
        (
            f"- Workload: GPT preset (see each table), per-rank micro batch {m['micro_batch']} sequences "
            f"× {m['block_size']} tokens (global batch {m['micro_batch'] * m['world']} sequences), "
            f"{m.get('dtype', 'fp32')}, "
            f"Adam lr {m['lr']}, gradient bucket {m['bucket_elems']:,} elements where a variant has one, seed {m['seed']}"
        ),
        (
            f"- Timing: {m['warmup']} warm-up steps, then {m['steps']} timed steps (forward + backward + optimizer step); "
            "step ms = median over the timed steps of the slowest rank's wall time of that step"
            + (f"; every variant run {m['rounds']} times, interleaved round-robin, and its fastest round "
               "reported (the machine's speed drifts over minutes; peak RSS is the largest round's)"
               if m.get("rounds", 1) > 1 else "")
        ),
        (
            "- Memory: peak RSS = max over ranks of `getrusage(RUSAGE_SELF).ru_maxrss`; "
            "RSS before model = the same, read after the imports (the variant's library included), "
            "process group and corpus, before building the model"
        ),
        "",
        *_command_block(commands),
        (
            f"Variants ({m.get('dtype', 'fp32')} throughout; `plain` = `Adam(lr)`, `fused` = `Adam(lr, fused=True)`, "
            "the same optimizer object handed to the engines"
            + ("; bf16: zeroshard with `\"bf16\": {\"enabled\": true}` (bf16 parameters and gradients, "
               "fp32 master weights and Adam state), peers on the model cast to bf16 (bf16 Adam state, "
               "no fp32 master: not the same recipe)" if m.get("dtype") == "bf16" else "") + "):"
        ),
        "",
        *NOTES,
    ]


def render(results: dict, sizes: list[str], modes: list[str], variants: list[str]) -> str:
    lines = _header(results)
    for size in sizes:
        for mode in modes:
            runs = {v: results["runs"].get(f"{size}/{mode}/{v}") for v in variants}
            runs = {v: r for v, r in runs.items() if r is not None}
            if not runs:
                continue
            params = next((r["num_params"] for r in runs.values() if _ok(r)), None)
            title = f"{size} ({params / 1e6:.1f}M parameters)" if params else size
            adam = "Adam(fused=True)" if mode == "fused" else "Adam (plain)"
            lines += ["", f"## {title}, {adam}", "", *_variant_table(runs)]
            ratios = _ratio_table(runs)
            if ratios:
                lines += ["", "zeroshard against each peer, step time / peak RSS:", "", *ratios]
            states = _model_state_table(runs)
            if states:
                lines += ["", "zeroshard model states per rank (bytes, rank 0's `memory_stats()`) and the "
                          "ZeRO formula:", "", *states]
            if mode == "fused":
                lines += ["", "Targets:", "", *_target_rows(runs), *_no_comm_rows(runs)]
    return "\n".join(lines) + "\n"


# -- the checkpoint benchmark (checkpoint.py) ---------------------------------------------

CHECKPOINT_LABELS = {
    "fsdp2": "FSDP2 + DCP",
    "fsdp2_reshard": "FSDP2 (reshard_after_forward) + DCP",
    "deepspeed_z2": "DeepSpeed ZeRO-2",
    "deepspeed_z3": "DeepSpeed ZeRO-3",
    "zeroshard_s2": "zeroshard stage 2",
    "zeroshard_s3": "zeroshard stage 3",
}
CHECKPOINT_PEER = "fsdp2"  # the ratios are against this variant
CHECKPOINT_NOTES = [
    (
        "- zeroshard stage 2/3: `engine.save_checkpoint(dir, tag, client_state)` / `engine.load_checkpoint(dir, tag)` "
        "(optimizer state included); every rank writes its shard of the fp32 masters and Adam state to one "
        "safetensors file, rank 0 adds `state.pt` (counters, param groups, client state) and `manifest.json`; "
        "`latest` names the tag. Stage 3 with `wrap=[Block]`."
    ),
    (
        "- FSDP2 + DCP: `fully_shard` on each Block, then on the root (`reshard_after_forward=False`); save = "
        "`get_state_dict(model, optimizer)` from `torch.distributed.checkpoint.state_dict`, then "
        "`dcp.save({model, optim, client}, checkpoint_id=...)`; load = `get_state_dict`, `dcp.load`, `set_state_dict`."
    ),
    (
        "- DeepSpeed ZeRO-2/3: `engine.save_checkpoint(dir, tag, client_state)` / `engine.load_checkpoint(dir, tag)` "
        "(optimizer state included), set up as in the training benchmark (torch Adam, gloo, `DS_ACCELERATOR=cpu`). "
        "Its file count includes the `latest` file and the `zero_to_fp32.py` / `zero_to_torch.py` scripts it copies "
        "next to every checkpoint. Loading on another world size needs DeepSpeed's universal-checkpoint "
        "conversion (`ds_to_universal.py`, then `load_universal_checkpoint`), which is not run here: the failure "
        "of a plain `load_checkpoint` is recorded."
    ),
]


def _ms(seconds_ms: float) -> str:
    return f"{seconds_ms:.0f}" if seconds_ms >= 100 else f"{seconds_ms:.1f}"


def _reload_cell(load: dict | None, notes: list[str], label: str, arrow: str, with_time: bool) -> str:
    if load is None:
        return "–"
    if not load["ok"]:
        notes.append(f"{label}, {arrow}: {load['error']}")
        return f"failed [{len(notes)}]"
    if load["exact"]:
        cell = "exact"
    else:
        cell = f"loaded, {len(load['tensors_differ'])} of {load['tensors']} tensors differ"
    if not load["changed_by_load"]:
        cell += " (the fresh model already matched: no evidence)"
    if not load["client_state_ok"]:
        cell += ", client state lost"
    return cell + (f", {_ms(load['load_ms'])} ms" if with_time else "")


def _checkpoint_table(runs: dict[str, dict], writer: int, worlds: list[int]) -> list[str]:
    others = [w for w in worlds if w != writer]
    head = ["variant", "save ms", "save + fsync ms", f"load ms ({writer} ranks)", "on disk MiB", "files",
            "save peak RSS Δ MiB", "RSS before save MiB", f"reload {writer} → {writer}",
            *[f"reload {writer} → {w}" for w in others]]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * 7 + "---|" * (1 + len(others))]
    notes: list[str] = []
    for name, run in runs.items():
        label = CHECKPOINT_LABELS[name]
        if not _ok(run):
            error = run["error"].replace("|", "\\|")
            lines.append(f"| {label} | failed: {error} |" + " |" * (len(head) - 2))
            continue
        loads = run["loads"]
        same = loads.get(str(writer))
        load_ms = _ms(same["load_ms"]) if same and same["ok"] else "–"
        cells = [
            label, _ms(run["save_ms"]), _ms(run["durable_ms"]), load_ms, f"{run['bytes'] / MIB:.1f}",
            str(run["files"]), f"{run['save_rss_delta_bytes'] / MIB:.1f}", f"{run['rss_before_save_bytes'] / MIB:.0f}",
            _reload_cell(same, notes, label, f"{writer} → {writer} ranks", with_time=False),
            *[_reload_cell(loads.get(str(w)), notes, label, f"{writer} → {w} ranks", with_time=True) for w in others],
        ]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    if notes:
        lines += ["", *[f"- [{i}] {note}" for i, note in enumerate(notes, 1)]]
    return lines


def _checkpoint_ratios(runs: dict[str, dict]) -> list[str]:
    peer = runs.get(CHECKPOINT_PEER)
    if not _ok(peer):
        return []
    keys = [("save_ms", "save"), ("durable_ms", "save + fsync"), ("load_ms", "load"), ("bytes", "bytes on disk"),
            ("save_rss_delta_bytes", "save peak RSS Δ")]

    def value(run: dict, key: str) -> float | None:
        if key == "load_ms":
            load = run["loads"].get(str(run["writer_world"]))
            return load["load_ms"] if load and load["ok"] else None
        return run[key]

    lines = ["| variant | " + " | ".join(k[1] for k in keys) + " |", "|---|" + "---:|" * len(keys)]
    for name, run in runs.items():
        if name == CHECKPOINT_PEER or not _ok(run):
            continue
        cells = []
        for key, _ in keys:
            ours, theirs = value(run, key), value(peer, key)
            cells.append(_ratio(ours, theirs) if ours is not None and theirs else "–")
        lines.append(f"| {CHECKPOINT_LABELS[name]} | " + " | ".join(cells) + " |")
    return lines if len(lines) > 2 else []


def render_checkpoints(results: dict, sizes: list[str], variants: list[str]) -> str:
    """The "Checkpoints" section: save/load time, size, RSS and reloads on other world sizes, per preset."""
    m = results["meta"]
    runs_all = results["runs"]
    commands = sorted({run["command"] for run in runs_all.values()})
    dates = sorted({run["measured_at"][:10] for run in runs_all.values()})
    worlds = sorted({int(w) for run in runs_all.values() for w in run.get("loads", {})},
                    key=lambda w: (w != m["world"], w))
    safetensors = f", safetensors {m['safetensors']}" if m.get("safetensors") else ""
    lines = [
        "## Checkpoints",
        "",
        f"- Date: {', '.join(dates)}",
        *_machine_lines(m, safetensors),
        (
            f"- Ranks: written by {m['world']} processes on this machine (backend {m['backend']}, "
            f"{m['threads']} thread per rank); read back by {', '.join(map(str, worlds)) or 'none'} "
            "(each a fresh process tree)"
        ),
        (
            f"- Workload: GPT preset (see each table), {m['train_steps']} training steps before the first save "
            f"(so Adam's `exp_avg` / `exp_avg_sq` exist), Adam ({m['mode']}) lr {m['lr']}, per-rank micro batch "
            f"{m['micro_batch']} × {m['block_size']} tokens, fp32, seed {m['seed']}"
        ),
        (
            "- save ms: wall time of the save call on each rank, all ranks starting together after a barrier; "
            f"the slowest rank, median over {m['rounds']} round(s), each round into a new directory (the earlier "
            "one deleted). save + fsync ms: from the same start until every rank's save has returned and rank 0 "
            "has fsynced every file written (zeroshard and DCP fsync their own files; DeepSpeed's `torch.save` "
            "does not, so its save ms leaves the write-back to the kernel)"
        ),
        (
            f"- load ms: wall time of loading weights and optimizer state at {m['world']} ranks into a freshly "
            "built engine/model (other seed, not trained), slowest rank, median over the rounds; a new engine for "
            "every round. The checkpoint was just written, so its files are read mostly from the page cache"
        ),
        (
            "- Memory: save peak RSS Δ = per rank, the RSS high-water mark during the save (`VmHWM`, reset "
            "through `/proc/self/clear_refs` just before) minus the RSS just before; the largest over ranks "
            "and rounds. RSS before save: the largest rank's RSS just before the first save. on disk MiB: the "
            "sizes of every file the save wrote (`ls -l`), files: their number"
        ),
        (
            "- reload: the weights gathered in full to rank 0 (zeroshard `full_state_dict(rank0_only=True)`, FSDP2 "
            "`get_model_state_dict(full_state_dict=True, cpu_offload=True)`, DeepSpeed `module.state_dict()`, "
            "inside `GatheredParameters` at ZeRO-3) after training and after loading, compared by SHA-256 of "
            "every tensor's bytes: exact = every tensor equal (the fresh model's differ before loading); "
            "time = load ms at that world size. A failure shows the first line of the error"
        ),
        "",
        *_command_block(commands),
        "Variants:",
        "",
        *CHECKPOINT_NOTES,
    ]
    for size in sizes:
        runs = {v: runs_all[f"{size}/{v}"] for v in variants if f"{size}/{v}" in runs_all}
        if not runs:
            continue
        params = next((r["num_params"] for r in runs.values() if _ok(r)), None)
        title = f"{size} ({params / 1e6:.1f}M parameters)" if params else size
        lines += ["", f"### Checkpoints: {title}", "", *_checkpoint_table(runs, m["world"], worlds)]
        ratios = _checkpoint_ratios(runs)
        if ratios:
            lines += ["", f"Against {CHECKPOINT_LABELS[CHECKPOINT_PEER]} (ratio of the values above):", "", *ratios]
    return "\n".join(lines) + "\n"


def _command_block(commands: list[str]) -> list[str]:
    """The markdown lines that show the commands a report came from."""
    return ["Command" + ("s" if len(commands) > 1 else "") + ":", "", "```", *commands, "```", ""]


def write_section(path: Path, text: str) -> None:
    """Replace the section of `path` whose heading is `text`'s first line, or append it."""
    heading = text.splitlines()[0]
    old = path.read_text() if path.exists() else ""
    start = old.find(heading + "\n")
    if start < 0:
        path.write_text(old.rstrip("\n") + "\n\n\n" + text)
        return
    nxt = re.search(r"^## ", old[start + len(heading):], re.MULTILINE)
    end = start + len(heading) + nxt.start() if nxt else len(old)
    path.write_text(old[:start] + text + ("\n\n" + old[end:] if nxt else ""))
