"""The Accelerator's arguments written into the zeroshard config (`zeroshard/accelerate/config.py`), in process.

Each case states the config the engine must get, by hand; a disagreement
is a ConfigError naming both values. The refusals before Accelerate sets
up any state (a missing config, DeepSpeed's launch flag) run the class.
"""

from __future__ import annotations

import json

import pytest

from zeroshard.accelerate import Accelerator
from zeroshard.accelerate.config import filled_config, precision_of, read_config
from zeroshard.config import ConfigError
from zeroshard.deepspeed.unsupported import UnsupportedError

STAGE2 = {"zero_optimization": {"stage": 2}}


def test_left_out_or_auto_keys_take_the_accelerators_values():
    assert filled_config(STAGE2, 2, "bf16", 1.0) == {
        "zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "bf16": {"enabled": True}}
    auto = {**STAGE2, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
    assert filled_config(auto, 4, "fp16", 0.5) == {
        "zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4, "gradient_clipping": 0.5,
        "bf16": {"enabled": False}, "fp16": {"enabled": True}}


def test_settings_not_given_leave_the_config_as_it_is():
    config = {**STAGE2, "gradient_accumulation_steps": 8, "bf16": {"enabled": True}}
    assert filled_config(config, None, None, None) == config
    assert filled_config(config, 8, "bf16", None) == config  # the same values: no conflict


def test_each_disagreement_is_named_in_one_error():
    config = {**STAGE2, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0, "bf16": {"enabled": True}}
    with pytest.raises(ConfigError) as raised:
        filled_config(config, 2, "no", 0.5)
    message = str(raised.value)
    assert "config gradient_accumulation_steps is 4 but Accelerator(gradient_accumulation_steps=2)" in message
    assert "config gradient_clipping is 1.0 but Accelerator(max_grad_norm=0.5)" in message
    assert "config bf16.enabled is True but Accelerator(mixed_precision='no')" in message


def test_precision_contradictions_are_errors():
    with pytest.raises(ConfigError, match=r"fp16.enabled is True but Accelerator\(mixed_precision='bf16'\)"):
        filled_config({**STAGE2, "fp16": {"enabled": True}}, None, "bf16", None)
    with pytest.raises(ConfigError, match=r"bf16.enabled is False but Accelerator\(mixed_precision='bf16'\)"):
        filled_config({**STAGE2, "bf16": {"enabled": False}}, None, "bf16", None)
    with pytest.raises(UnsupportedError, match="fp8"):
        filled_config(STAGE2, None, "fp8", None)


def test_auto_clipping_needs_max_grad_norm():
    with pytest.raises(ConfigError, match=r'gradient_clipping is "auto".*max_grad_norm'):
        filled_config({**STAGE2, "gradient_clipping": "auto"}, None, None, None)


def test_precision_of_the_filled_config():
    assert precision_of(STAGE2) == "no"
    assert precision_of({"bf16": {"enabled": True}}) == "bf16"
    assert precision_of({"fp16": {"enabled": True}, "bf16": {"enabled": False}}) == "fp16"
    assert precision_of({"bf16": {"enabled": "auto"}}) is None  # the model's dtype decides at prepare


def test_a_json_path_is_read_and_mistakes_show_at_once(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(STAGE2), encoding="utf-8")
    assert read_config(str(path)) == STAGE2
    with pytest.raises(ConfigError, match="not found; check the path"):
        read_config(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_config(tmp_path / "bad.json")


def test_refused_before_accelerate_sets_up_its_state(monkeypatch):
    with pytest.raises(ConfigError, match="needs config="):
        Accelerator()
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(UnsupportedError, match="accelerate launch --use_deepspeed"):
        Accelerator(config=STAGE2)
    with pytest.raises(UnsupportedError, match=r"Accelerator\(fsdp_plugin=...\)"):
        Accelerator(config=STAGE2, fsdp_plugin=object())
