"""The offload keys of the config (zeroshard/config/offload.py, offload_merge.py): every key parsed, the defaults,
each combination that cannot be honoured an error naming the key and the fix, DeepSpeed's other names read into
their keys, initialize(offload=...) merged, Hugging Face's files with cpu and nvme offload, and zero.Init's
remote_device against the config."""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path

import pytest
import torch

import zeroshard
import zeroshard.deepspeed as deepspeed
from zeroshard.config import RULES, Config, ConfigError, Status
from zeroshard.config.offload import AioConfig, OffloadOptimizerConfig, OffloadParamConfig
from zeroshard.config.offload_merge import OTHER_NAMES, declared_param_device
from zeroshard.deepspeed import UnsupportedError

DATA = Path(__file__).parent / "data"
OVERRIDE = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0}  # what the Trainer adds


def zero(stage: int, **keys) -> dict:
    return {"zero_optimization": {"stage": stage, **keys}}


def problems(raw: dict, **load) -> list[str]:
    """The lines of the ConfigError that loading `raw` raises."""
    with pytest.raises(ConfigError) as info:
        Config.load(raw, **load)
    return [line.removeprefix("  - ") for line in str(info.value).splitlines()[1:]]


# ---- keys and defaults ----

def test_defaults_are_deepspeeds_and_disabled():
    config = Config.load({})
    opt, param = config.zero_optimization.offload_optimizer, config.zero_optimization.offload_param
    assert opt == OffloadOptimizerConfig() and param == OffloadParamConfig() and config.aio == AioConfig()
    assert not opt.enabled and not param.enabled
    assert (opt.device, opt.nvme_path, opt.pin_memory, opt.buffer_count, opt.ratio, opt.fast_init, opt.pipeline_read,
            opt.pipeline_write, opt.delayed_update, opt.delayed_update_warmup) == (
        "none", None, False, 4, 1.0, False, False, False, False, 20)
    assert (param.device, param.nvme_path, param.pin_memory, param.buffer_count, param.buffer_size,
            param.max_in_cpu) == ("none", None, False, 5, 100_000_000, 1_000_000_000)
    aio = config.aio
    assert (aio.block_size, aio.queue_depth, aio.thread_count, aio.single_submit, aio.overlap_events,
            aio.use_gds) == (1_048_576, 8, 1, False, True, False)
    assert config.zero_optimization.sub_group_size == 1_000_000_000


def test_every_field_documents_its_deepspeed_key():
    for model in (OffloadOptimizerConfig, OffloadParamConfig, AioConfig):
        for name, field in model.model_fields.items():
            assert field.description and "DeepSpeed: " in field.description, name


def test_every_key_is_parsed():
    raw = {**zero(3, sub_group_size=1e7,
                  offload_optimizer={"device": "nvme", "nvme_path": "/nvme/opt", "pin_memory": True, "buffer_count": 8,
                                     "fast_init": True, "pipeline_read": True, "pipeline_write": True,
                                     "delayed_update": True, "delayed_update_warmup": 3},
                  offload_param={"device": "nvme", "nvme_path": "/nvme/param", "pin_memory": True, "buffer_count": 6,
                                 "buffer_size": 1e6, "max_in_cpu": 0}),
           "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 2, "single_submit": True,
                   "overlap_events": False, "use_gds": False}}
    config, report = Config.load_with_report(raw)
    z = config.zero_optimization
    assert z.offload_optimizer == OffloadOptimizerConfig(
        device="nvme", nvme_path="/nvme/opt", pin_memory=True, buffer_count=8, fast_init=True,
        pipeline_read=True, pipeline_write=True, delayed_update=True, delayed_update_warmup=3)  # ratio < 1 refused with it
    assert z.offload_param == OffloadParamConfig(device="nvme", nvme_path="/nvme/param", pin_memory=True,
                                                 buffer_count=6, buffer_size=1_000_000, max_in_cpu=0)
    assert z.offload_optimizer.enabled and z.offload_param.enabled and z.sub_group_size == 10_000_000
    assert config.aio == AioConfig(block_size=262144, queue_depth=32, thread_count=2, single_submit=True,
                                   overlap_events=False)
    # the keys kept for DeepSpeed's sake are listed at start-up with why they change nothing
    assert [key for key, _ in report.no_effect] == [
        "zero_optimization.offload_optimizer.fast_init", "zero_optimization.offload_optimizer.pipeline_read",
        "zero_optimization.offload_optimizer.pipeline_write", "aio.queue_depth", "aio.single_submit",
        "aio.overlap_events"]
    assert Config.load(config.to_dict()) == config  # a round trip
    # a config written back whole, every no-effect key at its default, asks for nothing and lists nothing
    assert Config.load_with_report(Config.load(zero(3)).to_dict())[1].no_effect == []


@pytest.mark.parametrize("device, expected", [("none", "none"), ("cpu", "cpu"), ("nvme", "nvme"), (None, "none")])
def test_device_takes_deepspeeds_values_and_null(device, expected):
    raw = zero(3, offload_optimizer={"device": device, "nvme_path": "/x"}, offload_param={"device": device,
                                                                                         "nvme_path": "/x"})
    z = Config.load(raw).zero_optimization
    assert z.offload_optimizer.device == z.offload_param.device == expected


def test_blocks_may_be_null_or_left_empty():
    for value in (None, {}):
        z = Config.load({**zero(3, offload_optimizer=value, offload_param=value), "aio": value}).zero_optimization
        assert not z.offload_optimizer.enabled and not z.offload_param.enabled


@pytest.mark.parametrize("key, value, line", [
    ("offload_optimizer.device", "CPU", 'zero_optimization.offload_optimizer.device must be "none", "cpu" or "nvme" '
                                        '(null = "none"); got "CPU"'),
    ("offload_param.device", "gpu", 'zero_optimization.offload_param.device must be "none", "cpu" or "nvme" '
                                    '(null = "none"); got "gpu"'),
    ("offload_optimizer.nvme_path", 7, "zero_optimization.offload_optimizer.nvme_path must be a directory path (a "
                                       "string) or null; got 7"),
    ("offload_optimizer.pin_memory", "yes", "zero_optimization.offload_optimizer.pin_memory must be true or false"),
    ("offload_optimizer.buffer_count", 0, "zero_optimization.offload_optimizer.buffer_count must be a positive "
                                          "integer; got 0"),
    ("offload_param.max_in_cpu", -1, "zero_optimization.offload_param.max_in_cpu must be an integer >= 0; got -1"),
    ("offload_optimizer", 1, 'zero_optimization.offload_optimizer must be a JSON object such as {"device": "cpu"}, '
                             "or null; got 1"),
])
def test_bad_values_name_the_key(key, value, line):
    block, field = (key.split(".") + [None])[:2]
    raw = zero(3, **{block: {"device": "cpu", field: value} if field else value})
    assert any(found.startswith(line) for found in problems(raw)), problems(raw)


@pytest.mark.parametrize("ratio", [0, -0.5, 1.5, float("nan"), "half", True])
def test_ratio_must_be_in_zero_one(ratio):
    assert problems(zero(2, offload_optimizer={"device": "cpu", "ratio": ratio}))[0].startswith(
        "zero_optimization.offload_optimizer.ratio must be a finite number > 0 and <= 1 (the fraction of the "
        'optimizer state offloaded; for none, set device "none")')


def test_partial_ratio_is_allowed_on_cpu_and_disk():
    for device in ("cpu", "nvme"):
        block = {"device": device, "nvme_path": "/x", "ratio": 0.5}
        assert Config.load(zero(1, offload_optimizer=block)).zero_optimization.offload_optimizer.ratio == 0.5


def test_gpudirect_storage_is_refused():
    assert problems({"aio": {"use_gds": True}}) == [
        "aio.use_gds must be false: GPUDirect Storage (disk reads straight into GPU memory) is not supported; "
        "reads and writes go through host memory. Set it false or remove it; got true"]
    assert Config.load({"aio": {"use_gds": False}}).aio.use_gds is False


# ---- combinations ----

def test_optimizer_offload_needs_a_sharded_stage():
    assert problems(zero(0, offload_optimizer={"device": "cpu"})) == [
        'zero_optimization.offload_optimizer.device "cpu" needs stage 1, 2 or 3: stage 0 shards nothing, so each '
        'rank steps every parameter on the device; set zero_optimization.stage to 1 or more, or set device "none"']
    for stage in (1, 2, 3):
        assert Config.load(zero(stage, offload_optimizer={"device": "cpu"})).zero_optimization.offload_optimizer.enabled


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_param_offload_needs_stage_3(stage):
    lines = problems(zero(stage, offload_param={"device": "cpu"}))
    assert lines[-1] == (
        f'zero_optimization.offload_param.device "cpu" needs stage 3, not stage {stage}: only stage 3 shards the '
        "parameters (below it every rank holds them whole on the device); set zero_optimization.stage to 3, or "
        'set device "none" (offload_optimizer offloads the optimizer state at stages 1 and 2)')


@pytest.mark.parametrize("block", ["offload_optimizer", "offload_param"])
@pytest.mark.parametrize("path", ["absent", None, ""])
def test_disk_needs_a_path(block, path):
    given = {"device": "nvme"} if path == "absent" else {"device": "nvme", "nvme_path": path}
    assert problems(zero(3, **{block: given})) == [
        f'zero_optimization.{block}.nvme_path is required with device "nvme": set it to a directory on the disk '
        'to use (each rank writes its own files there), or use device "cpu"']


def test_delayed_update_needs_an_offloaded_optimizer():
    assert problems(zero(2, offload_optimizer={"delayed_update": True})) == [
        "zero_optimization.offload_optimizer.delayed_update true needs an offloaded optimizer (it overlaps the CPU "
        'step with the next forward): set offload_optimizer.device "cpu" or "nvme", or remove delayed_update']
    assert Config.load(zero(2, offload_optimizer={"device": "cpu", "delayed_update": True}))


def test_delayed_update_needs_the_whole_optimizer_state_offloaded():
    assert problems(zero(2, offload_optimizer={"device": "cpu", "ratio": 0.5, "delayed_update": True})) == [
        "zero_optimization.offload_optimizer.delayed_update true needs the whole optimizer state offloaded, not "
        "ratio 0.5: the part kept on the device is stepped in place, in the parameters the next forward reads "
        "while the delayed step runs; set offload_optimizer.ratio 1, or remove delayed_update"]


@pytest.mark.parametrize("zeropp, named", [
    ({"zero_quantized_weights": True}, "zero_quantized_weights true (qwZ's quantized gather is not implemented"),
    ({"zero_hpz_partition_size": 2}, "zero_hpz_partition_size 2 (hpZ keeps a secondary copy of each unit's "
                                     "parameters on the device after its forward, which defeats parameter offload"),
    ({"zero_quantized_weights": True, "zero_hpz_partition_size": 4}, "zero_quantized_weights true, "
                                                                     "zero_hpz_partition_size 4 (qwZ"),
])
def test_param_offload_with_zeropp_weights_is_refused(zeropp, named):
    lines = problems(zero(3, offload_param={"device": "cpu"}, **zeropp))
    assert len(lines) == 1 and lines[0].startswith(
        'zero_optimization.offload_param.device "cpu" is not supported together with ZeRO++\'s ' + named)
    assert lines[0].endswith('set offload_param.device "none", or turn those keys off')
    # qgZ and optimizer offload go with ZeRO++
    assert Config.load(zero(3, offload_param={"device": "cpu"}, zero_quantized_gradients=True))
    assert Config.load(zero(3, offload_optimizer={"device": "cpu"}, **zeropp))


def test_every_problem_of_a_config_is_in_one_error():
    raw = zero(0, offload_optimizer={"device": "nvme"}, offload_param={"device": "nvme"})
    assert [line.split(" ")[0] for line in problems(raw)] == [
        "zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device",
        "zero_optimization.offload_optimizer.nvme_path", "zero_optimization.offload_param.nvme_path"]


# ---- DeepSpeed's other names ----

def test_the_registry_marks_exactly_the_names_merged():
    assert {key for key, rule in RULES.items() if rule.status is Status.MAPPED} == set(OTHER_NAMES)


def test_legacy_switches_are_read_into_the_blocks():
    raw = zero(3, cpu_offload=True, cpu_offload_param=True, cpu_offload_use_pin_memory=True)
    config, report = Config.load_with_report(raw)
    z = config.zero_optimization
    assert (z.offload_optimizer.device, z.offload_optimizer.pin_memory) == ("cpu", True)
    assert (z.offload_param.device, z.offload_param.pin_memory) == ("cpu", True)
    assert report.mapped == [
        ("zero_optimization.offload_optimizer.device", "cpu", "zero_optimization.cpu_offload true"),
        ("zero_optimization.offload_param.device", "cpu", "zero_optimization.cpu_offload_param true"),
        ("zero_optimization.offload_optimizer.pin_memory", True, "zero_optimization.cpu_offload_use_pin_memory true"),
        ("zero_optimization.offload_param.pin_memory", True, "zero_optimization.cpu_offload_use_pin_memory true")]
    assert "set from DeepSpeed's other names or initialize(offload=...):" in report.block()
    assert raw["zero_optimization"]["cpu_offload"] is True  # the caller's dict is kept
    # false asks for nothing; agreeing with the block is fine
    assert not Config.load(zero(2, cpu_offload=False)).zero_optimization.offload_optimizer.enabled
    assert Config.load(zero(2, cpu_offload=True, offload_optimizer={"device": "cpu"}))
    _, report = Config.load_with_report(zero(2, cpu_offload_use_pin_memory=True))
    assert report.no_effect == [("zero_optimization.cpu_offload_use_pin_memory",
                                 "no offload block is enabled, so there is no host memory to pin")]


def test_a_legacy_switch_against_the_block_names_both():
    assert problems(zero(2, cpu_offload=True, offload_optimizer={"device": "nvme", "nvme_path": "/x"})) == [
        'zero_optimization.cpu_offload true sets zero_optimization.offload_optimizer.device to "cpu", but the config '
        'has "nvme": keep offload_optimizer (DeepSpeed\'s current key) and remove zero_optimization.cpu_offload']
    assert problems(zero(3, cpu_offload_param=False, offload_param={"device": "cpu"}))[0].startswith(
        'zero_optimization.cpu_offload_param false sets zero_optimization.offload_param.device to "none", but the '
        'config has "cpu"')
    assert problems(zero(2, cpu_offload_use_pin_memory=True, offload_optimizer={"device": "cpu", "pin_memory": False})
                    ) == ["zero_optimization.cpu_offload_use_pin_memory true sets zero_optimization.offload_optimizer."
                          "pin_memory to true, but the config has false: keep the block's pin_memory and remove "
                          "zero_optimization.cpu_offload_use_pin_memory"]
    assert problems(zero(2, cpu_offload="yes")) == [
        'zero_optimization.cpu_offload must be true or false (a JSON boolean); got "yes"']


def test_aio_intra_op_parallelism_is_thread_count():
    config, report = Config.load_with_report({"aio": {"intra_op_parallelism": 4}})
    assert config.aio.thread_count == 4 and report.mapped[0][:2] == ("aio.thread_count", 4)
    assert Config.load({"aio": {"intra_op_parallelism": 2, "thread_count": 2}}).aio.thread_count == 2
    assert problems({"aio": {"intra_op_parallelism": 2, "thread_count": 3}}) == [
        "aio.intra_op_parallelism 2 and aio.thread_count 3 disagree (DeepSpeed's newer and older name of one "
        "setting): keep one of them"]


# ---- Hugging Face's files ----

def hf_file(name: str, device: str) -> dict:
    raw = {**json.loads((DATA / name).read_text(encoding="utf-8")), **OVERRIDE}
    for block in ("offload_optimizer", "offload_param"):
        if block in raw["zero_optimization"]:
            raw["zero_optimization"][block].update({"device": device}, **(
                {"nvme_path": "/local_nvme"} if device == "nvme" else {}))
    return raw


@pytest.mark.parametrize("name", ["ds_config_zero2.json", "ds_config_zero3.json"])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_hf_files_load_with_cpu_and_disk_offload(name, device):
    config = Config.load(hf_file(name, device), _facts())
    z = config.zero_optimization
    assert z.offload_optimizer.device == device and z.offload_optimizer.pin_memory is True
    assert z.offload_param.device == (device if "zero3" in name else "none")
    if device == "nvme":
        raw = hf_file(name, device)
        del raw["zero_optimization"]["offload_optimizer"]["nvme_path"]
        assert problems(raw, facts=_facts())[0].startswith("zero_optimization.offload_optimizer.nvme_path is required")


def _facts():
    from zeroshard.config import ConfigFacts
    from zeroshard.config.from_code import optimizer_facts

    opt = torch.optim.AdamW(torch.nn.Linear(3, 3).parameters(), lr=5e-5, weight_decay=0.01)
    return ConfigFacts(world_size=2, param_dtype="float32", hidden_size=64,
                       optimizer=optimizer_facts("AdamW", opt.param_groups), lr_scheduler="LambdaLR")


# ---- initialize(offload=...) ----

def test_offload_argument_fills_the_blocks():
    config, report = Config.load_with_report(zero(1), offload="cpu")
    assert config.zero_optimization.offload_optimizer.device == "cpu"
    assert report.mapped == [("zero_optimization.offload_optimizer.device", "cpu", "initialize(offload=...)")]
    arg = {"optimizer": "nvme", "param": "cpu", "nvme_path": "/local_nvme", "ratio": 0.5}
    assert [line.split(" ")[0] for line in problems({}, offload=arg)] == [  # it chooses no stage
        "zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device"]
    z = Config.load(zero(3), offload=arg).zero_optimization
    assert (z.offload_optimizer.device, z.offload_optimizer.nvme_path, z.offload_optimizer.ratio) == (
        "nvme", "/local_nvme", 0.5)
    assert (z.offload_param.device, z.offload_param.nvme_path) == ("cpu", None)  # the path is for disk blocks
    # what the config already says is fine; it may give the rest
    raw = zero(3, offload_optimizer={"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 8})
    assert Config.load(raw, offload=arg).zero_optimization.offload_optimizer.buffer_count == 8
    assert Config.load(zero(2), offload=None) == Config.load(zero(2))


def test_offload_argument_against_the_config_is_an_error():
    raw = zero(2, offload_optimizer={"device": "nvme", "nvme_path": "/a"})
    assert problems(raw, offload="cpu") == [
        'initialize(offload=...) sets zero_optimization.offload_optimizer.device to "cpu", but the config has '
        '"nvme": give it in one place']
    assert problems(raw, offload={"optimizer": "nvme", "nvme_path": "/b"}) == [
        'initialize(offload=...) sets zero_optimization.offload_optimizer.nvme_path to "/b", but the config has "/a": '
        "give it in one place"]
    assert problems(zero(2, cpu_offload=True), offload="none")[0].startswith(
        'initialize(offload=...) sets zero_optimization.offload_optimizer.device to "none", but the config has "cpu"')


@pytest.mark.parametrize("offload, line", [
    (5, 'initialize(offload=...) must be None, one of "none", "cpu", "nvme" (the optimizer state\'s device) or a dict '
        "with keys optimizer, param, nvme_path, ratio; got int"),
    ("gpu", "initialize(offload=...)'s optimizer must be one of \"none\", \"cpu\", \"nvme\"; got \"gpu\""),
    ({"params": "cpu"}, 'initialize(offload=...) has no key "params"; its keys are optimizer, param, nvme_path, ratio'),
    ({"optimizer": "nvme", "nvme_path": ""}, "initialize(offload=...)'s nvme_path must be a directory path (a "
                                             'non-empty string); got ""'),
    ({"optimizer": "cpu", "ratio": "half"}, "initialize(offload=...)'s ratio must be a number in (0, 1]; got \"half\""),
    ({"optimizer": "cpu", "nvme_path": "/x"}, "initialize(offload=...) gives nvme_path, but no offload block has "
                                              'device "nvme": add "optimizer": "nvme" or "param": "nvme", or drop '
                                              "nvme_path"),
    ({"ratio": 0.5}, "initialize(offload=...) gives ratio, but the optimizer state is not offloaded: add "
                     '"optimizer": "cpu" (or "nvme"), or drop ratio'),
])
def test_bad_offload_arguments(offload, line):
    assert problems(zero(2), offload=offload) == [line]


def test_offload_argument_with_a_config_object_checks_only_what_it_sets():
    loaded = Config.load(zero(3, stage3_wrap_classes=["Block"]))
    z = Config.load(loaded, offload={"optimizer": "cpu", "param": "cpu"}).zero_optimization
    assert z.offload_optimizer.enabled and z.offload_param.enabled and z.stage3_wrap_classes == ("Block",)
    explicit = Config.load(zero(3, offload_optimizer={"device": "none"}))
    assert problems(explicit, offload="cpu")[0].startswith(
        'initialize(offload=...) sets zero_optimization.offload_optimizer.device to "cpu", but the config has "none"')
    assert Config.load(loaded) is loaded  # nothing to merge: returned as is


def test_initialize_takes_offload_and_refuses_a_conflict_before_building():
    assert inspect.signature(zeroshard.initialize).parameters["offload"].default is None
    model = torch.nn.Linear(2, 2)
    raw = {**zero(2, offload_optimizer={"device": "nvme", "nvme_path": "/x"}), "train_micro_batch_size_per_gpu": 1}
    with pytest.raises(ConfigError, match=r"initialize\(offload=...\) sets zero_optimization.offload_optimizer.device"):
        zeroshard.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), copy.deepcopy(raw), offload="cpu")


# ---- zero.Init(remote_device=...) ----

def test_zero_init_remote_device_must_agree_with_the_config(tmp_path):
    on_cpu = {**zero(3, offload_param={"device": "cpu"}), "train_batch_size": "auto"}  # autos need not resolve here
    for config in (on_cpu, zero(3, cpu_offload_param=True), Config.load(zero(3, offload_param={"device": "cpu"}))):
        with deepspeed.zero.Init(remote_device="cpu", config_dict_or_path=config):
            assert torch.nn.Linear(2, 2).weight.is_meta
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(zero(3, offload_param={"device": "nvme", "nvme_path": "/x"})))
    deepspeed.zero.Init(remote_device="nvme", config_dict_or_path=str(path))
    deepspeed.zero.Init(remote_device="nvme", config=path)  # DeepSpeed's older keyword
    deepspeed.zero.Init(remote_device="none", config_dict_or_path=zero(3))
    deepspeed.zero.Init(remote_device="none")
    with pytest.raises(UnsupportedError, match=r"zero.Init\(remote_device='nvme'\) disagrees with the config's "
                                               r'zero_optimization.offload_param.device "cpu": zeroshard reads'):
        deepspeed.zero.Init(remote_device="nvme", config_dict_or_path=on_cpu)
    with pytest.raises(UnsupportedError, match=r"remote_device='cpu'\) needs the config beside it: zeroshard reads "
                                               r"where stage 3's parameters live \(offload\) from the config key "
                                               r"zero_optimization.offload_param.device"):
        deepspeed.zero.Init(remote_device="cpu")
    with pytest.raises(UnsupportedError, match="DeepSpeed's values are"):
        deepspeed.zero.Init(remote_device="gpu", config_dict_or_path=on_cpu)
    assert declared_param_device({}) == "none" and declared_param_device(zero(3, offload_param=None)) == "none"


@pytest.mark.parametrize("block", ["offload_optimizer", "offload_param"])
def test_async_save_with_a_disk_tier_is_refused_when_the_config_loads(block):
    raw = zero(3, **{block: {"device": "nvme", "nvme_path": "/x"}}) | {"checkpoint": {"async_save": True}}
    with pytest.raises(ConfigError, match=r"checkpoint.async_save with offload device \"nvme\""):
        Config.load(raw)
    assert Config.load(zero(3, **{block: {"device": "cpu"}}) | {"checkpoint": {"async_save": True}})
