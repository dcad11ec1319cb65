"""The section "Compression on a shaped link" of benchmarks/compression_map.py: the map, the bytes, the
estimate's break-even bandwidth beside the measured crossing."""

from __future__ import annotations

import argparse
import datetime
import math
import re
import statistics

import zeropp_slow_network as net

from zeroshard import estimate
from zeroshard.dtypes import WIRE_BITS


def bytes_per_second(rate: str) -> float:
    """tc's `100mbit` (decimal prefixes) in bytes per second."""
    m = re.fullmatch(r"([\d.]+)([kmg]?)bit", rate.lower())
    if not m:
        raise ValueError(f"rate '{rate}': expected tc's form such as 10gbit, 1gbit, 100mbit")
    return float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]] / 8


def gbit(bandwidth: float | None) -> str:
    return "any" if bandwidth is None else "never" if bandwidth == 0 else f"{8 * bandwidth / 1e9:.3g} Gbit/s"


def best_by_rate(rounds: list[dict], rates: list[str]) -> dict[str, dict[str, dict]]:
    """{rate: {variant: its fastest successful round}} (the machine is shared: slower rounds are other load)."""
    return {rate: net.fastest_rounds([r for r in rounds if r["rate"] == rate]) for rate in rates}


def analyse(rounds: list[dict], rates: list[str], codecs: dict[str, str], baseline: str,
            per_element: dict[str, float]) -> dict:
    """C from the baseline, the estimate over its buckets, each codec's break-even and measured crossing."""
    best = best_by_rate(rounds, rates)
    base = [best[rate][baseline] for rate in rates if "error" not in best[rate].get(baseline, {"error": 1})]
    if not base:
        return {}
    compute = statistics.median(r["compute_seconds"] for r in base)
    buckets = base[0]["buckets"]
    summary = estimate.compression_summary(
        buckets, 2, 2, {c: (WIRE_BITS[c], per_element[c]) for c in codecs.values()}, param_bytes=4,
        compute=compute, overlap=estimate.BACKWARD_SHARE * compute)
    # What the link delivered to the exact collectives at the slowest rate, where the link bounds them:
    # the bytes each rank sent over the step's time beyond C, as a share of the rate.
    slowest = min(rates, key=bytes_per_second)
    sent = summary["exact"]["wire_bytes_per_rank"]
    slow_base = best[slowest].get(baseline, {"error": 1})
    efficiency = None if "error" in slow_base else (
        sent / (slow_base["median_step_seconds"] - compute) / bytes_per_second(slowest))
    out = {"compute_seconds": compute, "summary": summary, "crossing": {}, "model": {}, "efficiency": efficiency,
           "efficiency_rate": slowest}
    for variant, codec in [(baseline, None), *codecs.items()]:
        plan = estimate.step_bytes(buckets, 2, 2, None if codec is None else WIRE_BITS[codec])
        out["model"][variant] = {rate: estimate.step_seconds(plan, 2, bytes_per_second(rate), compute,
                                                             summary["overlap_seconds"], per_element.get(codec, 0.0))
                                 for rate in rates}
        out["model"][variant]["bytes"] = sum(plan.by_op().values())
        if codec is not None:
            out["crossing"][codec] = crossing(best, rates, baseline, variant)
    return out


def crossing(best: dict, rates: list[str], baseline: str, variant: str) -> str | float:
    """Where baseline / variant passes 1, interpolated in log bandwidth between two rates (bytes per second);
    else in words: above or below every rate measured."""
    points = sorted((bytes_per_second(rate), best[rate][baseline]["median_step_seconds"]
                     / best[rate][variant]["median_step_seconds"]) for rate in rates
                    if "error" not in best[rate].get(variant, {"error": 1})
                    and "error" not in best[rate].get(baseline, {"error": 1}))
    if len(points) < 2:
        return "not measured"
    for (b1, r1), (b2, r2) in zip(points, points[1:]):
        if (r1 - 1) * (r2 - 1) <= 0 and r1 != r2:
            return math.exp(math.log(b1) + (math.log(b2) - math.log(b1)) * (r1 - 1) / (r1 - r2))
    faster = points[0][1] > 1
    if all((r > 1) == faster for _, r in points):
        return (f"faster at every rate: above {gbit(points[-1][0])}" if faster
                else f"slower at every rate: below {gbit(points[0][0])}")
    return "the ratio crosses 1 more than once (noise)"


def map_table(best: dict, rates: list[str], variants: list[str], baseline: str) -> str:
    """Rows: variants; columns: rates; cells: median step seconds and baseline / variant."""
    lines = ["| variant | " + " | ".join(net.pretty_rate(r) for r in rates) + " |",
             "|---|" + "---:|" * len(rates)]
    for v in variants:
        cells = []
        for rate in rates:
            r, base = best[rate].get(v), best[rate].get(baseline, {})
            if r is None or "error" in r:
                cells.append("failed" if r else "")
                continue
            ratio = f" ({base['median_step_seconds'] / r['median_step_seconds']:.2f}x)" if "error" not in base else ""
            cells.append(f"{r['median_step_seconds']:.2f} s{ratio}")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bytes_table(rounds: list[dict], best: dict, rates: list[str], variants: list[str], model: dict) -> str:
    """Per rate and variant: every round, the model's step seconds, the link's, comm_stats' and the estimate's
    bytes per step, rank 0's loss."""
    lines = ["| rate | variant | step s, each round | model s | link MB/step | comm_stats MB/step | estimate MB/step "
             "| loss first → last |", "|---|---|---|---:|---:|---:|---:|---|"]
    for rate in rates:
        for v in variants:
            r = best[rate].get(v)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {net.pretty_rate(rate)} | {v} | failed: `{r['error'].splitlines()[0][:200]}` |||||")
                continue
            rounds_s = " / ".join(f"{x['median_step_seconds']:.2f}" for x in rounds
                                  if x["variant"] == v and x["rate"] == rate and "error" not in x)
            mod, engine = model.get(v), r["engine_bytes_per_step_rank0"]
            seconds, estimated = (f"{mod[rate]:.2f}", f"{mod['bytes'] / 1e6:.1f}") if mod else ("n/a", "n/a")
            recorded = f"{engine / 1e6:.1f}" if engine else "n/a"
            lines.append(f"| {net.pretty_rate(rate)} | {v} | {rounds_s} | {seconds} | "
                         f"{r['link_bytes_per_step'] / 1e6:.1f} | {recorded} | {estimated} | "
                         f"{r['losses_rank0'][0]:.4f} → {r['losses_rank0'][-1]:.4f} |")
    return "\n".join(lines)


def threshold_table(found: dict, codecs: dict[str, str]) -> str:
    """Per codec: its measured time, bytes, the estimate's break-even (at the nominal rate, and at the rate the
    exact collectives achieved), the measured crossing, and their ratio."""
    e = found["efficiency"]
    lines = ["| codec | codec ns/element (measured) | bytes/step vs exact | estimate: pays below | "
             "the same at the achieved rate | measured: crosses at | estimate / measured (achieved) |",
             "|---|---:|---:|---|---|---|---:|"]
    for codec in codecs.values():
        row = found["summary"]["codecs"][codec]
        est, meas = row["break_even_bytes_per_second"], found["crossing"][codec]
        achieved = est / e if est and e else None  # the nominal rate at which the link delivers `est`
        agree = (f"{est / meas:.2f} ({achieved / meas:.2f})" if isinstance(meas, float) and achieved else "n/a")
        lines.append(f"| {codec} | {row['codec_seconds_per_element'] * 1e9:.1f} | {row['ratio']:.3f} | {gbit(est)} | "
                     f"{gbit(achieved) if achieved else 'n/a'} | {gbit(meas) if isinstance(meas, float) else meas} | "
                     f"{agree} |")
    return "\n".join(lines)


def section(args: argparse.Namespace, rounds: list[dict], found: dict, context: dict) -> str:
    """The BENCHMARKS.md section. `context`: command, codecs, baseline, variants, skipped, loads."""
    best = best_by_rate(rounds, args.rates)
    variants, codecs, baseline = context["variants"], context["codecs"], context["baseline"]
    n_layer, n_embd = net.SIZES[args.size]
    params = next((r["num_params"] for r in rounds if "num_params" in r), 0)
    skipped = "".join(f"\n- Skipped: {v}: {why}" for v, why in context["skipped"].items())
    found_text = ""
    if found:
        summary = found["summary"]
        found_text = f"""
The estimate (`estimate.compression_summary`, the model of docs/compression.md) with C = {found['compute_seconds']:.3f} s ({baseline}'s step less its seconds blocked in collectives, median over the rates) and O = {summary['overlap_seconds']:.3f} s (backward's share, 2/3 of C), beside the measured crossing of each codec's curve with {baseline}'s. The model takes the link's nominal rate each way; at {net.pretty_rate(found['efficiency_rate'])} {baseline}'s collectives got {f"{found['efficiency']:.2f}" if found['efficiency'] else 'n/a'} of it (bytes each rank sent / (step - C) / rate), and "at the achieved rate" divides the estimate by that share:

{threshold_table(found, codecs)}
"""
    return f"""## Compression on a shaped link

- Date: {datetime.date.today()}
- Machine: {net.machine()}; CPU only, 2 ranks (1 thread each). Shared with other jobs: load average {context['loads'][0]} before, {context['loads'][1]} after; the figures are noisy
- zeroshard: {net.zeroshard_revision()}
- Network: 2 network namespaces as 2 nodes x 1 rank, a veth pair shaped with `tc qdisc ... root tbf rate R {' '.join(net.TBF)}` on both ends, R changed in place between rates
- Workload: GPT {args.size} ({n_layer} layers, width {n_embd}, vocabulary {net.VOCAB}; {params / 1e6:.1f}M parameters), 1 sequence x {args.tokens} tokens per rank per step, fp32, Adam lr 1e-4; gradient buckets of 6,553,600 elements (25 MiB) in zeroshard and DDP (ddp_powersgd: one bucket, as torch's PowerSGD hook on gloo needs); `overlap_comm: true`; DDP's PowerSGD: `matrix_approximation_rank` 4, `start_powerSGD_iter` 2
- Timing: {args.warmup} warm-up steps, {args.steps} timed; step s = median over the timed steps of the slower rank's step; {args.rounds} round(s) of every rate and variant, interleaved; the fastest round shown{skipped}

Command:

```
{context['command']}
```

Median step seconds (zeroshard_s2 / variant: above 1x the variant is faster):

{map_table(best, args.rates, variants, baseline)}
{found_text}
Per rate: every round, the model's step seconds, and the bytes per step (link: what both veth ends sent, TCP/IP headers included; comm_stats: rank 0's logical bytes, setup ops left out; estimate: `estimate.step_bytes` over the engine's buckets). For 2 ranks each rank sends half of the logical bytes, so the link's figure (both directions) is about the logical one:

{bytes_table(rounds, best, args.rates, variants, found.get('model', {}))}
"""
