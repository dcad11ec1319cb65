"""Transfer, Poison, Copier on the CPU, and the worker pool's order and errors."""

from __future__ import annotations

import threading

import pytest
import torch

from zeroshard.offload import Copier, Poison, Transfer, aligned_empty, completed
from zeroshard.offload.pool import Job, WorkerPool
from zeroshard.offload.transfer import POISON_ENV

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.int8, torch.bool]


def _values(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    return torch.randint(0, 100, (n,), generator=g).to(dtype)


def test_completed_is_done():
    t = completed()
    assert t.done()
    t.wait()
    t.wait()


@pytest.mark.parametrize("value, expected", [(None, None), ("", None), ("0", None), ("20", 20.0), (" 5.5 ", 5.5)])
def test_poison_from_env(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(POISON_ENV, raising=False)
    else:
        monkeypatch.setenv(POISON_ENV, value)
    poison = Poison.from_env()
    assert (poison.delay_ms if poison else None) == expected


@pytest.mark.parametrize("value", ["abc", "-3", "inf", "nan"])
def test_poison_from_env_refuses_a_bad_value(monkeypatch, value):
    monkeypatch.setenv(POISON_ENV, value)
    with pytest.raises(ValueError, match=POISON_ENV):
        Poison.from_env()


@pytest.mark.parametrize("dtype", DTYPES)
def test_poison_fill_sets_every_bit_or_nan(dtype):
    t = _values(10, dtype)
    Poison(1).fill(t)
    if dtype.is_floating_point:
        assert t.isnan().all()
    elif dtype == torch.bool:
        assert t.all()
    else:
        assert (t.view(torch.uint8) == 0xFF).all()
    # 0xFF bytes read as NaN in every float dtype: a uint8 buffer's poison shows in its typed views
    raw = torch.zeros(16, dtype=torch.uint8)
    Poison(1).fill(raw)
    for float_dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        assert raw.view(float_dtype).isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("poison", [None, Poison(5)])
def test_cpu_copy_equals_copy_(dtype, poison):
    copier = Copier(torch.device("cpu"), poison=poison)
    src = _values(1001, dtype)
    dst, expected = torch.empty_like(src), torch.empty_like(src)
    expected.copy_(src)
    t = copier.copy(dst, src)
    t.wait()
    assert t.done() and torch.equal(dst, expected)
    t.wait()  # idempotent
    copier.close()


def test_a_reader_that_does_not_wait_sees_nan_and_one_that_waits_sees_the_data():
    copier = Copier("cpu", poison=Poison(1000), threads=2)  # 1 s: not done when checked, however loaded the machine
    src = torch.arange(4096, dtype=torch.float32)
    dst = torch.zeros(4096)
    t = copier.copy(dst, src)
    assert not t.done()  # the copy runs beside the caller: it is not done when copy() returns
    assert dst.isnan().all()  # what a reader that skipped wait() sees
    _ = torch.randn(256, 256) @ torch.randn(256, 256)  # the caller computes meanwhile
    t.wait()
    assert t.done() and torch.equal(dst, src)
    copier.close()


def test_a_copy_error_is_raised_by_every_wait():
    copier = Copier("cpu")
    t = copier.copy(torch.empty(3), torch.empty(4))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="size"):
            t.wait()
    assert t.done()
    copier.close()
    copier.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        copier.copy(torch.empty(1), torch.empty(1))


def test_the_pool_serves_urgent_jobs_first_and_each_kind_in_order():
    """A read (urgent) queued behind writes gets the next chunk; writes finish in the order they were queued,
    the first one before the second starts (the order training waits for them), not all near the end."""
    pool, order, started, gate = WorkerPool(1, "test"), [], threading.Event(), threading.Event()

    def run_a(i):
        if i == 0:
            started.set()
            gate.wait()  # hold the only thread until the other jobs are queued too
        order.append(f"a{i}")

    a = pool.submit(Job(4, run_a))
    assert started.wait(10)
    b = pool.submit(Job(2, lambda i: order.append(f"b{i}")))
    r = pool.submit(Job(2, lambda i: order.append(f"r{i}"), urgent=True))
    gate.set()
    for job in (a, b, r):
        Transfer(job).wait()
    pool.close()
    assert order == ["a0", "r0", "r1", "a1", "a2", "a3", "b0", "b1"]


def test_a_failed_chunk_skips_the_rest_and_wait_raises_it():
    pool, ran = WorkerPool(1, "test"), []

    def run(i):
        ran.append(i)
        if i == 1:
            raise OSError(5, "boom")

    t = Transfer(pool.submit(Job(5, run)))
    with pytest.raises(OSError, match="boom"):
        t.wait()
    assert t.done() and ran == [0, 1]
    pool.close()


def test_an_empty_job_is_done_at_once():
    assert Transfer(Job(0, lambda i: None)).done()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host<->device copies on a side stream need CUDA")
@pytest.mark.parametrize("poison", [None, Poison(50)])
def test_cuda_copies_follow_the_current_stream_and_their_events(poison):
    device = torch.device("cuda")
    copier = Copier(device, poison=poison)
    host = aligned_empty(4096 * 4, pin=True).view(torch.float32)
    host.copy_(torch.arange(4096.0))
    gpu = torch.empty(4096, device=device)
    copier.copy(gpu, host).wait()
    gpu.mul_(2)  # queued on the current stream: the copy below must see it (the side stream waits for it)
    back = aligned_empty(4096 * 4, pin=True).view(torch.float32)
    t = copier.copy(back, gpu)
    if poison is not None:
        assert not t.done() and back.isnan().all()
    t.wait()
    assert t.done() and torch.equal(back, host * 2)
    copier.close()
