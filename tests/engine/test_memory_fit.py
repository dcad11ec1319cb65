"""Model states that cannot fit end in OutOfMemoryError on every rank before any is made, not a kernel kill.

Real limits, no mocks: two ranks run inside a cgroup v1 memory group
(`memory_fit_rank.py`, started here with their pids written into the group)
whose cap is far below a 101M-parameter GPT's model states (16 bytes per
element in fp32 with AdamW, the ZeRO formula), and every rank must raise
naming the group and each rank's need; a tiny GPT under the same cap trains
as plain PyTorch does. An RLIMIT_AS cap on one process is read as such.
"""

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from zeroshard.estimate.formulas import model_state_bytes
from zeroshard.offload.headroom import Headroom, host_headroom

REPO = Path(__file__).resolve().parents[2]
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
CAP = 900 * 2**20  # both ranks together: torch and zeroshard imported take about 250 MB each
BIG = {"vocab_size": 256, "block_size": 64, "n_layer": 8, "n_head": 8, "n_embd": 1024}  # 101M parameters
TINY = {"vocab_size": 65, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32}


def _cgroup(tmp_path: Path) -> Path:
    if not os.access(CGROUP_V1, os.W_OK):
        pytest.skip("needs root and a cgroup v1 memory hierarchy at /sys/fs/cgroup/memory")
    group = CGROUP_V1 / f"zeroshard-test-{os.getpid()}-{tmp_path.name}"
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(CAP))
    return group


def _run_in(group: Path, model: dict, config: dict, out: Path, world: int = 2) -> list[dict]:
    def join():  # in the child, before it execs: its memory is charged to the group from the start
        (group / "cgroup.procs").write_text(str(os.getpid()))

    port = 20000 + os.getpid() % 20000
    procs = [subprocess.Popen(
        [sys.executable, "-m", "tests.engine.memory_fit_rank", json.dumps(model), json.dumps(config),
         str(out / f"rank{r}.json")],
        cwd=REPO, preexec_fn=join,
        env=os.environ | {"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                          "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        for r in range(world)]
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0] * world, f"exit codes {codes} (a kernel kill is -9)"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_states_over_a_cgroup_cap_raise_on_every_rank(tmp_path):
    group = _cgroup(tmp_path)
    try:
        too_big = _run_in(group, BIG, {"meta": True, "zero_optimization": {"stage": 3}}, tmp_path)
        fits = _run_in(group, TINY, {"zero_optimization": {"stage": 3}}, tmp_path)
    finally:
        group.rmdir()
    numel = 101_099_520
    need = sum(model_state_bytes(numel, 2, 3).values())  # fp32 AdamW: 4 + 4 + 8 bytes per element of the shard
    for rank, result in enumerate(too_big):
        assert result["error"] == "OutOfMemoryError" and result["is_memory_error"], result
        message = result["message"]
        assert f"the memory cgroup {group}" in message and f"limit {CAP / 2**30:.2f} GiB" in message, message
        for r in range(2):
            assert f"rank {r} {need / 2**30:.2f} GiB" in message, (rank, message)
        assert "offload_optimizer" in message and "offload_param" in message, message
    for result in fits:
        assert result["loss"] == pytest.approx(result["reference"], rel=1e-6), result


def test_an_address_space_rlimit_is_the_headroom():
    cap = 8 * 2**30
    probe = ("import resource, json; from zeroshard.offload.headroom import host_headroom; h = host_headroom(); "
             "v = int(next(l for l in open('/proc/self/status') if l.startswith('VmSize')).split()[1]) * 1024; "
             "print(json.dumps([h.where, h.limit, h.nbytes, v]))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, check=True, capture_output=True, text=True,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap))).stdout
    where, limit, nbytes, vm_size = json.loads(out)
    assert where == "the RLIMIT_AS limit (ulimit)" and limit == cap
    assert 0 <= cap - vm_size - nbytes < 64 * 2**20, (cap, vm_size, nbytes)  # VmSize read a moment apart
    assert host_headroom().nbytes < 2**60  # this process: at least MemAvailable bounds it


def test_a_disk_tier_hands_freed_blocks_back_only_where_host_memory_is_short():
    """Short: some limit's free bytes are under HEAP_SLACK (2) times what its ranks would hold in memory
    with no disk tier (their host need plus what went to disk); then freed blocks go back at once."""
    from zeroshard.engine.memory_fit import HEAP_SLACK, _host_short, _Row
    gib = 2**30
    assert HEAP_SLACK == 2

    def rows(free: int, needs: list[tuple[int, int]], shared: bool = True) -> list[_Row]:
        limit = Headroom(free, "the memory cgroup /x", 64 * gib, shared)
        return [_Row(("vm", "the memory cgroup /x" if shared else f"the limit of rank {r}"), r, need, limit, spill)
                for r, (need, spill) in enumerate(needs)]

    two_ranks = [(1 * gib, 2 * gib), (1 * gib, 2 * gib)]  # 3 GiB each without a disk tier: 6 GiB together
    assert not _host_short(rows(12 * gib, two_ranks))  # exactly twice
    assert _host_short(rows(12 * gib - 1, two_ranks))
    assert not _host_short(rows(7 * gib, two_ranks, shared=False))  # each rank's own limit: 3 GiB of 7
    assert _host_short(rows(5 * gib, two_ranks, shared=False))
