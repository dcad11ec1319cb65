"""Every DeepSpeed config key has one status (deepspeed_keys.py), and the docs' key table is the registry's."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from zeroshard.config import RULES, Config, ConfigError, ConfigWarning, Status
from zeroshard.config.deepspeed_keys import is_section
from zeroshard.config.keys import _schema_keys
from zeroshard.config.keys_table import END, START, table
from zeroshard.config.offload_merge import OTHER_NAMES

BUSY = [True, {"enabled": True, "device": "cpu", "autotp_size": 2, "deepcompile": True}, 2, "sum", "bf16"]
IDLE = [False, {}, 1, -1, "mean", 1.0, None, True]


def nested(dotted: str, value) -> dict:
    *parents, key = dotted.split(".")
    raw = {key: value}
    for parent in reversed(parents):
        raw = {parent: raw}
    return raw


def load(raw: dict):
    return Config.load_with_report(raw)


@pytest.mark.parametrize("key", sorted(RULES))
def test_each_deepspeed_key_has_its_status(key):
    rule = RULES[key]
    if rule.status is Status.MAPPED:  # read into the key it names (tests/config/test_offload_keys.py)
        _, report = load(nested(key, 1 if key.startswith("aio.") else False))
        said = [why for k, why in report.no_effect if k == key] + [
            source for _, _, source in report.mapped if source.startswith(key)]
        assert key in OTHER_NAMES and len(said) == 1, (key, report)
        return
    if rule.status is Status.NO_EFFECT:
        _, report = load(nested(key, 1))
        assert report.no_effect == [(key, rule.why)]
        return
    busy = next(v for v in BUSY if rule.idle is None or not rule.idle(v))
    with pytest.raises(ConfigError) as info:
        load(nested(key, busy))
    yet = " yet" if rule.status is Status.NOT_YET else ""
    assert str(info.value) == f"invalid zeroshard config (dict):\n  - {key} is not supported by zeroshard{yet}: {rule.why}"
    if rule.idle is not None:
        idle = next(v for v in IDLE if rule.idle(v))
        _, report = load(nested(key, idle))
        assert report.no_effect == [(key, f"{rule.idle_values} asks for nothing")]


def test_registry_and_schema_do_not_overlap():
    schema = set(_schema_keys(Config, ""))
    assert not schema & set(RULES)
    sections = {key.rsplit(".", 1)[0] for key in schema if "." in key}
    for key in RULES:  # the key scan reaches every rule: no parent is a rule or a schema key that is no section
        parts = key.split(".")
        for parent in (".".join(parts[:end]) for end in range(1, len(parts))):
            assert parent not in RULES and (parent not in schema or parent in sections), key


DOCUMENTED = Path(__file__).parent / "data" / "deepspeed_config_keys.txt"


def covered(key: str, schema: set[str]) -> bool:
    """A schema key, a rule, a section of rules, or a key inside a value that a rule or a schema field takes whole."""
    parts = key.split(".")
    parents = {".".join(parts[:end]) for end in range(1, len(parts))}
    whole = {k for k in schema if not any(other.startswith(k + ".") for other in schema)}
    return key in schema or key in RULES or is_section(key) or bool(parents & (set(RULES) | whole))


def test_every_documented_deepspeed_key_is_a_schema_field_or_a_rule():
    lines = DOCUMENTED.read_text(encoding="utf-8").splitlines()
    documented = [line for line in lines if line and not line.startswith("#")]
    assert len(documented) > 200 and len(set(documented)) == len(documented)
    schema = set(_schema_keys(Config, ""))
    assert [key for key in documented if not covered(key, schema)] == []
    for key in documented:  # and the loader agrees: any problem is the value's, never an unknown key
        for value in (1, {}):
            try:
                load(nested(key, value))
            except ConfigError as error:
                assert "unknown key" not in str(error), str(error)


def test_a_rule_section_given_a_value_that_is_no_object_says_so():
    for raw, message in [({"data_types": 1}, "data_types must be a JSON object with DeepSpeed's keys "
                                             "(grad_accum_dtype); got 1"),
                         ({"checkpoint": {"parallel_write": True}}, "checkpoint.parallel_write must be a JSON "
                                                                    "object with DeepSpeed's keys (pipeline_stage)")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            Config.load(raw)


def test_misplaced_and_misspelt_keys_suggest_the_right_one():
    for raw, hint in [({"offload_optimizer": {"device": "cpu"}}, "'zero_optimization.offload_optimizer'"),
                      ({"fp61": {"enabled": True}}, "'fp16'"), ({"amp_": {}}, "'amp'"),
                      ({"checkpoint": {"tag_validaton": "Warn"}}, "'tag_validation'"),
                      ({"zero_optimization": {"contiguous_gradient": True}}, "'contiguous_gradients'")]:
        with pytest.raises(ConfigError, match=f"did you mean {hint}"):
            Config.load(raw)


def test_strict_false_ignores_rejected_keys_and_reports_each():
    raw = {"strict": False, "amp": {"enabled": True}, "steps_per_print": 10,
           "zero_optimization": {"stage": 2, "mics_shard_size": 4}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config, report = Config.load_with_report(raw)
    assert [key for key, _ in report.ignored] == ["amp", "zero_optimization.mics_shard_size"]
    assert [key for key, _ in report.no_effect] == ["steps_per_print"]
    assert len([w for w in caught if w.category is ConfigWarning]) == 2
    assert config.stage == 2 and "amp" in raw  # the caller's dict is kept
    with pytest.raises(ConfigError, match="gradient_clipping is \"auto\""):  # autos stay errors
        Config.load({"strict": False, "gradient_clipping": "auto"})


def test_docs_key_table_is_the_registry():
    page = (Path(__file__).parents[2] / "docs" / "deepspeed-config.md").read_text(encoding="utf-8")
    start, end = page.index(START), page.index(END) + len(END)
    assert page[start:end] == table(), "regenerate: python -m zeroshard.config.keys_table (paste between the markers)"
