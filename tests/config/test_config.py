"""Tests for zeroshard.config: loading, defaults, and every error path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from zeroshard.config import (
    Bf16Config,
    CheckpointConfig,
    Config,
    ConfigError,
    Fp16Config,
    ZeroConfig,
)

TOP_ALLOWED = ", ".join(sorted(Config.model_fields))
ZERO_ALLOWED = ", ".join(sorted(ZeroConfig.model_fields))

DEFAULTS = {
    "train_micro_batch_size_per_gpu": None,
    "train_batch_size": None,
    "optimizer": None,
    "scheduler": None,
    "strict": True,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "gradient_allreduce_op": "mean",
    "gradient_divide_factor": None,
    "collective_timeout": 1800.0,
    "rank_check_timeout": 20.0,
    "zero_optimization": {
        "stage": 0,
        "reduce_scatter": True,
        "reduce_once_per_window": False,
        "reduce_bucket_size": 25_000_000,
        "allgather_bucket_size": 25_000_000,
        "overlap_comm": True,
        "overlap_param_gather": False,
        "stage3_wrap_classes": [],
        "leaf_module": {"classes": [], "names": [], "name_suffixes": []},
        "stage3_auto_wrap_min_params": 1_000_000,
        "stage3_param_persistence_threshold": 100_000,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 50_000_000,
        "offload_optimizer": {"device": "none", "nvme_path": None, "pin_memory": False, "buffer_count": 4,
                              "ratio": 1.0, "fast_init": False, "pipeline_read": False, "pipeline_write": False,
                              "delayed_update": False, "delayed_update_warmup": 20},
        "offload_param": {"device": "none", "nvme_path": None, "pin_memory": False, "buffer_count": 5,
                          "buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000},
        "sub_group_size": 1_000_000_000,
        "zero_quantized_weights": False,
        "zero_hpz_partition_size": 1,
        "zero_quantized_gradients": False,
        "zeropp_block_size": 128,
        "zeropp_gradient_bits": 8,
        "zeropp_gradient_hadamard": None,
        "zeropp_compile_quantizers": None,
        "zeropp_ranks_per_node": None,
    },
    "bf16": {"enabled": False},
    "fp16": {"enabled": False, "loss_scale": 0.0, "initial_scale_power": 16, "loss_scale_window": 1000,
             "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1.0},
    "communication_data_type": None,
    "communication_compression": {
        "gradients": {"codec": "none", "block_size": 128, "hadamard": False, "error_feedback": True,
                      "hierarchical": False, "rank": 4, "start_step": 10, "warm_start": True},
        "parameters": {"codec": "none", "block_size": 128, "hadamard": False}},
    "dataloader_drop_last": False,
    "checkpoint": {"tag_validation": "Warn", "async_save": False},
    "non_finite": {"action": "skip", "max_consecutive_skips": 10},
    "aio": {"block_size": 1_048_576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
            "overlap_events": True, "use_gds": False},
    "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                 "contiguous_memory_optimization": False, "number_checkpoints": None,
                                 "synchronize_checkpoint_boundary": False, "profile": False},
}


def error_of(source) -> str:
    """The message of the ConfigError that `Config.load(source)` raises."""
    with pytest.raises(ConfigError) as info:
        Config.load(source)
    return str(info.value)


def one_problem(line: str) -> str:
    """The full message for a dict config with exactly one problem."""
    return f"invalid zeroshard config (dict):\n  - {line}"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_text(text, encoding="utf-8")
    return path


# ---- defaults and inputs ----

def test_defaults():
    config = Config.load({})
    assert config.to_dict() == DEFAULTS
    assert config == Config()
    assert config.stage == 0
    assert config.zero_optimization.reduce_scatter is True
    assert config.zero_optimization.overlap_comm is True


def test_empty_zero_section_gives_defaults():
    assert Config.load({"zero_optimization": {}}) == Config()


def test_load_from_dict():
    config = Config.load({
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 8,
        "gradient_clipping": 1,
        "zero_optimization": {"stage": 2, "reduce_scatter": False, "overlap_comm": False,
                              "reduce_bucket_size": 1000, "allgather_bucket_size": 2000},
    })
    assert config.train_micro_batch_size_per_gpu == 4
    assert config.gradient_accumulation_steps == 8
    assert config.gradient_clipping == 1.0 and isinstance(config.gradient_clipping, float)
    assert config.zero_optimization == ZeroConfig(
        stage=2, reduce_scatter=False, overlap_comm=False,
        reduce_bucket_size=1000, allgather_bucket_size=2000)
    assert config.stage == 2


@pytest.mark.parametrize("as_path", [str, Path])
def test_load_from_path(tmp_path, as_path):
    path = write(tmp_path, json.dumps({"zero_optimization": {"stage": 1}}))
    config = Config.load(as_path(path))
    assert config.stage == 1
    assert config.zero_optimization.reduce_bucket_size == 25_000_000


def test_load_config_returns_it_unchanged():
    config = Config.load({"zero_optimization": {"stage": 2}})
    assert Config.load(config) is config


def test_load_rejects_other_types():
    assert error_of(42) == ("Config.load expects a dict, a path to a JSON file or a Config; "
                            "got int")


# ---- files ----

def test_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=re.escape(f"config file '{path}' not found; "
                                                    "check the path")):
        Config.load(path)


def test_json_syntax_error_names_line_and_column(tmp_path):
    path = write(tmp_path, '{\n  "gradient_accumulation_steps": 2,\n}\n')
    message = error_of(path)
    assert message.startswith(f"config file '{path}' is not valid JSON: ")
    assert "at line 3, column 1; fix the syntax there" in message


def test_json_top_level_must_be_object(tmp_path):
    path = write(tmp_path, "[1, 2]")
    assert error_of(path) == (f"config file '{path}' must hold a JSON object ({{...}}) at the "
                              "top level; got a JSON list")


def test_json_duplicate_key_is_an_error(tmp_path):
    path = write(tmp_path, '{"zero_optimization": {"stage": 1, "stage": 2}}')
    assert error_of(path) == (f"config file '{path}' repeats the key 'stage' in one object; "
                              "keep only one")


def test_file_errors_name_the_file(tmp_path):
    path = write(tmp_path, '{"zero_optimization": {"stage": 7}}')
    assert error_of(path).startswith(f"invalid zeroshard config (file '{path}'):\n")


# ---- keys ----

def test_top_level_typo_suggests_spelling():
    assert error_of({"gradient_acumulation_steps": 2}) == one_problem(
        "unknown key 'gradient_acumulation_steps' (did you mean "
        f"'gradient_accumulation_steps'?); allowed keys at the top level: {TOP_ALLOWED}")


def test_nested_typo_names_dotted_path_and_suggests_spelling():
    assert error_of({"zero_optimization": {"reduce_bucket_sise": 5}}) == one_problem(
        "unknown key 'zero_optimization.reduce_bucket_sise' (did you mean "
        f"'reduce_bucket_size'?); allowed keys in 'zero_optimization': {ZERO_ALLOWED}")


def test_unknown_key_without_close_match_has_no_suggestion():
    assert error_of({"zero_optimization": {"xyzzy": 1}}) == one_problem(
        f"unknown key 'zero_optimization.xyzzy'; allowed keys in 'zero_optimization': "
        f"{ZERO_ALLOWED}")


def test_misspelt_deepspeed_key_suggests_it():
    with pytest.raises(ConfigError, match=re.escape("unknown key 'fp61' (did you mean 'fp16'?)")):
        Config.load({"fp61": {"enabled": True}})
    with pytest.raises(ConfigError, match=re.escape("unknown key 'amp_' (did you mean 'amp'?)")):
        Config.load({"amp_": {"enabled": True}})


# ---- values ----

@pytest.mark.parametrize("stage, shown", [(7, "7"), (4, "4"), (-1, "-1"), (True, "true"),
                                          ("2", '"2"'), (2.0, "2.0")])
def test_bad_stage(stage, shown):
    assert error_of({"zero_optimization": {"stage": stage}}) == one_problem(
        f"zero_optimization.stage must be one of 0, 1, 2, 3; got {shown}")


@pytest.mark.parametrize("config, line", [
    ({"collective_timeout": 0}, "collective_timeout must be a number of seconds > 0; got 0"),
    ({"collective_timeout": "1h"}, 'collective_timeout must be a number of seconds > 0; got "1h"'),
    ({"zero_optimization": {"stage3_wrap_classes": "Block"}},
     'zero_optimization.stage3_wrap_classes must be a list of module class names such as ["Block"]; got "Block"'),
    ({"zero_optimization": {"stage3_param_persistence_threshold": -1}},
     "zero_optimization.stage3_param_persistence_threshold must be an integer >= 0; got -1"),
    ({"zero_optimization": {"stage3_max_live_parameters": 0}},
     "zero_optimization.stage3_max_live_parameters must be a positive integer; got 0"),
])
def test_stage3_and_timeout_errors(config, line):
    assert error_of(config) == one_problem(line)


@pytest.mark.parametrize("key", ["reduce_bucket_size", "allgather_bucket_size"])
@pytest.mark.parametrize("size", [0, -1, -5e8])
def test_bucket_size_must_be_positive(key, size):
    assert error_of({"zero_optimization": {key: size}}) == one_problem(
        f"zero_optimization.{key} must be a positive integer; got {int(size)}")


@pytest.mark.parametrize("key", ["reduce_bucket_size", "allgather_bucket_size"])
def test_bucket_size_accepts_whole_float(key):
    size = getattr(Config.load({"zero_optimization": {key: 5e8}}).zero_optimization, key)
    assert size == 500_000_000 and type(size) is int


def test_bucket_size_rejects_fraction():
    assert error_of({"zero_optimization": {"reduce_bucket_size": 1.5}}) == one_problem(
        "zero_optimization.reduce_bucket_size must be a positive integer; got 1.5 "
        "(a float is accepted only when it is a whole number, such as 5e8)")


@pytest.mark.parametrize("size, shown", [("25 MB", '"25 MB"'), (True, "true"),
                                         (None, "null")])
def test_bucket_size_rejects_non_numbers(size, shown):
    assert error_of({"zero_optimization": {"allgather_bucket_size": size}}) == one_problem(
        f"zero_optimization.allgather_bucket_size must be a positive integer; got {shown}")


@pytest.mark.parametrize("key", ["reduce_scatter", "overlap_comm"])
@pytest.mark.parametrize("value, shown", [("yes", '"yes"'), ("true", '"true"'), (1, "1"),
                                          (0, "0"), (None, "null")])
def test_bool_is_strict(key, value, shown):
    assert error_of({"zero_optimization": {key: value}}) == one_problem(
        f"zero_optimization.{key} must be true or false (a JSON boolean); got {shown}")


@pytest.mark.parametrize("key", ["gradient_accumulation_steps", "train_micro_batch_size_per_gpu"])
def test_counts_must_be_positive(key):
    assert error_of({key: 0}) == one_problem(f"{key} must be a positive integer; got 0")


def test_micro_batch_size_may_be_null():
    config = Config.load({"train_micro_batch_size_per_gpu": None})
    assert config.train_micro_batch_size_per_gpu is None


@pytest.mark.parametrize("value, shown", [(-0.5, "-0.5"), (True, "true"), ("one", '"one"'), ("-1.0", '"-1.0"'),
                                          (float("inf"), "Infinity")])
def test_gradient_clipping_must_be_finite_non_negative(value, shown):
    assert error_of({"gradient_clipping": value}) == one_problem(
        f"gradient_clipping must be a finite number >= 0 (0.0 turns clipping off); got {shown}")


def test_zero_section_must_be_object():
    assert error_of({"zero_optimization": 2}) == one_problem(
        'zero_optimization must be a JSON object such as {"stage": 2}; got 2')


def test_every_bad_value_reported_once_in_one_error():
    message = error_of({"gradient_accumulation_steps": -2,
                        "zero_optimization": {"stage": 7, "overlap_comm": "yes"}})
    assert message.splitlines() == [
        "invalid zeroshard config (dict):",
        "  - gradient_accumulation_steps must be a positive integer; got -2",
        "  - zero_optimization.stage must be one of 0, 1, 2, 3; got 7",
        "  - zero_optimization.overlap_comm must be true or false (a JSON boolean); got \"yes\"",
    ]


def test_tag_validation_takes_deepspeeds_spellings_in_any_case():
    # DeepSpeed upper-cases the value and accepts WARN, IGNORE and FAIL (runtime/constants.py ValidationMode).
    for given, stored in [("Warn", "Warn"), ("WARN", "Warn"), ("ignore", "Ignore"), ("FaIl", "Fail")]:
        assert Config.load({"checkpoint": {"tag_validation": given}}).checkpoint.tag_validation == stored
    assert Config.load({}).checkpoint.tag_validation == "Warn"
    assert error_of({"checkpoint": {"tag_validation": "strict"}}) == one_problem(
        'checkpoint.tag_validation must be one of "Warn", "Ignore", "Fail" (any case); got "strict"')
    assert error_of({"checkpoint": "Fail"}) == one_problem(
        'checkpoint must be a JSON object such as {"tag_validation": "Warn"}; got "Fail"')


def test_checkpoint_section_keeps_the_other_deepspeed_keys_statuses():
    config, report = Config.load_with_report({"checkpoint": {
        "tag_validation": "fail", "load_universal": True, "use_node_local_storage": False,
        "parallel_write": {"pipeline_stage": True}}})
    assert config.checkpoint == CheckpointConfig(tag_validation="Fail")
    assert [key for key, _ in report.no_effect] == [
        "checkpoint.load_universal", "checkpoint.use_node_local_storage", "checkpoint.parallel_write.pipeline_stage"]
    assert "checkpoint.use_node_local_storage is not supported" in error_of(
        {"checkpoint": {"use_node_local_storage": True}})


def test_dataloader_drop_last():
    assert Config.load({}).dataloader_drop_last is False
    assert Config.load({"dataloader_drop_last": True}).dataloader_drop_last is True
    assert error_of({"dataloader_drop_last": "true"}) == one_problem(
        'dataloader_drop_last must be true or false (a JSON boolean); got "true"')


# ---- the loaded object ----

def test_config_is_frozen():
    config = Config.load({})
    with pytest.raises(ValidationError, match="frozen"):
        config.gradient_accumulation_steps = 2
    with pytest.raises(ValidationError, match="frozen"):
        config.zero_optimization.stage = 2
    assert config == Config()


def test_to_dict_round_trip():
    config = Config.load({
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": 2, "reduce_scatter": False, "reduce_bucket_size": 2e8,
                              "allgather_bucket_size": 1234, "overlap_comm": False},
    })
    as_dict = config.to_dict()
    assert as_dict["zero_optimization"]["reduce_bucket_size"] == 200_000_000
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert Config.load(as_dict) == config
    assert Config.load(as_dict) != Config()


def test_every_field_documents_its_deepspeed_key():
    for model in (Config, ZeroConfig, Bf16Config, Fp16Config, CheckpointConfig):
        for name, field in model.model_fields.items():
            assert field.description and "DeepSpeed: " in field.description, name


# ---- mixed precision ----

def test_precision_defaults_hold_whichever_keys_are_given():
    config = Config.load({"fp16": {"enabled": True, "hysteresis": 3}})
    assert config.fp16 == Fp16Config(enabled=True, hysteresis=3)
    assert (config.fp16.loss_scale, config.fp16.initial_scale_power, config.fp16.loss_scale_window,
            config.fp16.consecutive_hysteresis, config.fp16.min_loss_scale) == (0.0, 16, 1000, False, 1.0)
    assert config.training_dtype == "fp16"
    assert Config.load({"bf16": {"enabled": True}}).training_dtype == "bf16"
    assert Config.load({"bf16": {"enabled": False}}).training_dtype == "fp32"
    assert Config.load({"bf16": {"enabled": True}, "communication_data_type": "fp32"}).communication_data_type == "fp32"


@pytest.mark.parametrize("config, line", [
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}},
     "bf16.enabled and fp16.enabled are both true; enable one of them (bf16 needs no loss scaling where "
     "the hardware has it)"),
    ({"bf16": True}, 'bf16 must be a JSON object such as {"enabled": true}; got true'),
    ({"fp16": []}, 'fp16 must be a JSON object such as {"enabled": true}; got []'),
    ({"bf16": {"enabled": 1}}, "bf16.enabled must be true or false (a JSON boolean); got 1"),
    ({"fp16": {"enabled": "yes"}}, 'fp16.enabled must be true or false (a JSON boolean); got "yes"'),
    ({"fp16": {"loss_scale": -1}}, "fp16.loss_scale must be a finite number >= 0 (0 = dynamic loss scaling); got -1"),
    ({"fp16": {"initial_scale_power": 1.5}}, "fp16.initial_scale_power must be an integer >= 0; got 1.5"),
    ({"fp16": {"loss_scale_window": 0}}, "fp16.loss_scale_window must be a positive integer; got 0"),
    ({"fp16": {"hysteresis": 0}}, "fp16.hysteresis must be a positive integer; got 0"),
    ({"fp16": {"consecutive_hysteresis": "no"}},
     'fp16.consecutive_hysteresis must be true or false (a JSON boolean); got "no"'),
    ({"fp16": {"min_loss_scale": 0}}, "fp16.min_loss_scale must be a finite number > 0; got 0"),
    ({"communication_data_type": "int8"},
     'communication_data_type must be one of "fp32", "bf16", "fp16" or null; got "int8"'),
    ({"communication_data_type": "bf16"},
     'communication_data_type "bf16" needs bf16.enabled: gradients are reduced in fp32 or in the training '
     'dtype (here "fp32")'),
    ({"fp16": {"enabled": True}, "communication_data_type": "bf16"},
     'communication_data_type "bf16" needs bf16.enabled: gradients are reduced in fp32 or in the training '
     'dtype (here "fp16")'),
    ({"fp16": {"enabled": True, "auto_cast": True}},
     "fp16.auto_cast is not supported by zeroshard: zeroshard casts floating-point inputs to the training "
     "dtype itself; remove the key"),
])
def test_precision_errors(config, line):
    assert error_of(config) == one_problem(line)


def test_precision_typo_suggests_spelling():
    assert error_of({"fp16": {"enabled": True, "hysterisis": 2}}) == one_problem(
        "unknown key 'fp16.hysterisis' (did you mean 'hysteresis'?); allowed keys in 'fp16': "
        "consecutive_hysteresis, enabled, hysteresis, initial_scale_power, loss_scale, loss_scale_window, "
        "min_loss_scale")


@pytest.mark.parametrize("zero, words", [
    ({"stage": 2, "zero_quantized_weights": True}, "need stage 3, not stage 2"),
    ({"stage": 3, "zero_quantized_gradients": True, "reduce_scatter": False}, "cannot run with reduce_scatter false"),
    ({"stage": 3, "zero_quantized_gradients": True, "zeropp_gradient_hadamard": True, "zeropp_block_size": 96},
     "power-of-two"),
    ({"stage": 3, "zero_hpz_partition_size": 4, "zeropp_ranks_per_node": 2}, "differs from zeropp_ranks_per_node"),
    ({"stage": 3, "zeropp_gradient_bits": 4}, "zeropp_gradient_bits \\(needs zero_quantized_gradients\\)"),
    ({"stage": 3, "zeropp_gradient_bits": 3, "zero_quantized_gradients": True}, "must be 4 or 8"),
    ({"stage": 3, "zeropp_compile_quantizers": True}, "zeropp_compile_quantizers \\(needs zero_quantized_weights"),
])
def test_zeropp_combinations_that_cannot_be_honoured_are_errors(zero, words):
    with pytest.raises(ConfigError, match=words):
        Config.load({"zero_optimization": zero})


def test_zeropp_defaults_survive_a_round_trip_and_follow_the_bits():
    config = Config.load({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}})
    assert config.zero_optimization.gradient_hadamard is False  # int8: no rotation
    assert config.zero_optimization.gradient_format == "int8"  # the codec's format (comm/compress/quantize.py)
    four = Config.load({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True, "zeropp_gradient_bits": 4}})
    assert four.zero_optimization.gradient_hadamard is True
    assert four.zero_optimization.gradient_format == "int4"
    assert Config.load(Config.load({}).to_dict()) == Config.load({})
    # Compiling is on where a compiler is (null); switching it off needs no quantizer to be on.
    assert Config.load({"zero_optimization": {"stage": 3}}).zero_optimization.zeropp_compile_quantizers is None
    off = Config.load({"zero_optimization": {"stage": 3, "zeropp_compile_quantizers": False}})
    assert off.zero_optimization.zeropp_compile_quantizers is False
