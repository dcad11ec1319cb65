"""The keys of a raw config: JSON reading, unknown keys (with a suggestion), and DeepSpeed keys by their status.

Pure functions over dicts; the sections' pydantic models come in as arguments.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import warnings
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from zeroshard.config.deepspeed_keys import RULES, Rule, Status, is_section, keys_below
from zeroshard.config.errors import ConfigError, ConfigWarning
from zeroshard.config.report import LoadReport
from zeroshard.config.values import show
from zeroshard.errors import ZeroshardError

NO_EFFECT = "No effect: "  # how the description of a field that changes nothing starts


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object from `path`, or raise `ConfigError` saying what to fix."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' not found; check the path "
                          f"(a relative path is resolved from {Path.cwd()})") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read config file '{path}': {error}") from None
    try:
        raw = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"config file '{path}' is not valid JSON: {error.msg} at line {error.lineno}, "
            f"column {error.colno}; fix the syntax there (JSON allows no comments or "
            "trailing commas, and strings use double quotes)") from None
    except _DuplicateKey as error:
        # json.loads would keep the last value and silently drop the others.
        raise ConfigError(f"config file '{path}' repeats the key '{error}' in one object; "
                          "keep only one") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file '{path}' must hold a JSON object ({{...}}) at the "
                          f"top level; got a JSON {type(raw).__name__}")
    return raw


def raw_config(config, given_as: str) -> dict[str, Any]:
    """A copy of `config` (a dict), or the JSON object of the file it names (`read_json`), as the front doors
    take a DeepSpeed config; `given_as` names the argument in the error for anything else."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        return read_json(Path(config))
    raise ConfigError(f"{given_as} takes a DeepSpeed config dict or the path of its JSON file; "
                      f"got {type(config).__name__}")


class _DuplicateKey(ZeroshardError):
    """Raised by `_reject_duplicate_keys`; the argument is the repeated key."""


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result




def key_problems(raw: dict[str, Any], model: type[BaseModel], report: LoadReport) -> list[str]:
    """One line per unknown key and one line listing the DeepSpeed keys zeroshard rejects.

    Keys with no effect go to `report.no_effect`. Under `"strict": false`
    the rejected keys are not problems: each goes to `report.ignored` and
    gets a `ConfigWarning`. Without problems, every DeepSpeed key that is not
    a schema field is then removed from `raw` (in place).
    """
    unknown: list[str] = []
    rejected: list[tuple[str, Rule]] = []
    _scan_keys(raw, model, "", unknown, rejected, report, sorted(RULES) + _schema_keys(model, ""))
    if rejected and raw.get("strict", True) is False and not unknown:
        for dotted, rule in rejected:
            why = f"{rule.status.value}: {rule.why}"
            warnings.warn(f"zeroshard ignores the DeepSpeed key '{dotted}' ({why}), because the config says "
                          '"strict": false', ConfigWarning, stacklevel=4)
            report.ignored.append((dotted, why))
    else:
        unknown += [f"{dotted} is not supported by zeroshard{' yet' if rule.status is Status.NOT_YET else ''}: "
                    f"{rule.why}" for dotted, rule in rejected]
    if not unknown:
        _drop_deepspeed_keys(raw, model)
    return unknown


def _drop_deepspeed_keys(raw: dict[str, Any], model: type[BaseModel]) -> None:
    """Remove (in place) every key that is not a schema field: each has been reported by now."""
    for key in list(raw):
        field = model.model_fields.get(key)
        if field is None:
            del raw[key]
        elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel) and isinstance(
                raw[key], dict):
            _drop_deepspeed_keys(raw[key], field.annotation)


def _scan_keys(raw: dict[str, Any], model: type[BaseModel] | None, prefix: str, unknown: list[str],
               rejected: list[tuple[str, Rule]], report: LoadReport, known: list[str]) -> None:
    """Walk `raw` against `model` (a schema section, or None below it) and the DeepSpeed registry."""
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        field = model.model_fields.get(key) if model is not None else None
        if field is not None:
            # a no-effect key at its default asks for nothing (a config written back from `to_dict()` has them all)
            if (why := no_effect_field(field.description)) is not None and value != field.default:
                report.no_effect.append((dotted, why))
            nested = field.annotation  # a section such as ZeroConfig, or a plain type
            if isinstance(nested, type) and issubclass(nested, BaseModel) and isinstance(value, dict):
                _scan_keys(value, nested, f"{dotted}.", unknown, rejected, report, known)
        elif dotted in RULES:
            rule = RULES[dotted]
            if rule.status is Status.NO_EFFECT:
                report.no_effect.append((dotted, rule.why))
            elif rule.idle is not None and rule.idle(value):
                report.no_effect.append((dotted, f"{rule.idle_values} asks for nothing"))
            else:
                rejected.append((dotted, rule))
        elif is_section(dotted) and isinstance(value, dict):
            _scan_keys(value, None, f"{dotted}.", unknown, rejected, report, known)
        elif is_section(dotted):  # a known section name: its value is wrong, not its name
            unknown.append(f"{dotted} must be a JSON object with DeepSpeed's keys "
                           f"({', '.join(keys_below(dotted + '.'))}); got {show(value)}")
        else:
            unknown.append(_unknown_key_message(str(key), model, prefix, known))


def no_effect_field(description: str | None) -> str | None:
    """Why a schema field changes nothing (its description starts "No effect: "), else None.

    DeepSpeed keys kept as fields for their section's sake (offload.py's fast_init, aio.single_submit).
    """
    if not description or not description.startswith(NO_EFFECT):
        return None
    return description.removeprefix(NO_EFFECT).partition(" DeepSpeed:")[0].rstrip(".")


def _unknown_key_message(key: str, model: type[BaseModel] | None, prefix: str, known: list[str]) -> str:
    ours = sorted(model.model_fields) if model is not None else []
    here = ours + keys_below(prefix)
    # A key of another section (`offload_optimizer` at the top level) points at its place
    # (`zero_optimization.offload_optimizer`); else the nearest spelling here, DeepSpeed's keys included.
    elsewhere = [k for k in known if k.rsplit(".", 1)[-1] == key and k != prefix + key]
    close = elsewhere[:1] or difflib.get_close_matches(key, here, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    where = f"in '{prefix[:-1]}'" if prefix else "at the top level"
    allowed = ", ".join(ours or keys_below(prefix))
    return f"unknown key '{prefix}{key}'{hint}; allowed keys {where}: {allowed}"


def _schema_keys(model: type[BaseModel], prefix: str) -> list[str]:
    """Every dotted key of the schema, sections' keys included."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            keys += _schema_keys(field.annotation, f"{prefix}{name}.")
    return keys
