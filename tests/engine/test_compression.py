"""communication_compression in the engine, at stages 0-3 on 2 ranks (and stage 2 on 4).

References: the same run without compression (losses, the memory formula of
tests/core/test_memory.py), the estimate's bytes (estimate/compression.py,
estimate/zeropp.py) for what comm_stats() records, and the tensor storage
the process holds for what memory_stats() reports. The convergence of
longer runs is measured in benchmarks/compression_convergence.py.
"""

import functools
import math

import pytest
import torch

from tests.core.test_memory import measure
from tests.core.test_precision import _fp16_run
from tests.distributed import run_ranks
from tests.recipes import Case, loss_of, make_model, make_optimizer, micro_batch, run_zeroshard
from zeroshard.config import Config, ConfigError
from zeroshard.dtypes import WIRE_BITS as BITS
from zeroshard.estimate import PERSISTENT, SHARDED, Flat, compressed_reduction_bytes, error_feedback_bytes, \
    qwz_all_gather_bytes, step_bytes

STEPS = 6
TRAINED = [Case(stage=s, optimizer="adamw1", codec=c, weights_codec=w)
           for s in (0, 1, 2, 3) for c, w in (("none", "none"), ("int8", "none"), ("int4", "int8" if s else "none"))]
TRAINED += [Case(stage=s, optimizer="adamw1", codec="fp8_e4m3", weights_codec="fp8_e4m3") for s in (1, 2)]


def _train(rank, world, device):
    out = []
    for case in TRAINED:
        engine, losses = run_zeroshard(rank, world, device, case, STEPS)
        stats = engine.comm_stats()
        sizes = [(b.flat.padded_numel, b.compressed is not None, b.gathers_after_step) for b in engine.buckets]
        params = torch.cat([p.detach().reshape(-1).float() for p in engine.module.parameters()])
        out.append((losses, {op: (s.bytes, s.uncompressed) for op, s in stats.items()}, sizes,
                    engine.memory_stats()["compression"],
                    params, engine.units != []))
    return out


def _overflow(rank, world, device):
    """fp16 with int8 gradients at stages 0 and 2: rank 1's loss is inf at step 2, so every rank skips it."""
    out = {}
    for stage in (0, 2):
        case = Case(stage=stage, dtype="fp16", optimizer="adamw1", codec="int8")
        _, history, error = _fp16_run(rank, world, device, case, 5, poisoned=(2,))
        out[stage] = (history, error)
    return out


def _resume(rank, world, device, path: str):
    """Six steps straight, against three, a save, a load into a fresh engine and three more: the same bits, the
    error feedback included (stage 0's gather residual, stage 2's reduce-scatter ones)."""
    import zeroshard

    out = {}
    for case in (Case(stage=0, optimizer="adamw1", codec="int4"), Case(stage=2, optimizer="adamw1", codec="int8")):
        engines = []
        for resumed in (False, True):
            model = make_model(device=device)
            engine = zeroshard.initialize(model, make_optimizer("adamw1", model), case.config())
            if resumed:
                engine.load_checkpoint(path, tag=f"stage{case.stage}")
            for step in range(3 if resumed else 0, 6):
                if step == 3 and not resumed:
                    engine.save_checkpoint(path, tag=f"stage{case.stage}")
                x, y = (t.to(device) for t in micro_batch(step, case, world, rank, 0))
                engine.backward(loss_of(engine, x, y))
                engine.step()
            engines.append(engine)
        straight, again = engines
        out[case.stage] = (all(torch.equal(a, b) for a, b in zip(straight.module.parameters(),
                                                                 again.module.parameters())),
                           [torch.equal(a, b) for x, y in zip(straight.buckets, again.buckets)
                            for a, b in zip(x.feedback.state_dict().values(), y.feedback.state_dict().values())],
                           straight.buckets[0].feedback.nbytes)
    return out


def _memory(rank, world, device):
    return [measure(rank, world, device, Case(stage=2, optimizer="adamw", codec=codec))[1:]
            for codec in ("none", "int8")]


@functools.lru_cache(maxsize=None)
def trained():
    return run_ranks(_train, 2)


@pytest.mark.parametrize("index", range(len(TRAINED)))
def test_training_follows_the_uncompressed_run(index):
    case = TRAINED[index]
    plain = TRAINED.index(Case(stage=case.stage, optimizer="adamw1"))
    for rank_result in trained():
        losses, ref = rank_result[index][0], rank_result[plain][0]
        tolerance = {"none": 0.0, "int8": 0.01, "fp8_e4m3": 0.01, "int4": 0.03}[case.codec]
        assert max(abs(a - b) / b for a, b in zip(losses, ref)) <= tolerance, (case, losses, ref)
    if case.codec != "none":  # it did compress: not the exact run's numbers
        assert trained()[0][index][0] != trained()[0][plain][0]
    # every rank computes with the same parameters, dequantized alike when they travel quantized
    assert torch.equal(trained()[0][index][4], trained()[1][index][4])


@pytest.mark.parametrize("index", range(len(TRAINED)))
def test_bytes_equal_the_estimate(index):
    case = TRAINED[index]
    recorded, sizes, feedback, stage3 = trained()[0][index][1], trained()[0][index][2], trained()[0][index][3], \
        trained()[0][index][5]
    sent = {op: b for op, (b, _) in recorded.items()}
    if case.codec == "none":
        assert all(b == exact for b, exact in recorded.values())  # ratio 1
        return
    bits = BITS[case.codec]
    reduced = {"reduce_scatter": 0, "all_gather": 0}
    memory, exact_reduced = 0, 0
    for numel, compressed, gathers in sizes:
        if compressed:
            for op, b in compressed_reduction_bytes(numel, 2, bits, 128, case.stage == 0).items():
                reduced[op] += b
            memory += error_feedback_bytes(numel, 2, case.stage == 0)
        else:  # stage 3's persistent buckets reduce exactly
            exact_reduced += 4 * numel
    assert sent["reduce_scatter"] == STEPS * (reduced["reduce_scatter"] + exact_reduced)
    assert sent["all_reduce"] == 0
    assert feedback == memory > 0
    if case.stage in (1, 2):  # the gather after the step: quantized with the parameters' codec, or exact
        weights = sum(qwz_all_gather_bytes(numel, 2, BITS[case.weights_codec], 128)
                      if case.weights_codec != "none" else 4 * numel for numel, _, _ in sizes)
        assert sent["all_gather"] == STEPS * weights
    elif case.stage == 0:
        assert sent["all_gather"] == STEPS * reduced["all_gather"]
    # int8 sends at most 0.27x, int4 0.14x of fp32's bytes, scales included
    fp32 = 4 * sum(numel for numel, compressed, _ in sizes if compressed)
    assert reduced["reduce_scatter"] <= {8: 0.27, 4: 0.14}[bits] * fp32  # int8 and fp8: 8 bits
    # comm_stats()'s uncompressed bytes: the exact reduce-scatter's (fp32 buffers: 4 bytes an element)
    assert recorded["reduce_scatter"][1] == STEPS * 4 * sum(numel for numel, _, _ in sizes)
    assert stage3 == (case.stage == 3)


# What initialize() sends once (the parameters' broadcast, the ranks' agreement), not in a step's bytes; and
# stage 3's rounds on the units of a step (a few bytes each, counted in tests/comm/test_comm_volume.py).
NOT_PRICED = ("broadcast", "object_gather", "fault_check", "unit_check")


@pytest.mark.parametrize("index", [i for i, case in enumerate(TRAINED) if case.weights_codec == "none"])
def test_step_bytes_equal_comm_stats(index):
    """`zeroshard estimate --compress`'s bytes per step (estimate.step_bytes, every op) over the engine's buckets."""
    case = TRAINED[index]
    recorded, sizes = trained()[0][index][1], trained()[0][index][2]
    # at stage 3 a persistent bucket is the one gathered after the step, as at stage 2
    buckets = [Flat(numel, PERSISTENT if case.stage == 3 and gathers else SHARDED) for numel, _, gathers in sizes]
    plan = step_bytes(buckets, 2, case.stage, None if case.codec == "none" else BITS[case.codec])
    per_step = {op: b for op, (b, _) in recorded.items() if b and op not in NOT_PRICED}
    assert {op: STEPS * b for op, b in plan.by_op().items()} == per_step


def test_stage2_memory_is_the_formula_plus_the_declared_feedback():
    for rank_result in run_ranks(_memory, 2):
        (padded, units, _, plain, held_plain), (padded2, _, _, fed, held) = rank_result
        assert padded == padded2
        others = ("compression", "staging", "activations", "peak")
        assert {k: v for k, v in fed.items() if k not in others} == {k: v for k, v in plain.items() if k not in others}
        assert plain["compression"] == 0 and fed["compression"] == 4 * padded  # one fp32 element per element sent
        assert held == fed.held() and held_plain == plain.held()


def test_a_non_finite_step_is_skipped_everywhere_and_leaves_no_residual():
    for rank_result in run_ranks(_overflow, 2):
        for stage, (history, error) in rank_result.items():
            assert error is None
            skipped = [h[1] for h in history]  # skipped steps after each step
            assert skipped == [0, 0, 1, 1, 1], (stage, history)
            # a residual of the inf step left in the feedback would make every later norm non-finite
            assert all(math.isfinite(h[3]) for i, h in enumerate(history) if i != 2), (stage, history)


def test_a_resume_continues_bit_for_bit(tmp_path):
    for rank_result in run_ranks(_resume, 2, str(tmp_path)):
        for stage, (weights, feedback, held) in rank_result.items():
            assert weights and feedback and all(feedback) and held > 0, (stage, weights, feedback)


@pytest.mark.parametrize("compression,zero,message", [
    ({"gradients": {"codec": "powersgd"}}, {"stage": 2}, "PowerSGD needs every rank to hold each matrix's whole"),
    ({"gradients": {"codec": "int8"}}, {"stage": 2, "reduce_scatter": False}, "replaces the reduce-scatter"),
    ({"parameters": {"codec": "int8"}}, {"stage": 0}, "stage 0 gathers no parameters"),
    ({"parameters": {"codec": "int8"}}, {"stage": 3, "offload_param": {"device": "cpu"},
                                         "offload_optimizer": {"device": "cpu"}}, "not implemented for parameter"),
    ({"gradients": {"codec": "int8"}}, {"stage": 3, "zero_quantized_gradients": True}, "keep one"),
    ({"gradients": {"codec": "int8", "rank": 2}}, {"stage": 1}, "rank: not a setting of codec 'int8'"),
    ({"gradients": {"codec": "powersgd", "block_size": 64}}, {"stage": 1}, "block_size: not a setting"),
    ({"gradients": {"codec": "int8", "hadamard": True, "block_size": 96}}, {"stage": 1}, "power-of-two block_size"),
    ({"gradients": {"codec": "int4", "block_size": 99}}, {"stage": 1}, "int4 packs two values a byte"),
    ({"parameters": {"block_size": 64}}, {"stage": 1}, "set while codec is 'none'"),
    ({"gradients": {"codec": "int2"}}, {"stage": 1}, "Input should be 'none', 'int8'"),
])
def test_impossible_settings_are_named(compression, zero, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        Config.load({"communication_compression": compression, "zero_optimization": zero})
