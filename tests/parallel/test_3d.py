"""pp2 x dp2 x tp2 (8 ranks), 1F1B: ZeRO stages 1 and 2 over dp inside tensor and pipeline parallelism
reproduce one process, with the GPT's embedding tied across the first and last stage."""

from tests.distributed import run_ranks
from tests.parallel.mesh_recipes import MeshCase, check_mesh_runs, train_on_mesh
from tests.recipes import Case
from zeroshard.parallel import build_mesh

STEPS = 6
CASES = [MeshCase(Case(stage=1, clip=0.3), micro_batches=2), MeshCase(Case(stage=2), micro_batches=2)]


def _ranks(rank, world, device, cases):
    mesh = build_mesh(pp=2, tp=2)
    return [train_on_mesh(mesh, device, mc, STEPS) for mc in cases]


def test_pp2_dp2_tp2_match_one_process():
    per_rank = run_ranks(_ranks, 8, CASES)
    for i, mc in enumerate(CASES):
        runs = [r[i] for r in per_rank]
        check_mesh_runs(runs, mc, {"pp": 2, "dp": 2, "tp": 2}, STEPS)
        for run in runs:  # the tie's gradients are summed over the two stages once per step
            assert run.comm["pp"].get("all_reduce", 0) == STEPS
