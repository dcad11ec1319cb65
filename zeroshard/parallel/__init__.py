"""3D parallelism: ZeRO over `dp` composed with DTensor tensor parallelism and torch pipelining.

Each name is imported from its module on first use: `torch.distributed.tensor` and
`torch.distributed.pipelining` (which brings in torch's compiler) cost about 1.4 s at every process start
together, and a run without tensor or pipeline parallelism needs neither.
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
