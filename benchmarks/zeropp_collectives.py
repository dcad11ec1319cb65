"""ZeRO++'s collectives against the plain ones: milliseconds and recorded bytes by scope, one call each.

    torchrun --nproc-per-node 4 benchmarks/zeropp_collectives.py [--ranks-per-node 2] [--mib 32] [--repeats 5]

The ranks are declared `--ranks-per-node` to a node (emulated on one
machine: nothing is slower across "nodes", so this measures the CPU cost of
quantizing, not the saving on a slow link). A bf16 flat buffer of `--mib`
MiB is reduce-scattered (plain, then qgZ) and all-gathered (plain, then qwZ
into bf16). Rank 0 prints, per variant, the median milliseconds and the
bytes the comm recorded for one call, by scope, as a fraction of M (the
buffer's bf16 bytes); for qgZ also the worst rank's relative error of its
fp32 shard against the fp32 mean (all-reduce / N) of the same gradients,
independent Gaussian (or Student-t 3) draws per rank: the mean is then
smallest against what each rank sends, the hardest case.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

from zeroshard.comm import Comm, CommRecorder, Hops, all_gather, qgz_reduce_scatter, qwz_all_gather, reduce_scatter
from zeroshard.comm.compress.quantize import BlockCodec
from zeroshard.comm.topology import build_topology

CODECS = {"int8/128": BlockCodec("int8", 128), "int4/128": BlockCodec("int4", 128),
          "int4/128+hadamard": BlockCodec("int4", 128, hadamard=True)}


def gradients(distribution: str, numel: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    normal = torch.randn(numel, generator=g)
    if distribution == "gaussian":
        return normal.to(torch.bfloat16)
    chi2 = torch.randn(3, numel, generator=g).square().sum(0)
    return (normal / (chi2 / 3).sqrt()).to(torch.bfloat16)


def variants(comm: Comm, hops: Hops, grads: torch.Tensor, mean: torch.Tensor) -> dict:
    """name -> (call, relative error of the result or None)."""
    size = grads.numel() // comm.world_size
    shard, scratch, full = torch.empty(size, dtype=torch.bfloat16), torch.empty_like(grads), torch.empty_like(grads)
    fp32_shard = torch.empty(size)
    out = {"reduce-scatter: plain bf16": (lambda: reduce_scatter(comm, shard, grads, scratch).wait(), None)}
    for name, codec in CODECS.items():
        call = partial(qgz_reduce_scatter, hops, fp32_shard, grads, codec, async_op=False)
        out[f"reduce-scatter: qgZ {name}"] = (call, lambda: (fp32_shard - mean).norm() / mean.norm())
    out["all-gather: plain bf16"] = (lambda: all_gather(comm, full).wait(), None)
    out["all-gather: qwZ int8/128"] = (lambda: qwz_all_gather(comm, full, grads[:size], CODECS["int8/128"]).wait(),
                                       None)
    return out


def measure(comm: Comm, fn, repeats: int) -> tuple[float, dict[str, int]]:
    """Median seconds of `fn` and the bytes by scope of one call."""
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        dist.barrier()
        before = {op: dict(s.by_scope) for op, s in comm.recorder.snapshot().items()}
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        after = comm.recorder.snapshot()
    scopes: dict[str, int] = {}
    for op, stats in after.items():
        for scope, nbytes in stats.by_scope.items():
            if nbytes != before[op].get(scope, 0):
                scopes[scope] = scopes.get(scope, 0) + nbytes - before[op].get(scope, 0)
    return statistics.median(times[1:]), scopes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--mib", type=float, default=32, help="size of the bf16 flat buffer")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--distribution", choices=("gaussian", "student-t3"), default="gaussian")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    topology = build_topology(dist.group.WORLD, args.ranks_per_node)
    comm = Comm.create(dist.group.WORLD, CommRecorder(), scope=topology.scope)
    hops = Hops.create(comm, topology)
    n = comm.world_size
    numel = int(args.mib * 2**20 / 2) // n * n
    model = 2 * numel  # M: the buffer's bytes in bf16
    if comm.rank == 0:
        print(f"torch {torch.__version__}, gloo, {n} ranks as {topology.nodes} nodes x {topology.ranks_per_node}, "
              f"{model / 2**20:.0f} MiB bf16 buffer, {args.distribution} gradients, median of {args.repeats}")
    grads = gradients(args.distribution, numel, comm.rank)
    mean = grads.float()
    dist.all_reduce(mean)
    mean = mean.view(n, -1)[comm.rank] / n
    for name, (fn, error) in variants(comm, hops, grads, mean).items():
        seconds, scopes = measure(comm, fn, args.repeats)
        worst = None if error is None else error().reshape(1)
        if worst is not None:
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if comm.rank == 0:
            by_scope = ", ".join(f"{s} {b / model:.4f} M" for s, b in sorted(scopes.items()))
            relative = "" if worst is None else f"; relative error per shard, worst rank {worst.item():.4f}"
            print(f"{name}: {1000 * seconds:.0f} ms; {by_scope}{relative}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
