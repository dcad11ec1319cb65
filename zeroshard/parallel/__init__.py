"""3D parallelism: ZeRO over `dp` composed with DTensor tensor parallelism and torch pipelining.

Each name is imported from its module on first use: `torch.distributed.tensor` and
`torch.distributed.pipelining` (which brings in torch's compiler) cost about 1.4 s of a process's start
together, which a process that builds no optimizer and no mesh (the CLI's launcher, `zeroshard estimate`)
need not pay. (Building a torch optimizer imports torch's compiler, and with it DTensor, anyway.)
"""

import importlib

_HOMES = {"CrossParallel": "cross", "DIMS": "mesh", "Mesh": "mesh", "MeshError": "mesh", "build_mesh": "mesh",
          "gpt_tp_plan": "plans", "parallelize_gpt": "plans", "PipelineError": "stage", "PipelineStage": "stage",
          "TieError": "ties"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"zeroshard.parallel.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'zeroshard.parallel' has no attribute '{name}'")
