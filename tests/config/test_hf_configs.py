"""Acceptance 2: Hugging Face's ds_config_zero2.json and ds_config_zero3.json, verbatim (tests/config/data).

Each loads with no other change to the file, its offload blocks included
(the optimizer state in host memory, at zero3 the parameters too; the
guide's NVMe example once its misplaced "aio" moves to the top level), and
with them removed or "device": "none": the keys with no effect are reported
once each, every "auto" is resolved from the optimizer and scheduler passed
in code, and what a user must add
is what Hugging Face's Trainer adds from its own arguments: a micro-batch
size and a clipping norm, given as a dict override. An "auto" nothing
resolves is an error naming the key. At 2 ranks, the zero2 file trains as
single-process PyTorch does, and the resolution block is logged once, on
rank 0 only.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from tests import recipes
from tests.distributed import run_ranks
from zeroshard.config import Config, ConfigError, ConfigFacts
from zeroshard.config.from_code import optimizer_facts

DATA = Path(__file__).parent / "data"
FILES = ["ds_config_zero2.json", "ds_config_zero3.json"]
# What the Trainer fills from --per_device_train_batch_size and --max_grad_norm; the rest is derived.
OVERRIDE = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0}
NO_EFFECT = {
    "ds_config_zero2.json": ["zero_optimization.allgather_partitions", "zero_optimization.contiguous_gradients",
                             "steps_per_print", "wall_clock_breakdown"],
    "ds_config_zero3.json": ["zero_optimization.contiguous_gradients",
                             "zero_optimization.stage3_gather_fp16_weights_on_model_save",
                             "steps_per_print", "wall_clock_breakdown"],
}


def verbatim(name: str) -> dict:
    return json.loads((DATA / name).read_text(encoding="utf-8"))


def without_offload(name: str) -> dict:
    raw = verbatim(name)
    for key in ("offload_optimizer", "offload_param"):
        raw["zero_optimization"].pop(key, None)
    return {**raw, **OVERRIDE}


def code_facts(hidden_size=None) -> ConfigFacts:
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.01)
    return ConfigFacts(world_size=2, param_dtype="float32", hidden_size=hidden_size,
                       optimizer=optimizer_facts("AdamW", opt.param_groups), lr_scheduler="LambdaLR")


@pytest.mark.parametrize("name", FILES)
def test_verbatim_file_loads_with_its_offload_blocks(name):
    config, report = Config.load_with_report({**verbatim(name), **OVERRIDE}, code_facts(hidden_size=64))
    zero = config.zero_optimization
    assert (zero.offload_optimizer.device, zero.offload_optimizer.pin_memory) == ("cpu", True)
    if "zero3" in name:
        assert (zero.stage, zero.offload_param.device, zero.offload_param.pin_memory) == (3, "cpu", True)
        assert zero.sub_group_size == 10**14  # the file's 1e14
    else:
        assert (zero.stage, zero.offload_param.enabled) == (2, False)
    assert sorted(key for key, _ in report.no_effect) == sorted(NO_EFFECT[name])


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("offload", ["removed", "device none"])
def test_file_without_offload_loads_and_reports(name, offload):
    raw = without_offload(name) if offload == "removed" else {**verbatim(name), **OVERRIDE}
    if offload == "device none":
        for key in ("offload_optimizer", "offload_param"):
            if key in raw["zero_optimization"]:
                raw["zero_optimization"][key]["device"] = "none"
    config, report = Config.load_with_report(raw, code_facts(hidden_size=64))
    assert sorted(key for key, _ in report.no_effect) == sorted(NO_EFFECT[name])
    assert not (config.zero_optimization.offload_optimizer.enabled or config.zero_optimization.offload_param.enabled)
    resolved = {key: value for key, value, _ in report.resolved}
    assert {k: resolved[f"optimizer.params.{k}"] for k in ("lr", "betas", "eps", "weight_decay")} == {
        "lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    assert (resolved["train_batch_size"], resolved["gradient_accumulation_steps"]) == (4, 1)
    assert resolved["fp16.enabled"] is False and config.training_dtype == "fp32"
    assert "scheduler" in resolved and config.scheduler is None  # the code scheduler is the schedule
    assert config.optimizer.params.lr == 5e-5
    if "zero3" in name:  # Hugging Face's rules on the hidden size
        assert (config.zero_optimization.reduce_bucket_size, config.zero_optimization.stage3_prefetch_bucket_size,
                config.zero_optimization.stage3_param_persistence_threshold) == (64 * 64, int(0.9 * 64 * 64), 640)
    block = report.block()
    for key in NO_EFFECT[name]:
        assert block.count(f"    {key}: ") == 1


def test_unresolvable_autos_are_errors_naming_the_key():
    raw = without_offload("ds_config_zero2.json")
    message = str(pytest.raises(ConfigError, Config.load, raw, ConfigFacts(world_size=2, param_dtype="float32"))
                  .value)
    for key in ("optimizer.params.lr", "optimizer.params.betas", "scheduler.params.warmup_min_lr",
                "scheduler.params.warmup_num_steps"):
        assert f'  - {key} is "auto", which zeroshard cannot work out here; put a value' in message
    assert "warmup_max_lr" not in message  # "auto" = the optimizer's lr
    verbatim_autos = {**without_offload("ds_config_zero2.json"), "gradient_clipping": "auto",
                      "train_micro_batch_size_per_gpu": "auto"}
    message = str(pytest.raises(ConfigError, Config.load, verbatim_autos, code_facts()).value)
    assert '  - gradient_clipping is "auto", which zeroshard cannot work out here; put the maximum gradient ' \
           "norm, such as 1.0" in message
    assert '  - train_micro_batch_size_per_gpu is "auto" and train_batch_size is "auto" or left out' in message


def test_block_must_agree_with_the_code_optimizer_and_scheduler():
    raw = {"optimizer": {"type": "SGD", "params": {"lr": "auto"}}}
    assert "optimizer.type 'SGD' builds torch.optim.SGD, but the optimizer passed in code is AdamW" in str(
        pytest.raises(ConfigError, Config.load, raw, code_facts()).value)
    raw = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": "auto"}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    message = str(pytest.raises(ConfigError, Config.load, raw, code_facts()).value)
    assert "optimizer.params.lr is 0.001 but the optimizer passed in code has 5e-05 (param group 0)" in message
    assert "scheduler.params.warmup_num_steps is 10 but an lr_scheduler (LambdaLR) is passed in code" in message
    raw = {"optimizer": {"type": "Adam", "params": {"lr": 5e-5}}}  # DeepSpeed's Adam is AdamW by default
    assert Config.load(raw, code_facts()).optimizer.params.lr == 5e-5


def test_guide_nvme_example_fails_only_on_the_misplaced_aio():
    # The guide nests "aio" in zero_optimization; DeepSpeed's own schema (extra="forbid") rejects it there too.
    with pytest.raises(ConfigError) as info:
        Config.load(DATA / "docs_zero3_nvme.json", code_facts())
    lines = str(info.value).splitlines()[1:]
    assert len(lines) == 1 and lines[0].startswith("  - unknown key 'zero_optimization.aio' (did you mean 'aio'?)")
    raw = {**verbatim("docs_zero3_nvme.json"), **OVERRIDE}
    raw["aio"] = raw["zero_optimization"].pop("aio")
    config = Config.load(raw, code_facts(hidden_size=64))
    zero = config.zero_optimization
    assert (zero.offload_optimizer.device, zero.offload_optimizer.nvme_path, zero.offload_optimizer.buffer_count) == (
        "nvme", "/local_nvme", 4)
    assert (zero.offload_param.device, zero.offload_param.nvme_path, zero.offload_param.buffer_size,
            zero.offload_param.max_in_cpu) == ("nvme", "/local_nvme", 10**8, 10**9)
    assert (config.aio.block_size, config.aio.queue_depth, config.aio.thread_count) == (262144, 32, 1)


def test_auto_lr_is_the_lr_the_optimizer_was_built_with():
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.1)  # sets lr to 1e-4 at once
    facts = ConfigFacts(optimizer=optimizer_facts("AdamW", opt.param_groups))
    assert Config.load({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, facts).optimizer.params.lr == 1e-3


# ---- 2 ranks: the zero2 file trains as one process does; the block is logged once, on rank 0 ----

STEPS, ROWS, LR = 3, 2, 1e-3


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))


def train_reference(world: int) -> tuple[list[float], torch.Tensor]:
    model = recipes.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched, losses = schedule(opt), []
    for step in range(STEPS):
        x, y = recipes.global_batch(step, ROWS * world)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OVERRIDE["gradient_clipping"])
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, recipes.flat_weights(model)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _train_hf_zero2(rank, world, device):
    import zeroshard

    records = _Records()
    logging.getLogger("zeroshard").addHandler(records)  # no level set: zeroshard.config.logs makes INFO visible
    model = recipes.make_model(device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    engine = zeroshard.initialize(model, opt, without_offload("ds_config_zero2.json"), lr_scheduler=schedule(opt),
                                  model_parameters=model.parameters())
    case = recipes.Case(stage=2, micro_rows=ROWS)
    losses = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in recipes.micro_batch(step, case, world, rank, 0))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    full = engine.full_state_dict()
    weights = torch.cat([full[name].reshape(-1).cpu() for name, _ in model.named_parameters()])
    blocks = [m for m in records.messages if m.startswith("zeroshard config:")]
    return {"losses": losses, "weights": weights, "blocks": blocks, "engine_line": any(
        m.startswith("zeroshard stage 2") for m in records.messages), "groups": _block_over_groups(device)}


def _block_over_groups(device) -> list[float]:
    """The config's block built over DeepSpeed-style param-group dicts, with a scheduler function."""
    import zeroshard

    model = recipes.make_model(device=device)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    engine = zeroshard.initialize(
        model, None, {"zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {
            "lr": 1e-3, "weight_decay": 0.1}}},
        model_parameters=[{"params": matrices}, {"params": others, "weight_decay": 0.0}], lr_scheduler=schedule)
    assert engine.lr_scheduler.optimizer is engine.optimizer
    left_out = recipes.make_model(device=device)
    with pytest.raises(zeroshard.ZeroshardError, match=r"require grad but are in no param group"):
        zeroshard.initialize(left_out, None, {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
                             model_parameters=list(left_out.parameters())[:1])
    return [g["weight_decay"] for g in engine.optimizer.param_groups]


def test_hf_zero2_trains_at_two_ranks_as_one_process():
    world = 2
    results = run_ranks(_train_hf_zero2, world)
    ref_losses, ref_weights = train_reference(world)
    rank_mean = [sum(r["losses"][s] for r in results) / world for s in range(STEPS)]
    assert rank_mean == pytest.approx(ref_losses, rel=1e-5)
    assert recipes.relative_error(results[0]["weights"], ref_weights) <= 1e-5
    assert torch.equal(results[0]["weights"], results[1]["weights"])
    assert len(results[0]["blocks"]) == 1 and results[1]["blocks"] == []
    block = results[0]["blocks"][0]
    assert "optimizer.params.lr = 0.001  (the optimizer passed in code (AdamW))" in block
    assert "    wall_clock_breakdown: " in block and block.count("steps_per_print") == 1
    assert results[0]["engine_line"] and not results[1]["engine_line"]
    assert results[0]["groups"] == [0.1, 0.0]


def test_code_scheduler_and_model_parameters_errors():
    from zeroshard.config.build import check_lr_scheduler, choose_optimizer, parameter_list

    model = torch.nn.Linear(3, 3)
    opt, other = (torch.optim.AdamW(model.parameters()) for _ in range(2))
    for scheduler, optimizer, message in [
        (torch.optim.lr_scheduler.LambdaLR(other, lambda s: 1.0), opt, "it is built on another optimizer"),
        (torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), None, "no optimizer is passed"),
        (torch.optim.lr_scheduler.ReduceLROnPlateau(opt), opt, "ReduceLROnPlateau steps on a metric"),
        (object(), opt, "lr_scheduler must be a torch LR scheduler or a function"),
    ]:
        with pytest.raises(ConfigError, match=message):
            check_lr_scheduler(scheduler, optimizer)
    with pytest.raises(ConfigError, match="model_parameters and the optimizer passed"):
        choose_optimizer(model, opt, Config.load({}), parameter_list([model.weight]))
    with pytest.raises(ConfigError, match="model_parameters must hold parameters or param-group dicts"):
        parameter_list(["weight"])
