"""PNG charts of a run and of `zeroshard compare`, drawn with matplotlib's Agg renderer.

Figures are built with `matplotlib.figure.Figure`, not pyplot: no global
state, no display needed. Sizes are in decimal MB, like the tables.
"""

from __future__ import annotations

from pathlib import Path

from zeroshard.estimate import wire_bytes

MB = 1e6
STATES = ("params", "grads", "master", "optimizer")
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
_DPI = 100


def loss_chart(path: Path, losses: list[float], lrs: list[float], first_step: int = 1) -> None:
    """The global mean loss per optimizer step (from `first_step`), with the learning rate on a second axis."""
    fig = _figure(figsize=(8, 4.5), dpi=_DPI, layout="constrained")
    ax = fig.add_subplot()
    steps = range(first_step, first_step + len(losses))
    ax.plot(steps, losses, color="tab:blue", label="loss")
    ax.set(xlabel="optimizer step", ylabel="loss (global mean)", title="Training loss")
    ax.grid(alpha=0.3)
    lr_ax = ax.twinx()
    lr_ax.plot(steps, lrs, color="tab:gray", linestyle="--", linewidth=1, label="learning rate")
    lr_ax.set_ylabel("learning rate")
    fig.legend(loc="upper right", bbox_to_anchor=(0.9, 0.9))
    fig.savefig(path)


def _stacked(ax, x: float, parts: dict[str, float], colors: dict[str, str], width: float,
             hatch: str | None = None) -> None:
    bottom = 0.0
    for name, value in parts.items():
        ax.bar(x, value, width, bottom=bottom, color=colors[name], hatch=hatch, edgecolor="white",
               alpha=0.55 if hatch else 1.0)
        bottom += value


def _legend(ax, colors: dict[str, str], extra: list | None = None, **kwargs) -> None:
    """A legend of the stacked parts (zero-height bars as handles), plus `extra` handles."""
    handles = [ax.bar(0, 0, color=color, label=name) for name, color in colors.items()]
    ax.legend(handles=handles + (extra or []), fontsize="small", **kwargs)


def memory_chart(path: Path, memory_stats: list[dict[str, int]], formula: dict[str, int], title: str) -> None:
    """Model-state bytes of every rank, stacked by state, beside the formula's total."""
    fig = _figure(figsize=(8, 4.5), dpi=_DPI, layout="constrained")
    ax = fig.add_subplot()
    parts = [k for k in STATES + ("staging",) if any(stats[k] for stats in memory_stats)]  # fp32: no master
    colors = _colors(parts)
    for rank, stats in enumerate(memory_stats):
        _stacked(ax, rank, {k: stats[k] / MB for k in parts}, colors, 0.6)
    line = ax.axhline(sum(formula.values()) / MB, color="black", linestyle="--", linewidth=1,
                      label="formula (model states)")
    ax.set_xticks(range(len(memory_stats)), [f"rank {r}" for r in range(len(memory_stats))])
    ax.set(ylabel="MB per rank", title=f"Memory per rank: {title}")
    _legend(ax, colors, [line], loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.savefig(path)


def compare_chart(path: Path, runs: list[dict], world: int) -> None:
    """Measured (solid) beside estimate (hatched) per run: model-state MB per rank, and MB sent per rank.

    Each run is {"name", "memory", "memory_estimate", "comm", "comm_estimate"},
    the memory dicts by state and the comm dicts (logical bytes) by
    collective. Traffic is drawn as bytes each rank sends on rings
    (`estimate.wire_bytes`), so an all-reduce shows its real, double cost.
    """
    def sent(logical: dict[str, int]) -> dict[str, float]:
        return {op: wire_bytes(b, world, op) for op, b in logical.items()}

    fig = _figure(figsize=(11, 4.8), dpi=_DPI, layout="constrained")
    memory_ax, comm_ax = fig.subplots(1, 2)
    panels = ((memory_ax, lambda run, key: run[key], "memory", STATES, "model states, MB per rank"),
              (comm_ax, lambda run, key: sent(run[key]), "comm", COLLECTIVES, "MB sent per rank per step"))
    for ax, values, key, parts, ylabel in panels:
        parts = [p for p in parts if any(run[key].get(p) for run in runs)]  # fp32 has no master copy
        colors = _colors(parts)
        top = 0.0
        for i, run in enumerate(runs):
            for dx, which, hatch in ((-0.2, key, None), (0.2, key + "_estimate", "//")):
                stack = {p: values(run, which).get(p, 0) / MB for p in parts}
                _stacked(ax, i + dx, stack, colors, 0.38, hatch=hatch)
                top = max(top, sum(stack.values()))
        ax.set_ylim(0, top * 1.3)  # headroom for the legend
        ax.set_xticks(range(len(runs)), [run["name"] for run in runs], rotation=20, ha="right")
        ax.set_ylabel(ylabel)
        hatched = ax.bar(0, 0, color="white", edgecolor="gray", hatch="//", label="estimate")
        _legend(ax, colors, [hatched], loc="upper center", ncol=4)
    memory_ax.set_title("Memory: measured | estimate")
    comm_ax.set_title("Communication: measured | estimate")
    fig.suptitle(f"zeroshard compare: {world} ranks (AR: all-reduce instead of reduce-scatter)")
    fig.savefig(path)


PEAK_PARTS = (*STATES, "activations", "buffers", "other")


def peak_chart(path: Path, rows: list[dict]) -> None:
    """Per stage, the step's peak per rank: the estimate by part (hatched) beside the measurement (solid).

    Each row (benchmarks/step_peak.py) holds "run" (model, dtype, stage), "predicted"
    (`StepPeak.as_dict()`) and "measured" ({"peak", "memory_stats"}). The estimate's buffers are its
    staging, stage 3's gathered units, a parameter's gradient and the recompute (or, when the optimizer step
    peaks, the step's temporaries); the measurement's are memory_stats' staging, its activations the
    measured ones, and "other" the rest of the resident peak (temporaries, fragments). One panel per
    model and dtype."""
    panels = list(dict.fromkeys((r["run"]["model"], r["run"]["dtype"]) for r in rows))
    fig = _figure(figsize=(5.5 * len(panels), 4.8), dpi=_DPI, layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    colors = _colors(PEAK_PARTS)
    for ax, (model, dtype) in zip(axes, panels):
        mine = [r for r in rows if (r["run"]["model"], r["run"]["dtype"]) == (model, dtype)]
        top = 0.0
        for i, row in enumerate(mine):
            _stacked(ax, i - 0.2, _estimated_parts(row["predicted"]), colors, 0.38, hatch="//")
            _stacked(ax, i + 0.2, _measured_parts(row["measured"], row["predicted"]["phase"]), colors, 0.38)
            top = max(top, row["predicted"]["total"] / MB, row["measured"]["peak"] / MB)
        ax.set_ylim(0, top * 1.3)  # headroom for the legend
        ax.set_xticks(range(len(mine)), [f"stage {r['run']['stage']}" for r in mine])
        ax.set(ylabel="MB per rank at the step's peak", title=f"{model}, {dtype}: estimate | measured")
        hatched = ax.bar(0, 0, color="white", edgecolor="gray", hatch="//", label="estimate")
        _legend(ax, colors, [hatched], loc="upper center", ncol=4)
    fig.savefig(path)


def _estimated_parts(p: dict) -> dict[str, float]:
    parts = {k: p[k] / MB for k in STATES}
    parts["activations"] = p["activations"] / MB if p["phase"] == "backward" else 0.0
    parts["buffers"] = p["total"] / MB - sum(parts.values())
    return parts


def _measured_parts(m: dict, phase: str) -> dict[str, float]:
    """memory_stats' kinds, the measured activations where the estimate peaks in backward (at the optimizer
    step they are gone), and the rest of the resident peak."""
    stats = m["memory_stats"]
    parts = {k: stats[k] / MB for k in STATES}
    parts["buffers"] = stats["staging"] / MB
    room = m["peak"] / MB - sum(parts.values())  # what the resident peak holds beyond the states
    parts["activations"] = max(0.0, min(stats["activations"] / MB, room)) if phase == "backward" else 0.0
    parts["other"] = max(0.0, room - parts["activations"])
    return {k: parts.get(k, 0.0) for k in PEAK_PARTS}


def _figure(**kwargs):
    """A matplotlib Figure; matplotlib (about 1 s to import) loads only when a chart is drawn, not when
    the CLI starts."""
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def _colors(names) -> dict[str, str]:
    return {name: f"C{i}" for i, name in enumerate(names)}
