"""Stage 3's gather schedule: on demand in the first step, then prefetching the next unit, within its limits,
and keeping from forward to backward the units reused within `stage3_max_reuse_distance`.

The tiny GPT with each Block a unit (`wrap=[Block]`) has three units:
the root (embeddings, final norm, tied head), blocks.0 and blocks.1.
Forward meets them as root, blocks.0, blocks.1; backward as root (the head),
blocks.1, blocks.0. References: those orders, read off the model's
structure; each unit's size, counted here from the model's parameters; the
limits, applied by hand to the units live at each moment; and the
single-process training of tests/recipes.py for the losses and weights.
A unit's reuse distance is counted here by hand from those orders: forwards
end as blocks.0, blocks.1, root, so the root is reused at once (0), blocks.1
after the root (ROOT_N), blocks.0 after blocks.1 and the root.
Every gather is recorded as (unit, prefetch?): a gather started inside
the schedule's `need(i)` for that same unit is on demand, any other is a
prefetch.
"""

from __future__ import annotations

import functools

import torch

from tests.distributed import run_ranks
from tests.recipes import (
    Case,
    loss_of,
    make_model,
    make_optimizer,
    micro_batch,
    relative_error,
    train_reference,
)

WORLD, STEPS = 2, 3
CASE = Case(stage=3, wrap=False)  # the units come from initialize(..., wrap=[Block])
ROOT, B0, B1 = "(root)", "blocks.0", "blocks.1"


def unit_sizes(world: int) -> dict[str, int]:
    """Elements each unit gathers: per optimizer param group (AdamW's two), padded to a multiple of N."""
    model = make_model()
    decay = {id(p) for p in model.parameters() if p.dim() >= 2}  # as make_optimizer("adamw") splits them
    sizes: dict[str, list[int]] = {}
    for name, p in model.named_parameters():  # the tied head is wte.weight: counted once, in the root
        unit = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else ROOT
        sizes.setdefault(unit, [0, 0])[id(p) in decay] += p.numel()
    return {unit: sum(-(-n // world) * world for n in groups) for unit, groups in sizes.items()}


SIZES = unit_sizes(WORLD)
ROOT_N, BLOCK_N = SIZES[ROOT], SIZES[B0]
assert SIZES[B1] == BLOCK_N and ROOT_N < BLOCK_N

# name -> zero_optimization keys (by default every unit is released after its forward)
LIMITS = {
    "default": {},
    "prefetch_below_block": {"stage3_prefetch_bucket_size": BLOCK_N - 1},
    "prefetch_at_block": {"stage3_prefetch_bucket_size": BLOCK_N},
    "live_below_two_units": {"stage3_max_live_parameters": ROOT_N + BLOCK_N - 1},
    "live_below_root_and_two_blocks": {"stage3_max_live_parameters": ROOT_N + 2 * BLOCK_N - 1},
    "live_at_root_and_two_blocks": {"stage3_max_live_parameters": ROOT_N + 2 * BLOCK_N},
    "reuse_at_once": {"stage3_max_reuse_distance": 1},
    "reuse_below_block": {"stage3_max_reuse_distance": ROOT_N + 1},
    "reuse_at_root_and_block": {"stage3_max_reuse_distance": ROOT_N + BLOCK_N},
    "reuse_all": {"stage3_max_reuse_distance": ROOT_N + BLOCK_N + 1},
    "reuse_within_live_of_two_units": {"stage3_max_reuse_distance": 10**9,
                                       "stage3_max_live_parameters": ROOT_N + BLOCK_N},
}

ON_DEMAND = {"forward": [(ROOT, False), (B0, False), (B1, False)],
             "backward": [(ROOT, False), (B1, False), (B0, False)]}
PREFETCHED = {"forward": [(ROOT, False), (B0, True), (B1, True)],
              "backward": [(ROOT, False), (B1, True), (B0, True)]}
# Live limit root + 2 blocks - 1: the root stays gathered through forward and backward, so only the
# first block after it fits beside it (root + block); the next would make root + 2 blocks.
FIRST_ONLY = {"forward": [(ROOT, False), (B0, True), (B1, False)],
              "backward": [(ROOT, False), (B1, True), (B0, False)]}
# Kept units are not gathered again in backward; the unit after a kept one is prefetched in its stead.
KEPT_ROOT = {"forward": PREFETCHED["forward"], "backward": [(B1, True), (B0, True)]}
KEPT_ROOT_AND_B1 = {"forward": PREFETCHED["forward"], "backward": [(B0, True)]}
KEPT_ALL = {"forward": PREFETCHED["forward"], "backward": []}
# Live limit root + block: the root and blocks.1 are kept (reused soonest), so blocks.0 never fits beside them.
KEPT_WITHIN_LIVE = {"forward": FIRST_ONLY["forward"], "backward": [(B0, False)]}
AFTER_FIRST_STEP = {
    "default": PREFETCHED, "prefetch_below_block": ON_DEMAND, "prefetch_at_block": PREFETCHED,
    "live_below_two_units": ON_DEMAND, "live_below_root_and_two_blocks": FIRST_ONLY,
    "live_at_root_and_two_blocks": PREFETCHED, "reuse_at_once": KEPT_ROOT, "reuse_below_block": KEPT_ROOT_AND_B1,
    "reuse_at_root_and_block": KEPT_ROOT_AND_B1, "reuse_all": KEPT_ALL, "reuse_within_live_of_two_units": KEPT_WITHIN_LIVE,
}


def _record(engine, sizes: dict[str, int]):
    """Wrap each unit's start_gather and the schedule's need: gathers go to `log["into"]` as
    (unit, prefetch?, elements live right after it started, counted from the units' states)."""
    from zeroshard.stage3.unit import UnitState

    schedule, units = engine.schedule, engine.units
    log = {"into": None, "outside": []}
    needing: list[int] = []

    def need(i, exact=True, after=None, _need=schedule.need):
        needing.append(i)
        try:
            _need(i, exact, after)
        finally:
            needing.pop()

    schedule.need = need
    for i, unit in enumerate(units):
        def start_gather(gathers, exact=True, i=i, unit=unit, _start=unit.start_gather):
            _start(gathers, exact)
            live = sum(sizes[u.name] for u in units if u.state in (UnitState.GATHERING, UnitState.GATHERED))
            entry = (unit.name, not (needing and needing[-1] == i), live)
            (log["into"] if log["into"] is not None else log["outside"]).append(entry)
        unit.start_gather = start_gather
    return log


def _train(rank, world, device, limits: dict, sizes: dict):
    import zeroshard
    from zeroshard.app.models.gpt import Block

    out = {}
    for name, extra in limits.items():
        model = make_model(device=device)
        config = CASE.config()
        config["zero_optimization"] |= extra
        engine = zeroshard.initialize(model, make_optimizer(CASE.optimizer, model), config, wrap=[Block])
        log = _record(engine, sizes)
        steps, losses = [], []
        for step in range(STEPS):
            x, y = (t.to(device) for t in micro_batch(step, CASE, world, rank, 0))
            log["into"] = forward = []
            loss = loss_of(engine, x, y)
            log["into"] = backward = []
            engine.backward(loss)
            log["into"] = None
            engine.step()
            steps.append({"forward": forward, "backward": backward,
                          "states": [u.state.name for u in engine.units]})
            losses.append(loss.item())
        outside = list(log["outside"])  # before full_state_dict, which gathers each unit itself
        full = engine.full_state_dict()
        weights = torch.cat([full[n].reshape(-1).cpu() for n, _ in engine.module.named_parameters()])
        out[name] = {"steps": steps, "losses": losses, "weights": weights, "outside": outside,
                     "units": [(u.name, u.gathered_numel) for u in engine.units]}
    return out


@functools.cache
def results() -> list[dict]:
    return run_ranks(_train, WORLD, LIMITS, SIZES)


def _order(gathers):
    return [(unit, prefetch) for unit, prefetch, _ in gathers]


def test_units_are_the_blocks_and_the_root_with_the_sizes_counted_here():
    for rank_result in results():
        for run in rank_result.values():
            assert run["units"] == [(ROOT, ROOT_N), (B0, BLOCK_N), (B1, BLOCK_N)]
            assert run["outside"] == []  # nothing gathered by step() itself


def test_first_step_gathers_on_demand_in_forward_then_backward_order():
    for rank_result in results():
        for name, run in rank_result.items():
            first = run["steps"][0]
            assert {p: _order(first[p]) for p in ("forward", "backward")} == ON_DEMAND, name


def test_later_steps_prefetch_the_next_unit_within_the_limits():
    per_rank = results()
    for name, want in AFTER_FIRST_STEP.items():
        for rank_result in per_rank:
            for step in rank_result[name]["steps"][1:]:
                assert {p: _order(step[p]) for p in ("forward", "backward")} == want, name
        assert per_rank[0][name]["steps"] == per_rank[1][name]["steps"], name  # ranks gather alike


def test_prefetches_keep_live_elements_within_the_limit():
    for rank_result in results():
        for name, run in rank_result.items():
            limit = LIMITS[name].get("stage3_max_live_parameters", 1_000_000_000)
            size_limit = LIMITS[name].get("stage3_prefetch_bucket_size", 50_000_000)
            prefetches = [g for step in run["steps"] for p in ("forward", "backward") for g in step[p] if g[1]]
            assert all(live <= limit and SIZES[unit] <= size_limit for unit, _, live in prefetches), name
            if name == "live_at_root_and_two_blocks":  # the limit is reached exactly, and allowed
                assert max(live for _, _, live in prefetches) == limit


def test_every_unit_is_sharded_after_each_step():
    for rank_result in results():
        for run in rank_result.values():
            assert all(step["states"] == ["SHARDED"] * 3 for step in run["steps"])


def test_training_matches_the_single_process_reference_whatever_the_prefetch():
    per_rank = results()
    ref_losses, ref_weights = train_reference(CASE, WORLD, STEPS)
    default = per_rank[0]["default"]
    for name in LIMITS:
        losses = torch.tensor([r[name]["losses"] for r in per_rank]).mean(0)
        err = ((losses - torch.tensor(ref_losses)).abs() / torch.tensor(ref_losses)).max().item()
        assert err <= 2e-5, f"{name}: loss error {err:.2e}"
        assert relative_error(per_rank[0][name]["weights"], ref_weights) <= 1e-4, name
        # Prefetching moves when a gather starts, not what it computes: bit for bit the same run.
        for r in per_rank:
            assert r[name]["losses"] == (r["default"]["losses"]), name
            assert torch.equal(r[name]["weights"], default["weights"]), name
