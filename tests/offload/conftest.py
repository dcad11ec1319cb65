"""Filesystems for the offload tests: a real disk (pytest's tmp_path) and small mounts of tmpfs and ramfs.

Mounting needs root (CAP_SYS_ADMIN); a test that needs a mount is skipped
only when the mount itself fails, with mount's own message as the reason.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

# Filesystems on a block device that support O_DIRECT (pytest's tmp_path is on one of these on most machines).
DISK_FILESYSTEMS = {"ext4", "ext3", "xfs", "btrfs", "f2fs"}


def filesystem_of(path: Path) -> str:
    """The type of the filesystem `path` is on, from /proc/mounts (the longest mount point above it)."""
    path = path.resolve()
    best, kind = "", "unknown"
    with open("/proc/mounts", encoding="utf-8") as mounts:
        for line in mounts:
            _, point, fstype, *_ = line.split()
            point = point.replace("\\040", " ")
            if (path == Path(point) or Path(point) in path.parents) and len(point) > len(best):
                best, kind = point, fstype
    return kind


def mount(where: Path, fstype: str, options: str):
    """Mount a `fstype` at `where` for the life of a fixture (yield from it); skip the test if mounting fails."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", fstype, "-o", options, fstype, str(where)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a {fstype} at {where} ({done.stderr.strip() or done.returncode}): "
                    "mounting needs root (CAP_SYS_ADMIN)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture
def tmpfs(tmp_path):
    """An 8 MiB tmpfs (O_DIRECT: refused before Linux 6.6, accepted as memory copies since)."""
    yield from mount(tmp_path / "tmpfs", "tmpfs", "size=8m")


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs: a full disk for any swap file larger than that."""
    yield from mount(tmp_path / "tiny", "tmpfs", "size=1m")


@pytest.fixture
def ramfs(tmp_path):
    """A ramfs: it refuses O_DIRECT on every kernel, so swap files there fall back to buffered I/O."""
    yield from mount(tmp_path / "ramfs", "ramfs", "mode=0755")


@pytest.fixture
def readonly_fs(tmp_path):
    """A read-only tmpfs: writing there fails even for root (EROFS), unlike permission bits."""
    yield from mount(tmp_path / "readonly", "tmpfs", "ro,size=1m")


@pytest.fixture
def disk(tmp_path):
    """pytest's tmp_path when it is on a disk filesystem (where O_DIRECT must be in use)."""
    kind = filesystem_of(tmp_path)
    if kind not in DISK_FILESYSTEMS:
        pytest.skip(f"{tmp_path} is on {kind}, not a disk filesystem ({', '.join(sorted(DISK_FILESYSTEMS))})")
    return tmp_path


def not_root() -> bool:
    return os.geteuid() != 0
