"""What a step reads and writes of the disk tier: the staging buffers kept between steps are a cache.

The bytes each step moves through the masters' and optimizer state's swap
files are counted at `SwapFile.read` / `SwapFile.write` (every transfer
moves its file's `nbytes`) and compared with what the cache promises: each
step writes every sub-group back, and reads every sub-group but the first
`buffer_count` of its order, which alternates step by step (the last
sub-groups of a step stay in memory and come first in the next one). A tier
of at most `buffer_count` sub-groups is read only at the first step. At
stages 2-3 the gradient shards of those first sub-groups stay in memory from
the window's last backward to the step; the others go to disk and back. The
losses equal the run without offload (the order changes no arithmetic).
"""

import dataclasses
from collections import Counter

from tests.distributed import run_ranks
from tests.recipes import Case, run_zeroshard, train_steps, train_zeroshard
from zeroshard.offload import SwapFile

STEPS = 4
BUFFER_COUNT = 4  # offload_optimizer.buffer_count's default
KINDS = ("read", "write", "read grad", "write grad")


def _counting(prefix: str = "bucket") -> tuple[Counter, callable]:
    """Count this process's swap-file bytes of the files named `prefix`... (the optimizer's: "bucket", the
    parameter shards: "unit") by verb; returns the counter and an undo."""
    moved: Counter = Counter()
    originals = {verb: getattr(SwapFile, verb) for verb in ("read", "write")}

    def counted(verb):
        def transfer(self, tensor):
            if self.name.startswith(prefix):
                moved[f"{verb} grad" if self.name.endswith(".grad") else verb] += self.nbytes
            return originals[verb](self, tensor)
        return transfer

    for verb in originals:
        setattr(SwapFile, verb, counted(verb))
    return moved, lambda: [setattr(SwapFile, verb, fn) for verb, fn in originals.items()]


def _measure(rank, world, device, cases):
    out = []
    for case in cases:
        plain, _ = train_zeroshard(rank, world, device, dataclasses.replace(case, offload="none",
                                                                            offload_params="none"), STEPS)
        moved, undo = _counting()
        per_step = []
        try:
            engine, losses = run_zeroshard(rank, world, device, case, 1)  # the first step creates the state
            for step in range(1, STEPS):
                before = Counter(moved)
                losses += train_steps(engine, None, case, world, rank, device, [step])
                per_step.append({kind: moved[kind] - before[kind] for kind in KINDS})
        finally:
            undo()
        tiers = engine.offload.tiers
        nbytes = {i: sum(s.nbytes for s in swaps.values()) for i, swaps in tiers.swaps.items()}
        grads = {i: swap.nbytes for i, swap in tiers.grad_swaps.items()}
        out.append((plain, losses, per_step, [list(g) for g in tiers.sub_groups], nbytes, grads))
        engine.offload.close()
    return out


def _expected(groups: list[list[int]], nbytes: dict[int, int], grads: dict[int, int]) -> list[dict[str, int]]:
    """Per step after the first: every sub-group's master and state written; those of all but the first
    BUFFER_COUNT of its order read. Gradient shards (stages 2-3): those of the first BUFFER_COUNT stay in
    memory from backward to the step; the others are written in backward and read back by the step."""
    def size(group, of):
        return sum(of.get(i, 0) for i in group)

    want = []
    for step in range(1, STEPS):
        order = groups if step % 2 == 0 else groups[::-1]  # the first step (0) ran in build order
        grad = sum(size(g, grads) for g in order[BUFFER_COUNT:])
        want.append({"read": sum(size(g, nbytes) for g in order[BUFFER_COUNT:]),
                     "write": sum(size(g, nbytes) for g in groups), "read grad": grad, "write grad": grad})
    return want


def test_a_step_reads_only_what_the_cache_lacks(tmp_path):
    disk = {"nvme_path": str(tmp_path)}
    cases = [
        Case(stage=1, offload="nvme", **disk),  # one sub-group: read once, at the first step
        Case(stage=2, offload="nvme", bucket=1500, sub_group=1, **disk),  # a sub-group per bucket
        Case(stage=3, offload="nvme", offload_params="nvme", sub_group=3000, clip=0.5, **disk),
    ]
    for i, (ref_losses, losses, per_step, groups, nbytes, grads) in enumerate(run_ranks(_measure, 2, cases)[0]):
        assert losses == ref_losses, f"{cases[i]}: losses differ from the run without offload"
        assert per_step == _expected(groups, nbytes, grads), (cases[i], groups, per_step)
        assert bool(grads) == (cases[i].stage > 1), cases[i]  # stages 2-3 keep the gradient shards on disk
        if cases[i].sub_group == 1:
            assert len(groups) > BUFFER_COUNT, f"{cases[i]}: too few sub-groups to test the reads ({groups})"
            assert all(step["read"] > 0 for step in per_step)
        if cases[i].sub_group is None:
            assert all(step["read"] == 0 for step in per_step) and len(groups) == 1


def _param_moves(rank, world, device, cases):
    out = []
    for case in cases:
        plain, _ = train_zeroshard(rank, world, device, dataclasses.replace(case, offload="none",
                                                                            offload_params="none"), STEPS)
        moved, undo = _counting("unit")
        per_step = []
        try:
            engine, losses = run_zeroshard(rank, world, device, case, 1)
            for step in range(1, STEPS):
                before = Counter(moved)
                losses += train_steps(engine, None, case, world, rank, device, [step])
                per_step.append({v: moved[v] - before[v] for v in ("read", "write")})
        finally:
            undo()
        shards = [b.flat.shard_swap for b in engine.buckets if b.flat.shard_swap is not None]  # build order
        kept = sum(engine.buckets[i].flat.shard_swap.nbytes for i in engine.offload.tiers.shards_kept)
        out.append((plain, losses, per_step, [(s.numel, s.nbytes) for s in shards], kept))
        engine.offload.close()
    return out


def test_the_shards_a_step_keeps_are_not_read_by_the_next_forward(tmp_path):
    disk = {"nvme_path": str(tmp_path), "stage": 3, "offload": "nvme", "offload_params": "nvme"}
    budgets = [None, 1, 2500]  # every shard kept (the defaults), none, the first ones
    cases = [Case(param_buffer=b, **disk) for b in budgets]
    for case, (ref_losses, losses, per_step, shards, kept_now) in zip(cases, run_ranks(_param_moves, 2, cases)[0]):
        assert losses == ref_losses, f"{case}: losses differ from the run without offload"
        budget, numel, kept = 5 * 10**8 if case.param_buffer is None else case.param_buffer, 0, 0
        for n, nbytes in shards:  # the first shards that fit in the budget together
            numel += n
            if numel > budget:
                break
            kept += nbytes
        total = sum(nbytes for _, nbytes in shards)
        assert kept_now == kept, f"{case}: the engine kept {kept_now} bytes of shards, the budget says {kept}"
        assert per_step == [{"write": total, "read": 2 * total - kept}] * (STEPS - 1), (case, shards, per_step)
        if case.param_buffer == 2500:
            assert 0 < kept < total, f"{case}: the budget should keep some shards, not all ({shards})"
