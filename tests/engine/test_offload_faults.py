"""Offload's disk faults at the engine, on 2 ranks: a full disk, an unwritable nvme_path, a swap file damaged in
training.

Real conditions, no mocks: small tmpfs mounts (a full disk), read-only mounts (unwritable even for root, who
ignores permission bits) at nvme_path or at one rank's swap directory only, and a byte of one rank's swap file
changed on disk between its write and its read. Each fault must end in one `OffloadError` on every rank that
names the failed rank, the file or path, the errno name (or the damage) and the fix, with no rank left waiting
in a collective for the failed one (a hang fails run_ranks at its timeout) and no rank going on to the
post-step all-gather. The checkpoint saved before the fault then loads into a fresh engine on a good
nvme_path, and training goes on bit for bit as the uninterrupted run of the same configuration on a good disk
(which tests/engine/test_offload_parity.py holds bitwise equal to the run without offload).

Optimizer state in small sub-groups (`sub_group_size`): a damaged file of the last bucket is found after the
rank has stepped and written back the others, the partial update the agreement must keep from going further.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.offload.conftest import mount
from tests.recipes import Case, loss_of, make_engine_with_schedule, micro_batch, relative_error, train_steps

WORLD = 2
STEPS = 4  # the uninterrupted run
SAVED_AT = 2  # the checkpoint: after this many steps
SUB_GROUP = 2000  # elements: about one bucket's shard per sub-group
# The optimizer's state on disk at each stage; at stage 3 the parameter shards on disk.
CASES = [Case(stage=s, offload="nvme") for s in (1, 2, 3)] + [Case(stage=3, offload="cpu", offload_params="nvme")]
FILLED = [CASES[1], CASES[3]]  # also trained on a disk filled after construction: optimizer state, then shards


# -- what each rank runs ---------------------------------------------------------------------------------------

def _engine(case: Case, path, device):
    config = dataclasses.replace(case, nvme_path=str(path)).config()
    config["zero_optimization"]["sub_group_size"] = SUB_GROUP
    return make_engine_with_schedule(case, config=config, device=device)[0]


def _train(engine, case: Case, rank: int, device, steps) -> list[float]:
    return train_steps(engine, None, case, WORLD, rank, device, steps)


def _weights(engine) -> torch.Tensor:
    full = engine.full_state_dict()
    return torch.cat([full[name].reshape(-1).cpu() for name, _ in engine.module.named_parameters()])


def _error(call) -> dict:
    """What `call()` raised: its type's name, message, path and errno (type None if it returned)."""
    try:
        call()
    except Exception as exc:  # every rank reports its own, the parent compares them
        return {"type": type(exc).__name__, "text": str(exc), "path": getattr(exc, "path", None),
                "errno": getattr(exc, "errno", None)}
    return {"type": None}


def _reference(case: Case, good: Path, rank: int, device) -> dict:
    """The uninterrupted run on a good disk: losses, weights, and the fault checks of its steps (calls, bytes)."""
    engine = _engine(case, good, device)
    checks = engine.comm_stats()["fault_check"]
    losses = _train(engine, case, rank, device, range(STEPS))
    after = engine.comm_stats()["fault_check"]
    out = {"losses": losses, "weights": _weights(engine), "units": len(engine.units),
           "disk_units": sum(any(f.shard_swap is not None for f in u.gathered_flats) for u in engine.units),
           "grads_on_disk": bool(engine.offload.tiers.grad_swaps),
           "checks": (after.calls - checks.calls, after.bytes - checks.bytes)}
    engine.offload.close()
    return out


def _resume(case: Case, good: Path, ckpt: str, rank: int, device) -> dict:
    """A fresh engine on a good disk, from the checkpoint, trained to the end."""
    engine = _engine(case, good, device)
    engine.load_checkpoint(ckpt)
    out = {"losses": _train(engine, case, rank, device, range(SAVED_AT, STEPS)), "weights": _weights(engine)}
    engine.offload.close()
    return out


def _ranks(rank, world, device, good, ckpts, bad, later):
    """Per case: the uninterrupted run; a run that saves a checkpoint and fails on a damaged swap file; a restart
    on each bad nvme_path; a run on a disk filled after construction; a resume from that checkpoint."""
    out = []
    for c, case in enumerate(CASES):
        ckpt = f"{ckpts}/{c}"
        run = {"reference": _reference(case, good, rank, device),
               "fault": _fault_in_training(case, good, ckpt, rank, device),
               "construction": {kind: _error(lambda: _engine(case, path, device)) for kind, path in bad.items()},
               # this rank's swap files still there after a failed construction (another rank's may be closing)
               "left": [str(p) for path in bad.values() for p in (path / "zeroshard-swap").glob(f"rank{rank}/*")]}
        if case in FILLED:
            run["later"] = _fills_later(case, later, rank, device)
        if case.offload_params == "nvme":
            run["backward"] = _fault_in_backward(case, good, rank, device)
        if case.stage == 2:
            run["gradient"] = _gradient_fault(good, rank, device)
        run["resumed"] = _resume(case, good, ckpt, rank, device)
        out.append(run)
    return out


def _fills_later(case: Case, later: Path, rank: int, device) -> dict:
    """Every swap file is allocated at construction: a disk filled after it changes nothing of the training."""
    import torch.distributed as dist

    engine = _engine(case, later, device)
    dist.barrier()
    if rank == 0:
        _fill(later / "filler")
    dist.barrier()
    free = os.statvfs(later).f_bavail
    losses = _train(engine, case, rank, device, range(STEPS))
    run = {"free": (free, os.statvfs(later).f_bavail), "losses": losses, "weights": _weights(engine)}
    dist.barrier()  # every rank has measured before any deletes its files
    engine.offload.close()
    dist.barrier()
    if rank == 0:
        (later / "filler").unlink()
    return run


def _fill(path: Path) -> None:
    """Write zeros to `path` until its filesystem is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        while True:
            os.write(fd, bytes(4096))
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)


def _fault_in_training(case: Case, good: Path, ckpt: str, rank: int, device) -> dict:
    engine = _engine(case, good, device)
    _train(engine, case, rank, device, range(SAVED_AT))
    engine.save_checkpoint(ckpt)
    _train(engine, case, rank, device, [SAVED_AT])  # every swap file is written again after the save
    victim = _damage(engine, case) if rank == 1 else None
    gathers = engine.comm_stats()["all_gather"].calls
    fault = _error(lambda: _train(engine, case, rank, device, [SAVED_AT + 1]))
    x, y = micro_batch(0, case, WORLD, rank, 0)
    out = {"fault": fault, "victim": victim, "all_gathers": engine.comm_stats()["all_gather"].calls - gathers,
           "then": _error(lambda: loss_of(engine, x, y)),
           "save": _error(lambda: engine.save_checkpoint(ckpt, tag="after_the_fault"))}
    engine.offload.close()
    out["latest"] = (Path(ckpt) / "latest").read_text().strip()
    return out


def _fault_in_backward(case: Case, good: Path, rank: int, device) -> dict:
    """A parameter shard damaged between a step's forward and its backward, which reads it again."""
    engine = _engine(case, good, device)
    _train(engine, case, rank, device, range(SAVED_AT))
    x, y = micro_batch(SAVED_AT, case, WORLD, rank, 0)
    loss = loss_of(engine, x, y)
    victim = _damage(engine, case) if rank == 1 else None
    out = {"fault": _error(lambda: engine.backward(loss)), "victim": victim,
           "then": _error(lambda: engine.step())}
    engine.offload.close()
    return out


def _gradient_fault(good: Path, rank: int, device) -> dict:
    """Stage 2, two micro-steps: a gradient shard's file damaged after the first micro-step wrote it; the
    second reads it back inside a reduction, where raising would leave the other rank in its next one."""
    case = Case(stage=2, accumulation=2, offload="nvme")
    engine = _engine(case, good, device)
    _train(engine, case, rank, device, [0])
    x, y = micro_batch(1, case, WORLD, rank, 0)
    engine.backward(loss_of(engine, x, y))
    engine.step()  # not a boundary: the gradient shards wait on disk
    victim = _damage(engine, case, ".grad") if rank == 1 else None
    x, y = micro_batch(1, case, WORLD, rank, 1)
    backward = _error(lambda: engine.backward(loss_of(engine, x, y)))
    out = {"backward": backward, "step": _error(engine.step), "victim": victim}
    engine.offload.close()
    return out


def _damage(engine, case: Case, suffix: str = ".exp_avg_sq") -> str:
    """Change one byte of a swap file of this rank, on disk: with the optimizer on disk the file of `suffix`
    (the second Adam moment unless said) of the last bucket the next step reads (its last in memory), else the
    last unit's parameter shard. Returns its path."""
    (swap,) = engine.offload.swaps.values()
    names = os.listdir(swap.path)
    if case.offload == "nvme":
        name = f"bucket{engine.offload.tiers.order[-1][-1]}{suffix}"
    else:
        name = max((n for n in names if n.endswith(".shard")), key=lambda n: int(n[4:].split(".")[0]))
        engine.offload.tiers.release()  # a shard kept for the next forward: its write lands first, then it is read
    path = swap.path / name
    with open(path, "r+b") as f:  # byte 0 lies inside what was written (the rest of the page is padding)
        first = f.read(1)[0]
        f.seek(0)
        f.write(bytes([first ^ 0xFF]))
    return str(path)


# -- the tests -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One spawn of the ranks for every test here. Bad nvme_paths: a 64 KiB tmpfs (full), a read-only tmpfs,
    and a directory whose rank-1 swap directory is a read-only mount (only rank 1's directory is bad); a 2 MiB
    tmpfs for the disk filled after construction."""
    root = tmp_path_factory.mktemp("faults")
    (root / "good").mkdir()
    mounts = {"full": mount(root / "full", "tmpfs", "size=64k"),
              "readonly": mount(root / "readonly", "tmpfs", "ro,size=64k"),
              "one_rank": mount(root / "one" / "zeroshard-swap" / "rank1", "tmpfs", "ro,size=64k"),
              "later": mount(root / "later", "tmpfs", "size=2m")}
    try:
        paths = {kind: next(m) for kind, m in mounts.items()}
        bad = {"full": paths["full"], "readonly": paths["readonly"], "one_rank": root / "one"}
        per_rank = run_ranks(_ranks, WORLD, root / "good", str(root / "ckpt"), bad, paths["later"])
        one_rank_left = sorted(p.name for p in (root / "one" / "zeroshard-swap").iterdir())
    finally:
        for m in mounts.values():
            m.close()  # runs mount's finally: unmounts
    return {"per_rank": per_rank, "one_rank_left": one_rank_left}


EXPECT = {  # what every rank's message says, by fault: the failed rank(s), the cause, the fix
    "full": (r"setting up offload failed on ranks? [01].*no room on nvme_path .*full for rank [01]'s swap file "
             r".*: it needs \d+ bytes.*\d+ bytes are free there \(ENOSPC\).*point nvme_path at a larger one.*"
             r"device \"cpu\""),
    "readonly": (r"setting up offload failed on ranks 0, 1.*rank 0: creating the swap directory .*readonly/"
                 r"zeroshard-swap/rank0 failed: EROFS.*rank 1: .*rank1 failed: EROFS.*mounted read-only"),
    "one_rank": (r"setting up offload failed on rank 1, and every rank stops there: rank 1: creating the swap "
                 r"directory .*one/zeroshard-swap/rank1 failed: EROFS.*point nvme_path at a writable disk"),
}
ERRNO = {"full": errno.ENOSPC, "readonly": errno.EROFS, "one_rank": errno.EROFS}


def _each(runs):
    """(rank, case, its run) for every rank and case."""
    return [(rank, case, run) for rank, per_case in enumerate(runs["per_rank"]) for case, run in zip(CASES, per_case)]


def test_a_bad_nvme_path_fails_construction_on_every_rank(runs):
    for rank, case, run in _each(runs):
        for kind, fault in run["construction"].items():
            what = (rank, case, kind)
            assert fault["type"] == "OffloadError" and fault["errno"] == ERRNO[kind], (what, fault)
            assert re.search(EXPECT[kind], fault["text"]), (what, fault["text"])
        assert run["left"] == [], f"swap files left behind by the failed constructions: {run['left']}"
    assert runs["one_rank_left"] == ["rank1"], "rank 0's swap directory must go when another rank failed"


def test_a_disk_filled_after_construction_changes_nothing(runs):
    for rank, case, run in _each(runs):
        if case not in FILLED:
            continue
        later, reference = run["later"], run["reference"]
        assert later["free"] == (0, 0), f"{case}: the disk must be full before the steps and stay so"
        assert later["losses"] == reference["losses"], (rank, case)
        assert torch.equal(later["weights"], reference["weights"]), (rank, case)


def test_a_damaged_swap_file_stops_every_rank(runs):
    victims = [run["fault"]["victim"] for run in runs["per_rank"][1]]
    for rank, case, run in _each(runs):
        fault, what = run["fault"], (rank, case)
        victim = victims[CASES.index(case)]
        assert fault["fault"]["type"] == "OffloadError", (what, fault["fault"])
        text = fault["fault"]["text"]
        assert f"failed on rank 1, and every rank stops there: rank 1: swap file {victim} is damaged" in text, \
            (what, text)
        assert "the last checkpoint is intact: restart from it" in text and fault["fault"]["path"] == victim, what
        if case.offload == "nvme":
            assert "the swap-file reads and writes of optimizer step 3 failed" in text, (what, text)
            assert fault["all_gathers"] == 0 or case.stage == 3, "a rank went on to the post-step all-gather"
        else:
            assert "reading the parameter shards of unit" in text, (what, text)
        assert fault["then"]["type"] == "EngineStateError" and "damaged" in fault["then"]["text"], what
        assert fault["save"]["type"] == "EngineStateError", (what, fault["save"])
        assert fault["latest"] == f"global_step{SAVED_AT}", "the failed engine must not save"


def test_a_parameter_shard_damaged_before_the_backward_that_reads_it(runs):
    victim = runs["per_rank"][1][-1]["backward"]["victim"]
    for rank, per_case in enumerate(runs["per_rank"]):
        run = per_case[-1]["backward"]
        assert run["fault"]["type"] == "OffloadError", run["fault"]
        assert re.search(r"reading the parameter shards of unit '.*' from disk \(or writing them back after the "
                         r"step\) failed on rank 1, and every rank "
                         rf"stops there: rank 1: swap file {re.escape(victim)} is damaged", run["fault"]["text"])
        assert run["then"]["type"] == "EngineStateError" and "damaged" in run["then"]["text"], run["then"]


def test_a_gradient_shard_damaged_between_micro_steps_stops_every_rank_at_the_step(runs):
    victim = next(run["gradient"]["victim"] for run in runs["per_rank"][1] if "gradient" in run)
    for rank, per_case in enumerate(runs["per_rank"]):
        (run,) = [r["gradient"] for r in per_case if "gradient" in r]
        assert run["backward"]["type"] is None, run["backward"]  # kept for the step: no rank left in a reduction
        assert run["step"]["type"] == "OffloadError", run["step"]
        assert re.search(r"the gradient shards of optimizer step 1 failed on rank 1, and every rank stops there: "
                         rf"rank 1: swap file {re.escape(victim)} is damaged", run["step"]["text"]), run["step"]


def test_the_checkpoint_saved_before_the_faults_resumes_bitwise(runs):
    for rank, case, run in _each(runs):
        resumed, reference = run["resumed"], run["reference"]
        assert resumed["losses"] == reference["losses"][SAVED_AT:], (rank, case)
        assert torch.equal(resumed["weights"], reference["weights"]), (
            rank, case, relative_error(resumed["weights"], reference["weights"]))


def test_one_fault_check_per_step_and_per_gather_of_a_unit_on_disk(runs):
    """The agreement's cost: 8 bytes per rank, once per optimizer step, once more at stages 2-3 for the
    gradient shards backward wrote to disk, and before each gather of a unit whose shards are on disk (its
    forward and its backward gather)."""
    for rank, case, run in _each(runs):
        calls, nbytes = run["reference"]["checks"]
        # the step's I/O; at stages 2-3 the gradient shards' (written in backward); each gather of a unit on disk
        grads = 1 if case.stage >= 2 and case.offload == "nvme" else 0
        assert run["reference"]["grads_on_disk"] == bool(grads), (rank, case)
        per_step = 1 + grads + 2 * run["reference"]["disk_units"]
        units = run["reference"]["units"] if case.offload_params == "nvme" else 0  # max_in_cpu 0: every one
        assert run["reference"]["disk_units"] == units, (rank, case)
        assert (calls, nbytes) == (STEPS * per_step, STEPS * per_step * 8 * WORLD), (rank, case, calls, nbytes)
