"""measure_bandwidth: it runs the swap path itself and reports plausible figures (no timing is asserted)."""

from __future__ import annotations

from zeroshard.offload import measure_bandwidth

KEYS = {"path", "direct", "block_size", "nbytes", "threads", "rounds", "write_bytes_per_s", "read_bytes_per_s",
        "write_s", "read_s"}


def test_on_a_disk_with_o_direct(disk):
    result = measure_bandwidth(disk, block_size=1 << 16, nbytes=(4 << 20) + 5, rounds=2)
    assert set(result) == KEYS
    assert result["direct"] and result["nbytes"] == (4 << 20) + 5 and result["block_size"] == 1 << 16
    assert result["write_bytes_per_s"] > 0 and result["read_bytes_per_s"] > 0
    assert len(result["write_s"]) == len(result["read_s"]) == 2
    assert not (disk / "zeroshard-swap").exists()


def test_buffered_where_o_direct_is_refused(ramfs):
    result = measure_bandwidth(ramfs, nbytes=1 << 20, rounds=1)  # drops the pages it may: the data stays exact
    assert not result["direct"] and result["read_bytes_per_s"] > 0
