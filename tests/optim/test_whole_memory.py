"""The memory and bytes of whole-tensor ownership equal their formulas (zeroshard/estimate/owned.py).

Per rank, `memory_stats()`'s optimizer bytes are the sum over the tensors it owns of the optimizer's state
for one tensor (Muon: one momentum; Adafactor: a matrix's row and column moments, a vector's own, a step
count), plus the element-wise optimizer's shard (AdamW: two moments and a step per buffer); every tensor is
owned once, and the ranks' owned elements differ by at most the largest tensor's. Each step's reduce-scatter and
all-gather move N x S elements per flat buffer, S its largest rank's segment.
"""

import pytest

from tests.distributed import run_ranks
from tests.optim import whole
from zeroshard.estimate.owned import STATE_BYTES, owned_bytes, segment_numel, sharded_bytes

_STEP = 4  # a 0-dim fp32 step count


def _measure(rank, world, device, kind, stage):
    import zeroshard

    model = whole.make_model()
    config = {"train_micro_batch_size_per_gpu": 2,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000,
                                    "stage3_param_persistence_threshold": 0}}
    engine = zeroshard.initialize(model, whole.make_optimizers(kind, model), config,
                                  wrap=[whole.Block] if stage == 3 else None)
    x, y = whole.batch(0, 2 * world)
    engine.backward(whole.loss_of(engine, x.chunk(world)[rank], y.chunk(world)[rank]))
    engine.step()
    before = {op: s.bytes for op, s in engine.comm_stats().items()}
    x, y = whole.batch(1, 2 * world)
    engine.backward(whole.loss_of(engine, x.chunk(world)[rank], y.chunk(world)[rank]))
    engine.step()  # one step between the two reads: its reduction and (stages 1-2) its gather
    after = engine.comm_stats()
    flats = {g: [[tuple(s) for s in b.flat.shapes] for b in engine.buckets if b.param_group == g]
             for g in range(len(engine.optimizer.param_groups))}
    owned = {g: [b.flat.owners for b in engine.buckets if b.param_group == g] for g in flats}
    return (engine.memory_stats()["optimizer"], flats, owned,
            {op: after[op].bytes - before[op] for op in ("reduce_scatter", "all_gather")})


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_optimizer_bytes_and_wire_bytes_equal_their_formula(kind, stage, world):
    results = run_ranks(_measure, world, kind, stage)
    _, flats, owned, _ = results[0]
    whole_kind, rest = ("muon", "adamw") if kind == "muon" else ("adafactor", None)
    per_rank = owned_bytes(flats[0], whole_kind, world)
    if rest:
        shared = sharded_bytes(flats[1], rest, world) + _STEP * len(flats[1])
        per_rank = [b + shared for b in per_rank]
    assert [r[0] for r in results] == per_rank
    # Every tensor once over the ranks; the ranks' elements apart by at most the largest tensor's.
    shapes = [s for shapes in flats[0] for s in shapes]
    assert sum(owned_bytes(flats[0], whole_kind, world)) == sum(STATE_BYTES[whole_kind](s) for s in shapes)
    owners = [o for bucket in owned[0] for o in bucket]
    loads = [sum(_numel(s) for s, o in zip(shapes, owners) if o == r) for r in range(world)]
    assert sum(loads) == sum(map(_numel, shapes)) and max(loads) - min(loads) <= max(map(_numel, shapes))
    # The wire: N x S fp32 elements per flat buffer, S the largest segment (element-wise: ceil(numel / N)).
    segments = segment_numel(flats[0], world) + [-(-sum(map(_numel, shapes)) // world) for shapes in flats.get(1, [])]
    want = world * 4 * sum(segments)
    for r in results:
        assert r[3]["reduce_scatter"] == want
        if stage < 3:  # stage 3 gathers unit by unit in forward and backward (docs/stage-3.md)
            assert r[3]["all_gather"] == want


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n
