"""`zeroshard.pretrained(path)`: a `save_pretrained` directory's weights, read unit by unit into a stage-3 model.

    config = AutoConfig.from_pretrained(path)
    with zeroshard.meta_init():
        model = AutoModelForCausalLM.from_config(config)
    engine = zeroshard.initialize(model, optimizer, ds_config, init=zeroshard.pretrained(path))

As each unit is materialised (`stage3/materialize.py`), its modules' tensors
are read from the safetensors files (`model.safetensors`, or the shards that
`model.safetensors.index.json` names), one tensor at a time, reading only
its bytes (`safetensors_files.py`), straight into the unit's buffer: a rank holds its shards, one unit and one
tensor being read, never the whole model. Every rank reads; rank 0's values
are the ones broadcast. Values are cast to the dtype the model was built in.

Keys are matched as `transformers` does: a model key is looked up as it is,
then without or with the model's `base_model_prefix` (a base checkpoint
loaded into a model with a head, and the reverse), and a tied parameter
needs any one of its names. Every file and model key is checked before
anything is read: a model key with no tensor (missing), a file key no
parameter takes (unexpected, except those the model class declares in
`_keys_to_ignore_on_load_unexpected`) or a shape mismatch is a `ModelError`
naming them. `init_missing=True` lets missing parameters take the model's own
initialisation instead (a new classification head); `ignore_unexpected=True`
drops unused file keys (a head checkpoint loaded into a base model).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from zeroshard.checkpoint.safetensors_files import WEIGHTS_FILE, Entry, entries, read
from zeroshard.errors import ModelError
from zeroshard.stage3.gathered import keys_by_tensor
from zeroshard.stage3.meta import own_init, pending

_INDEX = WEIGHTS_FILE + ".index.json"


class Pretrained:
    """`init=` for `zeroshard.initialize`: the weights of a `save_pretrained` directory (safetensors)."""

    def __init__(self, path: str | os.PathLike, *, init_missing: bool = False, ignore_unexpected: bool = False):
        self.path = Path(path)
        self.init_missing, self.ignore_unexpected = init_missing, ignore_unexpected

    def __repr__(self) -> str:
        return f"zeroshard.pretrained({str(self.path)!r})"

    def for_model(self, model: nn.Module) -> Callable[[nn.Module], None]:
        """Check every key and shape, load the model's real buffers now, and return `init(module)`."""
        where = tensors_in(self.path)
        source = self._match(model, {key: entry.shape for key, (_, entry) in where.items()})
        missing_init = own_init(model) if self.init_missing else None
        prefixes = {id(m): f"{name}." if name else "" for name, m in model.named_modules()}

        def init(module: nn.Module) -> None:
            prefix = prefixes[id(module)]
            named = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            wanted = [(source.get(prefix + name), t) for name, t in named
                      if isinstance(t, nn.Parameter) or prefix + name in source]
            if missing_init is not None and any(key is None for key, _ in wanted):
                missing_init(module)
            self._read(where, [(key, t) for key, t in wanted if key is not None])

        buffers = [(prefixes[id(m)] + n, b) for m in model.modules() for n, b in m.named_buffers(recurse=False)]
        self._read(where, [(source[key], b) for key, b in buffers if not b.is_meta and key in source])
        return init

    def _match(self, model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
        """Model key -> file key, for every key with a tensor in the files; raises on what does not fit."""
        tensors = model.state_dict(keep_vars=True)
        prefix = getattr(model, "base_model_prefix", "") or ""
        names = keys_by_tensor(tensors)
        source, missing, mismatched = {}, [], []
        for keys in names.values():
            found = {key: f for key in keys if (f := _file_key(key, prefix, shapes)) is not None}
            if not found:
                missing.append(keys[0])
            for key, file_key in found.items():
                # A pending value (an edit before initialize: a resized embedding) replaces the file's.
                if tuple(shapes[file_key]) != tuple(tensors[key].shape) and pending(tensors[key]) is None:
                    mismatched.append(f"{key} (file {tuple(shapes[file_key])}, model {tuple(tensors[key].shape)})")
                source[key] = file_key
            for key in keys:  # a tied parameter is read under the name the files have
                source.setdefault(key, next(iter(found.values()), None))
        source = {k: v for k, v in source.items() if v is not None}
        ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
        unexpected = sorted(set(shapes) - set(source.values()))
        unexpected = [k for k in unexpected if not any(p.search(k) for p in ignored)]
        problems = []
        if missing and not self.init_missing:
            problems.append(f"missing from the files: {_listed(missing)} (init_missing=True initialises them "
                            f"as the model itself does, for a new head)")
        if unexpected and not self.ignore_unexpected:
            problems.append(f"in the files but not in the model: {_listed(unexpected)} (ignore_unexpected=True "
                            f"drops them, for a checkpoint with a head this model lacks)")
        if mismatched:
            problems.append(f"shapes differ: {_listed(mismatched)}")
        if problems:
            raise ModelError(f"the weights in {self.path} do not fit the {type(model).__name__}: "
                             f"{'; '.join(problems)}. Build the model from the same directory's config "
                             f"(AutoConfig.from_pretrained(path))")
        return source

    def _read(self, where: dict[str, tuple[str, Entry]], wanted: list[tuple[str, torch.Tensor]]) -> None:
        """Copy each file key's tensor (in the file `where` names) into its target, reading only its bytes."""
        by_file: dict[str, list] = {}
        for key, target in wanted:
            name, entry = where[key]
            # A tied parameter of this module may live in another unit, not materialised now (meta, or an
            # empty shard): it is read when its own unit is.
            if not target.is_meta and tuple(target.shape) == entry.shape:
                by_file.setdefault(name, []).append((entry, target))
        with torch.no_grad():
            for name, entries in by_file.items():
                read(self.path / name, entries)


def pretrained(path: str | os.PathLike, *, init_missing: bool = False, ignore_unexpected: bool = False) -> Pretrained:
    """`init=zeroshard.pretrained(path)`: load a `save_pretrained` directory into a model built under
    `zeroshard.meta_init()` at stage 3, unit by unit (see this module's docstring)."""
    return Pretrained(path, init_missing=init_missing, ignore_unexpected=ignore_unexpected)


def tensors_in(path: Path) -> dict[str, tuple[str, Entry]]:
    """Key -> (the safetensors file in `path` that holds it, where in that file) for a save_pretrained directory."""
    if (path / _INDEX).is_file():
        names = sorted(set(json.loads((path / _INDEX).read_text())["weight_map"].values()))
    elif (path / WEIGHTS_FILE).is_file():
        names = [WEIGHTS_FILE]
    else:
        present = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        raise ModelError(f"{path} holds neither {WEIGHTS_FILE} nor {_INDEX} "
                         f"(it has: {', '.join(present) or 'nothing'}); "
                         "zeroshard.pretrained reads safetensors as save_pretrained writes them: load the model in "
                         "one process and save it again with model.save_pretrained(path)")
    return {key: (name, entry) for name in names for key, entry in entries(path / name).items()}


def _file_key(key: str, prefix: str, shapes: dict) -> str | None:
    """The file's name for a model key: itself, without the base model's prefix, or with it."""
    candidates = [key]
    if prefix:
        candidates += [key[len(prefix) + 1:]] if key.startswith(prefix + ".") else [f"{prefix}.{key}"]
    return next((c for c in candidates if c in shapes), None)


def _listed(keys: list[str], most: int = 10) -> str:
    more = f" and {len(keys) - most} more" if len(keys) > most else ""
    return ", ".join(keys[:most]) + more
