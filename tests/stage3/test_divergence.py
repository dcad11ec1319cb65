"""Stage 3 trains models whose ranks run different units in a step, as DDP does.

The model (tests/stage3/moe.py) has each expert, block and its side tower as a unit: an expert a rank
routes no token to is not called there, the tower runs only for the ranks whose batch has an image, and
the last block runs twice on some ranks. The reference is DDP (find_unused_parameters=True) on the same
batches: the mean of the ranks' gradients, micro-step by micro-step. Each run also records which experts
and towers each rank ran, so the test checks that the ranks did diverge.
"""

from __future__ import annotations

import contextlib
import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_ranks
from tests.recipes import relative_error
from tests.stage3.moe import UNITS, Expert, MoE, MoENet, Tower, batch

STEPS, LR = 4, 1e-2


def _config(accumulation: int, dtype: str, stage: int = 3) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accumulation,
            "gradient_clipping": 0.0, "bf16": {"enabled": dtype == "bf16"},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


def _engine(device, top: int, accumulation: int, dtype: str, stage: int = 3, leaf: str | None = None):
    """`leaf`: "config" (zero_optimization.leaf_module) or "deepspeed" (set_z3_leaf_modules) makes each MoE
    block a leaf: one unit with its experts."""
    import zeroshard
    from zeroshard.deepspeed.utils import set_z3_leaf_modules

    torch.manual_seed(0)
    model = MoENet(top).to(device)
    config = _config(accumulation, dtype, stage)
    if leaf == "config":
        config["zero_optimization"]["leaf_module"] = {"classes": ["tests.stage3.moe.MoE"]}
    elif leaf == "deepspeed":
        set_z3_leaf_modules(model, [MoE])
    ran = []
    for name, module in model.named_modules():
        if isinstance(module, (Expert, Tower)):
            module.register_forward_hook(lambda m, a, o, name=name: ran[-1].add(name))
    engine = zeroshard.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), config,
                                  wrap=list(UNITS) if stage == 3 else None)
    return engine, ran


def _on(device, b: dict) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()}


def _train(engine, ran, rank, device, accumulation, steps, first=0) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        for micro in range(accumulation):
            ran.append(set())
            loss = engine(**_on(device, batch(step, micro, rank)))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _ddp(rank, device, top: int, accumulation: int) -> tuple[list[float], dict]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = MoENet(top).to(device)
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        for micro in range(accumulation):
            sync = micro == accumulation - 1
            with contextlib.nullcontext() if sync else ddp.no_sync():
                loss = ddp(**_on(device, batch(step, micro, rank)))
                (loss / accumulation).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().cpu().float() for k, v in model.state_dict().items()}


def _against_ddp(rank, world, device, top: int, accumulation: int, dtype: str, leaf: str | None = None) -> dict:
    engine, ran = _engine(device, top, accumulation, dtype, leaf=leaf)
    losses = _train(engine, ran, rank, device, accumulation, STEPS)
    full = {k: v.cpu().float() for k, v in engine.full_state_dict().items()}
    ref_losses, ref = _ddp(rank, device, top, accumulation)
    return {"losses": losses, "ref_losses": ref_losses, "ran": ran, "full": full, "ref": ref,
            "checks": engine.comm_stats()["unit_check"].calls, "units": [u.name for u in engine.units]}


def _diverged(ranks: list[dict]) -> bool:
    """Whether some micro-step had an expert or the tower run on one rank and not on another."""
    return any(len({frozenset(r["ran"][s]) for r in ranks}) > 1 for s in range(len(ranks[0]["ran"])))


def _weights_error(result: dict) -> float:
    return relative_error(torch.cat([v.reshape(-1) for v in result["full"].values()]),
                          torch.cat([result["ref"][k].reshape(-1) for k in result["full"]]))


@pytest.mark.parametrize("world,top,accumulation,tolerance", [(2, 1, 1, 1e-4), (2, 2, 2, 1e-4), (4, 1, 2, 1e-4)])
def test_ranks_that_run_different_units_train_as_ddp(world, top, accumulation, tolerance):
    ranks = run_ranks(_against_ddp, world, top, accumulation, "fp32")
    assert _diverged(ranks)
    for r in ranks:
        assert r["checks"] > 0
        loss_error = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], r["ref_losses"]))
        assert loss_error <= 2e-5, (loss_error, r["losses"], r["ref_losses"])
        assert _weights_error(r) <= tolerance, _weights_error(r)


@pytest.mark.parametrize("leaf", ["config", "deepspeed"])
def test_leaf_modules_gather_each_moe_block_whole_and_train_as_ddp(leaf):
    ranks = run_ranks(_against_ddp, 2, 2, 1, "fp32", leaf)
    for r in ranks:
        assert r["units"] == ["(root)", "tower", "blocks.0", "blocks.0.moe", "blocks.1", "blocks.1.moe"]
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], r["ref_losses"])) <= 2e-5
        assert _weights_error(r) <= 1e-4


def _bad_leaves(rank, world, device) -> dict:
    import zeroshard
    from zeroshard.deepspeed.utils import set_z3_leaf_modules

    out = {}
    for name, leaf in (("class", {"classes": ["Mixer"]}), ("name", {"names": ["blocks.7.moe"]}),
                       ("suffix", {"name_suffixes": ["mlp"]}), ("container", {"names": ["blocks"]})):
        config = _config(1, "fp32")
        config["zero_optimization"] |= {"leaf_module": leaf}
        model = MoENet()
        try:
            zeroshard.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
        except zeroshard.ModelError as error:
            out[name] = str(error)
    try:
        set_z3_leaf_modules(MoENet(), ["Mixer", MoE])
    except zeroshard.ModelError as error:
        out["deepspeed"] = str(error)
    return out


def test_leaf_modules_that_match_no_module_are_a_clear_error():
    for r in run_ranks(_bad_leaves, 2):
        for name, entry in (("class", "Mixer"), ("name", "blocks.7.moe"), ("suffix", "mlp")):
            assert f"'{entry}'" in r[name] and "match no module" in r[name] and "MoE" in r[name], r[name]
        assert "blocks" in r["container"] and "no forward of their own" in r["container"], r["container"]
        assert "['Mixer']" in r["deepspeed"] and "match no module" in r["deepspeed"], r["deepspeed"]


def _bf16(rank, world, device) -> dict:
    out = {}
    for stage in (2, 3):
        engine, ran = _engine(device, 2, 2, "bf16", stage)
        out[stage] = {"losses": _train(engine, ran, rank, device, 2, STEPS), "ran": ran,
                      "full": {k: v.cpu().float() for k, v in engine.full_state_dict().items()}}
    out["ref_losses"], out["ref"] = _ddp(rank, device, 2, 2)
    return out


def test_in_bf16_stage_3_trains_as_stage_2_and_near_fp32_ddp():
    ranks = run_ranks(_bf16, 2)
    assert _diverged([r[3] for r in ranks])
    for r in ranks:
        # Stage 2 has no units: every rank runs its whole model, the gradients' mean is the same reduction.
        assert r[3]["losses"] == r[2]["losses"]
        assert all(torch.equal(r[3]["full"][k], r[2]["full"][k]) for k in r[2]["full"])
        assert max(abs(a - b) / b for a, b in zip(r[3]["losses"], r["ref_losses"])) <= 2e-2  # bf16's own rounding


def _checkpointed(rank, world, device, root: str) -> dict:
    engine, ran = _engine(device, 2, 2, "fp32")
    _train(engine, ran, rank, device, 2, 2)
    engine.save_checkpoint(root, tag="mid")
    after = _train(engine, ran, rank, device, 2, 2, first=2)
    again, ran = _engine(device, 2, 2, "fp32")
    again.load_checkpoint(root, tag="mid")
    resumed = _train(again, ran, rank, device, 2, 2, first=2)
    return {"after": after, "resumed": resumed}


def test_a_checkpoint_saved_and_loaded_in_a_divergent_run_resumes_it_exactly():
    root = tempfile.mkdtemp()
    for r in run_ranks(_checkpointed, 2, root):
        assert r["resumed"] == r["after"]


def _outside_any_unit(rank, world, device) -> dict:
    """Rank 1 reads a parameter through gathered_parameters inside its forward, rank 0 does not: a collective
    only one rank reaches, outside any unit's forward or backward, which no round can match."""
    import zeroshard

    engine, ran = _engine(device, 1, 1, "fp32")
    ran.append(set())
    model = engine.module
    model.blocks[0].register_forward_pre_hook(
        lambda m, a: zeroshard.gathered_parameters(model.head.weight).__enter__() if dist.get_rank() == 1 else None)
    try:
        engine.backward(engine(**_on(device, batch(0, 0, rank))))
    except zeroshard.CollectiveError as error:
        return {"error": str(error)}
    return {"error": None}


def test_a_collective_no_round_can_match_is_a_collective_error_on_every_rank():
    for r in run_ranks(_outside_any_unit, 2, timeout_s=180):
        assert r["error"] is not None
        assert "rank 0:" in r["error"] and "rank 1:" in r["error"], r["error"]
        assert "unit_check" in r["error"] and "gathered_parameters is a collective call" in r["error"], r["error"]
