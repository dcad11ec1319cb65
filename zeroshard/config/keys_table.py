"""The markdown table of every DeepSpeed config key and its status in zeroshard, for docs/deepspeed-config.md.

Implemented keys are the schema's fields that name a DeepSpeed key (their
description ends "DeepSpeed: <key>", not "DeepSpeed: none"), except those whose
description starts "No effect: " (no effect); the others come from the
registry (deepspeed_keys.py). A test checks the page holds this
table between its markers; `python -m zeroshard.config.keys_table` prints it.
"""

from __future__ import annotations

from pydantic import BaseModel

from zeroshard.config.deepspeed_keys import RULES, Status
from zeroshard.config.keys import no_effect_field
from zeroshard.config.schema import Config

START, END = "<!-- key-table:start -->", "<!-- key-table:end -->"


def _implemented(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str]]:
    rows = []
    for name, field in model.model_fields.items():
        description = field.description or ""
        if "DeepSpeed: none" in description:
            continue  # a zeroshard-only key
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows += _implemented(annotation, f"{prefix}{name}.")
        elif (why := no_effect_field(description)) is not None:
            rows.append((prefix + name, Status.NO_EFFECT.value, why))
        else:
            rows.append((prefix + name, Status.IMPLEMENTED.value, description.partition(" DeepSpeed:")[0]))
    return rows


def table() -> str:
    """The table, markers included."""
    rows = _implemented(Config, "")
    for key, rule in RULES.items():
        why = rule.why
        if rule.idle is not None:
            why = f"{why} ({rule.idle_values}: no effect)"
        rows.append((key, rule.status.value, why))
    lines = [START, "", "| key | status | why / what to do |", "|---|---|---|"]
    lines += [f"| `{key}` | {status} | {why.replace('|', '/')} |" for key, status, why in rows]
    return "\n".join(lines + ["", END])


if __name__ == "__main__":
    print(table())
