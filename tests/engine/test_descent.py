"""`zeroshard.initialize` descends: its steps run once each, in order, and every check comes before any tensor.

(a) What "calls no function of a module it has already left" means here: a
profile hook (`sys.setprofile`) records every Python call whose caller is
`initialize`'s own frame and whose function lives in a zeroshard module.
Their modules, in call order, with repeats in a row merged, are the steps of
the descent; no module may appear twice in that list, so once `initialize`
has called into a later step's module it never calls into an earlier one.
What a step calls below itself is the step's own business (a check may use
`core/local.py`, and so may the build), and is not constrained.

(b) A `TorchDispatchMode` sees every tensor operation; an output whose storage
is none of its inputs' (a fresh allocation, off the meta device), floating
point and of at least one parameter's elements counts as an allocation of
model states (the bytes of an object collective's pickles do not). Each
check's refusal must come with none counted, and a successful `initialize`
under the same meter counts some (the meter can fail).
"""

import importlib
import sys

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import zeroshard
from tests.distributed import run_ranks

WIDTH = 64  # every parameter holds WIDTH * WIDTH elements: the smallest model-state tensor
STEPS = ["zeroshard.engine.validate", "zeroshard.engine.load", "zeroshard.engine.join", "zeroshard.engine.checks",
         "zeroshard.engine.layout", "zeroshard.engine.agreement", "zeroshard.engine.build",
         "zeroshard.config.build", "zeroshard.engine.engine"]


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False, dtype=dtype) for _ in range(3)))


def _stays(modules: list[str]) -> list[str]:
    """Maximal runs of one module, one entry each."""
    return [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]


def _traced_initialize(*args, **kwargs):
    """initialize(*args, **kwargs) with its direct calls' modules, and every zeroshard call's module below it."""
    code = importlib.import_module("zeroshard.engine.initialize").initialize.__code__
    direct, every = [], []

    def profile(frame, event, _arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("zeroshard"):
            return
        every.append(module)
        if frame.f_back is not None and frame.f_back.f_code is code:
            direct.append(module)

    sys.setprofile(profile)
    try:
        engine = zeroshard.initialize(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return engine, direct, every


def _descent(rank, world, device, stage):
    model = _model().to(device)
    config = {"zero_optimization": {"stage": stage}}
    engine, direct, every = _traced_initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    loss = engine(torch.randn(2, WIDTH, device=device)).sum()
    engine.backward(loss)
    engine.step()
    return {"direct": direct, "modules": len(set(every[1:])), "stays": len(_stays(every[1:]))}


@pytest.mark.parametrize("world", [1, 2])
def test_initialize_never_calls_back_into_a_module_it_has_left(world):
    for stage in (0, 3):
        for out in run_ranks(_descent, world, stage):
            steps = _stays(out["direct"])
            assert len(steps) == len(set(steps)), f"stage {stage}: initialize re-enters a module: {steps}"
            in_order = [m for m in steps if m in STEPS]
            assert in_order == STEPS, (stage, steps)


class _Allocations(TorchDispatchMode):
    """Counts fresh floating-point tensors of at least `numel` elements off the meta device."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        held = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                and t.device.type != "meta"}
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.device.type != "meta" and t.is_floating_point()
                    and t.numel() >= self.numel and t.untyped_storage().data_ptr() not in held):
                self.count += 1
        return out


def _meta_model(dtype):
    with torch.device("meta"):
        return _model(dtype)


def _init(module):
    if isinstance(module, nn.Linear):
        module.reset_parameters()


def _cases():
    """name -> (a call of initialize that one check refuses, the error's class); models made at once."""
    def left_out(model, **kwargs):  # the model is made here, outside the meter
        return lambda: zeroshard.initialize(model, torch.optim.SGD(list(model.parameters())[1:], lr=0.1),
                                            {"zero_optimization": {"stage": 1}}, **kwargs)

    def plain(config, model=None, **kwargs):
        model = _model() if model is None else model
        return lambda: zeroshard.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config, **kwargs)

    return {
        "config": (plain({"zero_optimization": {"stage": 7}}), zeroshard.ConfigError),
        "wrap": (plain({"zero_optimization": {"stage": 3, "stage3_wrap_classes": ["Block"]}}, wrap=[nn.Linear]),
                 zeroshard.ConfigError),
        "dtype": (plain({}, _model(torch.bfloat16)), zeroshard.ModelError),
        "meta dtype": (plain({"zero_optimization": {"stage": 1}}, _meta_model(torch.bfloat16), init=_init),
                       zeroshard.ModelError),
        "optimizer": (left_out(_model()), zeroshard.OptimizerError),
        "meta optimizer": (left_out(_meta_model(torch.float32), init=_init), zeroshard.OptimizerError),
        "powersgd fp16": (plain({"fp16": {"enabled": True}, "zero_optimization": {"stage": 1},
                                 "communication_compression": {"gradients": {"codec": "powersgd"}}}),
                          zeroshard.ConfigError),
        "units": (plain({"zero_optimization": {"stage": 3, "stage3_wrap_classes": ["Block"]}}),
                  zeroshard.ModelError),
    }


def _refusals(rank, world, device):
    out = {}
    for name, (call, error) in _cases().items():
        meter = _Allocations(WIDTH * WIDTH)
        with meter:
            try:
                call()
                out[name] = "no error"
                continue
            except error:
                pass
        out[name] = meter.count
    model = _model()
    with _Allocations(WIDTH * WIDTH) as meter:  # the meter sees what a build allocates
        zeroshard.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_optimization": {"stage": 1}})
    out["built"] = meter.count
    return out


def test_every_check_refuses_before_a_model_state_is_allocated():
    out = run_ranks(_refusals, 1)[0]
    assert out.pop("built") > 0
    assert out == {name: 0 for name in _cases()}, out


def _mismatch(rank, world, device):
    model = _model()
    with _Allocations(WIDTH * WIDTH) as meter:
        try:
            zeroshard.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1)),
                                 {"zero_optimization": {"stage": 3}})
        except zeroshard.RankMismatchError as exc:
            return str(exc), meter.count
    return "no error", meter.count


def test_ranks_that_differ_are_refused_before_a_model_state_is_allocated():
    for message, count in run_ranks(_mismatch, 2):
        assert "rank 1 differs from rank 0: its optimizer param group 0 has other lr" in message
        assert count == 0
