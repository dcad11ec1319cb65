"""run_ranks' pool (tests/rank_pool.py): a case on pooled ranks finds and ends as a case on ranks spawned for it.

The reference is the same case on fresh ranks (`fresh=True`; forked from
the fork server, and spawned without it): a probe of the process state
after a case that changed all it could, and the RankFailure of a case that
raises, exits or is killed, must be equal. The ranks' process ids tell a
pool kept from one ended.
"""

from __future__ import annotations

import ast
import logging
import multiprocessing
import os
import resource
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests import rank_pool
from tests.distributed import RankFailure, run_ranks
from tests.rank_state import KEPT, RESET
from zeroshard.comm import collectives
from zeroshard.comm.recorder import CommRecorder
from zeroshard.offload import memory
from zeroshard.offload.pool import WorkerPool

MARK: list[int] = []  # a test module's own state: a case appends, the next finds it empty (modules imported anew)
MUTATORS = {"add", "append", "clear", "discard", "extend", "insert", "pop", "popitem", "remove", "setdefault",
            "update"}


def _pid(rank, world, device):
    return os.getpid()


def _dirty(rank, world, device):
    """Change every piece of process state the pool puts back (the modules are imported at the top: what
    importing a module does is not the case's doing)."""
    os.environ["ZEROSHARD_POOL_DIRT"] = "1"
    os.environ.pop("ONEDNN_MAX_CPU_ISA", None)
    os.chdir("/")
    sys.path.append("/nonexistent")
    MARK.append(rank)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    torch.manual_seed(5)
    if device.type == "cuda":
        torch.rand(4, device=device)  # moves the CUDA generator's offset
    torch.set_grad_enabled(False)
    torch.set_float32_matmul_precision("medium")
    logging.getLogger("zeroshard").setLevel(logging.DEBUG)
    logging.getLogger("zeroshard").addHandler(logging.NullHandler())
    logging.getLogger().addHandler(logging.NullHandler())
    warnings.simplefilter("error")
    signal.signal(signal.SIGUSR1, lambda *_: None)
    sys.excepthook = lambda *_: None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft // 2, hard))
    dist.new_group(list(range(world)))
    collectives.Comm.create(dist.group.WORLD, CommRecorder())
    memory._warned.add("probe")
    WorkerPool(1, "left-open")  # as a Copier never closed leaves it
    collectives.all_gather_object = None  # a fault injected in a rank, not put back
    dist.distributed_c10d._get_default_store().set("left-by-an-earlier-case", "1")
    return os.getpid()


def _probe(rank, world, device):
    """The process state a case starts with."""
    def logger(name):
        lg = logging.getLogger(name)
        return lg.level, [type(h).__name__ for h in lg.handlers], lg.propagate

    return os.getpid(), {
        "env": dict(os.environ), "cwd": os.getcwd(), "path": list(sys.path), "mark": list(MARK),
        "torch": (torch.get_default_dtype(), torch.get_num_threads(), torch.is_grad_enabled(),
                  torch.get_float32_matmul_precision()),
        "rng": (torch.initial_seed() != 5, torch.rand(4, device=device).tolist() if device.type == "cuda" else None),
        "logging": (logger(""), logger("zeroshard"), logging.root.manager.disable),
        "warnings": repr(warnings.filters), "hooks": sys.excepthook is sys.__excepthook__,
        "signal": signal.getsignal(signal.SIGUSR1), "limit": resource.getrlimit(resource.RLIMIT_NOFILE),
        "zeroshard": (dict(collectives._created), set(memory._warned), collectives.all_gather_object.__name__),
        "threads": sorted(t.name for t in threading.enumerate()),
        "dist": (dist.get_world_size(), dist.distributed_c10d._world.group_count,
                 dist.distributed_c10d._get_default_store().check(["left-by-an-earlier-case"])),
    }


@pytest.mark.parametrize("world", [1, 2])
def test_a_pooled_rank_finds_what_a_fresh_one_finds(world, monkeypatch):
    # As an in-process torch.compile leaves it, after the fork server started (PER_CASE_ENV): spawned ranks inherit it.
    run_ranks(_pid, world)
    monkeypatch.setenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "1")
    dirtied = run_ranks(_dirty, world)
    pooled = run_ranks(_probe, world)
    forked = run_ranks(_probe, world, fresh=True)
    with monkeypatch.context() as spawning:  # the reference: ranks spawned for the case, no fork server
        spawning.setattr(rank_pool, "_context", lambda: torch.multiprocessing.get_context("spawn"))
        spawned = run_ranks(_probe, world, fresh=True)
    assert [pid for pid, _ in pooled] == dirtied, "the pool was not kept after a case that ended well"
    assert not {pid for pid, _ in forked + spawned} & set(dirtied)
    assert run_ranks(_pid, world) == dirtied, "a case on fresh ranks ended the pool"
    for (_, got), (_, fresh), (_, want) in zip(pooled, forked, spawned):
        assert got == fresh == want


def _fail(rank, world, device, how):
    if rank == world - 1:
        if how == "raise":
            raise ValueError(f"rank {rank} fails on purpose")
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


@pytest.mark.parametrize("how,world", [("raise", 2), ("exit", 1), ("kill", 1)])
def test_a_failing_case_ends_as_on_fresh_ranks_and_the_next_gets_new_ranks(how, world):
    before = run_ranks(_pid, world)
    failures = []
    for fresh in (False, True):
        with pytest.raises(RankFailure) as failure:
            run_ranks(_fail, world, how, fresh=fresh)
        failures.append(failure.value)
    pooled, fresh = failures
    assert str(pooled) == str(fresh) and pooled.hung == fresh.hung == [] and pooled.errors == fresh.errors
    assert list(pooled.errors) == [world - 1]
    assert not set(run_ranks(_pid, world)) & set(before)


def _sleep_on_rank1(rank, world, device):
    if rank == 1:
        threading.Event().wait(60)
    return rank


def test_a_rank_past_the_timeout_is_killed_named_hung_and_the_next_case_gets_new_ranks():
    before = run_ranks(_pid, 2)
    with pytest.raises(RankFailure) as failure:
        run_ranks(_sleep_on_rank1, 2, timeout_s=3)
    assert failure.value.hung == [1]
    assert list(failure.value.errors) == [1] and "exitcode" in failure.value.errors[1]
    assert not set(run_ranks(_pid, 2)) & set(before)


def _leave(rank, world, device, what):
    if what == "thread":
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    elif what == "child":
        multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,), daemon=True).start()
    else:
        from torch.distributed.device_mesh import init_device_mesh

        init_device_mesh("cpu", (world,))
    return os.getpid()


@pytest.mark.parametrize("what", ["thread", "child", "mesh"])
def test_a_case_that_leaves_what_cannot_be_undone_is_followed_by_new_ranks(what):
    left = run_ranks(_leave, 1, what)
    assert not set(run_ranks(_pid, 1)) & set(left)


def _pid_and_test(rank, world, device):
    return os.getpid(), os.environ.get("PYTEST_CURRENT_TEST")


def _inductor_address(rank, world, device):
    return os.environ.get("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")


def test_a_pool_serves_the_next_test_with_that_tests_name(monkeypatch):
    # pytest rewrites PYTEST_CURRENT_TEST at every test: the ranks are kept, and see the new value
    first = run_ranks(_pid_and_test, 2)
    assert [name for _, name in first] == [os.environ["PYTEST_CURRENT_TEST"]] * 2
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_next.py::test_next (call)")
    assert run_ranks(_pid_and_test, 2) == [(pid, "tests/test_next.py::test_next (call)") for pid, _ in first]
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    assert run_ranks(_pid_and_test, 2) == [(pid, None) for pid, _ in first]
    monkeypatch.setenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "1")  # as an in-process torch.compile sets it
    assert [pid for pid, _ in run_ranks(_pid_and_test, 2)] == [pid for pid, _ in first]
    assert run_ranks(_inductor_address, 2) == ["1", "1"]


def _env(rank, world, device):
    return os.environ.get("ZEROSHARD_POOL_PROBE")


def test_the_parents_environment_at_each_case_reaches_the_ranks(monkeypatch):
    assert run_ranks(_env, 1) == [None]
    monkeypatch.setenv("ZEROSHARD_POOL_PROBE", "set")
    assert run_ranks(_env, 1) == ["set"]
    monkeypatch.delenv("ZEROSHARD_POOL_PROBE")
    assert run_ranks(_env, 1) == [None]


def _mutated_module_state(path: Path) -> set[str]:
    """Names bound at module level that the module's functions mutate (a method that changes them in place, an
    item assignment, `global`), and functions that cache their calls: state a case could leave to the next."""
    tree = ast.parse(path.read_text())
    bound = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
             for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    cached = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)
              and any("cache" in ast.unparse(d) for d in node.decorator_list)}
    mutated = set()
    functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in (inner for function in functions for inner in ast.walk(function)):
        if isinstance(node, ast.Global):
            mutated.update(node.names)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            if isinstance(node.func.value, ast.Name):
                mutated.add(node.func.value.id)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            if isinstance(node.value, ast.Name):
                mutated.add(node.value.id)
    return (bound & mutated) | cached


def test_zeroshards_module_state_is_reset_between_cases_or_kept_with_a_reason():
    root = Path(__file__).resolve().parents[1]
    found = {(".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"), name)
             for p in (root / "zeroshard").rglob("*.py") for name in _mutated_module_state(p)}
    listed = {(module, name) for module, names in RESET.items() for name in names} | set(KEPT)
    assert found == listed, ("module-level state of zeroshard outlives a test case in a pooled rank: clear it in "
                             "tests/rank_state.py's RESET, or say in KEPT why the next case may see it",
                             found ^ listed)
