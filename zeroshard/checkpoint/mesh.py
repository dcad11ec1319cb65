"""Checkpoints on a mesh: one data-parallel checkpoint per model part, and the mesh they were saved on.

Each (pp, tp) coordinate holds a different part of the model (its pipeline
stage's layers, its tp shard of each DTensor). Its data-parallel ranks
save that part as an ordinary zeroshard checkpoint in `save_dir/pp<p>-tp<t>/`,
so a load reshards it over another `dp` size as any checkpoint does.
`save_dir/mesh.json` records the mesh; a load on another `pp` or `tp` is an
error naming what differs (resharding across `tp` or `pp` is not built).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from zeroshard.checkpoint.files import CheckpointError
from zeroshard.parallel.mesh import Mesh

MESH_FILE = "mesh.json"


def part_dir(root: str | Path, mesh: Mesh) -> Path:
    """Where this rank's model part is saved under `root`."""
    return Path(root) / mesh.model_part


def write_mesh(root: str | Path, mesh: Mesh) -> None:
    """Record the mesh under `root` (one rank calls it; written whole or not at all)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{MESH_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps({"pp": mesh.pp, "dp": mesh.dp, "tp": mesh.tp}))
    os.replace(tmp, root / MESH_FILE)


def check_mesh(root: str | Path, mesh: Mesh) -> None:
    """Raise `CheckpointError` unless `root` is empty of checkpoints or was saved with this mesh's pp and tp."""
    root = Path(root)
    if mesh.model_part in (root.name, root.parent.name) or (root / "manifest.json").exists():
        raise CheckpointError(f"{root} is a model part's directory; on a mesh give load_checkpoint the directory "
                              "given to save_checkpoint (it holds mesh.json and one directory per part), and the "
                              "tag as tag=")
    file = root / MESH_FILE
    if not file.exists():
        if (root / "latest").exists() or any(root.glob("*/manifest.json")):
            raise CheckpointError(f"{root} holds a checkpoint saved without a mesh (data parallel only), but this "
                                  f"engine runs on the mesh {mesh.describe()}; a model split over pp or tp "
                                  "cannot load it: consolidate it (zeroshard consolidate) and load the weights "
                                  "into the model before parallelizing it")
        return
    saved = json.loads(file.read_text())
    differs = [f"{dim}={saved[dim]} when saved, {mesh.size(dim)} now" for dim in ("pp", "tp")
               if saved[dim] != mesh.size(dim)]
    if differs:
        raise CheckpointError(f"the checkpoint in {root} was saved on the mesh pp={saved['pp']} x dp={saved['dp']} x "
                              f"tp={saved['tp']}, this engine runs on {mesh.describe()}: {'; '.join(differs)}. "
                              "Only dp may change between save and load; resume with the same pp and tp")
