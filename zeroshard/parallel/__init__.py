"""3D parallelism: ZeRO over `dp` composed with DTensor tensor parallelism and torch pipelining."""

from zeroshard.parallel.cross import CrossParallel
from zeroshard.parallel.mesh import DIMS, Mesh, MeshError, build_mesh
from zeroshard.parallel.plans import gpt_tp_plan, parallelize_gpt
from zeroshard.parallel.stage import PipelineError, PipelineStage
from zeroshard.parallel.ties import TieError

__all__ = ["DIMS", "CrossParallel", "Mesh", "MeshError", "PipelineError", "PipelineStage", "TieError",
           "build_mesh", "gpt_tp_plan", "parallelize_gpt"]
