"""One full state dict from a sharded checkpoint, in one process, without a process group.

`zeroshard consolidate CKPT model.safetensors` (or `consolidate(...)`) joins
every rank's pieces into whole tensors, keyed as the model's own
`state_dict()`, so the result loads into the plain model with
`model.load_state_dict(safetensors.torch.load_file(path))`. `write` creates
the output's directory; an OUT that is not a .safetensors file is a
directory that gets `model.safetensors`, and for a Hugging Face model
`config.json` (`model_config.py`), so `from_pretrained(OUT)` loads it. The checkpoint
is verified first, as a load verifies it (`verify.py`: sizes, headers, save
ids, checksums), so a damaged one is refused, not joined. Trained
parameters come from the fp32 masters; `dtype` casts floating-point
values. A checkpoint saved with `exclude_frozen_parameters=True` gives the
trained parameters and the buffers only (no frozen parameter, no
config.json): an adapter's weights, which `load_state_dict(state,
strict=False)` puts onto the base model. `full_tensors` gives any stored kind by parameter name (the
optimizer's `optim.exp_avg`, say). The command itself is the app's
(zeroshard/app/cli.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from zeroshard.checkpoint.files import CheckpointError, group_state_keys, parse_manifest, resolve
from zeroshard.checkpoint.frozen import excluded
from zeroshard.checkpoint.model_config import check_config_target, write_config
from zeroshard.checkpoint.pieces import PieceReader
from zeroshard.checkpoint.safetensors_files import WEIGHTS_FILE
from zeroshard.checkpoint.verify import problems_of, raise_first
from zeroshard.dtypes import MASTER_DTYPE, from_torch_name


def full_tensors(load_dir: str | Path, tag: str | None = None, kind: str = "param") -> dict[str, torch.Tensor]:
    """Every parameter's (or buffer's, kind "buffer") whole tensor of `kind`, by name.

    kind "param" is fp32 for trained parameters (the masters), the stored
    dtype for frozen ones; "optim.<key>" is the optimizer's state tensor.
    """
    path = resolve(load_dir, tag)
    manifest = verified(path)
    with PieceReader(path, manifest) as reader:
        return _whole(reader, path, manifest, kind)


def verified(path: Path) -> dict:
    """The manifest of tag directory `path`, after every check a load makes (checksums included)."""
    manifest = parse_manifest(path)
    raise_first(problems_of(path, manifest))
    return manifest


def _whole(reader: PieceReader, path: Path, manifest: dict, kind: str) -> dict[str, torch.Tensor]:
    table = manifest["buffers"] if kind == "buffer" else manifest["params"]
    out, left_out = {}, excluded(manifest) if kind == "param" else frozenset()
    for name, entry in table.items():
        if (kind.startswith("optim.") and entry.get("group") is None) or name in left_out:
            continue  # frozen: no optimizer state; left out of the checkpoint (exclude_frozen_parameters)
        shape = _state_shape(manifest, kind, name, entry) if kind.startswith("optim.") else entry["shape"]
        if shape is None:
            continue  # its optimizer keeps no such state (several optimizers)
        numel = int(torch.Size(shape).numel())
        why = reader.missing(kind, name, 0, numel)
        if why is not None:
            raise CheckpointError(f"{path}: {why}")
        values = torch.empty(numel, dtype=_stored_dtype(kind, entry))
        reader.read_into(kind, name, 0, values)
        out[name] = values.view(shape)
    return out


def _state_shape(manifest: dict, kind: str, name: str, entry: dict) -> list[int] | None:
    """The shape of a trained parameter's optimizer state `kind`: its own, owned whole ("owned_state"), else
    the parameter's where its param group keeps that key ("group_state"); None where it keeps none."""
    key, owned = kind.removeprefix("optim."), manifest.get("owned_state", {})
    if name in owned:
        return owned[name].get(key)
    return entry["shape"] if key in group_state_keys(manifest, entry["group"]) else None


def _stored_dtype(kind: str, entry: dict) -> torch.dtype:
    """Masters and optimizer state are fp32; frozen parameters and buffers keep their own dtype."""
    if kind == "buffer" or (kind == "param" and entry["group"] is None):
        return from_torch_name(entry["dtype"])
    return MASTER_DTYPE


def consolidate(load_dir: str | Path, tag: str | None = None, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's full state dict (every key of `model.state_dict()`; tied keys are separate copies). Of a
    checkpoint saved with exclude_frozen_parameters, every key but the frozen parameters': the trained ones
    and the buffers, for `model.load_state_dict(state, strict=False)` onto the base model."""
    return _consolidate(resolve(load_dir, tag), dtype)[0]


def _consolidate(path: Path, dtype: torch.dtype | None,
                 verify: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """(the full state dict, the manifest) of tag directory `path`: one manifest read, one pass over the files."""
    manifest = verified(path) if verify else parse_manifest(path)
    with PieceReader(path, manifest) as reader:
        stored = _whole(reader, path, manifest, "param") | _whole(reader, path, manifest, "buffer")
    out, used = {}, set()
    for key, name in manifest["state_dict"].items():
        if name not in stored:
            continue  # a frozen parameter the checkpoint left out
        tensor = stored[name]
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[key] = tensor.clone() if id(tensor) in used else tensor  # safetensors stores no aliases
        used.add(id(tensor))
    return out, manifest


def _each_tensor_once(state: dict[str, torch.Tensor], manifest: dict) -> dict[str, torch.Tensor]:
    """`state` with each stored tensor under its first key of the model's state dict only: the name transformers
    keeps for tied weights (the embedding, registered before the head that reuses it); from_pretrained ties
    the others again."""
    first: dict[str, str] = {}
    for key, name in manifest["state_dict"].items():
        first.setdefault(name, key)
    return {key: tensor for key, tensor in state.items() if first[manifest["state_dict"][key]] == key}


def write(load_dir: str | Path, out: str | Path, tag: str | None = None, dtype: torch.dtype | None = None,
          verified: bool = False) -> tuple[int, list[Path]]:
    """Write the consolidated state dict; returns the number of tensors and the files written.

    `out` ending in .safetensors is the file (its directory is created); any
    other `out` is a directory, created, that gets model.safetensors. Beside
    the weights goes config.json when the checkpoint carries a Hugging Face
    config, unless the checkpoint left out its frozen parameters (the file
    then holds the trained parameters and buffers only, and is no model
    `from_pretrained` loads). `verified`: the caller has just verified the checkpoint
    (`verify.verify`), so it is not read twice.
    """
    path = resolve(load_dir, tag)
    state, manifest = _consolidate(path, dtype, verify=not verified)
    # No config.json without the frozen base: from_pretrained would fill the missing weights at random.
    config = manifest.get("hf_config") if not excluded(manifest) else None
    if config is not None:  # a transformers model: a tied parameter written once, as its save_pretrained does
        state = _each_tensor_once(state, manifest)
    out = Path(out)
    weights = out if out.suffix == ".safetensors" else out / WEIGHTS_FILE
    check_config_target(weights.parent, config)
    try:
        weights.parent.mkdir(parents=True, exist_ok=True)
        # "format": "pt" is what transformers' from_pretrained expects of a safetensors file.
        save_file({k: v.contiguous() for k, v in state.items()}, str(weights),
                  metadata={"format": "pt", "source": str(path), "global_steps": str(manifest["global_steps"])})
    except Exception as exc:  # safetensors reports I/O errors in its own error type
        raise CheckpointError(f"cannot write {weights} ({exc}); give an OUT in a writable place") from None
    written = write_config(weights.parent, config)
    return len(state), [weights] + ([written] if written else [])
