"""The documented public names: errors and their bases, imports, the version, and the engine's state machine."""

import re
from pathlib import Path

import pytest
import torch

import zeroshard
from tests.distributed import run_ranks

ERRORS = {  # documented error -> the builtin it has always derived from
    "CheckpointError": RuntimeError,
    "CollectiveError": RuntimeError,
    "ConfigError": ValueError,
    "LossScaleError": RuntimeError,
    "OptimizerError": TypeError,
    "RankMismatchError": RuntimeError,
    "EngineStateError": RuntimeError,
    "GradientError": RuntimeError,
    "LaunchError": RuntimeError,
    "ModelError": ValueError,
    "NonFiniteError": FloatingPointError,
    "GenerationError": ValueError,
}


@pytest.mark.parametrize("name, builtin", ERRORS.items())
def test_each_documented_error_is_public_and_a_zeroshard_error(name, builtin):
    error = getattr(zeroshard, name)
    assert name in zeroshard.__all__
    assert issubclass(error, zeroshard.ZeroshardError)
    assert issubclass(error, builtin), f"{name} no longer derives from {builtin.__name__}"
    with pytest.raises(zeroshard.ZeroshardError):  # one except clause catches each
        raise error("x")


def test_zeroshard_error_is_the_root():
    assert zeroshard.ZeroshardError.__module__ == "zeroshard.errors"
    assert issubclass(zeroshard.ZeroshardError, Exception)
    assert not issubclass(zeroshard.ZeroshardError, (RuntimeError, ValueError, TypeError))


def test_documented_imports():
    from zeroshard.consolidate import consolidate, full_tensors
    from zeroshard.estimate import summarize

    assert callable(zeroshard.initialize)
    assert callable(zeroshard.gathered_parameters)
    assert callable(consolidate) and callable(full_tensors)
    assert zeroshard.estimate.summarize is summarize
    assert zeroshard.consolidate.consolidate is consolidate
    from zeroshard.engine import TrainingState

    assert {s.name for s in TrainingState} >= {"IDLE", "FORWARD", "BACKWARD", "STEP_DUE", "STEP", "FAILED"}


def test_version_is_pyproject_version():
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text(encoding="utf-8")
    try:
        import tomllib

        version = tomllib.loads(text)["project"]["version"]
    except ModuleNotFoundError:  # Python 3.10
        version = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M).group(1)
    assert zeroshard.__version__ == version


# -- engine misuse, one rank, every stage -------------------------------------


def _engine(stage: int):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return zeroshard.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                {"zero_optimization": {"stage": stage}})


def _loss(engine):
    torch.manual_seed(1)
    return engine(torch.randn(5, 4)).pow(2).mean()


def _misuse_and_states(rank, world, device, stages):
    from zeroshard.engine import TrainingState

    def attempt(fn):
        try:
            fn()
        except Exception as exc:  # the type and the message are what the test checks
            return type(exc), str(exc)
        return None

    def step_twice(stage):
        e = _engine(stage)
        _loss(e).backward()
        e.step()
        e.step()

    def step_first(stage):
        _engine(stage).step()

    def hold_inside_hold(stage):
        e = _engine(stage)
        with e.coalesce_grad_reduction(), e.no_sync():
            pass

    out = {}
    for stage in stages:
        e = _engine(stage)
        states = [e.state]
        e.backward(_loss(e))
        states.append(e.state)
        e.step()
        states.append(e.state)
        states = [s is TrainingState[n] for s, n in zip(states, ("IDLE", "STEP_DUE", "IDLE"))]
        out[stage] = {"states": states, **{fn.__name__: attempt(lambda fn=fn: fn(stage))
                                           for fn in (step_twice, step_first, hold_inside_hold)}}
    return out


MISUSE = {
    "step_twice": "engine.step() was called without a backward (loss.backward() or engine.backward(loss))",
    "step_first": "engine.step() was called without a backward (loss.backward() or engine.backward(loss))",
    "hold_inside_hold": "no_sync() entered inside coalesce_grad_reduction(); re-entry is not supported",
}


def test_engine_misuse_raises_engine_state_error():
    stages = (0, 1, 2, 3)
    (results,) = run_ranks(_misuse_and_states, 1, stages)
    for stage in stages:
        assert results[stage]["states"] == [True, True, True], f"stage {stage}: not IDLE -> STEP_DUE -> IDLE"
        for misuse, fragment in MISUSE.items():
            raised = results[stage][misuse]
            assert raised is not None, f"stage {stage}: {misuse} raised nothing"
            kind, message = raised
            assert issubclass(kind, zeroshard.EngineStateError), (stage, misuse, kind, message)
            assert fragment in message, (stage, misuse, message)
