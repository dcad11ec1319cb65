"""aligned_empty: size rounded to ALIGN, address aligned, pinning's fallback logged once."""

from __future__ import annotations

import logging

import pytest
import torch

from zeroshard.offload import ALIGN, aligned_empty, round_up
from zeroshard.offload import memory


@pytest.mark.parametrize("nbytes", [0, 1, 7, ALIGN - 1, ALIGN, ALIGN + 1, 3 * ALIGN + 5, 1 << 20])
def test_size_and_alignment(nbytes):
    buf = aligned_empty(nbytes)
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.device.type == "cpu"
    assert buf.numel() == round_up(nbytes) and buf.numel() % ALIGN == 0 and buf.numel() >= nbytes
    assert buf.data_ptr() % ALIGN == 0
    assert buf.is_contiguous()


def test_round_up():
    assert [round_up(n) for n in (0, 1, ALIGN, ALIGN + 1)] == [0, ALIGN, ALIGN, 2 * ALIGN]
    assert round_up(10, 8) == 16


def test_negative_size_is_refused():
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        aligned_empty(-1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for machines without CUDA")
def test_pin_without_cuda_falls_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(memory, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="zeroshard.offload.memory"):
        first = aligned_empty(100, pin=True)
        second = aligned_empty(100, pin=True)
    assert not first.is_pinned() and not second.is_pinned()
    assert first.data_ptr() % ALIGN == 0
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "torch.cuda.is_available() is False" in warnings[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pin_with_cuda_pins():
    buf = aligned_empty(5000, pin=True)
    assert buf.is_pinned() and buf.data_ptr() % ALIGN == 0 and buf.numel() == 2 * ALIGN
