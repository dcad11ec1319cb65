"""Mesh: the device mesh of 3D parallelism, with named dimensions `pp`, `dp` and `tp`.

The world is laid out pipeline-major and tensor-minor: consecutive ranks
share a `tp` group (the busiest traffic, so it stays inside a node), then
`dp`, then `pp`. ZeRO shards over `dp` only; `tp` is PyTorch's DTensor,
`pp` is `torch.distributed.pipelining`. Any dimension may be 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from zeroshard.comm import ensure_process_group
from zeroshard.comm.group import this_rank_gpu
from zeroshard.errors import ZeroshardError

DIMS = ("pp", "dp", "tp")


class MeshError(ZeroshardError, ValueError):
    """A mesh that cannot be laid over the world (sizes that do not multiply to the world size)."""


@dataclass(frozen=True)
class Mesh:
    """The `pp` x `dp` x `tp` device mesh and this rank's place in it."""

    device_mesh: DeviceMesh

    def size(self, dim: str) -> int:
        return self.device_mesh.size(DIMS.index(dim))

    def rank(self, dim: str) -> int:
        """This rank's coordinate along `dim`."""
        return self.device_mesh.get_local_rank(dim)

    def group(self, dim: str) -> dist.ProcessGroup:
        """The process group of the ranks that differ from this one only along `dim`."""
        return self.device_mesh.get_group(dim)

    @property
    def pp(self) -> int:
        return self.size("pp")

    @property
    def dp(self) -> int:
        return self.size("dp")

    @property
    def tp(self) -> int:
        return self.size("tp")

    @property
    def coordinate(self) -> dict[str, int]:
        return {dim: self.rank(dim) for dim in DIMS}

    @property
    def model_part(self) -> str:
        """The name of the model part this rank holds: its `pp` and `tp` coordinates, e.g. "pp1-tp0"."""
        return f"pp{self.rank('pp')}-tp{self.rank('tp')}"

    def describe(self) -> str:
        return f"pp={self.pp} x dp={self.dp} x tp={self.tp}"


def build_mesh(pp: int = 1, tp: int = 1, dp: int | None = None, device: torch.device | None = None,
               timeout: timedelta | None = None) -> Mesh:
    """The mesh over the world (joined from torchrun's environment if needed); `dp` defaults to what is left.

    `device`: where the ranks compute; default this rank's GPU when CUDA is there, else the CPU.
    """
    device = device or (this_rank_gpu() if torch.cuda.is_available() else torch.device("cpu"))
    ensure_process_group(device, timeout)
    world = dist.get_world_size()
    for name, size in (("pp", pp), ("tp", tp), ("dp", dp)):
        if size is not None and (not isinstance(size, int) or size < 1):
            raise MeshError(f"{name}={size!r}: each mesh dimension is a positive integer")
    if world % (pp * tp):
        raise MeshError(f"the world has {world} ranks, which pp={pp} x tp={tp} = {pp * tp} does not divide; "
                        f"launch a multiple of {pp * tp} ranks (torchrun --nproc-per-node), or change pp or tp")
    dp = world // (pp * tp) if dp is None else dp
    if pp * dp * tp != world:
        raise MeshError(f"pp={pp} x dp={dp} x tp={tp} = {pp * dp * tp} ranks, but the world has {world}; "
                        "leave dp out to use the ranks that are left")
    return Mesh(init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=DIMS))
