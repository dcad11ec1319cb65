"""engine.placement() and the start-up line: what stage 3 sharded, kept whole and left frozen, per rank.

The expected figures are worked out by hand from the model's shapes: each
flat buffer of n elements is padded to ceil(n / N) * N elements and a rank
holds ceil(n / N) of a sharded one; a unit holds one flat of its sharded
trained parameters, one of its persistent ones (each under
stage3_param_persistence_threshold) and one of its frozen ones at or over the
threshold; frozen parameters under it stay as they are. The bytes must equal
memory_stats()["params"], and the numbers of the INFO line must equal both.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.nn as nn

from tests.distributed import run_ranks

THRESHOLD = 1000  # elements: the blocks' weights (1,089) and the frozen base weight (1,023) are over it


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(33, 33)  # weight 1,089 elements: sharded; bias 33: persistent

    def forward(self, x):
        return torch.tanh(self.fc(x))


class LoraNet(nn.Module):
    """Two Block units; in the root unit an input layer, a frozen base Linear with LoRA adapters, a head."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 33)  # 264 + 33
        self.blocks = nn.ModuleList([Block(), Block()])
        self.base = nn.Linear(33, 31).requires_grad_(False)  # frozen: weight 1,023 (sharded), bias 31 (whole)
        self.lora_a = nn.Linear(33, 3, bias=False)  # 99
        self.lora_b = nn.Linear(3, 31, bias=False)  # 93
        self.head = nn.Linear(31, 5)  # 155 + 5

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.base(h) + self.lora_b(self.lora_a(h)))


ROOT_PERSISTENT = ("inp.weight", "inp.bias", "lora_a.weight", "lora_b.weight", "head.weight", "head.bias")
ROOT_PERSISTENT_NUMEL = 264 + 33 + 99 + 93 + 155 + 5  # 649
TRAINABLE = 2 * (1089 + 33) + ROOT_PERSISTENT_NUMEL  # 2,893
FROZEN = 1023 + 31

LINE = re.compile(r"zeroshard stage (\d) on (\d) ranks: .*?; ([\d,]+) parameter elements \(([\d,]+) trainable, "
                  r"([\d,]+) frozen\); this rank holds ([\d,]+) bytes of parameters: (.*)$")


def pad(n: int, world: int) -> int:
    return -(-n // world) * world


def shard(n: int, world: int) -> int:
    return -(-n // world)


def numbers(text: str) -> list[int]:
    """The numbers of `text`, not the digits inside names (stage3_...)."""
    return [int(n.replace(",", "")) for n in re.findall(r"(?<!\w)\d[\d,]*", text)]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def _engines(rank, world, device, cases):
    """Each (config, step) case: (placement, memory_stats params, this rank's lines); `step`: after one step."""
    import zeroshard

    logger, records = logging.getLogger("zeroshard"), _Records()
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    out = []
    try:
        for config, step in cases:
            records.records.clear()
            torch.manual_seed(0)
            model = LoraNet().to(device)
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            engine = zeroshard.initialize(model, opt, config, wrap=[Block] if config["zero_optimization"]["stage"]
                                          == 3 else None)
            if step:
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)).to(device)
                engine.backward(engine(x).float().pow(2).mean())
                engine.step()
            lines = [(r.levelname, r.getMessage()) for r in records.records
                     if r.getMessage().startswith("zeroshard stage")]
            out.append((engine.placement(), engine.memory_stats()["params"], lines))
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    return out


def _stage3(threshold=None, bf16=False):
    zero = {"stage": 3} if threshold is None else {"stage": 3, "stage3_param_persistence_threshold": threshold}
    return {"zero_optimization": zero, "bf16": {"enabled": bf16}}


def _check_line(placement, params, lines, rank):
    """The INFO line's figures are placement()'s and memory_stats()'s; rank 0 alone logs it."""
    infos = [text for level, text in lines if level == "INFO"]
    if rank != 0:
        assert lines == []
        return
    assert len(infos) == 1, lines
    made = re.search(r": (\d+) units? \(largest '([^']+)': ([\d,]+) elements gathered on demand, ([\d,]+) "
                     r"persistent\), ", infos[0])
    if placement.units:
        largest = max(placement.units, key=lambda u: u.gathered + u.persistent)
        assert made.group(1, 2) == (str(len(placement.units)), largest.name)
        assert numbers(made.group(3) + " " + made.group(4)) == [largest.gathered, largest.persistent]
    else:
        assert made is None
    stage, world, total, trainable, frozen, held, kinds = LINE.match(infos[0]).groups()
    assert (int(stage), int(world)) == (placement.stage, placement.world_size)
    assert [int(n.replace(",", "")) for n in (total, trainable, frozen, held)] == [
        placement.total.elements, placement.trainable.elements, placement.frozen.elements, params]
    if placement.stage == 3:
        assert numbers(kinds) == [placement.sharded.bytes, placement.sharded.full_bytes, placement.persistent.bytes,
                                  placement.persistence_threshold, placement.frozen.bytes,
                                  placement.frozen_sharded.bytes, placement.frozen_whole.bytes]
    else:
        assert numbers(kinds) == [3, placement.persistent.bytes, placement.frozen.bytes]


@pytest.mark.parametrize("world", [1, 2])
def test_stage3_units_persistent_and_frozen_equal_the_hand_count_and_memory_stats(world):
    cases = [(_stage3(THRESHOLD), False), (_stage3(THRESHOLD), True), (_stage3(THRESHOLD, bf16=True), False),
             (_stage3(), False)]
    results = run_ranks(_engines, world, cases)
    for rank, per_case in enumerate(results):
        for (config, _), (placement, params, lines) in zip(cases, per_case):
            size = 2 if config["bf16"]["enabled"] else 4
            under_default = config["zero_optimization"].get("stage3_param_persistence_threshold") is None
            expected = _expected_units_default(world) if under_default else _expected_units(world)
            got = {u.name: (u.gathered, u.frozen, u.shard, u.persistent, u.persistent_params)
                   for u in placement.units}
            assert got == expected
            if under_default:
                _check_whole(placement, world, size)
            else:
                _check_split(placement, world, size)
            assert placement.total.bytes == params  # memory_stats()["params"], after a step too
            assert placement.total.elements == sum(p.numel() for p in LoraNet().parameters())
            assert (placement.trainable.elements, placement.frozen.elements) == (TRAINABLE, FROZEN)
            _check_line(placement, params, lines, rank)
            if rank == 0:  # by hand: the root unit 1,023 + 649 elements, each block 1,089 + 33
                largest = ("'blocks.0': 0 elements gathered on demand, 1,122 persistent" if under_default
                           else "'(root)': 1,023 elements gathered on demand, 649 persistent")
                assert f"3 units (largest {largest})" in lines[0][1]
            warnings = [text for level, text in lines if level == "WARNING"]
            assert len(warnings) == (1 if under_default and rank == 0 else 0), lines
            if warnings:
                assert "stage3_param_persistence_threshold (100000)" in warnings[0]
                assert "0 shards every parameter" in warnings[0]


def _expected_units(world):
    def block(i):
        return 1089, 0, shard(1089, world), 33, (f"blocks.{i}.fc.bias",)
    return {"blocks.0": block(0), "blocks.1": block(1),
            "(root)": (1023, 1023, shard(1023, world), ROOT_PERSISTENT_NUMEL, ROOT_PERSISTENT)}


def _expected_units_default(world):
    """Every parameter under 100,000 elements: nothing gathered, each unit's trained parameters whole."""
    def block(i):
        return 0, 0, 0, 1089 + 33, (f"blocks.{i}.fc.weight", f"blocks.{i}.fc.bias")
    return {"blocks.0": block(0), "blocks.1": block(1), "(root)": (0, 0, 0, ROOT_PERSISTENT_NUMEL, ROOT_PERSISTENT)}


def _check_split(placement, world, size):
    p = placement
    assert not p.shards_nothing and p.persistence_threshold == THRESHOLD and p.buckets == 5
    assert (p.sharded.elements, p.sharded.held) == (2 * 1089, 2 * shard(1089, world))
    assert (p.sharded.bytes, p.sharded.full_bytes) == (size * 2 * shard(1089, world), size * 2 * pad(1089, world))
    persistent = 2 * pad(33, world) + pad(ROOT_PERSISTENT_NUMEL, world)  # padded like every flat buffer
    assert (p.persistent.elements, p.persistent.held, p.persistent.bytes) == (
        2 * 33 + ROOT_PERSISTENT_NUMEL, persistent, size * persistent)
    assert (p.frozen_sharded.elements, p.frozen_sharded.held) == (1023, shard(1023, world))
    assert (p.frozen_sharded.bytes, p.frozen_sharded.full_bytes) == (size * shard(1023, world), size * pad(1023, world))
    assert (p.frozen_whole.elements, p.frozen_whole.bytes) == (31, size * 31)


def _check_whole(placement, world, size):
    p = placement
    assert p.shards_nothing and p.buckets == 3
    assert p.sharded.elements == p.sharded.bytes == p.frozen_sharded.elements == p.frozen_sharded.bytes == 0
    persistent = 2 * pad(1089 + 33, world) + pad(ROOT_PERSISTENT_NUMEL, world)
    assert (p.persistent.elements, p.persistent.bytes) == (TRAINABLE, size * persistent)
    assert (p.frozen_whole.elements, p.frozen_whole.bytes) == (FROZEN, size * FROZEN)


@pytest.mark.parametrize("world", [1, 2])
def test_stages_0_to_2_keep_every_parameter_whole(world):
    cases = [({"zero_optimization": {"stage": s}}, s == 2) for s in (0, 1, 2)]
    for rank, per_case in enumerate(run_ranks(_engines, world, cases)):
        for (config, _), (placement, params, lines) in zip(cases, per_case):
            p = placement
            assert (p.stage, p.units, p.persistence_threshold, p.buckets) == (
                config["zero_optimization"]["stage"], (), None, 1)
            assert p.sharded.elements == p.frozen_sharded.elements == 0 and not p.shards_nothing
            assert (p.persistent.elements, p.persistent.bytes) == (TRAINABLE, 4 * pad(TRAINABLE, world))
            assert (p.frozen_whole.elements, p.frozen_whole.bytes) == (FROZEN, 4 * FROZEN)
            assert p.total.bytes == params
            _check_line(p, params, lines, rank)


def _peft_lora(rank, world, device):
    """A real PEFT LoRA on a tiny Llama at stage 3, every parameter sharded: (placement, params, lines, peft's
    (trainable, all) counts)."""
    from peft import LoraConfig, get_peft_model

    from tests.hf.models import STAGE3, auto_class, config_of, layer_class

    import zeroshard

    logger, records = logging.getLogger("zeroshard"), _Records()
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        torch.manual_seed(0)
        model = get_peft_model(auto_class("llama").from_config(config_of("llama")),
                               LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        counts = model.get_nb_trainable_parameters()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        engine = zeroshard.initialize(model.to(device), opt, STAGE3, wrap=[layer_class(model)])
        lines = [(r.levelname, r.getMessage()) for r in records.records if r.getMessage().startswith("zeroshard stage")]
        return engine.placement(), engine.memory_stats()["params"], lines, counts
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)


def test_placement_is_a_public_frozen_dataclass():
    import dataclasses

    from zeroshard.engine import ParamPlacement, ParamShare, UnitPlacement

    share = ParamShare(3, 2, 8, 16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        share.bytes = 0
    assert share + share == ParamShare(6, 4, 16, 32)
    assert all(dataclasses.is_dataclass(c) for c in (ParamPlacement, ParamShare, UnitPlacement))


def test_a_peft_lora_line_shows_the_frozen_base():
    for rank, (placement, params, lines, (trainable, everything)) in enumerate(run_ranks(_peft_lora, 2)):
        p = placement
        assert (p.trainable.elements, p.frozen.elements) == (trainable, everything - trainable)
        # Threshold 0: every parameter sharded, the frozen base too.
        assert (p.sharded.elements, p.frozen_sharded.elements, p.persistent.elements, p.frozen_whole.elements) == (
            trainable, everything - trainable, 0, 0)
        assert p.total.bytes == params
        assert len(p.units) == 3 and {u.name for u in p.units} >= {"base_model.model.model.layers.0"}
        _check_line(p, params, lines, rank)
