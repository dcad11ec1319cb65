"""The Hugging Face config a checkpoint carries, so that `zeroshard consolidate` writes a loadable directory.

A `transformers` model holds its `PretrainedConfig` as `model.config`. A
save stores its config.json content in the manifest (`hf_config`), and
consolidate writes it as `config.json` beside the weights, so that
`AutoModel*.from_pretrained(directory)` loads them. Recognised by duck
typing: this module does not import transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from zeroshard.checkpoint.files import CheckpointError

CONFIG_FILE = "config.json"  # the name transformers reads


def hf_config(module: torch.nn.Module) -> dict | None:
    """config.json's content for a `transformers` model (what save_pretrained writes); None for another module."""
    config = getattr(module, "config", None)
    if not (hasattr(config, "model_type") and callable(getattr(config, "to_json_string", None))):
        return None
    return json.loads(config.to_json_string())


def check_config_target(directory: Path, config: dict | None) -> None:
    """Refuse, before anything is written, to replace another model's config.json in `directory`."""
    target = directory / CONFIG_FILE
    if config is None or not target.is_file():
        return
    try:
        same = json.loads(target.read_text(encoding="utf-8")) == config
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        same = False
    if not same:
        raise CheckpointError(f"{target} exists and is not this checkpoint's model config; remove it, or "
                              "write the consolidated model to another directory")


def write_config(directory: Path, config: dict | None) -> Path | None:
    """Write `config` as directory/config.json; returns its path (None when there is no config)."""
    if config is None:
        return None
    target = directory / CONFIG_FILE
    try:
        target.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    except OSError as exc:
        raise CheckpointError(f"cannot write {target} ({exc}); give an OUT in a writable place") from None
    return target
