"""Checkpoints of offloaded state: saved from and loaded into the host or disk tier, resharded as always.

A run with its optimizer state (and stage 3's parameter shards) offloaded
stops after SAVE_AT steps and saves; it is resumed with the same offload,
without offload, and on 4 ranks instead of 2; a run without offload is
resumed with nvme offload. The reference is the run that never stopped,
without offload: offload changes no bit (tests/engine/test_offload_parity.py),
so every resumed run on 2 ranks equals it bitwise. On 4 ranks the reduction's
arithmetic differs: the run meets single-process PyTorch within the parity
bar, and the state it loaded, saved again from 4 ranks, is the written state
exactly. A swap file damaged on one rank makes the save fail on every rank.

The disk tier goes through memory a sub-group at a time (here every disk
bucket is a sub-group): the offload buffers in use at once during a save and
during a load, counted byte by byte at the pool, stay within the `ahead` + 2
sub-groups the step itself holds, less than the tier.
"""

from __future__ import annotations

from dataclasses import replace
import re
from pathlib import Path

import torch

from tests.distributed import run_ranks
from tests.recipes import Case, make_engine_with_schedule, relative_error, train_reference, train_steps
from zeroshard import CheckpointError
from zeroshard.checkpoint.consolidate import full_tensors
from zeroshard.offload import ALIGN

STEPS, SAVE_AT = 4, 2
CASES = [
    Case(stage=1, accumulation=2, clip=0.5, offload="cpu", schedule=True),
    Case(stage=2, offload="cpu"),
    Case(stage=3, accumulation=2, offload="cpu"),
    Case(stage=1, clip=0.5, offload="nvme"),
    Case(stage=2, accumulation=2, offload="nvme", bucket=1500, schedule=True),
    Case(stage=3, offload="nvme"),
    Case(stage=3, accumulation=2, clip=0.5, offload="nvme", offload_params="nvme"),
    Case(stage=3, dtype="bf16", offload="nvme", offload_params="nvme"),
]
PLAIN = {"offload": "none", "offload_params": "none"}


def _engine(case: Case, device, swap: Path, seed: int = 0):
    """The case's engine, its swap files under `swap`, every disk bucket a sub-group of its own."""
    swap.mkdir(parents=True, exist_ok=True)
    case = replace(case, nvme_path=str(swap))
    config = case.config()
    config["zero_optimization"]["sub_group_size"] = 1  # elements: a sub-group holds at least one bucket
    return make_engine_with_schedule(case, config=config, seed=seed, device=device)


def _weights(engine) -> torch.Tensor:
    full = engine.full_state_dict()
    return torch.cat([full[name].reshape(-1).float().cpu() for name, _ in engine.module.named_parameters()])


def _in_use_during(engine, action) -> dict:
    """The bytes of the offload pool's buffers in use at most during `action`, after it, and after the
    tiers let go of the sub-groups they keep in memory between passes, with what the step holds at most
    (`budget` consecutive sub-groups: the one stepped, the one before it being written, the `ahead` after
    it being read: masters, optimizer state, parameter shards, and the parameter shards kept for the next
    forward) and the whole tier."""
    pool, tiers = engine.offload.pool, engine.offload.tiers
    peak = [pool.in_use()]

    def acquire(nbytes: int) -> torch.Tensor:
        buffer = type(pool).acquire(pool, nbytes)
        peak[0] = max(peak[0], pool.in_use())
        return buffer

    pool.acquire = acquire
    try:
        action()
    finally:
        del pool.acquire
    after = pool.in_use()
    tiers.release()
    groups = []
    for group in tiers.sub_groups:
        files = [s for i in group for s in tiers.swaps[i].values()]
        files += [tiers.buckets[i].flat.shard_swap for i in group if tiers.buckets[i].flat.shard_swap is not None]
        groups.append(sum(-(-f.nbytes // ALIGN) * ALIGN for f in files))
    # The parameter shards a step leaves in memory for the next forward (offload_param's buffers) come on top.
    kept = sum(-(-tiers.buckets[i].flat.shard_swap.nbytes // ALIGN) * ALIGN for i in tiers.shards_kept)
    step = max(sum(groups[n : n + tiers.budget]) for n in range(len(groups))) + kept
    return {"peak": peak[0], "after": after, "released": pool.in_use(), "step": step, "tier": sum(groups)}


def _measured(engine, action) -> dict | None:
    """`_in_use_during(engine, action)` with a disk tier; else `action()` alone (None)."""
    if engine.offload.tiers.on_disk:
        return _in_use_during(engine, action)
    action()
    return None


def _save(engine, schedule, directory: Path) -> dict | None:
    return _measured(engine, lambda: engine.save_checkpoint(
        directory, client_state={"schedule": schedule and schedule.state_dict()}))


def _resume(rank, world, device, case: Case, directory: Path, swap: Path) -> tuple:
    """Load into a new engine (other initial weights), train to STEPS: (losses, weights, steps, pool use)."""
    engine, schedule = _engine(case, device, swap, seed=7)

    def load():
        _, client = engine.load_checkpoint(directory)
        if schedule is not None:
            schedule.load_state_dict(client["schedule"])

    in_use = _measured(engine, load)
    losses = train_steps(engine, schedule, case, world, rank, device, range(SAVE_AT, STEPS))
    out = (losses, _weights(engine), engine.global_steps, in_use)
    engine.offload.close()
    return out


def _on_two_ranks(rank, world, device, root):
    """Per case: the reference (saving at SAVE_AT without offload), the offloaded run's save, and the
    resumed runs: {reader: (losses, weights, steps, pool use)}."""
    out = []
    for i, case in enumerate(CASES):
        where = Path(root) / str(i)
        engine, schedule = _engine(replace(case, **PLAIN), device, where / "swap-reference")
        losses = train_steps(engine, schedule, case, world, rank, device, range(SAVE_AT))
        _save(engine, schedule, where / "plain")
        losses += train_steps(engine, schedule, case, world, rank, device, range(SAVE_AT, STEPS))
        reference = (losses[SAVE_AT:], _weights(engine))
        engine, schedule = _engine(case, device, where / "swap-saver")
        train_steps(engine, schedule, case, world, rank, device, range(SAVE_AT))
        saved = _save(engine, schedule, where / "offload")
        damaged = _save_from_a_damaged_swap_file(rank, engine, where) if case.offload == "nvme" else None
        engine.offload.close()
        readers = {"same offload": (case, "offload"), "no offload": (replace(case, **PLAIN), "offload")}
        if case.offload == "nvme":
            readers["offload, saved without"] = (case, "plain")
        resumed = {name: _resume(rank, world, device, reader, where / written, where / f"swap-{k}")
                   for k, (name, (reader, written)) in enumerate(readers.items())}
        out.append((reference, saved, resumed, damaged))
    return out


def _save_from_a_damaged_swap_file(rank, engine, where: Path) -> str:
    """Rank 0's swap file of its first master damaged: the save's error, on every rank."""
    if rank == 0:
        file = engine.offload.tiers.swaps[0]["master"].file.path
        with open(file, "r+b") as f:
            f.write(b"\xff" * 8)
    try:
        engine.save_checkpoint(where / "offload")
    except CheckpointError as exc:
        return str(exc)
    return "saved"


def _on_four_ranks(rank, world, device, root):
    """The 2-rank saves of the fp32 cases, loaded with the same offload on 4 ranks (the same global batch),
    saved again at once, then trained to STEPS."""
    out = []
    for i, case in enumerate(CASES):
        if case.dtype == "fp32":
            where = Path(root) / str(i)
            engine, schedule = _engine(replace(case, micro_rows=1), device, where / "swap-4", seed=7)
            _, client = engine.load_checkpoint(where / "offload")
            if schedule is not None:
                schedule.load_state_dict(client["schedule"])
            engine.save_checkpoint(where / "resaved")
            losses = train_steps(engine, schedule, replace(case, micro_rows=1), world, rank, device,
                                 range(SAVE_AT, STEPS))
            out.append((losses, _weights(engine)))
            engine.offload.close()
    return out


def _check_pool_use(case: Case, what: str, in_use: dict | None) -> None:
    """With a disk tier (`in_use` measured), the save or load held no more of it at once than the step, and
    nothing beyond the sub-groups the tiers keep between passes."""
    if in_use is None:
        return
    assert in_use["released"] == 0, f"{case}: {what} left {in_use['released']} bytes of offload buffers in use"
    assert in_use["after"] <= in_use["step"] and 0 < in_use["peak"] <= in_use["step"], (
        f"{case}: {what} held {in_use['peak']} bytes of the disk tier's {in_use['tier']} at once "
        f"(the step: at most {in_use['step']})")
    assert in_use["peak"] < in_use["tier"], f"{case}: {what} held the whole disk tier at once ({in_use['tier']} bytes)"


def test_offloaded_state_resumes_exactly_on_any_world_size(tmp_path):
    two = run_ranks(_on_two_ranks, 2, str(tmp_path))
    for rank, per_case in enumerate(two):
        for case, ((ref_losses, ref_weights), saved, resumed, damaged) in zip(CASES, per_case):
            assert (saved is not None) == (case.offload == "nvme")
            _check_pool_use(case, "the save", saved)
            if case.offload == "nvme":
                assert re.match(r"rank 0: cannot read its master weights and optimizer state \(OffloadError: swap "
                                r"file .*bucket0\.master.* is damaged.*nothing was written and earlier checkpoints "
                                r"are intact$", damaged), damaged
            for reader, (losses, weights, steps, in_use) in resumed.items():
                assert losses == ref_losses and steps == STEPS, f"{case}, {reader}, rank {rank}: {losses}"
                assert torch.equal(weights, ref_weights), (
                    f"{case}, {reader}: weights differ from the run that never stopped "
                    f"({relative_error(weights, ref_weights):.2e})")
                _check_pool_use(case, f"the load ({reader})", in_use)
    four = run_ranks(_on_four_ranks, 4, str(tmp_path))
    for k, (i, case) in enumerate((i, c) for i, c in enumerate(CASES) if c.dtype == "fp32"):
        ref_losses, ref_weights = train_reference(case, 2, STEPS)
        losses = torch.tensor([r[k][0] for r in four]).mean(0)  # the mean over ranks is the global batch's
        loss_err = ((losses - torch.tensor(ref_losses[SAVE_AT:])).abs() / torch.tensor(ref_losses[SAVE_AT:])).max()
        assert loss_err <= 2e-5, f"{case} on 4 ranks: loss error {loss_err:.2e} against single-process PyTorch"
        assert all(torch.equal(r[k][1], four[0][k][1]) for r in four)
        assert relative_error(four[0][k][1], ref_weights) <= 1e-4, f"{case} on 4 ranks"
        for kind in ("param", "optim.exp_avg", "optim.exp_avg_sq"):
            written, resaved = (full_tensors(tmp_path / str(i) / d, kind=kind) for d in ("offload", "resaved"))
            assert written.keys() == resaved.keys() and written
            assert all(torch.equal(written[n], resaved[n]) for n in written), f"{case}: {kind} changed on 4 ranks"
