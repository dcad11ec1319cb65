"""The demo's closing report (rank 0): run summary, sample, measured-vs-formula tables, and
the same figures as one JSON-ready dict for `--report`."""

from __future__ import annotations

import argparse
import os
import statistics

import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from rich.text import Text

import zeroshard
from zeroshard import estimate
from zeroshard.app.estimate.model_count import stage3_flats
from zeroshard.app.demo.compress import reduction_formula
from zeroshard.app.demo.offload import offloaded, pool_formula
from zeroshard.dtypes import WIRE_BITS
from zeroshard.estimate.offload import POOLS
from zeroshard.estimate.zeropp import ZeroPP, hpz_secondary_bytes, stage3_comm_bytes

_STEP_COUNTER_BYTES = 4  # torch's Adam(W) keeps one fp32 `step` tensor per optimizer tensor


def formulas(psi: int, world: int, args: argparse.Namespace, engine: zeroshard.Engine) -> tuple[dict, dict]:
    """(model-state bytes per rank, logical comm bytes per step) that `zeroshard.estimate` predicts.

    `psi` is the padded Ψ the ranks split; the engine's flat buffers hold one
    Adam step counter each, and its precision sets the bytes per element.
    With offload, the memory is the three pools' sum (`offload_pools`).
    The step check (gradient norm, non-finite flag, counters) is its own op:
    `estimate.step_check_bytes`.
    """
    memory = estimate.model_state_bytes(psi, world, args.stage, **_bytes_per_element(engine, args),
                                        optimizer_scalar_bytes=_STEP_COUNTER_BYTES * len(engine.buckets))
    if offloaded(engine.config):
        pools = offload_pools(engine, args)
        memory = {kind: sum(pools[pool][kind] for pool in POOLS) for kind in memory}
    comm = estimate.comm_bytes_per_step(
        psi, args.stage, elem_bytes=engine.precision.param_dtype.itemsize, reduce_scatter=args.reduce_scatter,
        accumulation=args.accumulation, reduce_bytes=engine.precision.reduce_dtype.itemsize)
    if _zeropp(engine.config).on:  # quantized and node-local collectives: the exact formula of each unit
        comm |= {op: sum(scopes.values()) for op, scopes in stage3_scopes(engine, args).items()}
    return memory, comm | reduction_formula(engine, args.accumulation)


def offload_pools(engine: zeroshard.Engine, args: argparse.Namespace) -> dict:
    """Each pool's bytes per rank by kind (device, host, disk; and pinned), as estimate/offload.py has them."""
    return pool_formula(engine, _bytes_per_element(engine, args))


def _zeropp(config: zeroshard.Config) -> ZeroPP:
    """Stage 3's quantized parts: ZeRO++'s keys, or communication_compression's parameter codec as qwZ."""
    zero, params = config.zero_optimization, config.communication_compression.parameters
    if params.codec != "none" and config.stage == 3:
        return ZeroPP(True, zero.zero_hpz_partition_size > 1, False, params.block_size, weight_bits=WIRE_BITS[params.codec])
    return ZeroPP(zero.zero_quantized_weights, zero.zero_hpz_partition_size > 1, zero.zero_quantized_gradients,
                  zero.zeropp_block_size, zero.zeropp_gradient_bits)


def ranks_per_node(engine: zeroshard.Engine) -> int:
    """D, as the engine's topology has it (config, else torchrun's LOCAL_WORLD_SIZE); one node if neither says."""
    configured = engine.config.zero_optimization.ranks_per_node
    return configured or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


def stage3_scopes(engine: zeroshard.Engine, args: argparse.Namespace) -> dict[str, dict[str, int]]:
    """Stage 3's all-gather and reduce-scatter bytes per step by scope ("node" / "cross_node"), per estimate."""
    return stage3_comm_bytes(stage3_flats(engine.units), dist.get_world_size(), ranks_per_node(engine),
                             engine.precision.param_dtype.itemsize, engine.precision.reduce_dtype.itemsize,
                             args.accumulation, _zeropp(engine.config))


def _bytes_per_element(engine: zeroshard.Engine, args: argparse.Namespace) -> dict[str, int]:
    config = engine.config
    return estimate.state_bytes_per_element(config.training_dtype, config.communication_data_type,
                                            args.accumulation, args.stage)


def _padded_psi(engine: zeroshard.Engine) -> int:
    return sum(u.flat.padded_numel for u in engine.buckets)  # padded: what the ranks really split


def _tokens_per_step(engine: zeroshard.Engine, args: argparse.Namespace) -> int:
    return args.micro_batch * dist.get_world_size() * args.accumulation * engine.module.cfg.block_size


def report_figures(engine: zeroshard.Engine, args: argparse.Namespace, config: zeroshard.Config,
                   result, everyone: list) -> dict:
    """Every figure of the run, JSON-ready: what `--report DIR` writes to report.json.

    Bytes throughout; `memory_stats` and `comm_stats` (last step: calls and
    logical bytes per collective) are lists indexed by rank; `estimate`
    holds the formulas for the same Ψ.
    """
    psi, world, tokens = _padded_psi(engine), dist.get_world_size(), _tokens_per_step(engine, args)
    memory, comm = formulas(psi, world, args, engine)
    return {
        "config": config.to_dict(), "world_size": world, "backend": dist.get_backend(),
        "model": args.model, "params": engine.num_params, "psi_padded": psi,
        "buckets": len(engine.buckets), "steps": args.steps, "first_step": result.first_step, "tokens_per_step": tokens,
        "losses": result.losses, "lr": result.lrs, "step_seconds": result.step_seconds,
        "tokens_per_second": [tokens / s for s in result.step_seconds],
        "memory_stats": [m for m, _, _ in everyone],
        "memory_pools": [pools for *_, pools in everyone],  # memory_stats(pool) by rank
        "comm_stats": [{op: {"calls": c, "bytes": b, "by_scope": s} for op, (c, b, s) in ops.items()}
                       for _, ops, _ in everyone],
        "estimate": {"memory": memory, "comm": comm} | ({"pools": offload_pools(engine, args)} if offloaded(config) else {}),
        "sample": result.sample,
    }


def print_report(console: Console, engine: zeroshard.Engine, args: argparse.Namespace,
                  result, everyone: list) -> None:
    """The run summary, the generated sample, and measured-vs-formula tables for memory and comm."""
    world, stage = dist.get_world_size(), args.stage
    psi, tokens = _padded_psi(engine), _tokens_per_step(engine, args)
    median = statistics.median(result.step_seconds[1:] or result.step_seconds)  # step 1 warms up
    console.print()
    console.print(f"[bold]zeroshard stage {stage}[/], {world} rank(s) on {dist.get_backend()}: "
                  f"{_steps_run(result.first_step, args.steps)} of {tokens:,} tokens")
    console.print(f"loss [bold]{result.losses[0]:.3f}[/] (first step) -> [bold]{result.losses[-1]:.3f}[/] "
                  f"(last step)")
    console.print(f"median step {median:.3f} s, {tokens / median:,.0f} tokens/s")
    count, numel = len(engine.buckets), sum(u.flat.numel for u in engine.buckets)
    console.print(f"Ψ = {psi:,} elements in {count} bucket{'' if count == 1 else 's'} ({numel:,} parameters"
                  + (f" + {psi - numel:,} padding)" if psi > numel else ")"))
    if result.sample:  # --sample 0 asks for none
        console.print(Text("sample: ") + Text(result.sample, style="italic"))  # Text: no markup in the sample
    memory, comm = formulas(psi, world, args, engine)
    if offloaded(engine.config):  # model states spread over three pools: each beside its formula
        console.print(_pools_table(offload_pools(engine, args), [pools for *_, pools in everyone]))
    else:
        console.print(_memory_table(memory, world, engine, args, result.memory, everyone))
    console.print(_comm_table(comm, world, engine, args, result.comm_last_step, everyone))
    if args.stage == 3 and (engine.comm.scope == "cross_node" or _zeropp(engine.config).on):
        console.print(_scope_table(engine, args, result.comm_last_step, everyone))


def _steps_run(first: int, last: int) -> str:
    return f"{last} steps" if first == 1 else f"steps {first}-{last} (resumed)"


def _match(ok: bool) -> str:
    return "[green]✓[/]" if ok else "[red]✗[/]"


def _memory_table(formula: dict[str, int], world: int, engine: zeroshard.Engine, args: argparse.Namespace,
                  measured: dict[str, int], everyone: list) -> Table:
    """Per-rank model-state bytes: rank 0's `memory_stats()` next to `estimate.model_state_bytes`."""
    stage, buckets, config = args.stage, len(engine.buckets), engine.config
    per = _bytes_per_element(engine, args)
    shard = "Ψ" if stage == 0 else "Ψ/N"
    how = {"params": f"{per['param_bytes']}Ψ" + ("/N" if stage == 3 else ""),
           "grads": f"{per['grad_bytes']}Ψ/N" if stage >= 2 else f"{per['grad_bytes']}Ψ",
           "master": f"{per['master_bytes']}{shard}" if per["master_bytes"] else "0: the fp32 params",
           "optimizer": f"8{shard} + 4·{buckets}"}
    table = Table(title=f"Model states per rank (bytes, {config.training_dtype})", title_justify="left",
                  show_edge=False, caption=f"N = {world} ranks; optimizer: AdamW's two moments and a 4-byte "
                  f"step counter per optimizer tensor ({buckets})", caption_justify="left")
    for name in ("state", "measured", "formula", "expression", "ok"):
        numeric = name in ("measured", "formula")
        table.add_column(name, justify="right" if numeric else "left", no_wrap=name != "expression")
    for key, expected in formula.items():
        ok = all(memory[key] == expected for memory, *_ in everyone)
        table.add_row(key, f"{measured[key]:,}", f"{expected:,}", how[key], _match(ok))
    table.add_row("staging", f"{measured['staging']:,}", "-", "communication staging", "")
    return table


def _pools_table(formula: dict, everyone: list[dict]) -> Table:
    """Each pool's model states: rank 0's `memory_stats(pool)` beside `estimate.offload_pool_bytes`."""
    table = Table(title="Memory pools per rank (bytes): memory_stats(pool) beside estimate.offload_pool_bytes",
                  title_justify="left", show_edge=False, caption_justify="left",
                  caption="ok: every rank equals the formula (host staging, the aligned buffers of disk "
                          "transfers: at most it, with their alignment and the I/O threads' bounce buffers); "
                          "optimizer: AdamW's moments and a 4-byte step counter per master, where the master is "
                          "(its moments on disk with it, the counter in host memory)")
    for name in ("pool", "state", "measured", "formula", "ok"):
        table.add_column(name, justify="right" if name in ("measured", "formula") else "left", no_wrap=True)
    for pool in POOLS:
        for kind in ("params", "grads", "master", "optimizer"):
            ok = all(rank[pool][kind] == formula[pool][kind] for rank in everyone)
            table.add_row(pool, kind, f"{everyone[0][pool][kind]:,}", f"{formula[pool][kind]:,}", _match(ok))
        if pool == "device":
            table.add_row(pool, "staging", f"{everyone[0][pool]['staging']:,}", "-", "communication staging")
        elif pool == "host":
            ok = all(rank[pool]["staging"] <= formula[pool]["staging"] for rank in everyone)
            table.add_row(pool, "staging", f"{everyone[0][pool]['staging']:,}", f"≤ {formula[pool]['staging']:,}",
                          _match(ok))
    return table


def _comm_table(formula: dict[str, int], world: int, engine: zeroshard.Engine, args: argparse.Namespace,
                measured: dict[str, tuple[int, int, set[str]]], everyone: list) -> Table:
    """Last step's logical bytes per collective next to `estimate.comm_bytes_per_step`."""
    param_bytes = engine.precision.param_dtype.itemsize
    wire = engine.precision.reduce_dtype.itemsize
    grads = f"{wire}Ψ" + (f"×{args.accumulation}" if args.stage >= 2 and args.accumulation > 1 else "")
    reduced = [grads] * (args.stage == 0 or not args.reduce_scatter)
    gathered = f"{param_bytes}Ψ" + (f"×{2 * args.accumulation}" if args.stage == 3 else "")
    how = {"all_reduce": " + ".join(reduced), "reduce_scatter": grads, "all_gather": gathered,
           "step_check": "40N (norm, inf/nan flag, step counters, collectives' checksum)",
           "fault_check": "8N per step and per gather of a unit on disk"}
    if _zeropp(engine.config).on:
        how |= {"reduce_scatter": "ZeRO++: by scope below", "all_gather": "ZeRO++: by scope below"}
    codec = engine.config.communication_compression.gradients.codec
    if reduction_formula(engine, args.accumulation):
        how |= {"reduce_scatter": f"{codec}: N x ⌈S/block⌉ blocks + scales"}
        how |= {"all_gather": f"{codec}: the all-reduce's gather"} if args.stage == 0 else {}
        how |= {"all_reduce": "PowerSGD: P, Q, exact part per bucket"} if codec == "powersgd" else {}
    weights = engine.config.communication_compression.parameters.codec
    if weights != "none" and args.stage in (1, 2):
        how |= {"all_gather": f"{weights}: the gather after the step"}
    formula = formula | {"step_check": estimate.step_check_bytes(world),
                         "fault_check": estimate.fault_check_bytes(world, _fault_checks(engine, args))}
    # all_gather's "object" is the setup's agreement check (0 bytes), not a way to move tensors.
    algorithms = {op: ",".join(sorted(a - {"object"})) for op, (_, b, a, _) in measured.items() if b}
    table = Table(title="Communication per optimizer step (bytes, last step)", title_justify="left",
                  caption="wire/rank: bytes each rank sends on a ring; algorithms: "
                          + "; ".join(f"{op} = {a}" for op, a in algorithms.items()),
                  caption_justify="left", show_edge=False)
    for name in ("collective", "calls", "measured", "formula", "expression", "wire/rank", "ok"):
        numeric = name in ("calls", "measured", "formula", "wire/rank")
        table.add_column(name, justify="right" if numeric else "left", no_wrap=name != "expression")
    for op, (calls, nbytes, *_) in measured.items():
        expected = formula.get(op, 0)
        if expected == 0 and nbytes == 0:
            continue
        ok = all(comm[op][1] == expected for _, comm, _ in everyone)
        wire = estimate.wire_bytes(expected, world, "all_gather" if op.endswith("_check") else op)
        table.add_row(op, str(calls), f"{nbytes:,}", f"{expected:,}", how.get(op, "0"),
                      f"{wire:,.0f}", _match(ok))
    return table


def _fault_checks(engine: zeroshard.Engine, args: argparse.Namespace) -> int:
    """Offload's fault checks in the last step: one after the step's disk I/O (none for a step a delayed update
    runs in the background), one for the landing of a delayed update, one for the gradient shards backward
    wrote to disk (stages 2-3), and at stage 3 one before each gather (forward and backward, each micro-step)
    of a unit whose shards are on disk."""
    delayed = engine.delayed is not None
    if not (engine.offload.swaps or delayed):
        return 0
    stepped_now = not (delayed and engine.delayed.delays(engine.global_steps - 1))
    on_disk = sum(any(f.shard_swap is not None for f in unit.gathered_flats) for unit in engine.units)
    return stepped_now + delayed + bool(engine.offload.tiers.grad_swaps) + 2 * args.accumulation * on_disk


def _scope_table(engine: zeroshard.Engine, args: argparse.Namespace,
                 measured: dict[str, tuple[int, int, set[str], dict[str, int]]], everyone: list) -> Table:
    """Stage 3's gathers and reductions inside a node and across nodes: rank 0 measured, and the estimate."""
    formula, zeropp = stage3_scopes(engine, args), _zeropp(engine.config)
    world, per_node = dist.get_world_size(), ranks_per_node(engine)
    m = sum(f.numel for f in stage3_flats(engine.units)) * engine.precision.param_dtype.itemsize
    parts = ", ".join(p for p, on in (("qwZ", zeropp.qwz), ("hpZ", zeropp.hpz), ("qgZ", zeropp.qgz)) if on)
    caption = f"M = {m:,} bytes (the parameters in {engine.config.training_dtype}); ok: every rank equals the estimate"
    if zeropp.hpz:
        secondary = hpz_secondary_bytes(stage3_flats(engine.units), world, per_node,
                                        engine.precision.param_dtype.itemsize)
        caption += f"; hpZ secondary shards: {secondary:,} bytes per rank from a step's first forward to the step"
    table = Table(title=f"Stage 3 by scope, {world // per_node} node(s) x {per_node} ranks, {parts or 'no ZeRO++'} "
                        "(bytes, last step)", title_justify="left", caption=caption, caption_justify="left",
                  show_edge=False)
    for name in ("scope", "collective", "measured", "formula", "× M", "ok"):
        table.add_column(name, justify="left" if name in ("collective", "scope", "ok") else "right", no_wrap=True)
    for scope in ("node", "cross_node"):
        for op, scopes in formula.items():
            expected, got = scopes.get(scope, 0), measured[op][3].get(scope, 0)
            ok = all(comm[op][2].get(scope, 0) == expected for _, comm, _ in everyone)
            table.add_row(scope.replace("_", "-"), op, f"{got:,}", f"{expected:,}", f"{got / m:.3f}", _match(ok))
    return table
