"""The in-process tests here run on one CPU rank: a gloo group made before this package's tests, so that on a
machine with a GPU `deepspeed.initialize` does not start an NCCL group (and move the models to the GPU).
Package-scoped and destroyed after them, so that the test files after these start with no group, as they
would alone; a group that existed before is left as it was."""

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True, scope="package")
def one_rank_gloo_group():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created and dist.is_initialized():
        dist.destroy_process_group()
