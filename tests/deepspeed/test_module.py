"""`zeroshard.deepspeed`'s functions against DeepSpeed's documented rules: initialize's arguments and
4-tuple, the DataLoader over this rank's share, add_config_arguments, init_distributed, zero.Init,
zero.GatheredParameters, and the names it does not provide. One rank, in process (init_distributed's
own group: a subprocess)."""

import argparse
import importlib
import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import zeroshard
import zeroshard.deepspeed as deepspeed
from zeroshard.deepspeed import MissingAPIError, UnsupportedError

CONFIG = {"train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _args(path=None):
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    return parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)] if path else [])


def test_add_config_arguments_as_deepspeed():
    assert vars(_args()) == {"deepspeed": False, "deepspeed_config": None}
    assert vars(_args("ds.json")) == {"deepspeed": True, "deepspeed_config": "ds.json"}


def test_the_config_comes_from_exactly_one_place(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIG))
    for kwargs in ({"args": _args(path)}, {"config": CONFIG}, {"config_params": CONFIG}, {"config": str(path)}):
        engine, optimizer, loader, scheduler = deepspeed.initialize(model=_model(), **kwargs)
        assert (optimizer, loader, scheduler) == (engine.optimizer, None, None), kwargs
        assert isinstance(optimizer, torch.optim.SGD) and engine.train_micro_batch_size_per_gpu() == 3
    engine, *_ = deepspeed.initialize(model=_model(), config=CONFIG, dist_init_required=True, distributed_port=1)
    assert engine.world_size == 1  # the group exists: dist_init_required=True joins it, the port has no effect
    deepspeed.initialize(model=_model(), config=CONFIG, dist_init_required=False)
    refused = {
        "config and config_params": ({"config": CONFIG, "config_params": CONFIG}, "both config and config_params"),
        "config and args": ({"config": CONFIG, "args": _args(path)}, "a config and args.deepspeed_config"),
        "none": ({"args": _args()}, "initialize needs a config"),
    }
    for name, (kwargs, match) in refused.items():
        with pytest.raises(zeroshard.ConfigError, match=match):
            deepspeed.initialize(model=_model(), **kwargs)
    with pytest.raises(zeroshard.ModelError, match="needs a model"):
        deepspeed.initialize(config=CONFIG)
    for kwargs in ({"mpu": object()}, {"mesh_param": (2, 1)}):
        with pytest.raises(UnsupportedError, match=r"not read: .*mesh=\) \(docs/parallel.md\)"):
            deepspeed.initialize(model=_model(), config=CONFIG, **kwargs)


def test_optimizer_and_scheduler_as_callables():
    model = _model()
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config={"train_micro_batch_size_per_gpu": 1},
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5))
    assert isinstance(optimizer, torch.optim.SGD) and isinstance(scheduler, torch.optim.lr_scheduler.ExponentialLR)
    x = torch.randn(2, 4)
    engine.backward(engine(x).sum())
    engine.step()
    assert engine.get_lr() == [0.25]


def test_training_data_gives_this_ranks_share_in_micro_batches():
    data = TensorDataset(torch.arange(10.0).reshape(10, 1), torch.arange(10))
    collate_calls = []

    def collate(rows):
        collate_calls.append(len(rows))
        return torch.utils.data.default_collate(rows)

    _, _, loader, _ = deepspeed.initialize(model=_model(), config=CONFIG, training_data=data, collate_fn=collate)
    reference = DataLoader(data, batch_size=3, sampler=DistributedSampler(data, num_replicas=1, rank=0))
    got, expected = list(loader), list(reference)
    assert len(got) == len(expected) == 4 and collate_calls == [3, 3, 3, 1]
    assert all(torch.equal(a, b) for g, e in zip(got, expected) for a, b in zip(g, e))
    assert isinstance(loader.sampler, DistributedSampler) and not loader.drop_last
    # dataloader_drop_last: DeepSpeed's DataLoader drops the last incomplete micro-batch (10 rows, 3 a batch: 3)
    dropping = deepspeed.initialize(model=_model(), config={**CONFIG, "dataloader_drop_last": True},
                                    training_data=data)[2]
    assert [len(b[1]) for b in dropping] == [3, 3, 3] and len(dropping) == 3
    assert all(torch.equal(a, b) for g, e in zip(dropping, expected) for a, b in zip(g, e))
    with pytest.raises(zeroshard.ConfigError, match="needs the micro-batch size"):
        deepspeed.initialize(model=_model(), config={"optimizer": CONFIG["optimizer"]}, training_data=data)


def test_init_distributed_joins_a_one_rank_group_without_torchrun():
    script = ("import torch.distributed as dist, zeroshard.deepspeed as deepspeed\n"
              "deepspeed.init_distributed(dist_backend='gloo')\n"
              "deepspeed.init_distributed()  # again: nothing happens\n"
              "print(dist.get_backend(), dist.get_world_size(), dist.get_rank())\n")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                                         "MASTER_PORT", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["gloo", "1", "0"]
    with pytest.raises(UnsupportedError, match="launch with `torchrun"):
        deepspeed.init_distributed(rank=0, world_size=2)
    with pytest.raises(zeroshard.LaunchError, match="'mpi' is not supported"):
        deepspeed.init_distributed(dist_backend="mpi")


class _ToRecorder(nn.Linear):
    """A CPU model that records where initialize moves it, instead of moving (no GPU needed)."""

    def to(self, *args, **kwargs):
        self.moved_to = args[0]
        return self


class _Stop(Exception):
    """Raised in place of building the engine (which would need the GPU)."""


def test_each_rank_moves_the_model_to_its_own_gpu_before_the_group_exists(monkeypatch):
    """DeepSpeed's engine puts each rank's model on cuda:LOCAL_RANK, and its getting-started script makes
    no group before initialize: the current device then is cuda:0 on every rank, which must not be used."""
    seen = []

    def engine_stand_in(model, *args, **kwargs):
        seen.append(model.moved_to)
        raise _Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(importlib.import_module("zeroshard.deepspeed.initialize"), "zeroshard_initialize",
                        engine_stand_in)
    # LOCAL_RANK 5 of 4 GPUs: each rank sees only its own (CUDA_VISIBLE_DEVICES), the current device
    for local_rank in ("0", "1", "3", "5"):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        with pytest.raises(_Stop):
            deepspeed.initialize(model=_ToRecorder(2, 2), config=CONFIG)
    monkeypatch.delenv("LOCAL_RANK")  # no torchrun: the one process's current device
    with pytest.raises(_Stop):
        deepspeed.initialize(model=_ToRecorder(2, 2), config=CONFIG)
    assert seen == [torch.device("cuda", r) for r in (0, 1, 3, 0, 0)]


class _WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.arange(4.0))  # computed in __init__: must stay real


def test_zero_init_builds_parameters_on_meta_and_keeps_buffers():
    with deepspeed.zero.Init(enabled=False):
        eager = _WithBuffer()
    assert not eager.lin.weight.is_meta
    with deepspeed.zero.Init(mem_efficient_linear=True, pin_memory=True, config_dict_or_path=CONFIG):
        built = _WithBuffer()
    assert built.lin.weight.is_meta and built.lin.bias.is_meta
    assert not built.scale.is_meta and torch.equal(built.scale, torch.arange(4.0))
    assert not nn.Linear(2, 2).weight.is_meta  # outside the block: eager again
    # initialize materialises it with the model's own initialisation: Linear.reset_parameters, as eager
    torch.manual_seed(0)
    with deepspeed.zero.Init():
        built = _WithBuffer()
    engine, *_ = deepspeed.initialize(model=built, config={**CONFIG, "zero_optimization": {"stage": 3}})
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        bound = 1 / 2  # reset_parameters' bound for 4 inputs: U(-1/sqrt(4), 1/sqrt(4))
        assert all(p.shape == (4, 4) or p.shape == (4,) for p in engine.module.parameters())
        assert all(0 < p.abs().max() <= bound for p in engine.module.parameters())
    assert torch.equal(engine.module.scale, torch.arange(4.0))
    for kwargs, match in (({"remote_device": "cpu"}, "offload"), ({"dtype": torch.float64}, "torch.bfloat16 or torch.float16"),
                          ({"module": eager}, "build the model inside the block"),
                          ({"zero_quantized_weights": True}, "zero_optimization.zero_quantized_weights")):
        with pytest.raises(UnsupportedError, match=match):
            deepspeed.zero.Init(**kwargs)


def test_gathered_parameters_at_stage_3():
    model = _model()
    expected = model[0].weight.detach().clone()
    engine, *_ = deepspeed.initialize(model=model, config={**CONFIG, "zero_optimization": {"stage": 3}})
    with deepspeed.zero.GatheredParameters(engine.module[0].weight, enabled=False):
        pass
    with deepspeed.zero.GatheredParameters(list(engine.module[0].parameters()), fwd_module=engine.module):
        assert torch.equal(engine.module[0].weight, expected)
    with torch.no_grad(), deepspeed.zero.GatheredParameters(engine.module[0].weight, modifier_rank=0):
        engine.module[0].weight.fill_(0.5)
    with deepspeed.zero.GatheredParameters(engine.module[0].weight):
        assert torch.equal(engine.module[0].weight, torch.full_like(expected, 0.5))


def test_names_not_provided_say_what_to_do():
    for name in ("pipe", "ops", "init_inference", "no_such_name"):
        assert not hasattr(deepspeed, name)
        with pytest.raises(MissingAPIError, match=rf"zeroshard.deepspeed.{name} is not available: .* See "
                                                  r"docs/migrate-from-deepspeed.md"):
            getattr(deepspeed, name)
    with pytest.raises(MissingAPIError, match="torch.optim.AdamW"):
        deepspeed.ops.adam  # noqa: B018
    with pytest.raises(MissingAPIError, match="zeroshard.deepspeed.zero.TiledLinear is not available"):
        deepspeed.zero.TiledLinear  # noqa: B018
    with pytest.raises(AttributeError) as info:
        deepspeed.__wrapped__  # noqa: B018  Python's own probing gets a plain AttributeError
    assert type(info.value) is AttributeError
    assert issubclass(MissingAPIError, zeroshard.ZeroshardError)
