"""Test-session settings: what must hold before torch runs its first kernel, and the session's garbage collector."""

import gc
import os

# Some virtual machines report AMX in cpuid but fault on its instructions ("Illegal
# instruction" in the first bf16 matmul, where oneDNN picks AMX). Capping oneDNN at
# AVX-512 BF16 avoids AMX and changes nothing where AMX is absent; spawned ranks inherit it.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, zeroshard, the test modules) stays for the session: the
    garbage collections of this process (a test's gc.collect(), the automatic ones) need not walk it, as a
    pooled rank's need not walk its imports (rank_state.py)."""
    gc.collect()  # what is garbage already goes now, not kept for the session
    gc.freeze()
