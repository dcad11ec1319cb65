"""What a pooled rank process puts back after each test case, so that the next case finds a fresh process.

A rank of the pool (rank_pool.py) runs one case after another. A rank
spawned for the case would start it with the parent's environment and
sys.path, torch's defaults, freshly seeded generators, no process group,
no logging or warning set-up, signal handler or resource limit of the
case's making, none of its threads, zeroshard's functions as imported (no
stand-in a case put in their place), and the test modules imported anew.
`RankState.before_case()` notes the state once the case's function and
arguments are unpickled (so what importing their modules did is part of
it, as in a fresh process); `restore()` puts it back after the case and
returns what it could not undo in place (a thread or child process
still running, a limit it cannot raise again, a DeviceMesh made): the
pool then ends its processes, and the next case gets new ones. A module
that a case imports inside its function stays imported: what importing it
did at that time (a warning filter, an environment variable) is undone
with the case, and a later case does not import it again.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import multiprocessing
import os
import random
import resource
import signal
import sys
import threading
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

THREAD_JOIN_S = 2.0  # how long a case's own threads get to end once the case is over

# zeroshard's module-level state, by module: the names that a case fills and the next must find empty.
# tests/test_distributed.py checks that every module-level container zeroshard mutates is here or in KEPT.
RESET = {"zeroshard.comm.collectives": ("_created",), "zeroshard.offload.memory": ("_warned",),
         "zeroshard.deepspeed.checkpointing": ("_configured", "_TRACKER")}
KEPT = {  # (module, name): why it may outlive a case
    ("zeroshard.comm.gloo_exit", "_gloo_exit_drain_registered"):
        "it pairs with the atexit registration it guards, which lasts as long as the process",
    ("zeroshard.comm.compress.quantize", "_compiled"):
        "a cache of torch.compile wrappers, each with whether compiling failed in this process (then the "
        "process runs that kernel eagerly); torch.compiler.reset() drops what they compiled",
    ("zeroshard.hf.adapter", "on_zeroshard"):
        "its cache maps a class to its zeroshard class, the same in every case (pickled arguments find it)",
}
LIMITS = [getattr(resource, name) for name in dir(resource) if name.startswith("RLIMIT_")]
CUDA_DEFAULT_SEED = 67280421310721  # c10's default_rng_seed_val: a fresh process's CUDA generators start there


def _meshes_made() -> list[int]:
    """A counter of the DeviceMeshes made in this process: DTensor's caches key on equal meshes, and a mesh of
    an earlier case names process groups (by their names, which restart with each world) that are gone."""
    from torch.distributed.device_mesh import DeviceMesh

    made = [0]
    init = DeviceMesh.__init__

    @functools.wraps(init)
    def counting_init(self, *args, **kwargs):
        made[0] += 1
        init(self, *args, **kwargs)

    DeviceMesh.__init__ = counting_init
    return made


@dataclass
class TorchDefaults:
    """torch's process-wide switches a case may flip and not put back."""

    dtype: torch.dtype
    device: torch.device
    threads: int
    matmul_precision: str
    deterministic: tuple[bool, bool]
    anomaly: tuple[bool, bool]

    @classmethod
    def capture(cls) -> "TorchDefaults":
        return cls(torch.get_default_dtype(), torch.get_default_device(), torch.get_num_threads(),
                   torch.get_float32_matmul_precision(),
                   (torch.are_deterministic_algorithms_enabled(),
                    torch.is_deterministic_algorithms_warn_only_enabled()),
                   (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()))

    def restore(self) -> None:
        """Each switch only where the case changed it (torch.use_deterministic_algorithms imports inductor)."""
        _reseed()
        torch.set_num_threads(self.threads)
        torch.set_grad_enabled(True)
        now = self.capture()
        if now.dtype != self.dtype:
            torch.set_default_dtype(self.dtype)
        if now.device != self.device:
            torch.set_default_device(self.device)
        if now.matmul_precision != self.matmul_precision:
            torch.set_float32_matmul_precision(self.matmul_precision)
        if now.deterministic != self.deterministic:
            torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        if now.anomaly != self.anomaly:
            torch.autograd.set_detect_anomaly(*self.anomaly)
        if "torch._dynamo" in sys.modules:  # compiled frames may hold guards on the case's process groups
            torch.compiler.reset()
            sys.modules["torch._dynamo"].utils.counters.clear()


def _reseed() -> None:
    """The generators as a fresh process has them: CPU, Python's and numpy's from OS entropy, CUDA's at c10's
    default seed."""
    torch.default_generator.seed()
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(CUDA_DEFAULT_SEED)  # also puts each generator's offset back to 0


@dataclass
class LoggingState:
    """Each logger's level, handlers, filters, propagation, and logging.disable's level.

    Loggers made during the case go back to a new logger's state: zeroshard and the tests set their loggers
    up in calls (config/logs.py's show_info at initialize), never at import.
    """

    loggers: dict[str, tuple] = field(default_factory=dict)
    disable: int = logging.NOTSET

    @staticmethod
    def _all() -> list[logging.Logger]:
        loggers = logging.root.manager.loggerDict.values()
        return [logging.root, *(lg for lg in loggers if isinstance(lg, logging.Logger))]

    @classmethod
    def capture(cls) -> "LoggingState":
        return cls({lg.name: (lg.level, list(lg.handlers), list(lg.filters), lg.propagate, lg.disabled)
                    for lg in cls._all()}, logging.root.manager.disable)

    def restore(self) -> None:
        for lg in self._all():
            lg.level, handlers, filters, lg.propagate, lg.disabled = self.loggers.get(
                lg.name, (logging.NOTSET, [], [], True, False))
            lg.handlers[:], lg.filters[:] = handlers, filters
        logging.disable(self.disable)
        logging.root.manager._clear_cache()  # effective levels were cached under the case's settings


@dataclass
class Bindings:
    """zeroshard's module-level names as a case found them: a case that puts a stand-in in place of a function
    (a fault injected in a rank) and does not put the function back would hand the stand-in to the next case.
    Names in KEPT may change; a module first imported during the case is not looked at."""

    names: dict[str, dict]

    @classmethod
    def capture(cls) -> "Bindings":
        return cls({name: dict(vars(module)) for name, module in list(sys.modules.items())
                    if (name == "zeroshard" or name.startswith("zeroshard.")) and module is not None})

    def restore(self) -> None:
        for module_name, names in self.names.items():
            now = vars(sys.modules[module_name])
            for name, value in names.items():
                if now.get(name) is not value and (module_name, name) not in KEPT and not name.startswith("__"):
                    now[name] = value


@dataclass
class CaseStart:
    """What a case starts with, taken once its function and arguments are unpickled: what importing their
    modules did stays, as in a fresh process, which imports them before its case."""

    env: dict[str, str]
    path: list[str]
    torch_defaults: TorchDefaults
    warning_filters: list
    showwarning: object
    hooks: tuple  # sys.excepthook, threading.excepthook
    signals: dict[int, object]
    limits: dict[int, tuple[int, int]]
    threads: set[threading.Thread]
    logging: LoggingState
    bindings: Bindings

    @classmethod
    def capture(cls) -> "CaseStart":
        return cls(dict(os.environ), list(sys.path), TorchDefaults.capture(), list(warnings.filters),
                   warnings.showwarning, (sys.excepthook, threading.excepthook),
                   {s: signal.getsignal(s) for s in signal.valid_signals() if signal.getsignal(s) is not None},
                   {lim: resource.getrlimit(lim) for lim in LIMITS}, set(threading.enumerate()), LoggingState.capture(),
                   Bindings.capture())

    def restore(self) -> list[str]:
        """Put back what the case changed; the reasons it could not (a resource limit it cannot raise)."""
        if dict(os.environ) != self.env:
            os.environ.clear()
            os.environ.update(self.env)
        sys.path[:] = self.path
        self.torch_defaults.restore()
        warnings.resetwarnings()  # also forgets which warnings were shown: a fresh process shows them again
        warnings.filters[:] = self.warning_filters
        warnings.onceregistry.clear()
        warnings.showwarning = self.showwarning
        self.logging.restore()
        self.bindings.restore()
        sys.excepthook, threading.excepthook = self.hooks
        for sig, handler in self.signals.items():
            if signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        reasons = []
        for lim, limits in self.limits.items():
            if resource.getrlimit(lim) != limits:
                try:
                    resource.setrlimit(lim, limits)
                except (ValueError, OSError) as exc:
                    reasons.append(f"resource limit {lim} stays {resource.getrlimit(lim)} ({exc})")
        return reasons

    def end_threads(self) -> list[str]:
        """Stop the offload worker pools a case left open (an unclosed Copier), wait for the case's threads."""
        gc.collect()  # engines and swap directories no longer referenced close their pools on collection
        from_case = [t for t in threading.enumerate() if t not in self.threads]
        for thread in from_case:
            owner = getattr(getattr(thread, "_target", None), "__self__", None)
            if type(owner).__module__ == "zeroshard.offload.pool" and type(owner).__name__ == "WorkerPool":
                owner.close()
        for thread in from_case:
            thread.join(THREAD_JOIN_S / len(from_case))
        if from_case:
            gc.collect()  # what the threads held
        gc.freeze()  # what survives is the process's own (modules): later collections need not walk it
        return [f"thread {t.name!r} still running" for t in from_case if t.is_alive()]


class RankState:
    """A pooled rank's process between cases: `before_case()` once a case is unpickled, `restore()` after it."""

    def __init__(self):
        self.cwd = os.getcwd()
        self.modules = {m for m in sys.modules if _is_tests(m)}  # the rank's own; a case's are imported anew
        self.meshes = _meshes_made()
        self.start: CaseStart | None = None
        gc.freeze()  # torch and the rest imported so far: collections after each case need not walk them

    def before_case(self) -> None:
        self.meshes[0] = 0
        self.start = CaseStart.capture()

    def restore(self) -> list[str]:
        """Undo what the case changed; the reasons this process cannot serve another case (empty: it can)."""
        reasons = _end_distributed()
        sys.stdout.flush()
        sys.stderr.flush()
        reasons += self.start.restore()
        os.chdir(self.cwd)
        for name in [m for m in sys.modules if _is_tests(m) and m not in self.modules]:
            del sys.modules[name]
        _reset_zeroshard()
        if self.meshes[0]:
            reasons.append(f"{self.meshes[0]} DeviceMesh(es) made: DTensor's caches may hand them to the next case")
        reasons += self.start.end_threads()
        reasons += [f"child process {p.name} still running" for p in multiprocessing.active_children()]
        _release_memory()
        return reasons


def _is_tests(module: str) -> bool:
    return module == "tests" or module.startswith("tests.")


def _end_distributed() -> list[str]:
    """Destroy every process group of the case (the next case gets a new store and groups)."""
    reasons = []
    try:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # the process may hold a broken communicator: end it
        reasons.append(f"ending the process group failed: {type(exc).__name__}: {exc}")
    if torch.cuda.is_initialized():
        torch.cuda.set_stream(torch.cuda.default_stream())
    return reasons


def _reset_zeroshard() -> None:
    for module, names in RESET.items():
        if module in sys.modules:
            for name in names:
                getattr(sys.modules[module], name).clear()


def _release_memory() -> None:
    """Give the case's freed memory back: an idle rank holds little, and peaks measured next start from 0."""
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        ctypes.CDLL(None).malloc_trim(0)  # glibc keeps freed heap pages otherwise
    except AttributeError:  # not glibc
        pass
