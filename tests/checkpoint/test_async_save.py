"""Asynchronous saves: a snapshot of the save's step, published only when complete, failures on every rank.

References: a synchronous save of the same step (the rank files' tensors
must be equal, element for element), the previous tag (still 'latest',
whole, while the new one is written or after it failed), and `verify`.
The background write is held by a gate so that the test, not the timing,
decides what happens before it ends.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import zeroshard
from tests.distributed import run_ranks
from tests.recipes import Case, make_engine_with_schedule, train_steps
from zeroshard.checkpoint import async_save
from zeroshard.checkpoint.files import LATEST
from zeroshard.checkpoint.verify import verify

CASES = [Case(stage=2, clip=0.5), Case(stage=3, dtype="bf16"), Case(stage=1, offload="cpu")]


def _gated_writer(gate: threading.Event, fail: bool):
    """`write_tensors` that waits for `gate`, then writes, or (`fail`) writes a little and meets a full disk."""
    real = async_save.write_tensors

    def write(path: Path, tensors, metadata):
        gate.wait()
        if fail:
            path.write_bytes(b"\0" * 64)
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, tensors, metadata)

    return write


def _change_everything(engine) -> None:
    """Every parameter, master and optimizer state tensor of this rank, changed in place."""
    with torch.no_grad():
        for p in engine.module.parameters():
            p.add_(1)
        for bucket in engine.buckets:
            bucket.master.add_(1)
            for value in engine.optimizer.state.get(bucket.master, {}).values():
                if torch.is_tensor(value) and value.dim() > 0:
                    value.add_(1)


def _snapshot(rank, world, device, root, monkeypatch_fail_rank):
    out = []
    for i, case in enumerate(CASES):
        engine, schedule = make_engine_with_schedule(case, device=device)
        save_dir = Path(root) / str(i)
        train_steps(engine, schedule, case, world, rank, device, range(2))
        engine.save_checkpoint(save_dir, tag="first")
        train_steps(engine, schedule, case, world, rank, device, range(2, 3))
        engine.save_checkpoint(Path(root) / f"sync{i}", tag="step3")  # the reference: the same step, synchronously
        gate = threading.Event()
        async_save.write_tensors, real = _gated_writer(gate, fail=False), async_save.write_tensors
        try:
            path = engine.save_checkpoint(save_dir, tag="step3", asynchronous=True)
            _change_everything(engine)  # after the save returned, before its write ends
            train_steps(engine, schedule, case, world, rank, device, range(3, 4))  # a boundary: not yet published
            latest_while_writing = (save_dir / LATEST).read_text().strip()
            gate.set()
            assert engine.wait_for_checkpoint() == path
        finally:
            async_save.write_tensors = real
        out.append((latest_while_writing, (save_dir / LATEST).read_text().strip()))
    out.append(_full_disk(rank, world, device, Path(root) / "full", monkeypatch_fail_rank))
    out.append(_refused_with_a_disk_tier(device, Path(root)))
    return out


def _refused_with_a_disk_tier(device, root: Path) -> str:
    """Offload to nvme: an asynchronous save would stage the whole disk tier in host memory, so it is refused."""
    (root / "swap").mkdir(exist_ok=True)
    engine = make_engine_with_schedule(Case(stage=1, offload="nvme", nvme_path=str(root / "swap")), device=device)[0]
    try:
        with pytest.raises(zeroshard.CheckpointError) as refused:
            engine.save_checkpoint(root / "nvme", asynchronous=True)
    finally:
        engine.offload.close()
    return str(refused.value)


def _full_disk(rank, world, device, save_dir: Path, fail_rank: int):
    """Rank `fail_rank`'s write meets a full disk: every rank raises at the next boundary; then it goes on."""
    case = CASES[0]
    engine, schedule = make_engine_with_schedule(case, device=device)
    train_steps(engine, schedule, case, world, rank, device, range(1))
    engine.save_checkpoint(save_dir, tag="good")
    gate = threading.Event()
    async_save.write_tensors, real = _gated_writer(gate, fail=rank == fail_rank), async_save.write_tensors
    try:
        engine.save_checkpoint(save_dir, tag="doomed", asynchronous=True)
        gate.set()
        while not engine._checkpoints.in_flight.written():  # this rank's write has ended, so the next boundary knows
            threading.Event().wait(0.01)
        with pytest.raises(zeroshard.CheckpointError) as raised:
            train_steps(engine, schedule, case, world, rank, device, range(1, 2))
    finally:
        async_save.write_tensors = real
    leftovers = sorted(p.name for p in save_dir.iterdir())
    train_steps(engine, schedule, case, world, rank, device, range(2, 3))  # the engine goes on
    engine.save_checkpoint(save_dir, tag="after", asynchronous=True)
    engine.wait_for_checkpoint()
    return str(raised.value), engine.global_steps, leftovers


def test_async_save_is_a_snapshot_published_when_complete_and_a_full_disk_fails_every_rank(tmp_path):
    results = run_ranks(_snapshot, 2, str(tmp_path), 1)
    for rank in range(2):
        *snapshots, (error, steps, leftovers), refused = results[rank]
        assert "offload device \"nvme\"" in refused and "nothing was written" in refused, refused
        for i, (while_writing, after) in enumerate(snapshots):
            assert (while_writing, after) == ("first", "step3"), (CASES[i], rank)
        assert "rank 1 cannot write its shard" in error and "No space left on device" in error, error
        assert "previous checkpoint is still 'latest'" in error, error
        assert leftovers == ["good", "latest"], leftovers  # the partial directory removed
        assert steps == 3
    for i, case in enumerate(CASES):
        tag, problems = verify(tmp_path / str(i))
        assert problems == [], problems
        for rank in range(2):
            name = f"rank_{rank:05d}.safetensors"
            written, reference = load_file(tmp_path / str(i) / "step3" / name), load_file(
                tmp_path / f"sync{i}" / "step3" / name)
            assert written.keys() == reference.keys() and written, case
            for key in reference:
                assert torch.equal(written[key], reference[key]), (case, rank, key)
    assert (tmp_path / "full" / LATEST).read_text().strip() == "after"
    assert verify(tmp_path / "full", "good")[1] == []
    assert not (tmp_path / "nvme").exists()


def test_the_writer_and_the_threads_it_starts_yield_the_cpu_to_training_and_training_keeps_its_priority():
    """Reference: the kernel's own per-thread nice values (getpriority on each thread's id)."""
    main_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: dict[str, int] = {}

    def checksum_thread() -> None:
        seen["started by the writer"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def writer() -> None:
        async_save._yield_to_training()
        seen["writer"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        child = threading.Thread(target=checksum_thread)
        child.start()
        child.join()

    thread = threading.Thread(target=writer)
    thread.start()
    thread.join()
    assert seen == {"writer": 19, "started by the writer": 19}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_nice
