"""How much more memory this process can take before the kernel refuses or kills it: the host's headroom.

Three limits can bind, and the smallest wins:

- the memory cgroup the process runs in (v1: `hierarchical_memory_limit`, the
  smallest limit on the path to the root; v2: `memory.max` of the group and
  each parent), less the group's working set: its usage without the inactive
  page cache, which the kernel reclaims before it kills anything;
- the address-space and data rlimits (RLIMIT_AS, RLIMIT_DATA), less what the
  process maps now (VmSize, VmData);
- the kernel's MemAvailable (with SwapFree where there is swap).

A cgroup's limit is shared by every process in it: callers that run several
ranks in one group compare the ranks' sum with it (`Headroom.where` names the
group, so ranks can tell they share one).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

_UNLIMITED = 1 << 60  # a cgroup's "no limit" is PAGE_COUNTER_MAX pages: anything this large is none


@dataclass(frozen=True)
class Headroom:
    """`nbytes` more bytes fit before `where` (a cgroup's path, an rlimit, MemAvailable) is reached."""

    nbytes: int
    where: str
    limit: int  # the limit's own size, bytes (for messages)
    shared: bool = True  # by every process under it (a cgroup, the host); an rlimit is this process's alone


def host_limits(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> list[Headroom]:
    """Every limit on this process's memory with its headroom: MemAvailable, the rlimits, the cgroups."""
    status = _fields(proc / "self/status")
    return [_meminfo(proc / "meminfo"), *_rlimits(status), *_cgroup(proc / "self/cgroup", cgroup_root)]


def host_headroom() -> Headroom:
    """The smallest headroom of `host_limits`: what this process can still allocate."""
    return min(host_limits(), key=lambda h: h.nbytes)


def _fields(path: Path) -> dict[str, int]:
    """`Key: value kB` lines as bytes."""
    out = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _meminfo(path: Path) -> Headroom:
    info = _fields(path)
    free = info.get("MemAvailable", info.get("MemFree", 0)) + info.get("SwapFree", 0)
    return Headroom(free, "the host's available memory (MemAvailable in /proc/meminfo)", info.get("MemTotal", 0))


def _rlimits(status: dict[str, int]) -> list[Headroom]:
    out = []
    for name, used in (("RLIMIT_AS", "VmSize"), ("RLIMIT_DATA", "VmData")):
        soft, _ = resource.getrlimit(getattr(resource, name))
        if soft != resource.RLIM_INFINITY:
            out.append(Headroom(max(0, soft - status.get(used, 0)), f"the {name} limit (ulimit)", soft, shared=False))
    return out


def _cgroup(self_cgroup: Path, root: Path) -> list[Headroom]:
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return _cgroup_v1(root / "memory" / path.lstrip("/"))
    for line in lines:
        if line.startswith("0::"):
            return _cgroup_v2(root, line[3:].lstrip("/"))
    return []


def _cgroup_v1(group: Path) -> list[Headroom]:
    try:
        stat = _stat(group / "memory.stat")
        usage = int((group / "memory.usage_in_bytes").read_text())
    except OSError:  # the group's files are not mounted here (a container without its cgroup view)
        return []
    limit = stat.get("hierarchical_memory_limit", _UNLIMITED)
    if limit >= _UNLIMITED:
        return []
    working = usage - stat.get("total_inactive_file", 0)
    return [Headroom(max(0, limit - working), f"the memory cgroup {group}", limit)]


def _cgroup_v2(root: Path, path: str) -> list[Headroom]:
    out = []
    group = root / path
    while True:  # every group up the path limits this one
        try:
            raw = (group / "memory.max").read_text().strip()
            if raw != "max":
                used = int((group / "memory.current").read_text()) - _stat(group / "memory.stat").get(
                    "inactive_file", 0)
                out.append(Headroom(max(0, int(raw) - used), f"the memory cgroup {group}", int(raw)))
        except OSError:
            pass
        if group == root or root not in group.parents:
            return out
        group = group.parent


def _stat(path: Path) -> dict[str, int]:
    out = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out
