"""The recorded collectives equal torch.distributed's own, with every algorithm, and log exact bytes."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks
from zeroshard.comm import Algorithms, CollectiveError, Comm, CommRecorder, all_gather, all_reduce, reduce_scatter
from zeroshard.comm.collectives import Pending

ALGORITHMS = [Algorithms("native", "native"), Algorithms("all_to_all", "send_recv")]
CHUNK = 5  # elements per rank


def _compare(rank, world, device):
    out = []
    for algorithms in ALGORITHMS:
        comm = Comm(dist.group.WORLD, CommRecorder(), algorithms)
        full = torch.randn(world * CHUNK, generator=torch.Generator().manual_seed(rank)).to(device)

        expected_rs = torch.empty(CHUNK, device=device)
        dist.reduce_scatter_single(expected_rs, full.clone())
        shard = torch.empty(CHUNK, device=device)
        reduce_scatter(comm, shard, full.clone(), scratch=torch.empty_like(full)).wait()
        in_place = full.clone()
        reduce_scatter(comm, in_place[rank * CHUNK:(rank + 1) * CHUNK], in_place,
                       scratch=torch.empty_like(full)).wait()

        expected_ag = torch.empty_like(full)
        dist.all_gather_single(expected_ag, full[rank * CHUNK:(rank + 1) * CHUNK].clone())
        gathered = full.clone()
        gathered[rank * CHUNK:(rank + 1) * CHUNK] = full[rank * CHUNK:(rank + 1) * CHUNK]
        all_gather(comm, gathered).wait()

        expected_ar = full.clone()
        dist.all_reduce(expected_ar)
        reduced = full.clone()
        all_reduce(comm, reduced).wait()

        stats = comm.recorder.snapshot()
        out.append({
            "rs": (shard.cpu(), expected_rs.cpu()),
            "rs_in_place": (in_place[rank * CHUNK:(rank + 1) * CHUNK].cpu(), expected_rs.cpu()),
            "ag": (gathered.cpu(), expected_ag.cpu()),
            "ar": (reduced.cpu(), expected_ar.cpu()),
            "stats": {op: (s.calls, s.bytes) for op, s in stats.items()},
        })
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_collectives_match_torch_distributed(world):
    nbytes = world * CHUNK * 4
    for rank_results in run_ranks(_compare, world):
        for res in rank_results:
            torch.testing.assert_close(*res["rs"], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(*res["rs_in_place"], rtol=1e-6, atol=1e-6)
            assert torch.equal(*res["ag"]), "all-gather must be exact"
            torch.testing.assert_close(*res["ar"], rtol=1e-6, atol=1e-6)
            assert res["stats"]["reduce_scatter"] == (2, 2 * nbytes)
            assert res["stats"]["all_gather"] == (1, nbytes)
            assert res["stats"]["all_reduce"] == (1, nbytes)
            assert res["stats"]["all_to_all"] == (0, 0)


def test_algorithms_follow_the_backend():
    """gloo: reduce-scatter as all-to-all + sum, all-gather as an exchange; NCCL: its own."""
    (algorithms,) = set(run_ranks(_algorithms, 2))
    want = Algorithms("all_to_all", "send_recv") if algorithms[0] == "gloo" else Algorithms("native", "native")
    assert algorithms[1] == want


def _algorithms(rank, world, device):
    return dist.get_backend(), Algorithms.for_group(dist.group.WORLD)


def test_a_failed_wait_fails_again_and_runs_nothing_after_it():
    class Lost:
        def wait(self, timeout=None):
            raise CollectiveError("the collective was lost")

    pending = Pending(SimpleNamespace(timeout_s=None), "all_gather", Lost())
    landed = []
    pending.then(lambda: landed.append(True))
    for _ in range(2):  # a second wait must not pass for landed
        with pytest.raises(CollectiveError):
            pending.wait()
    assert landed == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_the_reduce_scatter_sums_chunks_as_torch_sum_does_in_place_or_not(world, dtype):
    # gloo's reduce-scatter adds the chunks of every rank into this rank's shard: bit for bit torch.sum over them.
    from zeroshard.comm.collectives import _sum_chunks

    chunk = 1001
    for rank in range(world):
        full = (torch.randn(world, chunk, generator=torch.Generator().manual_seed(rank)) * 100).to(dtype)
        received = (torch.randn(world, chunk, generator=torch.Generator().manual_seed(99)) * 100).to(dtype)
        chunks = received.clone()
        chunks[rank] = full[rank]
        want = torch.sum(chunks, dim=0)
        out = torch.empty(chunk, dtype=dtype)
        _sum_chunks(out, full[rank], received.clone(), rank)
        assert torch.equal(out, want), (rank, "separate")
        _sum_chunks(full[rank], full[rank], received.clone(), rank)  # the shard is its own chunk of full
        assert torch.equal(full[rank], want), (rank, "in place")
