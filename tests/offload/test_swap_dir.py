"""SwapDir: its lock, a crashed run's leftovers, cleanup at close and at exit, unusable roots, a full disk."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from zeroshard.offload import ALIGN, OffloadError, SwapDir
from tests.offload.conftest import not_root

REPO = Path(__file__).resolve().parents[2]


# offload imports nothing of zeroshard but the leaves (test_imports.py), so a child process can skip the
# facade's __init__ (the engine, the checkpoint package: seconds of imports) with an empty parent package.
_BARE_PACKAGE = f"""
import sys, types
sys.modules["zeroshard"] = types.ModuleType("zeroshard")
sys.modules["zeroshard"].__path__ = [{str(REPO / "zeroshard")!r}]
"""


def _python(code: str, *args: str | Path) -> subprocess.Popen:
    """`python -c code args...` importing this checkout's zeroshard.offload; pipes for stdin, stdout, stderr."""
    return subprocess.Popen([sys.executable, "-c", _BARE_PACKAGE + textwrap.dedent(code), *map(str, args)],
                            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


_WRITER = """
    import os, sys, torch
    from zeroshard.offload import SwapDir
    swap = SwapDir(sys.argv[1], 3)
    f = swap.file("bucket0.master", 10_000)
    f.write(torch.ones(2_500)).wait()
    print(f.path, flush=True)
    # exits without close()
"""


def test_files_and_directory_layout(tmp_path):
    with SwapDir(tmp_path, 5) as swap:
        a = swap.file("bucket0.master", 10)
        b = swap.file("bucket0.exp_avg", ALIGN + 1)
        assert swap.path == tmp_path / "zeroshard-swap" / "rank5"
        assert a.path == swap.path / "bucket0.master" and a.path.stat().st_size == ALIGN
        assert b.path.stat().st_size == 2 * ALIGN  # pre-allocated, rounded up to ALIGN
        assert swap.nbytes() == 3 * ALIGN
        assert sorted(p.name for p in swap.path.iterdir()) == [".lock", "bucket0.exp_avg", "bucket0.master"]
        assert (swap.path / ".lock").read_text().strip() == str(os.getpid())
    assert not (tmp_path / "zeroshard-swap").exists()  # the rank directory and its parent are gone
    swap.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        swap.file("late", 1)


def test_a_swap_dir_nobody_holds_is_collected_and_its_files_deleted(tmp_path):
    swap = SwapDir(tmp_path, 0)
    kept = swap.file("kept", 4)
    kept.write(torch.ones(1)).wait()
    del swap
    gc.collect()
    assert not (tmp_path / "zeroshard-swap").exists()
    with pytest.raises(RuntimeError, match="closed"):
        kept.read(torch.empty(1))


def test_other_ranks_directories_stay(tmp_path):
    with SwapDir(tmp_path, 0), SwapDir(tmp_path, 1) as one:
        one.file("x", 1)
    swap = SwapDir(tmp_path, 0)
    other = SwapDir(tmp_path, 1)
    swap.close()
    assert other.path.is_dir() and not swap.path.exists()
    other.close()


@pytest.mark.parametrize("name", ["", ".lock", ".hidden", "a/b", "../x", "-x", 3])
def test_a_bad_name_is_refused(tmp_path, name):
    with SwapDir(tmp_path, 0) as swap, pytest.raises(ValueError, match="swap file name"):
        swap.file(name, 1)


def test_a_name_twice_is_refused(tmp_path):
    with SwapDir(tmp_path, 0) as swap:
        swap.file("bucket1.master", 8)
        with pytest.raises(ValueError, match="already taken"):
            swap.file("bucket1.master", 8)


def test_block_size_must_be_a_multiple_of_align(tmp_path):
    with pytest.raises(ValueError, match="multiple of 4096"):
        SwapDir(tmp_path, 0, block_size=1000)


def test_a_second_swap_dir_on_the_same_root_and_rank_is_refused(tmp_path):
    with SwapDir(tmp_path, 0):
        with pytest.raises(OffloadError, match=rf"in use by another run \(pid {os.getpid()} \(this process"):
            SwapDir(tmp_path, 0)
    SwapDir(tmp_path, 0).close()  # free again once closed


def test_another_process_holding_the_lock_is_named(tmp_path):
    holder = _python("""
        import sys
        from zeroshard.offload import SwapDir
        swap = SwapDir(sys.argv[1], 0)
        print("ready", flush=True)
        sys.stdin.read()
        swap.close()
    """, tmp_path)
    try:
        assert holder.stdout.readline().strip() == "ready", holder.stderr.read()
        with pytest.raises(OffloadError, match=rf"in use by another run \(pid {holder.pid}\).*point nvme_path"):
            SwapDir(tmp_path, 0)
    finally:
        holder.communicate("", timeout=60)
    SwapDir(tmp_path, 0).close()


def test_files_are_removed_at_interpreter_exit(tmp_path):
    run = _python(_WRITER, tmp_path)
    out, err = run.communicate(timeout=60)
    assert run.returncode == 0, err
    assert Path(out.strip()).name == "bucket0.master"
    assert not (tmp_path / "zeroshard-swap").exists()


def test_a_crashed_runs_leftovers_are_removed_at_start(tmp_path, caplog):
    crashed = SwapDir(tmp_path, 3)
    left = crashed.file("bucket0.master", 10_000)
    left.write(torch.ones(2_500)).wait()
    crashed._finalizer.detach()  # a crash: no cleanup runs ...
    os.close(crashed._shared.lock_fd)  # ... and the kernel drops the dead process's lock
    assert left.path.exists()
    with caplog.at_level(logging.INFO, logger="zeroshard.offload"), SwapDir(tmp_path, 3) as swap:
        assert not left.path.exists()
        assert [p.name for p in swap.path.iterdir()] == [".lock"]
    crashed._shared.pool.close()
    left.close_fd()
    assert any(f"pid {os.getpid()}" in r.getMessage() and "1 leftover swap files (12288 bytes)" in r.getMessage()
               for r in caplog.records)


def test_a_missing_root_is_refused(tmp_path):
    with pytest.raises(OffloadError, match=r"nvme_path .*missing does not exist \(ENOENT\)"):
        SwapDir(tmp_path / "missing", 0)


def test_a_file_in_place_of_the_root_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(OffloadError, match=r"is not a directory \(ENOTDIR\)"):
        SwapDir(tmp_path / "file", 0)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "zeroshard-swap").write_text("")  # a file where the swap tree goes
    with pytest.raises(OffloadError, match=r"creating the swap directory .* failed"):
        SwapDir(tmp_path / "dir", 0)


def test_a_read_only_root_is_refused_even_as_root(readonly_fs):
    with pytest.raises(OffloadError, match=r"failed: EROFS.*read-only") as info:
        SwapDir(readonly_fs, 0)
    assert info.value.errno == 30


@pytest.mark.skipif(not not_root(), reason="permission bits do not stop root (the read-only mount test covers it)")
def test_an_unwritable_root_is_refused(tmp_path):
    (tmp_path / "ro").mkdir(mode=0o500)
    with pytest.raises(OffloadError, match=r"EACCES.*permission"):
        SwapDir(tmp_path / "ro", 0)


def test_a_full_disk_fails_at_file_not_at_write(tiny_tmpfs):
    with SwapDir(tiny_tmpfs, 0) as swap:
        small = swap.file("small", 100_000)
        with pytest.raises(OffloadError, match=r"no room on nvme_path .* for rank 0's swap file .*big: it needs "
                                               r"2097152 bytes, besides the 102400 bytes.*ENOSPC.*free space on that "
                                               r"disk, point nvme_path at a larger one.*device \"cpu\""):
            swap.file("big", 2 << 20)
        assert not (swap.path / "big").exists() and swap.nbytes() == 102_400
        small.write(torch.zeros(25_000)).wait()  # what was allocated still works
