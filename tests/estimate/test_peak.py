"""`estimate.step_peak` by hand: each part of a step's peak from the engine's rules, on small round numbers.

The measured side (the resident peak of real steps, memory_stats' staging to the byte) is
tests/engine/test_step_peak.py; here each rule is worked out by hand (docs/memory.md, "The step's peak,
part by part").
"""

from zeroshard.estimate import Flat, step_peak

PSI, N = 1000, 2  # elements, ranks
BUCKETS = (400, 300, 300)  # stages 0-2, backward's order; padded to even sizes already
UNITS = ((Flat(100),), (Flat(300),), (Flat(300),), (Flat(300),))  # the root (100) first, then three blocks


def test_staging_replays_the_pool():
    staging = {s: step_peak(PSI, 0, s, N, "fp32", buckets=BUCKETS, units=UNITS).staging for s in range(4)}
    assert staging[0] == 0  # all-reduce in place
    assert staging[1] == 4 * 400  # one scratch block of the largest bucket, reused by each bucket in turn
    assert staging[2] == 4 * 400 * 3  # the bucket filling, the staging and scratch of the one in flight
    # the root's staging (taken by the final norm's gradient at once, held to the end), three blocks of 300
    assert staging[3] == 4 * (100 + 3 * 300)
    assert step_peak(PSI, 0, 2, N, "fp32", buckets=BUCKETS, scratch=False).staging == 4 * 400 * 2  # NCCL: none
    assert step_peak(PSI, 0, 1, 1, "fp32", buckets=BUCKETS).staging == 0  # one rank: no reduce-scatter


def test_the_two_moments():
    plain = step_peak(PSI, 10_000, 0, N, "fp32", buckets=BUCKETS, largest_param=200, activation_grad=700)
    assert (plain.params, plain.grads, plain.master, plain.optimizer) == (4 * PSI, 4 * PSI, 0, 8 * PSI + 4 * 3)
    assert plain.backward == 16 * PSI + 12 + 10_000 + 4 * 200 + 700 and plain.step_temporaries == 0
    assert (plain.phase, plain.total) == ("backward", plain.backward)
    bf16 = step_peak(PSI, 100, 0, N, "bf16", buckets=BUCKETS)
    assert bf16.step_temporaries == 4 * PSI  # the fp32 copy of every 16-bit gradient, at the optimizer step
    assert (bf16.phase, bf16.total) == ("step", 16 * PSI + 12 + 4 * PSI)
    assert step_peak(PSI, 0, 1, N, "bf16", buckets=BUCKETS).step_temporaries == 4 * PSI // N  # of the shard
    # stages 2-3 with accumulation: the gradient shard is summed in fp32 already, the optimizer reads it
    assert step_peak(PSI, 0, 2, N, "bf16", buckets=BUCKETS, accumulation=2).step_temporaries == 0


def test_stage3_gathers_the_root_the_last_unit_and_the_prefetched_one():
    peak = step_peak(PSI, 0, 3, N, "fp32", units=UNITS, recompute=50)
    assert peak.gathered == 4 * (100 + 300 + 300) and peak.recompute == 50
    assert step_peak(PSI, 0, 3, N, "fp32", units=UNITS, prefetch_numel=299).gathered == 4 * (100 + 300)
    assert step_peak(PSI, 0, 3, N, "fp32", units=UNITS, max_live_numel=699).gathered == 4 * (100 + 300)
