"""ZeRO++'s collectives at 4 ranks as 2 nodes x 2, 1 x 4 and 4 x 1: qgZ's mean and qwZ's gather, and their bytes.

qgZ is compared with torch.distributed (all-reduce, this rank's slice, / N)
on the same gradients, and its error is held to the bound that the block
scales give (comm/compress/qgz.py): the scales are recomputed here, in one process,
from every rank's gradients with the codec's own quantize / dequantize.
qwZ must give exactly dequantize(quantize(shard)) of every rank. The bytes
recorded by scope must equal estimate/zeropp.py's formulas.

All cases run in one spawn of 4 ranks; the tests read its results.
"""

import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.distributed import run_ranks
from zeroshard.comm import Comm, CommRecorder
from zeroshard.comm.compress.qgz import Hops, qgz_reduce_scatter
from zeroshard.comm.compress.quantize import BlockCodec, CodecError, dequantize, quantize
from zeroshard.comm.compress.qwz import qwz_all_gather
from zeroshard.comm.topology import TopologyError, build_topology
from zeroshard.estimate import qgz_reduce_scatter_bytes, qwz_all_gather_bytes

WORLD = 4
LAYOUTS = (2, 4, 1)  # ranks per node: 2 nodes x 2, 1 node x 4, 4 nodes x 1
SIZES = (1, 7, 1009, 2048, 10007)  # 1-D: one element, odd, prime, whole blocks in every shard, a larger prime
CODECS = {name: BlockCodec.named(name, 64) for name in ("int8", "int4", "int4+hadamard", "fp8_e4m3")}
DISTRIBUTIONS = ("gaussian", "student-t3")
QWZ_SIZES = (1, 7, 1009)  # elements per shard
QWZ_CODECS = {"int8": BlockCodec("int8", 128), "int8+hadamard": BlockCodec("int8", 64, hadamard=True),
              "fp8_e4m3": BlockCodec("fp8_e4m3", 128)}
QWZ_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
U32 = 2.0 ** -24  # fp32 unit roundoff


def _draw(distribution: str, numel: int, generator: torch.Generator) -> torch.Tensor:
    normal = torch.randn(numel, generator=generator)
    if distribution == "gaussian":
        return normal
    chi2 = torch.randn(3, numel, generator=generator).square().sum(0)
    return normal / (chi2 / 3).sqrt()  # Student-t, 3 degrees of freedom: heavy tails


def gradient(distribution: str, numel: int, rank: int) -> torch.Tensor:
    """A rank's gradient: a signal shared by the ranks plus as much noise of the rank's own."""
    signal = _draw(distribution, numel, torch.Generator().manual_seed(numel))
    return signal + _draw(distribution, numel, torch.Generator().manual_seed(1000 * numel + rank + 1))


def weights(numel: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(7 * numel + rank)).to(dtype)


def _delta(before, after, op: str) -> dict:
    return {"calls": after[op].calls - before[op].calls, "bytes": after[op].bytes - before[op].bytes,
            "by_scope": {s: b - before[op].by_scope.get(s, 0) for s, b in after[op].by_scope.items()
                         if b != before[op].by_scope.get(s, 0)}}


def _qgz_cases(rank, world, device, hops, recorder) -> dict:
    out = {}
    for distribution in DISTRIBUTIONS:
        for numel in SIZES:
            size = -(-numel // world)
            grad = gradient(distribution, numel, rank).to(device)
            expected = F.pad(grad, (0, world * size - numel))
            dist.all_reduce(expected)
            expected = expected[rank * size:(rank + 1) * size] / world
            for name, codec in CODECS.items():
                shard = torch.full((size,), float("nan"), device=device)
                before = recorder.snapshot()
                qgz_reduce_scatter(hops, shard, grad, codec).wait()
                out[distribution, numel, name] = {"shard": shard.cpu(), "expected": expected.cpu(),
                                                  **_delta(before, recorder.snapshot(), "reduce_scatter")}
    return out


def _qwz_cases(rank, world, device, comm) -> dict:
    out = {}
    for dtype in QWZ_DTYPES:
        for size in QWZ_SIZES:
            for name, codec in QWZ_CODECS.items():
                shard = weights(size, rank, dtype).to(device)
                kept = shard.clone()
                full = torch.full((world * size,), float("nan"), dtype=dtype, device=device)
                before = comm.recorder.snapshot()
                qwz_all_gather(comm, full, shard, codec).wait()
                out[dtype, size, name] = {"full": full.cpu(), "shard_kept": torch.equal(shard, kept),
                                          **_delta(before, comm.recorder.snapshot(), "all_gather")}
    return out


def _more_cases(rank, world, device, comm, topology, hops) -> dict:
    """Any shape reads as flat; two reductions in flight at once; 16-bit input; an overflow; misuse raises."""
    codec = CODECS["int4"]
    grad = gradient("gaussian", 407, rank).to(device)  # 37 x 11: 102 elements a shard, one of them padding
    flat, shaped, first, second = (torch.empty(102, device=device) for _ in range(4))
    qgz_reduce_scatter(hops, flat, grad, codec).wait()
    qgz_reduce_scatter(hops, shaped, grad.view(37, 11), codec).wait()
    pendings = [qgz_reduce_scatter(hops, first, grad, codec), qgz_reduce_scatter(hops, second, 2 * grad, codec)]
    for pending in pendings:
        pending.wait()
    half, widened, overflowed = (torch.empty(102, device=device) for _ in range(3))
    qgz_reduce_scatter(hops, half, grad.bfloat16(), codec).wait()
    qgz_reduce_scatter(hops, widened, grad.bfloat16().float(), codec).wait()
    inf = grad.clone()
    inf[0] = float("inf") if rank == world - 1 else inf[0]  # one rank's overflow, in rank 0's shard
    qgz_reduce_scatter(hops, overflowed, inf, codec).wait()
    reversed_nodes = replace(topology, layout=topology.layout[::-1])  # chunk r would not land on rank r
    return {"shaped": torch.equal(flat, shaped),
            "in flight": torch.equal(first, flat) and torch.equal(second, 2 * flat),  # doubling is exact
            "bf16": torch.equal(half, widened),
            "finite": overflowed.isfinite().all().item(),
            "wrong shard": _error(lambda: qgz_reduce_scatter(hops, torch.empty(101), grad, codec), CodecError),
            "reversed nodes": _error(lambda: Hops.create(comm, reversed_nodes), TopologyError),
            "qwz wrong size": _error(lambda: qwz_all_gather(comm, torch.empty(9), torch.empty(2), codec), CodecError)}


def _error(fn, kind) -> str | None:
    try:
        fn()
    except kind as error:
        return str(error)
    return None


def _cases(rank, world, device):
    out = {}
    for ranks_per_node in LAYOUTS:
        topology = build_topology(dist.group.WORLD, ranks_per_node)
        comm = Comm.create(dist.group.WORLD, CommRecorder(), scope=topology.scope)
        hops = Hops.create(comm, topology)
        out["qgz", ranks_per_node] = _qgz_cases(rank, world, device, hops, comm.recorder)
        out["qwz", ranks_per_node] = _qwz_cases(rank, world, device, comm)
        out["more", ranks_per_node] = _more_cases(rank, world, device, comm, topology, hops)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_cases, WORLD)


def _over_the_wire(rows: torch.Tensor, codec: BlockCodec) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of (..., S) quantized as its own message: the dequantized rows and their scales (..., blocks)."""
    size = rows.shape[-1]
    flat = rows.reshape(-1, size)
    padded = F.pad(flat, (0, codec.blocks(size) * codec.block_size - size))
    q = quantize(padded, codec)
    values = dequantize(q).view(padded.shape)[:, :size]
    return values.view(rows.shape), q.scales.view(*rows.shape[:-1], -1)


def block_bounds(grads: torch.Tensor, ranks_per_node: int, codec: BlockCodec) -> torch.Tensor:
    """(owner, blocks): the bound of comm/compress/qgz.py per block of each shard of the mean, g (sum s1 + sum s2) / 2N.

    `grads`: (senders, owners, S) fp32, every rank's padded gradient by shard.
    """
    n = grads.shape[0]
    nodes = n // ranks_per_node
    partials = grads.view(nodes, ranks_per_node, *grads.shape[1:]).sum(1)  # one rank a node: its own gradient
    scales = []
    if ranks_per_node > 1:  # hop 1: every sender's shard quantized; each node sums what its ranks sent
        received, hop1 = _over_the_wire(grads, codec)
        partials = received.view(nodes, ranks_per_node, *grads.shape[1:]).sum(1)
        scales.append(hop1)
    if nodes > 1:  # hop 2: each node's partial sums quantized
        scales.append(_over_the_wire(partials, codec)[1])
    scales = torch.cat(scales)
    return scales.sum(0) * codec.level_gap / (2 * n)


def _check_qgz(case: dict, grads: torch.Tensor, ranks_per_node: int, codec: BlockCodec) -> dict:
    """Assert the bound on every shard; return the relative errors per shard and the ratio of norms."""
    _, owners, size = grads.shape
    ours = torch.stack([r["shard"] for r in case])
    expected = torch.stack([r["expected"] for r in case])
    bounds = block_bounds(grads, ranks_per_node, codec) * (1 + 1e-4)  # fp32 rounding of x/s and q*s
    # fp32 sums of N values, ours and torch.distributed's, then / N: each under (N - 1) u sum|x| / N.
    slack = 2 * U32 * grads.abs().sum(0)
    padding = codec.blocks(size) * codec.block_size - size
    error = ours - expected
    if codec.hadamard:  # the bound holds per block in L2, sqrt(block_size) times the rotated one
        per_block = F.pad(error, (0, padding)).view(owners, -1, codec.block_size).norm(dim=2)
        allowed = bounds * math.sqrt(codec.block_size) + F.pad(slack, (0, padding)).view(
            owners, -1, codec.block_size).norm(dim=2)
        assert (per_block <= allowed).all(), f"worst block error / bound {(per_block / allowed).max():.4f}"
    else:
        allowed = bounds.repeat_interleave(codec.block_size, dim=1)[:, :size] + slack
        assert (error.abs() <= allowed).all(), f"worst element error / bound {(error.abs() / allowed).max():.4f}"
    assert (error.norm(dim=1) <= allowed.norm(dim=1)).all(), "per shard, in L2: the blocks' bounds together"
    return {"relative": (error.norm(dim=1) / expected.norm(dim=1)).tolist(),
            "ratio": (ours.norm() / expected.norm()).item()}


@pytest.mark.parametrize("ranks_per_node", LAYOUTS)
@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_qgz_is_the_exact_mean_within_the_scales_bound(results, ranks_per_node, distribution):
    for numel in SIZES:
        size = -(-numel // WORLD)
        grads = torch.stack([F.pad(gradient(distribution, numel, r), (0, WORLD * size - numel))
                             for r in range(WORLD)]).view(WORLD, WORLD, size)
        for name, codec in CODECS.items():
            case = [r["qgz", ranks_per_node][distribution, numel, name] for r in results]
            found = _check_qgz(case, grads, ranks_per_node, codec)
            assert abs(found["ratio"] - 1) <= 0.02, (numel, name, found)


@pytest.mark.parametrize("ranks_per_node", LAYOUTS)
def test_qgz_records_its_bytes_by_scope(results, ranks_per_node):
    for (distribution, numel, name), _ in results[0]["qgz", ranks_per_node].items():
        codec = CODECS[name]
        expected = qgz_reduce_scatter_bytes(numel, WORLD, ranks_per_node, codec.bits, codec.block_size)
        expected = {scope: nbytes for scope, nbytes in expected.items() if nbytes}
        for rank_results in results:
            got = rank_results["qgz", ranks_per_node][distribution, numel, name]
            assert got["by_scope"] == expected, (numel, name)
            assert (got["calls"], got["bytes"]) == (len(expected), sum(expected.values())), (numel, name)


@pytest.mark.parametrize("ranks_per_node", LAYOUTS)
@pytest.mark.parametrize("dtype", QWZ_DTYPES, ids=str)
def test_qwz_gathers_exactly_the_dequantized_shards(results, ranks_per_node, dtype):
    for size in QWZ_SIZES:
        for name, codec in QWZ_CODECS.items():
            expected = torch.cat([dequantize(quantize(weights(size, r, dtype), codec), dtype) for r in range(WORLD)])
            nbytes = qwz_all_gather_bytes(WORLD * size, WORLD, codec.bits, codec.block_size)
            scope = "cross_node" if ranks_per_node < WORLD else "node"
            for rank_results in results:
                got = rank_results["qwz", ranks_per_node][dtype, size, name]
                assert got["full"].dtype == dtype and torch.equal(got["full"], expected), (size, name)
                assert got["shard_kept"], "the shard (a master copy) is left as it was"
                assert (got["calls"], got["bytes"], got["by_scope"]) == (1, nbytes, {scope: nbytes})


@pytest.mark.parametrize("ranks_per_node", LAYOUTS)
def test_qgz_takes_any_shape_and_dtype_runs_in_flight_keeps_overflows_and_refuses_misuse(results, ranks_per_node):
    for rank_results in results:
        got = rank_results["more", ranks_per_node]
        assert got["shaped"], "a 2-D tensor reduces as its flat view"
        assert got["in flight"], "two reductions in flight give what each gives alone"
        assert got["bf16"], "16-bit gradients are quantized from their fp32 values"
        assert "into a 1-D shard of 102 elements, not (101,)" in got["wrong shard"]
        assert "qwZ gathers 4 shards of 2 elements into a 1-D buffer of 8 elements, not (9,)" in got["qwz wrong size"]
    assert [r["more", ranks_per_node]["finite"] for r in results] == [False, True, True, True], \
        "an inf on one rank leaves the mean non-finite where it was, for the overflow check"
    refused = [r["more", ranks_per_node]["reversed nodes"] for r in results]
    if ranks_per_node == WORLD:  # one node: reversing changes nothing
        assert refused == [None] * WORLD
    else:
        assert all("needs the data-parallel group's ranks node by node" in m for m in refused), refused


def test_the_formulas_give_the_papers_cross_node_volumes():
    """Per step of a bf16 model (M = 2 bytes a parameter), 2 nodes x 8, blocks of 128, scales included:
    qwZ's gather 0.5M + 1/64 M, and qgZ's second hop, summed over a node's 8 ranks, 0.25M + 1/64 M at int4."""
    numel, world, per_node = 16 * 2**20, 16, 8
    model = 2 * numel
    assert qwz_all_gather_bytes(numel, world, 8, 128) / model == 0.5 + 1 / 64
    int4 = qgz_reduce_scatter_bytes(numel, world, per_node, 4, 128)
    assert per_node * int4["cross_node"] / model == 0.25 + 1 / 64
    assert int4["node"] / model == 0.25 + 1 / 64  # hop 1 sends the whole gradient inside the node
    assert qgz_reduce_scatter_bytes(numel, world, world, 4, 128)["cross_node"] == 0  # one node
    assert qgz_reduce_scatter_bytes(numel, world, 1, 8, 128)["node"] == 0  # one rank a node
    with pytest.raises(ValueError, match="must divide"):
        qgz_reduce_scatter_bytes(numel, world, 3)
