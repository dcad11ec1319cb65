"""The engine holds what the estimate prices from the plan: `memory_stats()` by pool, to the byte.

One world of 4 ranks, declared 2 nodes x 2 (ZeRO++'s hpZ and qgZ need
nodes), runs every setup in turn: two GPTs, stages 0-3, fp32 and bf16 with
gradient accumulation, stage 3's units by class and by size with persistent
parameters, the optimizer offloaded to the CPU (and the parameters at stage
3), and ZeRO++ (qwZ, hpZ, qgZ). The reference is the estimator on the
model's meta-device count (`count_module`: buckets, units and flats by the
engine's own planning functions, nothing allocated): `step_peak` for the
device pool (model states, Adam's 4-byte step per trained tensor, and the
staging blocks of plan/staging.py), `offload_pool_bytes` for the pools with
offload, `hpz_secondary_bytes` for hpZ's shards after a backward. Sizes
priced are the plan's padded flats.
"""

from __future__ import annotations


import torch

from tests.distributed import run_ranks
from tests.distributed import test_device as rank_device
from tests.recipes import Case, make_engine, micro_batch
from zeroshard.app.estimate.model_count import AUTO_WRAP_MIN_PARAMS, count_module
from zeroshard.app.models import GPT, PRESETS, GPTConfig
from zeroshard.estimate import Flat, hpz_secondary_bytes, offload_pool_bytes, state_bytes_per_element, step_peak
from zeroshard.plan.flats import FROZEN, PERSISTENT, padded_numel

WORLD, PER_NODE = 4, 2
KINDS = ("params", "grads", "master", "optimizer", "staging", "hpz_secondary", "compression")
MODELS = {"tiny": PRESETS["tiny"], "wide": GPTConfig(vocab_size=65, block_size=32, n_layer=3, n_head=2, n_embd=48)}
ALL3 = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True,
        "zeropp_compile_quantizers": False}
SETUPS = [  # (model, case, ZeRO++ keys)
    *[("tiny", Case(stage=s, optimizer="adamw1"), {}) for s in range(4)],
    *[("wide", Case(stage=s, optimizer="adamw1", bucket=8000), {}) for s in (1, 3)],
    ("tiny", Case(stage=2, optimizer="adamw1", dtype="bf16", accumulation=2), {}),
    ("wide", Case(stage=3, optimizer="adamw1", dtype="bf16", accumulation=2, wrap=False, persistence=100), {}),
    ("tiny", Case(stage=1, optimizer="adamw1", offload="cpu"), {}),
    ("tiny", Case(stage=2, optimizer="adamw1", offload="cpu", dtype="bf16"), {}),
    ("tiny", Case(stage=3, optimizer="adamw1", offload="cpu", offload_params="cpu"), {}),
    ("tiny", Case(stage=3, optimizer="adamw1", dtype="bf16"), ALL3),
    ("wide", Case(stage=3, optimizer="adamw1", dtype="bf16"), {"zero_hpz_partition_size": 2}),
]


def _config(case: Case, zeropp: dict) -> dict:
    config = case.config()
    config["zero_optimization"] |= {"zeropp_ranks_per_node": PER_NODE} | zeropp
    return config


def _measure(rank, world, device, setups):
    out = []
    for model, case, zeropp in setups:
        engine = make_engine(case, model=lambda cfg=MODELS[model]: GPT(cfg).to(device),
                             config=_config(case, zeropp), device=device)
        for micro in range(case.accumulation):
            x, y = (t.to(device) for t in micro_batch(0, case, world, rank, micro))
            engine.backward(engine(x, y))
            engine.step()
        pools = {pool: dict(engine.memory_stats(pool)) for pool in ("device", "host", "disk")}
        x, y = (t.to(device) for t in micro_batch(1, case, world, rank, 0))
        engine.backward(engine(x, y))  # hpZ's secondary shards are held from the first gather to the step
        out.append({"pools": pools, "hpz_after_backward": engine.memory_stats()["hpz_secondary"]})
        engine.offload.close()
    return out


def _count(model: str, case: Case):
    with torch.device("meta"):
        module = GPT(MODELS[model])
    return count_module(model, module, ("Block",) if case.wrap else (), AUTO_WRAP_MIN_PARAMS, case.persistence,
                        case.bucket)


def _estimate(model: str, case: Case, scratch: bool) -> dict:
    """Each pool's bytes by kind, from the plan's sizes: `step_peak` on the device, `offload_pool_bytes` off it."""
    counted = _count(model, case)
    flats = [Flat(n) for n in counted.buckets] if case.stage < 3 else list(counted.flats)
    trained = [f for f in flats if f.kind != FROZEN]
    padded = sum(padded_numel(f.numel, WORLD) for f in trained)
    # An offloaded fp32 gradient shard is the reduction's own only for fp32 reductions on the CPU (the host).
    apart = case.offload != "none" and (case.dtype != "fp32" or rank_device(WORLD).type != "cpu")
    peak = step_peak(padded, 0, case.stage, WORLD, case.dtype, buckets=counted.buckets, units=counted.units,
                     accumulation=case.accumulation, scratch=scratch, shard_apart=apart)
    zero = {"hpz_secondary": 0, "compression": 0}
    device = {kind: getattr(peak, kind) for kind in KINDS[:5]} | zero
    if case.offload == "none":
        return {"device": device, "host": dict.fromkeys(KINDS, 0), "disk": dict.fromkeys(KINDS, 0)}
    per_element = state_bytes_per_element(case.dtype, case.wire, case.accumulation, case.stage)
    persistent = sum(padded_numel(f.numel, WORLD) for f in trained if f.kind == PERSISTENT)
    pools = offload_pool_bytes(padded, WORLD, case.stage, **per_element, offload_optimizer=case.offload,
                               offload_param=case.offload_params, persistent_numel=persistent)
    steps = 4 * len(trained)  # Adam's step counters, beside the masters on the host
    out = {pool: pools[pool] | zero for pool in ("device", "host", "disk")}
    out["host"]["optimizer"] += steps
    out["device"]["staging"] = peak.staging  # the plan's staging blocks; the formula's is the bucket in flight
    return out


def test_memory_stats_equal_the_estimate_of_the_plan_to_the_byte():
    measured = run_ranks(_measure, WORLD, SETUPS)
    scratch = rank_device(WORLD).type == "cpu"  # gloo's reduce-scatter is an all-to-all into a scratch block
    for i, (model, case, zeropp) in enumerate(SETUPS):
        want = _estimate(model, case, scratch and not zeropp.get("zero_quantized_gradients"))
        for rank, got in enumerate(r[i] for r in measured):
            for pool in ("device", "host", "disk"):
                assert {k: got["pools"][pool][k] for k in KINDS} == want[pool], (model, case, zeropp, rank, pool)
            if zeropp.get("zero_hpz_partition_size"):
                param_bytes = state_bytes_per_element(case.dtype)["param_bytes"]
                hpz = hpz_secondary_bytes(_count(model, case).flats, WORLD, PER_NODE, param_bytes)
                assert got["hpz_after_backward"] == hpz > 0, (model, case, rank)
