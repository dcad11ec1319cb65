"""What the communication and memory logs call things: object gathers and staging memory.

An `all_gather_object` (ranks checking that they agree) is recorded as its
own op, `object_gather`, with the pickled bytes of every rank's object as
its logical size: not as a 0-byte `all_gather`, which would skew the
all-gather formula. `memory_stats()` names pooled communication memory
`staging`; `buffers` is its deprecated alias (read with a warning, not a key of its own).
"""

import pickle

import pytest

from tests.distributed import run_ranks
from tests.recipes import Case, make_model, make_optimizer, micro_batch

WORLD = 2


def _obj(rank: int) -> dict:
    return {"rank": rank, "names": ["wte.weight"] * (3 + 5 * rank), "lr": 1e-3 * (rank + 1)}


def _object_gather(rank, world, device):
    import torch.distributed as dist

    from zeroshard.comm import OPS, Comm, CommRecorder, all_gather_object

    comm = Comm.create(dist.group.WORLD, CommRecorder())
    before = comm.recorder.snapshot()
    gathered = [all_gather_object(comm, _obj(rank)), all_gather_object(comm, "x" * (100 + rank))]
    after = comm.recorder.snapshot()
    return {"ops": OPS, "gathered": gathered,
            "delta": {op: (after[op].calls - before[op].calls, after[op].bytes - before[op].bytes) for op in OPS},
            "algorithms": sorted(after["object_gather"].algorithms)}


def _engine_logs(rank, world, device, stages):
    import zeroshard

    out = {}
    for stage in stages:
        case = Case(stage=stage)
        model = make_model(device=device)
        engine = zeroshard.initialize(model, make_optimizer(case.optimizer, model), case.config())
        at_init = engine.comm_stats()
        x, y = (t.to(device) for t in micro_batch(0, case, world, rank, 0))
        engine.backward(engine(x, y))
        engine.step()
        out[stage] = {"object_gather": (at_init["object_gather"].calls, at_init["object_gather"].bytes),
                      "all_gather_at_init": (at_init["all_gather"].calls, at_init["all_gather"].bytes),
                      "memory": engine.memory_stats()}
    return out


def _both(rank, world, device, stages):
    return {"object_gather": _object_gather(rank, world, device), "engine": _engine_logs(rank, world, device, stages)}


STAGES = (0, 2, 3)


@pytest.fixture(scope="module")
def runs():
    """One spawn of the ranks for both tests."""
    return run_ranks(_both, WORLD, STAGES)


def test_object_gather_is_its_own_op_with_pickled_bytes(runs):
    expected_bytes = (sum(len(pickle.dumps(_obj(r))) for r in range(WORLD))
                      + sum(len(pickle.dumps("x" * (100 + r))) for r in range(WORLD)))
    for out in (r["object_gather"] for r in runs):
        assert "object_gather" in out["ops"]
        assert out["gathered"] == [[_obj(r) for r in range(WORLD)], ["x" * (100 + r) for r in range(WORLD)]]
        delta = out["delta"]
        assert delta["object_gather"] == (2, expected_bytes)
        assert expected_bytes > 0
        assert delta["all_gather"] == (0, 0), "an object gather must not count as an all_gather"
        assert all(delta[op] == (0, 0) for op in out["ops"] if op != "object_gather"), delta
        assert out["algorithms"] == ["pickle"]


def test_engine_logs_object_gathers_and_staging(runs):
    for out in (r["engine"] for r in runs):
        for stage in STAGES:
            calls, nbytes = out[stage]["object_gather"]
            assert calls >= 1 and nbytes > 0, (stage, "ranks agree through object gathers at initialize")
            if stage == 0:  # nothing else gathers at stage 0: a 0-byte all_gather would be an object gather
                assert out[stage]["all_gather_at_init"] == (0, 0)
            calls, nbytes = out[stage]["all_gather_at_init"]
            assert calls == 0 or nbytes > 0, (stage, "an all_gather of 0 bytes")
            memory = out[stage]["memory"]
            # `buffers` is the deprecated name of `staging`: readable, but not a key, so sums count it once.
            assert "staging" in memory and "buffers" not in memory
            with pytest.warns(DeprecationWarning, match=r"memory_stats\(\)\['staging'\]"):
                assert memory["buffers"] == memory["staging"]
            if stage >= 2:  # gradients were staged for a reduce-scatter
                assert memory["staging"] > 0, stage
