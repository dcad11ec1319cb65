"""The in-process tests here run on one CPU rank: a gloo group made before any test, so that on a machine
with a GPU `deepspeed.initialize` does not start an NCCL group (and move the models to the GPU) for the
in-process tests of other files that run after these."""

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True, scope="session")
def one_rank_gloo_group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
