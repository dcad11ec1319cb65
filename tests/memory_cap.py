"""A memory cap below the full model for one rank process: RLIMIT_DATA over its private writable memory."""

from __future__ import annotations

import resource

import torch


def data_bytes() -> int:
    """This process's private writable memory (VmData): what RLIMIT_DATA caps."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmData:"))
    return int(line.split()[1]) * 1024


def return_freed_memory() -> None:
    """From now on, glibc hands freed blocks of 64 KiB and more back to the system: otherwise it keeps them in
    its heap (its mmap threshold grows with each large free), and that heap counts against the cap. A case
    calls it first, as MALLOC_MMAP_THRESHOLD_=65536 would at its process's start; what it changes lasts as
    long as the process, so the case runs on ranks of its own (run_ranks' fresh=True)."""
    from zeroshard.offload.memory import return_freed_blocks  # MMAP_THRESHOLD: 64 KiB

    return_freed_blocks()


class MemoryCap:
    """Caps this process at its memory now + `fraction` x `full_bytes`; `whole_fits` says whether a tensor of
    `full_bytes` still fits under it (it must not, or the cap proves nothing), `held()` whether the growth
    since stays under it."""

    def __init__(self, full_bytes: int, fraction: float = 0.85):
        self.cap = int(fraction * full_bytes)
        self.base = data_bytes()
        resource.setrlimit(resource.RLIMIT_DATA, (self.base + self.cap, self.base + self.cap))
        try:
            torch.empty(full_bytes // 4)  # the whole model in fp32
            self.whole_fits = True
        except RuntimeError:
            self.whole_fits = False

    def held(self) -> bool:
        return data_bytes() - self.base <= self.cap
