"""memory_stats(pool=...) with offload equals estimate/offload.py's formula per pool and kind, and is true.

One step of fp32 AdamW per case; per rank the padded elements P (so the
formula's shard is P / N exactly), the elements offloaded O (a ratio's
prefix of the buckets) and the buckets (torch's Adam keeps a 4-byte step per
master, where its master lives: the formula leaves that scalar to the
caller). Staging (the offload's aligned buffers, communication staging) is
declared memory, checked within a bound; every storage this process holds is
in the device or host pool.
"""

import dataclasses

import pytest

from tests.core.test_memory import held_storage_bytes
from tests.distributed import run_ranks
from tests.recipes import Case, make_engine, micro_batch
from zeroshard.core.memory import MemoryStats
from zeroshard.estimate.offload import offload_pool_bytes

KINDS = ("params", "grads", "master", "optimizer")


def _measure(rank, world, device, cases):
    out = []
    for case in cases:
        baseline = held_storage_bytes()
        engine = make_engine(case, device=device)
        for micro in range(case.accumulation):
            x, y = micro_batch(0, case, world, rank, micro)
            engine.backward(engine(x, y))
            engine.step()
        del x, y
        pools = {pool: dict(engine.memory_stats(pool)) for pool in ("device", "host", "disk")}
        held = held_storage_bytes() - baseline
        padded = sum(b.flat.padded_numel for b in engine.buckets)
        offloaded = sum(b.flat.shard_numel for b in engine.buckets if b.offload)
        steps = {"device": sum(not b.offload for b in engine.buckets), "host": sum(b.offload for b in engine.buckets)}
        largest = engine.offload.largest_shard(engine.units)
        out.append((case, padded, offloaded, steps, pools, held, engine.offload.buffer_overhead(), largest))
        engine.offload.close()
    return out


def _param_buffers(case) -> dict:
    return {} if case.param_buffer is None else {"param_buffer_count": 1, "param_buffer_size": case.param_buffer}


@pytest.mark.parametrize("world", [2])
def test_pools_match_formula_and_storage(world, tmp_path):
    disk = {"nvme_path": str(tmp_path)}
    cases = [Case(stage=s, offload=o, **disk) for s in (1, 2, 3) for o in ("cpu", "nvme")] + [
        Case(stage=3, offload="cpu", offload_params="cpu"),
        Case(stage=3, offload="nvme", offload_params="nvme", **disk),
        Case(stage=2, offload="cpu", ratio=0.5),
        Case(stage=2, accumulation=2, offload="nvme", **disk),
        # The delayed update's CPU step reads its own copy of the gradient shard (stage 1 has one already).
        Case(stage=1, offload="cpu", delayed=0),
        Case(stage=3, offload="nvme", offload_params="nvme", delayed=0, **disk),
        # Sub-groups and parameter buffers smaller than a bucket's or a unit's shard: whole ones move.
        Case(stage=2, offload="nvme", sub_group=1, **disk),
        Case(stage=3, offload="nvme", offload_params="nvme", sub_group=1, param_buffer=1, **disk),
    ]
    cases = [dataclasses.replace(c, optimizer="adamw") for c in cases]
    for case, padded, offloaded, steps, pools, held, overhead, largest in run_ranks(_measure, world, cases)[0]:
        want = offload_pool_bytes(padded, world, case.stage, offload_optimizer=case.offload,
                                  offload_param=case.offload_params, offloaded_numel=offloaded, max_in_cpu=0,
                                  delayed_update=case.delayed is not None, largest_shard=largest,
                                  sub_group_size=case.sub_group or 10**9, **_param_buffers(case))
        for pool in ("device", "host", "disk"):
            for kind in KINDS:
                # Adam's step counters, 4 bytes per master, in memory beside it (the host for a disk master).
                expected = want[pool][kind] + (4 * steps.get(pool, 0) if kind == "optimizer" else 0)
                assert pools[pool][kind] == expected, f"{case}: {pool} {kind} {pools[pool][kind]} != {expected}"
        assert pools["device"]["master"] == 0 or case.ratio < 1, case
        # The formula counts the values; each aligned buffer adds up to 2 x ALIGN, the I/O threads their bounces.
        assert pools["host"]["staging"] <= want["host"]["staging"] + overhead, (case, pools["host"], want["host"])
        in_memory = MemoryStats(pools["device"]).held() + MemoryStats(pools["host"]).held()
        assert held == in_memory, f"{case}: held {held} vs reported {in_memory}"
