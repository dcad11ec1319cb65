"""One rank process of a pool (rank_pool.py): it runs test cases one after another, each in a process group of
its own.

For each case the parent sends (fn, args, store port, collective timeout,
cwd, its values of rank_pool.PER_CASE_ENV), then its stdout and stderr,
through the rank's pipe. The rank joins the case's TCPStore and forms the
process group on it, as a freshly spawned rank would, runs
`fn(rank, world_size, device, *args)`, and sends back ("result", bytes of
torch.save({"ok": ...} or {"error", "traceback"})). It then destroys the
group, puts its process back as it found it (rank_state.py) and sends
("ready", reasons), the reasons being what it could not undo (none: it can
take another case). A failure outside `fn` (joining the group, saving the
result, unpickling the case) ends the process with a traceback on stderr
and exit code 1, which is what it did to a rank spawned for one case.
"""

from __future__ import annotations

import atexit
import io
import os
import sys
import traceback
from datetime import timedelta
from multiprocessing import reduction

import torch
import torch.distributed as dist


def test_device(world_size: int) -> torch.device:
    """cuda:<rank> when every rank can have its own GPU, else cpu (set per rank by the worker)."""
    if os.environ.get("ZEROSHARD_TEST_DEVICE") != "cpu" and torch.cuda.device_count() >= world_size:
        return torch.device("cuda")
    return torch.device("cpu")


def serve(rank: int, world_size: int, conn) -> None:
    """The rank's life: cases until the parent sends None or goes away, then what the process registered to
    run at exit: a spawned process runs it as it ends, one forked from the fork server (rank_pool.py) ends in
    os._exit and would not."""
    try:
        _serve(rank, world_size, conn)
    finally:
        atexit._run_exitfuncs()


def _serve(rank: int, world_size: int, conn) -> None:
    from tests import distributed  # noqa: F401  (imported by the cases; kept, as the modules this rank runs on)
    from tests.rank_state import RankState

    torch.set_num_threads(1)  # ranks share the machine's cores
    device = test_device(world_size)
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    state = RankState()
    while True:
        try:
            case = conn.recv()  # unpickling imports the case's modules
        except EOFError:  # the parent is gone
            return
        if case is None:
            return
        fn, args, port, collective_timeout_s, cwd, per_case_env = case
        _attach_output(conn)
        os.chdir(cwd)
        _set_env(per_case_env)
        state.before_case()
        conn.send(("result", _run_case(rank, world_size, device, port, collective_timeout_s, fn, args)))
        conn.send(("ready", state.restore()))


def _attach_output(conn) -> None:
    """The parent's stdout and stderr at this case (pytest's capture of the test that runs it) become the rank's:
    what the case prints shows in that test's report, as a rank spawned for the case would have it."""
    sys.stdout.flush()
    sys.stderr.flush()
    for target in (1, 2):  # rank_pool.OUTPUT_FDS
        fd = reduction.recv_handle(conn)
        os.dup2(fd, target)
        os.close(fd)


def _set_env(values: dict) -> None:
    """The parent's values of rank_pool.PER_CASE_ENV (None: unset there)."""
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _run_case(rank, world_size, device, port, collective_timeout_s, fn, args) -> bytes:
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                          timeout=timedelta(seconds=collective_timeout_s))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=collective_timeout_s))
    try:
        result = {"ok": fn(rank, world_size, device, *args)}
    except BaseException as exc:  # sent to the parent, which raises it with the rank's traceback
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    out = io.BytesIO()
    torch.save(result, out)
    return out.getvalue()
