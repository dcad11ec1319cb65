"""The predicted peak of a training step against the measured one, stages 0-3 on 2 ranks (issue 25, acceptance 2).

Reference: the process's own resident high-water mark during one step
(VmHWM, reset through /proc/self/clear_refs) above its RSS before the model
was built, with freed blocks handed back to the system at once
(`zeroshard.app.estimate.step_peak.measure`; on a GPU the allocator's peak). The
prediction, `zeroshard.estimate.step_peak` on the model's meta-device counts,
must be within 10% of it; the model states and the staging buffers it replays
from the engine's rule must equal `memory_stats().held()` to the byte. The 4m
preset in fp32 with 4 rows of 128 tokens: model states of 65 MB (stage 0) to
32 MB (stage 3) per rank and 39 MB of activations, peaking at the backward's
start; and in bf16 with one row at stage 0, where the optimizer step peaks
(the fp32 copy of the 16-bit gradients). Its own ranks
(`fresh=True`): `measure` fixes glibc's mmap threshold for the process.
"""

from __future__ import annotations

from tests.distributed import run_ranks
from tests.distributed import test_device as rank_device
from zeroshard.app.models import PRESETS
from zeroshard.app.estimate.step_peak import PeakRun, measure, predict

RUNS = [PeakRun("4m", stage, "fp32", micro_batch=4, seq=128, bucket=1_000_000) for stage in range(4)] + [
    PeakRun("4m", 0, "bf16", micro_batch=1, seq=128, bucket=1_000_000)]  # the optimizer step peaks: fp32 grads


def _cpu_norm_stats(run: PeakRun) -> int:
    """Bytes the CPU keeps less than the meta count: in bf16 its LayerNorm keeps the mean and reciprocal standard
    deviation of each token in bf16, where the meta device (and CUDA) keep them in fp32; the GPT has two
    LayerNorms per block and a final one."""
    norms = 2 * PRESETS[run.model].n_layer + 1
    return 0 if run.dtype == "fp32" else norms * 2 * (4 - 2) * run.micro_batch * run.seq


def _measure(rank, world, device, runs):
    return [measure(run, device) for run in runs]


def test_predicted_step_peak_is_within_10_percent_of_the_measured_one():
    per_rank = run_ranks(_measure, 2, RUNS, fresh=True)
    for i, run in enumerate(RUNS):
        predicted = predict(run, 2, scratch=rank_device(2).type == "cpu")  # gloo's all-to-all reduce-scatter
        for rank, measured in enumerate(r[i] for r in per_rank):
            assert measured["memory_stats"]["staging"] == predicted.staging, (run.stage, rank, measured)
            assert measured["held"] == predicted.held, (run.stage, rank, measured)  # model states and staging
            assert measured["memory_stats"]["activations"] == predicted.activations - _cpu_norm_stats(run), run
            ratio = measured["peak"] / predicted.total
            assert 0.9 <= ratio <= 1.1, (run.stage, rank, ratio, measured, predicted)
    assert [predict(run, 2).phase for run in RUNS] == ["backward"] * 4 + ["step"]  # both moments are checked
