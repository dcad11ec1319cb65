"""memory_stats()'s `activations` and `peak` against two independent counts, at stages 0-3 on 2 ranks.

References: a saved-tensor hook the test installs around `engine(...)` itself
(the engine's meter must hand every tensor on to it), which counts the saved
storages that did not exist before the forward (every tensor storage alive
before it, found through the garbage collector, is left out: the parameters,
stage 3's flat buffers, the batch), each once; and `zeroshard estimate`'s
count of the same model on the meta device. `peak` is what is held now plus
the largest forward of the accumulation window.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests.distributed import run_ranks
from tests.recipes import Case, make_engine, micro_batch
from zeroshard.app.estimate.activation_count import count_activations


def _storages_alive() -> dict[int, torch.UntypedStorage]:
    gc.collect()
    return {t.untyped_storage()._cdata: t.untyped_storage() for t in gc.get_objects() if isinstance(t, torch.Tensor)}


def counted_by_test(forward) -> tuple[object, int]:
    """(the forward's result, bytes of the storages it saved for backward that it made)."""
    before = _storages_alive()  # held until the count is done: no new storage can take their addresses
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage._cdata not in before:
            saved[storage._cdata] = storage
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = forward()
    return out, sum(s.nbytes() for s in saved.values())


def _steps(rank, world, device, cases):
    out = []
    for case in cases:
        engine = make_engine(case, device=device)
        counts = []
        for micro, rows in enumerate((2, 1)):  # the window's first micro-step is the larger one
            x, y = (t[:rows].contiguous().to(device) for t in micro_batch(0, case, world, rank, micro))
            loss, by_test = counted_by_test(lambda: engine(x, y))
            meta = count_activations("tiny", rows, x.shape[1], "full" if case.variant != "plain" else "none",
                                     "fp32").total
            with torch.no_grad():
                engine(x, y)  # saves nothing: the count of the last training forward stands
            counts.append((engine.memory_stats()["activations"], by_test, meta))
            engine.backward(loss)
            engine.step()
        stats = engine.memory_stats()
        out.append((counts, stats, engine.memory_stats("host")["activations"]))
    return out


CASES = [Case(stage=s, accumulation=2) for s in range(4)] + [Case(stage=3, accumulation=2, variant="non_reentrant")]


@pytest.mark.parametrize("world", [2])
def test_activations_and_peak(world):
    for rank in run_ranks(_steps, world, CASES):
        for case, (counts, stats, host) in zip(CASES, rank):
            for measured, by_test, meta in counts:
                assert measured == by_test == meta, (case, counts)
            assert counts[0][0] > counts[1][0]  # 2 rows save more than 1
            assert stats["activations"] == counts[1][0]  # the last forward's
            assert stats["peak"] == stats.held() + counts[0][0], (case, stats)  # the window's largest
            assert host == 0  # on the CPU every tensor is in the device pool
    plain, checkpointed = rank[3][0][0][0], rank[4][0][0][0]
    assert checkpointed < plain / 2  # each block keeps its input only
