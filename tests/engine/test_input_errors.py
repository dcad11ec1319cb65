"""Documented inputs of the wrong kind end in a zeroshard error that names the argument, never in a raw
AttributeError or TypeError from deep inside (one rank; the messages are the reference)."""

import re
import tempfile

import pytest
import torch
import torch.nn as nn

import zeroshard
from tests.distributed import run_ranks


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


STAGE3 = {"zero_optimization": {"stage": 3}}
INITIALIZE = {
    "model_not_a_module": (lambda: zeroshard.initialize("model"), zeroshard.ModelError,
                           "model must be a torch.nn.Module; got str"),
    "optimizer_not_an_optimizer": (lambda: zeroshard.initialize(_model(), "adam"), zeroshard.OptimizerError,
                                   "optimizer must be a torch.optim.Optimizer"),
    "group_not_a_group": (lambda: zeroshard.initialize(_model(), None, {}, group="world"), zeroshard.LaunchError,
                          "group must be a torch.distributed.ProcessGroup"),
    "wrap_names_not_classes": (lambda: zeroshard.initialize(_model(), None, STAGE3, wrap=["Linear"]),
                               zeroshard.ConfigError, "wrap takes module classes, such as wrap=[Block]; got 'Linear'"),
    "init_not_callable": (lambda: zeroshard.initialize(_model(), None, STAGE3, init="reset"), zeroshard.ModelError,
                          "init must be a function of one module"),
}


def _engine_misuse(rank, world, device):
    model = _model()
    engine = zeroshard.initialize(model, _sgd(model), {"zero_optimization": {"stage": 2}})
    calls = {
        "save_dir_not_a_path": lambda: engine.save_checkpoint(123),
        "tag_not_a_string": lambda: engine.save_checkpoint("unused", tag=[5]),
        "load_tag_not_a_string": lambda: engine.load_checkpoint(tempfile.mkdtemp(), tag=[5]),
        "loss_not_a_scalar": lambda: engine.backward(engine(torch.randn(2, 4))),
        "loss_without_grad": lambda: engine.backward(torch.tensor(1.0)),
        "gathered_not_parameters": lambda: zeroshard.gathered_parameters("weight").__enter__(),
        "modifier_rank_not_a_rank": lambda: zeroshard.gathered_parameters(model[0].weight, modifier_rank="0")
        .__enter__(),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except Exception as exc:  # the kind is what the test checks
            out[name] = (type(exc).__name__, isinstance(exc, zeroshard.ZeroshardError), str(exc))
    # The bad loss was refused before backward: the engine still trains.
    loss = engine(torch.randn(2, 4)).mean()
    engine.backward(loss)
    engine.step()
    out["trains_after"] = engine.global_steps
    return out


ENGINE = {
    "save_dir_not_a_path": ("CheckpointError", "save_dir must be a path (str or pathlib.Path); got int"),
    "tag_not_a_string": ("CheckpointError", "checkpoint tag must be a string or a number (a directory name); got list [5]"),
    "load_tag_not_a_string": ("CheckpointError",
                              "checkpoint tag must be a string or a number (a directory name); got list [5]"),
    "loss_not_a_scalar": ("GradientError", "needs a scalar loss tensor that requires grad; got a tensor of shape (2, 1)"),
    "loss_without_grad": ("GradientError", "requires_grad=False"),
    "gathered_not_parameters": ("ModelError", "gathered_parameters takes parameters"),
    "modifier_rank_not_a_rank": ("ModelError", "modifier_rank must be None or a rank number (0, 1, ...); got '0'"),
}


@pytest.mark.parametrize("name", INITIALIZE)
def test_initialize_names_the_argument_of_the_wrong_kind(name):
    call, error, message = INITIALIZE[name]
    with pytest.raises(error, match=re.escape(message)):
        call()


def test_engine_calls_name_the_argument_of_the_wrong_kind():
    out = run_ranks(_engine_misuse, 1)[0]
    for name, (kind, message) in ENGINE.items():
        assert out[name] is not None, f"{name}: no error"
        got_kind, is_ours, got = out[name]
        assert (got_kind, is_ours) == (kind, True), (name, got_kind, got)
        assert message in got, (name, got)
    assert out["trains_after"] == 1
