"""The predicted peak of a training step against the measured one, stages 0-3 on 2 ranks (issue 25, acceptance 2).

Reference: the process's own resident high-water mark during one step
(VmHWM, reset through /proc/self/clear_refs) above its RSS before the model
was built, with freed blocks handed back to the system at once
(`zeroshard.app.step_peak.measure`; on a GPU the allocator's peak). The
prediction, `zeroshard.estimate.step_peak` on the model's meta-device counts,
must be within 10% of it; the staging buffers it replays from the engine's
rule must equal `memory_stats()["staging"]` to the byte. The 4m preset in
fp32 with 4 rows of 128 tokens: model states of 66 MB (stage 0) to 33 MB
(stage 3) per rank and 40 MB of activations, against an interpreter of
about 300 MB whose own growth would otherwise blur the figure. Its own ranks
(`fresh=True`): `measure` fixes glibc's mmap threshold for the process.
"""

from __future__ import annotations

from tests.distributed import run_ranks
from tests.rank_worker import test_device
from zeroshard.app.step_peak import PeakRun, measure, predict

RUNS = [PeakRun("4m", stage, "fp32", micro_batch=4, seq=128, bucket=1_000_000) for stage in range(4)]


def _measure(rank, world, device, runs):
    return [measure(run, device) for run in runs]


def test_predicted_step_peak_is_within_10_percent_of_the_measured_one():
    per_rank = run_ranks(_measure, 2, RUNS, fresh=True)
    for i, run in enumerate(RUNS):
        predicted = predict(run, 2, scratch=test_device(2).type == "cpu")  # gloo's all-to-all reduce-scatter
        for rank, measured in enumerate(r[i] for r in per_rank):
            assert measured["memory_stats"]["staging"] == predicted.staging, (run.stage, rank, measured)
            assert measured["held"] == predicted.held, (run.stage, rank, measured)  # model states and staging
            assert measured["memory_stats"]["activations"] == predicted.activations, (run.stage, rank)
            ratio = measured["peak"] / predicted.total
            assert 0.9 <= ratio <= 1.1, (run.stage, rank, ratio, measured, predicted)
