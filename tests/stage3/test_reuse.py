"""Units kept whole from forward to backward (`stage3_max_reuse_distance`): what they change and what not.

References: the same training with every unit released after its forward
(the default), bit for bit; the state dict read before the forward (the
shards' own values); the all-gather bytes of the default run, less the
units the rule keeps (counted here from the units' sizes).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tests.distributed import run_ranks
from tests.recipes import Case, make_engine, micro_batch

WORLD, STEPS = 2, 3
CASE = Case(stage=3, dtype="bf16", optimizer="adamw1_slow")
KEEP_ALL = {"stage3_max_reuse_distance": 10**9}


def _engine(device, zero: dict, case: Case = CASE):
    config = case.config()
    config["zero_optimization"] |= zero
    return make_engine(case, config=config, device=device)


def _train(engine, case: Case, world: int, rank: int, device, after=None) -> list[float]:
    """STEPS training steps: each one's loss, or what `after(x, y)` returns once the step is over."""
    out = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in micro_batch(step, case, world, rank, 0))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        out.append(loss.item() if after is None else after(x, y))
    return out


def _run(rank, world, device, zero: dict, read_between: bool):
    """Train STEPS steps; with `read_between`, read the full state dict between each forward and its backward."""
    engine = _engine(device, zero)
    losses, reads = [], []
    for step in range(STEPS):
        x, y = (t.to(device) for t in micro_batch(step, CASE, world, rank, 0))
        before = engine.full_state_dict()
        gathered = engine.comm_stats()["all_gather"].bytes
        loss = engine(x, y)
        if read_between:
            reads.append(all(torch.equal(before[k], v) for k, v in engine.full_state_dict().items()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        step_bytes = engine.comm_stats()["all_gather"].bytes - gathered
    weights = torch.cat([t.reshape(-1).float().cpu() for t in engine.full_state_dict().values()])
    kept = engine.schedule._reused
    return {"losses": losses, "weights": weights, "reads": reads, "step_bytes": step_bytes,
            "kept": sorted(kept), "sizes": [u.gathered_numel for u in engine.units]}


def _variants(rank, world, device):
    qwz = {"zero_quantized_weights": True, "zeropp_compile_quantizers": False}  # eager: compiled, the same
    runs = {"release": ({}, False), "keep": (KEEP_ALL, False), "keep_read": (KEEP_ALL, True),
            "qwz": (qwz, False), "qwz_keep_read": (qwz | KEEP_ALL, True)}
    return {name: _run(rank, world, device, zero, read) for name, (zero, read) in runs.items()}


def test_kept_units_train_bit_for_bit_as_released_ones_and_gather_less():
    for out in run_ranks(_variants, WORLD):
        release, keep = out["release"], out["keep"]
        assert keep["losses"] == release["losses"] and torch.equal(keep["weights"], release["weights"])
        assert release["kept"] == [] and keep["kept"] == [i for i, n in enumerate(keep["sizes"]) if n]
        # bf16 parameters: 2 bytes an element; the step's own gathers, plus the full state dict's exact ones
        saved = 2 * sum(keep["sizes"][i] for i in keep["kept"])
        assert release["step_bytes"] - keep["step_bytes"] == saved


def test_an_exact_read_between_forward_and_backward_sees_the_shards_values_and_changes_nothing():
    for out in run_ranks(_variants, WORLD):
        assert all(out["keep_read"]["reads"]) and all(out["qwz_keep_read"]["reads"])
        for plain, read in (("keep", "keep_read"), ("qwz", "qwz_keep_read")):
            assert out[read]["losses"] == out[plain]["losses"], read
            assert torch.equal(out[read]["weights"], out[plain]["weights"]), read


def _read_in_second_use(rank, world, device, zero: dict):
    """The first block runs twice a forward (Case variant "twice") and, inside its second run, reads its own
    weight whole with `gathered_parameters`: kept from its first run, it is in use again there."""
    import zeroshard

    case = replace(CASE, variant="twice")
    engine = _engine(device, zero, case)
    runs = [0]

    def read_own_weight(module, args):
        runs[0] += 1
        if runs[0] % 2 == 0:
            with zeroshard.gathered_parameters(module.attn.qkv.weight):
                pass

    engine.module.blocks[0].register_forward_pre_hook(read_own_weight)
    return _train(engine, case, world, rank, device)


def _flush_after_forward(rank, world, device, zero: dict):
    """With the update delayed, a forward (grad on, no backward), then `flush_update`: the units that forward
    kept hold the weights before the update, which the next training forward must not use."""
    case = replace(CASE, dtype="fp32", optimizer="adamw1", offload="cpu", delayed=0)
    engine = _engine(device, zero, case)

    def forward_then_flush(x, y):
        loss = engine(x, y).item()  # a forward of its own, grad on
        engine.flush_update()
        return loss

    return _train(engine, case, world, rank, device, after=forward_then_flush)


def test_a_kept_unit_used_again_in_a_forward_is_in_use_there():
    kept, released = (run_ranks(_read_in_second_use, WORLD, zero) for zero in (KEEP_ALL, {}))
    assert kept == released


def test_a_landed_delayed_update_releases_what_a_forward_kept():
    kept, released = (run_ranks(_flush_after_forward, WORLD, zero) for zero in (KEEP_ALL, {}))
    assert kept == released
