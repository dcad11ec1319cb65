"""How fast each way of running the logical reduce-scatter and all-gather is on this backend.

    torchrun --nproc-per-node 2 benchmarks/collectives.py [--mib 190] [--repeats 5]

Rank 0 prints the median milliseconds per algorithm. This is the measurement
behind `zeroshard.comm.collectives.Algorithms.for_group`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def exchange(full: torch.Tensor, rank: int, n: int, send_own: bool, recv: torch.Tensor) -> None:
    """Batched send/recv: send own chunk (all-gather) or each peer's chunk (reduce-scatter)."""
    chunk = full.numel() // n
    ops = []
    for peer in range(n):
        if peer != rank:
            src = full[rank * chunk:(rank + 1) * chunk] if send_own else full[peer * chunk:(peer + 1) * chunk]
            ops.append(dist.P2POp(dist.isend, src, peer))
            ops.append(dist.P2POp(dist.irecv, recv[peer * chunk:(peer + 1) * chunk], peer))
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def algorithms(full: torch.Tensor, rank: int, n: int) -> dict:
    chunk = full.numel() // n
    own = full[rank * chunk:(rank + 1) * chunk]
    scratch, shard = torch.empty_like(full), torch.empty(chunk)

    def zero_others_then_all_reduce():
        full[: rank * chunk].zero_()
        full[(rank + 1) * chunk:].zero_()
        dist.all_reduce(full)

    def all_to_all_sum():
        dist.all_to_all_single(scratch, full)
        torch.sum(scratch.view(n, -1), 0, out=shard)

    def exchange_sum():
        exchange(full, rank, n, send_own=False, recv=scratch)
        scratch[rank * chunk:(rank + 1) * chunk] = own
        torch.sum(scratch.view(n, -1), 0, out=shard)

    return {
        "all-gather: native all_gather_single": lambda: dist.all_gather_single(scratch, own),
        "all-gather: all-reduce of a zero-filled buffer": zero_others_then_all_reduce,
        "all-gather: send/recv exchange": lambda: exchange(full, rank, n, send_own=True, recv=full),
        "reduce-scatter: native reduce_scatter_single": lambda: dist.reduce_scatter_single(shard, full),
        "reduce-scatter: all-to-all + sum": all_to_all_sum,
        "reduce-scatter: send/recv exchange + sum": exchange_sum,
        "all-reduce (for scale)": lambda: dist.all_reduce(full),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, default=190, help="size of the full fp32 buffer")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    numel = int(args.mib * 2**20 / 4) // n * n
    full = torch.randn(numel)
    for name, fn in algorithms(full, rank, n).items():
        times = []
        for _ in range(args.repeats + 1):  # the first call warms up
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        if rank == 0:
            print(f"{n} ranks, {numel * 4 / 2**20:.0f} MiB, {name}: {1000 * statistics.median(times[1:]):.0f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
