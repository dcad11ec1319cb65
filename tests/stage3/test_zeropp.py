"""ZeRO++ in stage 3's training: qwZ, hpZ and qgZ switched on by config, at 4 ranks declared 2 nodes x 2.

References: the bytes of estimate/zeropp.py's formulas, computed here from
the engine's own flat buffers (and the paper's 0.5M / 0 / 0.25M bounds);
dequantize(quantize(shard)) of every rank's exact shard, gathered with
torch.distributed; plain stage 3 (itself checked against single-process
training in test_parity) for hpZ's bitwise losses and for training with
all three on.
"""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from tests.distributed import RankFailure, run_ranks
from tests.recipes import GPT_CFG, Case, make_engine, micro_batch
from zeroshard.app.demo import data
from zeroshard.app.estimate.model_count import stage3_flats
from zeroshard.app.models import GPT
from zeroshard.comm.compress.quantize import BlockCodec, dequantize, quantize
from zeroshard.estimate import qgz_reduce_scatter_bytes, qwz_all_gather_bytes
from zeroshard.estimate.zeropp import ZeroPP, hpz_secondary_bytes, stage3_comm_bytes

WORLD, PER_NODE = 4, 2
ALL3 = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
QWZ, HPZ = {"zero_quantized_weights": True}, {"zero_hpz_partition_size": 2}
# The quantizers' arithmetic, eagerly: compiled it gives the same values (tests/comm/compress/test_quantize.py and the
# default's own test below), and compiling takes seconds in every rank.
EAGER = {"zeropp_compile_quantizers": False}


def _engine(case: Case, device, zeropp: dict, model=None, default_compile: bool = False):
    config = case.config()
    config["zero_optimization"] |= {"zeropp_ranks_per_node": PER_NODE} | ({} if default_compile else EAGER) | zeropp
    if not (zeropp.get("zero_quantized_weights") or zeropp.get("zero_quantized_gradients")):
        config["zero_optimization"].pop("zeropp_compile_quantizers", None)  # only with a quantizer on
    return make_engine(case, model=model, config=config, device=device)


def _train(engine, case: Case, world: int, rank: int, steps: int, first: int = 0) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        total = 0.0
        for micro in range(case.accumulation):
            x, y = (t.to(engine.device) for t in micro_batch(step, case, world, rank, micro))
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.item() / case.accumulation
        losses.append(total)
    return losses


def _by_scope(before, after, op: str) -> dict[str, int]:
    return {s: b - before[op].by_scope.get(s, 0) for s, b in after[op].by_scope.items()
            if b - before[op].by_scope.get(s, 0)}


def _flats(engine) -> list[tuple[int, int]]:
    """(numel, shard numel) of every gathered flat buffer of every unit."""
    return [(f.numel, f.shard_numel) for unit in engine.units for f in unit.gathered_flats]


def _bytes_run(rank, world, device, variants: dict):
    out = {}
    case = Case(stage=3, dtype="bf16", optimizer="adamw1_slow")
    for name, zeropp in variants.items():
        engine = _engine(case, device, zeropp)
        _train(engine, case, world, rank, 1)  # the measured step below is not the first
        before = engine.comm_stats()
        _train(engine, case, world, rank, 1, first=1)
        after = engine.comm_stats()
        out[name] = {"gather": _by_scope(before, after, "all_gather"),
                     "reduce": _by_scope(before, after, "reduce_scatter"), "flats": _flats(engine),
                     "psi": sum(numel for numel, _ in _flats(engine)), "units": stage3_flats(engine.units)}
    return out


def test_cross_node_bytes_per_step_are_the_papers_and_the_formulas():
    variants = {"plain": {}, "int4": ALL3 | {"zeropp_gradient_bits": 4}, "int8": ALL3}
    for out in run_ranks(_bytes_run, WORLD, variants):
        flats, psi = out["plain"]["flats"], out["plain"]["psi"]
        m = 2 * psi  # bf16: M = 2 bytes x Ψ
        padded = sum(2 * WORLD * shard for _, shard in flats)
        assert padded - m < 2 * WORLD * len(flats)  # M, up to the flats' padding to N shards
        assert out["plain"]["gather"] == {"cross_node": 2 * padded}  # forward M + backward M
        assert out["plain"]["reduce"] == {"cross_node": padded}  # + M
        for name, bits in (("int4", 4), ("int8", 8)):
            run = out[name]
            forward = sum(qwz_all_gather_bytes(numel, WORLD, 8, 128) for numel, _ in flats)
            assert run["gather"] == {"cross_node": forward, "node": padded}  # hpZ: backward inside the node
            assert forward <= 0.53 * m
            hops = [qgz_reduce_scatter_bytes(numel, WORLD, PER_NODE, bits, 128) for numel, _ in flats]
            assert run["reduce"] == {s: sum(h[s] for h in hops) for s in ("node", "cross_node")}
            assert run["reduce"]["cross_node"] <= (0.28 if bits == 4 else 0.53) * m / PER_NODE
        for name, zeropp in (("plain", ZeroPP()), ("int4", ZeroPP(True, True, True, gradient_bits=4)),
                             ("int8", ZeroPP(True, True, True, gradient_bits=8))):  # what zeroshard estimate prints
            estimate = stage3_comm_bytes(out[name]["units"], WORLD, PER_NODE, 2, 2, 1, zeropp)
            assert estimate == {"all_gather": out[name]["gather"], "reduce_scatter": out[name]["reduce"]}


def _forward_weights_by_dtype(rank, world, device, dtypes: list[str]):
    return {dtype: _forward_weights(device, world, rank, dtype) for dtype in dtypes}


def _forward_weights(device, world: int, rank: int, dtype: str):
    """One unit's full buffer as forward saw it, every rank's exact shard, and the masters around a backward."""
    case = Case(stage=3, dtype=dtype, optimizer="adamw1_slow")
    engine = _engine(case, device, QWZ)
    unit = next(u for u in engine.units if u.name == "blocks.0")
    flat = unit.buckets[0].flat
    seen = []
    unit.module.attn.register_forward_pre_hook(lambda *_: seen.append(flat.data.detach().clone()))
    master = unit.buckets[0].master
    master_before = master.detach().clone()
    x, y = (t.to(device) for t in micro_batch(0, case, world, rank, 0))
    engine.backward(engine(x, y))
    master_after_backward = master.detach().clone()
    shards = [torch.empty_like(flat.shard_data) for _ in range(world)]
    dist.all_gather(shards, flat.shard_data)
    full = engine.full_state_dict()  # exact: the shards' own values, never qwZ's
    names = {id(p): name for name, p in engine.module.named_parameters()}
    exact = flat.views(torch.cat(shards))
    return {"forward": seen[0].cpu(), "shards": [s.cpu() for s in shards],
            "master_unchanged": torch.equal(master_before, master_after_backward),
            "state_dict_exact": all(torch.equal(full[names[id(p)]], view) for p, view in zip(flat.params, exact))}


def test_qwz_forward_weights_are_dequantized_shards_and_masters_stay_exact():
    codec = BlockCodec("int8", 128)
    dtypes = ["fp32", "bf16", "fp16"]
    for out in (by_dtype[dtype] for by_dtype in run_ranks(_forward_weights_by_dtype, 2, dtypes) for dtype in dtypes):
        expected = torch.cat([dequantize(quantize(s, codec), s.dtype) for s in out["shards"]])
        assert out["forward"].dtype == expected.dtype
        assert torch.equal(out["forward"], expected)
        assert not torch.equal(out["forward"], torch.cat(out["shards"]))  # quantized indeed
        assert out["master_unchanged"] and out["state_dict_exact"]


def _hpz_run(rank, world, device, variants: dict):
    case = Case(stage=3, accumulation=2, optimizer="adamw1")
    out = {}
    for name, zeropp in variants.items():
        engine = _engine(case, device, zeropp)
        _train(engine, case, world, rank, 1)
        before = engine.comm_stats()
        losses = _train(engine, case, world, rank, 2, first=1)
        after = engine.comm_stats()
        held = []
        for micro in range(case.accumulation):  # one more window: what is held between backward and step
            x, y = micro_batch(9, case, world, rank, micro)
            engine.backward(engine(x, y))
            held.append(engine.memory_stats()["hpz_secondary"])
            engine.step()
        out[name] = {"losses": losses, "gather": _by_scope(before, after, "all_gather"), "flats": _flats(engine),
                     "held": held, "after_step": engine.memory_stats()["hpz_secondary"],
                     "units": stage3_flats(engine.units)}
    return out


def test_hpz_alone_is_bitwise_plain_stage3_and_gathers_backward_inside_the_node():
    variants = {"plain": {}, "hpz": HPZ, "qwz": QWZ, "qwz+hpz": QWZ | HPZ}
    for out in run_ranks(_hpz_run, WORLD, variants):
        assert out["hpz"]["losses"] == out["plain"]["losses"]
        # hpZ's secondary shards are copies of the forward's (dequantized) weights: backward sees the same.
        assert out["qwz+hpz"]["losses"] == out["qwz"]["losses"]
        padded = sum(4 * WORLD * shard for _, shard in out["plain"]["flats"])  # fp32 bytes per gather
        steps, accumulation = 2, 2
        assert out["plain"]["gather"] == {"cross_node": steps * 2 * accumulation * padded}
        # One gather across nodes per window (the first forward); the other 2A - 1 stay in the node.
        assert out["hpz"]["gather"] == {"cross_node": steps * padded, "node": steps * (2 * accumulation - 1) * padded}
        assert out["hpz"]["held"] == [padded // PER_NODE] * accumulation and out["plain"]["held"] == [0, 0]
        assert out["hpz"]["held"][0] == hpz_secondary_bytes(out["hpz"]["units"], WORLD, PER_NODE, 4)
        assert out["hpz"]["after_step"] == 0


def _training_run(rank, world, device, steps: int):
    """Plain stage 3 and all three parts, bf16, on the demo's corpus (a loss that can fall, unlike random tokens)."""
    corpus = data.CharCorpus.from_text(data.load_text())
    case = Case(stage=3, dtype="bf16", optimizer="adamw1", micro_rows=4)
    losses = {}
    for name, zeropp in (("plain", {}), ("all3", ALL3)):
        engine = _engine(case, device, zeropp, model=lambda: GPT(replace(GPT_CFG, vocab_size=corpus.vocab_size)))
        losses[name] = []
        for step in range(steps):
            batch = corpus.global_batch(step, case.micro_rows * world, GPT_CFG.block_size)
            x, y = (t.to(device) for t in data.micro_batch(batch, rank, world, 0, 1))
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses[name].append(loss.item())
    return losses


def test_training_with_all_three_ends_within_two_percent_of_plain_stage3():
    out = run_ranks(_training_run, WORLD, 25)[0]
    assert out["all3"][0] == pytest.approx(out["plain"][0], rel=0.02)
    last = {name: sum(losses[-5:]) / 5 for name, losses in out.items()}  # one step's loss is noisy
    assert last["all3"] == pytest.approx(last["plain"], rel=0.02)
    assert last["all3"] < 0.8 * out["all3"][0]  # it trains


def _grad_norms(rank, world, device, variants: dict):
    case = Case(stage=3, optimizer="adamw1")
    norms = {}
    for name, zeropp in variants.items():
        engine = _engine(case, device, zeropp)
        _train(engine, case, world, rank, 1)
        norms[name] = engine.global_grad_norm
    return norms


def test_qgz_gives_the_mean_so_the_gradient_norm_is_plain_stage3s():
    qgz = {"zero_quantized_gradients": True}
    int4 = qgz | {"zeropp_gradient_bits": 4}
    variants = {"plain": {}, "int8": qgz, "int4": int4, "int4, 4 nodes x 1": int4 | {"zeropp_ranks_per_node": 1}}
    norms = run_ranks(_grad_norms, WORLD, variants)[0]
    assert norms["int8"] / norms["plain"] == pytest.approx(1.0, abs=0.005)
    for name in ("int4", "int4, 4 nodes x 1"):  # not D x the mean (DeepSpeed's 2-D tensors)
        assert norms[name] / norms["plain"] == pytest.approx(1.0, abs=0.02)


def _unknown_nodes(rank, world, device):
    case = Case(stage=3)
    config = case.config()
    config["zero_optimization"]["zero_quantized_gradients"] = True
    make_engine(case, config=config, device=device)


def test_qgz_without_known_nodes_names_the_key_on_every_rank(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(RankFailure) as failure:
        run_ranks(_unknown_nodes, 2)
    assert failure.value.errors.keys() == {0, 1}
    assert all("zero_hpz_partition_size" in e["error"] and "TopologyError" in e["error"]
               for e in failure.value.errors.values())


def _compile_default(rank, world, device):
    from zeroshard.comm.compress.quantize import compile_unavailable

    out = {"compiler": compile_unavailable(device) is None}
    case = Case(stage=3, dtype="bf16", optimizer="adamw1_slow")
    for name, default_compile in (("default", True), ("eager", False)):
        engine = _engine(case, device, ALL3, default_compile=default_compile)
        losses = _train(engine, case, world, rank, 2)
        reducer = next(b.compressed for u in engine.units for b in u.buckets if b.compressed is not None)
        out[name] = {"losses": losses, "weights": torch.cat([t.float().reshape(-1).cpu() for t in
                                                             engine.full_state_dict().values()]),
                     "compiled": (engine.schedule.gathers.weights.compiled, reducer.codec.compiled)}
    return out


def test_quantizers_compile_by_default_where_a_compiler_is_present_with_the_eager_values():
    for out in run_ranks(_compile_default, WORLD):
        assert out["default"]["compiled"] == (out["compiler"], out["compiler"])
        assert out["eager"]["compiled"] == (False, False)
        assert out["default"]["losses"] == out["eager"]["losses"]
        assert torch.equal(out["default"]["weights"], out["eager"]["weights"])
