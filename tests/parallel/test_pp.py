"""pp2 x dp2 (4 ranks): torch's pipeline schedules with zeroshard as the data-parallel layer reproduce one process.

The GPT is split in two stages; its tied embedding lives on both (the head's
copy on the last stage), summed over the stages at each step. Gradients are
reduced by the engine's explicit pass, never by hooks alone: the zero-bubble
schedule assigns weight gradients by hand. Reductions per step, as
`comm_stats()` records them: L (one per bucket or unit) when the window's
gradients accumulate and are reduced once; M x L, plus one more for each
target holding a tied copy (summed over the stages once the schedule is
done), when they are reduced after each of the M micro-batches.
Also: a checkpoint saved on pp2 x dp2 reloads on pp2 x dp1 and goes on
exactly; on another pp or tp it is refused, naming what differs.
"""

import errno
from dataclasses import replace

import pytest
import torch
from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleavedZeroBubble

import zeroshard
from tests.distributed import run_ranks
from tests.parallel.mesh_recipes import (
    MeshCase,
    batch,
    check_mesh_runs,
    make_engine,
    make_gpt,
    reference,
    report,
    train_steps,
)
from tests.recipes import Case, make_optimizer, relative_error
from zeroshard.app.models import GPTStage, lm_loss
from zeroshard.checkpoint import CheckpointError
from zeroshard.parallel import PipelineError, PipelineStage, TieError, build_mesh

STEPS, MORE, M = 6, 2, 4
CASES = [
    MeshCase(Case(stage=1, clip=0.3), micro_batches=M),
    MeshCase(Case(stage=2), micro_batches=M),
    MeshCase(Case(stage=2), micro_batches=M, per_micro_batch=True),
    MeshCase(Case(stage=3, clip=0.3), micro_batches=M),
    MeshCase(Case(stage=2, clip=0.3), micro_batches=M, schedule="ScheduleInterleavedZeroBubble"),
]
SAVED = 1  # the case whose checkpoint is reloaded


def _ranks(rank, world, device, cases, ckpt):
    mesh = build_mesh(pp=2)
    runs = []
    for i, mc in enumerate(cases):
        engine, part, step_fn = make_engine(mesh, device, mc)
        runs.append(report(engine, part, train_steps(mesh, device, mc, step_fn, range(STEPS))))
        if i == SAVED:
            engine.save_checkpoint(ckpt)
            _torn_save_moves_no_latest(engine, ckpt)
    return runs


def _torn_save_moves_no_latest(engine, ckpt) -> None:
    """A save that fails in one model part (its disk full) raises on every rank and moves no part's 'latest'."""
    from zeroshard.checkpoint import saving

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    real = saving.write_streamed
    if engine.mesh.rank("pp") == 1:
        saving.write_streamed = full
    try:
        with pytest.raises(CheckpointError, match="not completed by every model part .*No space left on device"):
            engine.save_checkpoint(ckpt, tag="torn")
    finally:
        saving.write_streamed = real
    assert [(p / "latest").read_text() for p in sorted(ckpt.glob("pp*-tp*"))] == [f"global_step{STEPS}\n"] * 2


def test_pp2_dp2_schedules_match_one_process_and_count_reductions(tmp_path):
    per_rank = run_ranks(_ranks, 4, CASES, tmp_path)
    for i, mc in enumerate(CASES):
        runs = [r[i] for r in per_rank]
        check_mesh_runs(runs, mc, {"pp": 2, "dp": 2, "tp": 1}, STEPS)
        for run in runs:
            op = "all_reduce" if mc.case.stage == 0 else "reduce_scatter"
            per_step = M * run.buckets + run.tied_buckets if mc.per_micro_batch else run.buckets
            assert run.comm["dp"][op] == STEPS * per_step, f"{mc}: {run.comm['dp'][op]} reductions"
            assert run.comm["pp"].get("all_reduce", 0) == STEPS * (run.tied_buckets > 0), "one tie sum per step"
    _reload_on_fewer_dp_ranks(tmp_path)


def _refusals(mesh, device, ckpt) -> list[str]:
    """What a pipeline refuses, on every rank, each with its reason."""
    said = []
    engine, part, _ = make_engine(mesh, device, MeshCase(Case(stage=3), micro_batches=2))
    with pytest.raises(PipelineError, match="one pipeline stage per rank"):
        PipelineStage(engine, stage_index=0)
    stage = PipelineStage(engine)
    zero_bubble = ScheduleInterleavedZeroBubble([stage], n_microbatches=2, loss_fn=lm_loss)
    x, y = batch(0, MeshCase(Case(), micro_batches=2), 1)
    with pytest.raises(PipelineError, match="zero-bubble schedule .* at ZeRO stage 3"):  # before any action
        stage.train_step(zero_bubble, x, y)
    plain = PipelineStage(make_engine(mesh, device, MeshCase(Case(stage=2), micro_batches=2))[0])
    one_f_one_b = Schedule1F1B(plain, n_microbatches=2, loss_fn=lm_loss)
    plain.train_step(one_f_one_b, x, y)
    schedule_step = (lambda: one_f_one_b.step(x)) if plain.is_first else (lambda: one_f_one_b.step(target=y))
    schedule_step()
    with pytest.raises(PipelineError, match="without engine.step"):  # the first step's gradients would stay
        schedule_step()
    with pytest.raises(CheckpointError, match="a model part's directory"):
        engine.load_checkpoint(next(ckpt.glob("pp*-tp*/global_step*")))
    said.append("refused")
    fresh = GPTStage(make_gpt(), mesh.rank("pp"), mesh.pp)
    with pytest.raises(TieError, match="does not have"):  # one stage misspells its copy: every rank hears it
        zeroshard.initialize(fresh, make_optimizer("adamw", fresh), {}, mesh=mesh,
                             tied={"embedding": "head.weigth" if fresh.last else "wte.weight"})
    return said


def _continue(rank, world, device, mc, ckpt):
    engine, part, step_fn = make_engine(build_mesh(pp=2), device, mc)
    refused = _refusals(engine.mesh, device, ckpt)
    engine.load_checkpoint(ckpt)
    run = report(engine, part, train_steps(engine.mesh, device, mc, step_fn, range(STEPS, STEPS + MORE)))
    other = build_mesh(tp=2)  # the same two ranks as pp1 x dp1 x tp2
    engine, _, _ = make_engine(other, device, replace(mc, micro_batches=1))
    refused_before = refused
    with pytest.raises(CheckpointError) as refused:
        engine.load_checkpoint(ckpt)
    return run, str(refused.value), refused_before


def _reload_on_fewer_dp_ranks(ckpt):
    saved = CASES[SAVED]
    # One dp rank takes both of the saved run's rows: the same global batches.
    mc = replace(saved, case=replace(saved.case, micro_rows=2 * saved.case.micro_rows))
    per_rank = run_ranks(_continue, 2, mc, ckpt)
    ref_losses, ref_weights = reference(saved, 2, STEPS + MORE)
    losses = [r[0].losses for r in per_rank if r[0].losses[0] is not None][0]
    err = max(abs(a - b) / b for a, b in zip(losses, ref_losses[STEPS:]))
    assert err <= 2e-5, f"the reloaded run's losses differ from the uninterrupted reference by {err:.2e}"
    for run, _, _ in per_rank:
        got = torch.cat([run.weights[n].reshape(-1) for n in sorted(run.weights)])
        want = torch.cat([ref_weights[n].reshape(-1) for n in sorted(run.weights)])
        assert relative_error(got, want) <= 1e-4
    for _, message, refused in per_rank:
        assert "pp=2 when saved, 1 now" in message and "tp=1 when saved, 2 now" in message, message
        assert refused == ["refused"]
