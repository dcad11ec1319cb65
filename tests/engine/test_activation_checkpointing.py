"""Activation checkpointing through `zeroshard.deepspeed.checkpointing.checkpoint` and the config's block.

References: single-process training on the global batch without
checkpointing (tests/recipes.py, tests/parallel/mesh_recipes.py); the same
engine without checkpointing (memory_stats' activations, comm_stats'
gathers); `zeroshard estimate`'s meta count with and without checkpointing
(how much the forward keeps less); the bytes of the blocks' inputs (each tp
rank keeps 1/tp of each with partition_activations, and all-gathers it over
tp for the recompute); the same function run without checkpoint on the same
RNG states (DeepSpeed's model-parallel RNG tracker).
"""

from __future__ import annotations

import logging

import pytest
import torch

import zeroshard.deepspeed as deepspeed
from tests.distributed import run_ranks
from tests.parallel.mesh_recipes import CFG, MeshCase, check_mesh_runs, train_on_mesh
from tests.recipes import GPT_CFG, Case, loss_of, make_engine, micro_batch, relative_error, train_reference
from zeroshard.app.estimate.activation_count import count_activations
from zeroshard.app.models import PRESETS
from zeroshard.config import ConfigError
from zeroshard.deepspeed import checkpointing

STEPS = 3
MESH_STEPS = 2  # on 4 ranks: enough to move the weights
NO_EFFECT_HERE = {"partition_activations": True, "cpu_checkpointing": True, "synchronize_checkpoint_boundary": True,
                  "number_checkpoints": 2, "profile": True}


def _train(rank, world, device, case: Case, block: dict | None):
    """(losses, full weights, activations of the first forward, dp all_gather calls, log lines) of one run."""
    config = case.config() | ({"activation_checkpointing": block} if block else {})
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("zeroshard").addHandler(handler)
    try:
        engine = make_engine(case, config=config, device=device)
        losses, activations = [], []
        for step in range(STEPS):
            x, y = (t.to(device) for t in micro_batch(step, case, world, rank, 0))
            loss = loss_of(engine, x, y)
            activations.append(engine.memory_stats()["activations"])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    finally:
        logging.getLogger("zeroshard").removeHandler(handler)
    full = engine.full_state_dict()
    weights = torch.cat([full[name].reshape(-1).cpu() for name, _ in engine.module.named_parameters()])
    return losses, weights, activations[0], engine.comm_stats()["all_gather"].calls, lines


def _two_ranks(rank, world, device, cases):
    return [_train(rank, world, device, case, block) for case, block in cases]


TWO_RANKS = [(Case(stage=s, variant=v), None) for s in range(4) for v in ("plain", "deepspeed")] + [
    (Case(stage=2, variant="deepspeed"), NO_EFFECT_HERE)]


def test_stages_0_to_3_match_one_process_and_keep_what_the_estimate_says():
    per_rank = run_ranks(_two_ranks, 2, TWO_RANKS)
    x, _ = micro_batch(0, Case(), 2, 0, 0)
    kept_less = (count_activations("tiny", *x.shape, "none", "fp32").total
                 - count_activations("tiny", *x.shape, "full", "fp32").total)
    runs = {(case.stage, case.variant, block is not None): [r[i] for r in per_rank]
            for i, (case, block) in enumerate(TWO_RANKS)}
    for (stage, variant, block), ranks in runs.items():
        case = Case(stage=stage)
        ref_losses, ref_weights = train_reference(case, 2, STEPS)  # without checkpointing
        losses = torch.tensor([r[0] for r in ranks]).mean(0)
        assert ((losses - torch.tensor(ref_losses)).abs() / torch.tensor(ref_losses)).max() <= 2e-5, (stage, variant)
        assert relative_error(ranks[0][1], ref_weights) <= 1e-4, (stage, variant)
        for mine, theirs in zip(ranks, runs[(stage, "plain", False)]):
            if variant == "deepspeed":  # each block keeps its input only, as the meta count predicts
                assert theirs[2] - mine[2] == kept_less, (stage, theirs[2], mine[2], kept_less)
            # stage 3: the recompute finds its unit gathered by the backward's own gather: no gather more
            assert mine[3] == theirs[3], (stage, variant, mine[3], theirs[3])
    lines = runs[(2, "deepspeed", True)][0][4]  # rank 0's log
    for key in ("partition_activations", "cpu_checkpointing", "synchronize_checkpoint_boundary", "number_checkpoints"):
        assert sum(line.startswith(f"activation_checkpointing.{key} has no effect here") for line in lines) == 1, key
    for run in ("forward", "recompute"):  # profile: one line per block and step each
        assert sum(f"activation checkpoint {run}" in line for line in lines) == STEPS * GPT_CFG.n_layer, run


def _mesh_ranks(rank, world, device, tp_cases, pp_cases):
    from zeroshard.parallel import build_mesh

    mesh = build_mesh(tp=2)
    tp_runs = [train_on_mesh(mesh, device, mc, MESH_STEPS) for mc in tp_cases]
    mesh = build_mesh(pp=2)
    return tp_runs, [train_on_mesh(mesh, device, mc, MESH_STEPS) for mc in pp_cases]


PA = {"partition_activations": True}
CONTIGUOUS = {"contiguous_memory_optimization": True, "number_checkpoints": 4}  # 4 blocks: the slots all used
TP_CASES = [MeshCase(Case(stage=s), checkpointing="deepspeed",
                     activation_checkpointing=PA | (CONTIGUOUS if s == 1 else {})) for s in range(4)] + [
    MeshCase(Case(stage=0), checkpointing="deepspeed")]  # whole checkpoints, for the bytes
PP_CASES = [MeshCase(Case(stage=s), micro_batches=2, checkpointing="deepspeed") for s in range(4)] + [
    MeshCase(Case(stage=0), micro_batches=2)]  # without checkpointing, for the bytes


def test_dp2_tp2_partitioned_checkpoints_and_pp2_dp2_match_one_process(monkeypatch):
    per_rank = run_ranks(_mesh_ranks, 4, TP_CASES, PP_CASES)
    tp = {"pp": 1, "dp": 2, "tp": 2}
    for i, mc in enumerate(TP_CASES):
        check_mesh_runs([r[0][i] for r in per_rank], mc, tp, MESH_STEPS)
    for i, mc in enumerate(PP_CASES):
        check_mesh_runs([r[1][i] for r in per_rank], mc, {"pp": 2, "dp": 2, "tp": 1}, MESH_STEPS)
    block_input = Case().micro_rows * CFG.block_size * CFG.n_embd * 4  # a dp rank's rows, fp32, replicated over tp
    for tp_runs, _ in per_rank:
        whole = tp_runs[-1]
        assert whole.comm["tp"].get("all_gather", 0) == 0
        for run in tp_runs[:-1]:  # each tp rank keeps half of each block's input; the recompute gathers it
            assert whole.memory["activations"] - run.memory["activations"] == CFG.n_layer * block_input // 2
            assert run.comm["tp"]["all_gather"] == MESH_STEPS * CFG.n_layer
            assert run.comm_bytes["tp"]["all_gather"] == MESH_STEPS * CFG.n_layer * block_input
    # pp: each stage's blocks keep their inputs only, as the meta count of one micro-batch predicts per block
    monkeypatch.setitem(PRESETS, "mesh-gpt", CFG)
    shape = (Case().micro_rows, CFG.block_size)  # one pipeline micro-batch of a dp rank
    plain, full = (count_activations("mesh-gpt", *shape, kind, "fp32").per_layer for kind in ("none", "full"))
    kept_less = sum(plain[:CFG.n_layer // 2]) - sum(full[:CFG.n_layer // 2])  # the 2 blocks of a stage
    for _, pp_runs in per_rank:
        whole = pp_runs[-1]
        for run in pp_runs[:-1]:
            assert whole.memory["activations"] - run.memory["activations"] == kept_less, (run.part, kept_less)


@pytest.fixture
def fresh_configuration(monkeypatch):
    monkeypatch.setattr(checkpointing, "_configured", {})
    monkeypatch.setattr(checkpointing, "_TRACKER", checkpointing.CudaRNGStatesTracker())


def test_configure_as_deepspeed(fresh_configuration, tmp_path):
    assert not checkpointing.is_configured()
    path = tmp_path / "ds.json"
    path.write_text('{"activation_checkpointing": {"partition_activations": true, "number_checkpoints": 3}}')
    checkpointing.configure(None, deepspeed_config=str(path), contiguous_checkpointing=True)  # arguments win
    assert checkpointing.is_configured()
    settings = checkpointing._configured["settings"]
    assert (settings.partition_activations, settings.contiguous_memory_optimization, settings.number_checkpoints) \
        == (True, True, 3)
    buffers = checkpointing._configured["buffers"]
    first, second = buffers.take(0, torch.ones(4)), buffers.take(0, torch.ones(4))  # slots of one buffer
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert first.untyped_storage().nbytes() == 3 * 4 * 4  # number_checkpoints slots
    checkpointing.reset()  # contiguous_memory_optimization's buffers let go: the next take starts a new one
    assert buffers.take(0, torch.ones(4)).untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    with pytest.raises(ConfigError, match="contiguous_memory_optimization needs partition_activations"):
        checkpointing.configure(None, contiguous_checkpointing=True)
    with pytest.raises(deepspeed.UnsupportedError, match="Megatron's mpu"):
        checkpointing.configure(object())
    assert deepspeed.checkpointing.non_reentrant_checkpoint is checkpointing.checkpoint


def _dropout_block(x: torch.Tensor) -> torch.Tensor:
    with checkpointing.get_cuda_rng_tracker().fork():  # a tp region's dropout: the model-parallel RNG state
        return torch.nn.functional.dropout(x.tanh(), 0.5) * 3


def test_recompute_replays_the_tracked_rng_state(fresh_configuration):
    # The recompute must draw the forward's dropout mask again from the tracked state, or the gradient is wrong.
    checkpointing.model_parallel_cuda_manual_seed(7)
    assert isinstance(checkpointing.get_cuda_rng_tracker(), checkpointing.CudaRNGStatesTracker)
    states = checkpointing.get_cuda_rng_tracker().get_states()
    x = torch.randn(64, requires_grad=True)
    out = checkpointing.checkpoint(_dropout_block, x)
    with checkpointing.get_cuda_rng_tracker().fork():
        torch.rand(5)  # the tracked state moves on before the recompute
    out.sum().backward()
    checkpointing.get_cuda_rng_tracker().set_states(states)
    x2 = x.detach().clone().requires_grad_()
    expected = _dropout_block(x2)
    expected.sum().backward()
    assert torch.equal(out, expected) and torch.equal(x.grad, x2.grad)
    assert 0 < (x.grad == 0).sum() < 64  # the mask dropped some elements


def test_hooks_around_the_checkpoint_still_see_what_it_keeps(fresh_configuration):
    # torch.autograd.graph.save_on_cpu (or the engine's meter) around a checkpoint gets its kept inputs
    checkpointing.configure(None, checkpoint_in_cpu=True)
    seen = []
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.shape) or t, lambda t: t):
        out = checkpointing.checkpoint(lambda a: a.sin().cos(), x)
    out.sum().backward()
    assert seen == [torch.Size([4, 8])]
    assert torch.allclose(x.grad, -x.sin().sin() * x.cos())
