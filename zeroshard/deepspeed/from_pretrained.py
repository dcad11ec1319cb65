"""`from_pretrained(path, dtype=...)` inside `zero.Init`: the model on meta in the dtype transformers loads it in.

The model is built from its config on the meta device, in the dtype that
transformers' own `from_pretrained(path, dtype=...)` gives its parameters
(`load_dtype`), and the weights of `path` are recorded as its init
(`zeroshard.pretrained(path)`): `initialize` reads them unit by unit, each
tensor cast from the file's dtype to the parameter's as transformers casts it
(`Tensor.copy_`, round to nearest even), so no rank holds the whole model, and
never in fp32 when the model is bf16.

`dtype` is read as transformers reads it: a torch dtype, its name
("bfloat16"), or "auto": the config's `dtype` (`torch_dtype` before
transformers 5), else the dtype of the files' first floating-point tensor.
Left out, it is transformers' default: "auto" from transformers 5 on, the
default torch dtype before. Inside `zero.Init(dtype=X)` every parameter is
built in X, so a left-out dtype means X and another one asked for is a
conflict (`UnsupportedError`).
"""

from __future__ import annotations

import copy
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from zeroshard.checkpoint.pretrained import pretrained, tensors_in
from zeroshard.deepspeed.unsupported import UnsupportedError
from zeroshard.dtypes import torch_name
from zeroshard.stage3.meta import record_init

# from_pretrained's keyword arguments about fetching from the Hub, which a local directory does not need
# (AutoModel*.from_pretrained passes them on to the model class's).
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies",
               "trust_remote_code", "code_revision", "_commit_hash", "_from_auto", "_from_pipeline", "adapter_kwargs")


@contextmanager
def from_pretrained_on_meta(block_dtype: torch.dtype | None) -> Iterator[None]:
    """`from_pretrained(path)` inside `zero.Init(dtype=block_dtype)`: the model from its config, on meta, and the
    weights of `path` recorded as its init, read unit by unit by `initialize` (no rank holds the whole model)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        yield
        return
    model_class = transformers.PreTrainedModel
    refusing = model_class.__dict__["from_pretrained"]  # meta_init's, restored on the way out
    major = int(transformers.__version__.split(".")[0])

    def load(cls, path, *model_args, config=None, **kwargs):
        requested = kwargs.pop("dtype", None)
        requested = kwargs.pop("torch_dtype", None) if requested is None else requested
        for key in _HUB_KWARGS:
            kwargs.pop(key, None)
        if model_args:
            raise UnsupportedError(f"{cls.__name__}.from_pretrained inside zero.Init takes the path and keyword "
                                   "arguments; pass no positional model arguments")
        if config is None:
            config, kwargs = cls.config_class.from_pretrained(path, return_unused_kwargs=True, **kwargs)
        else:
            config = copy.deepcopy(config)  # as transformers does: building sets its dtype
        if kwargs:
            raise UnsupportedError(f"{cls.__name__}.from_pretrained({', '.join(sorted(kwargs))}=...) inside "
                                   "zero.Init is not supported: only the path, config=, dtype= and the config's "
                                   "own keys are; load the model outside zero.Init for the others")
        if requested is None and block_dtype is None:
            requested = "auto" if major >= 5 else torch.get_default_dtype()  # transformers' own default
        dtype = load_dtype(requested, block_dtype, config, Path(path))
        model = cls._from_config(config, **{"dtype" if major >= 5 else "torch_dtype": dtype})
        record_init(model, pretrained(path))
        return model

    model_class.from_pretrained = classmethod(load)
    try:
        yield
    finally:
        model_class.from_pretrained = refusing


def load_dtype(requested, block_dtype: torch.dtype | None, config, path: Path) -> torch.dtype:
    """The dtype of the parameters of `from_pretrained(path, dtype=requested)` inside `zero.Init(dtype=block_dtype)`:
    `requested` as transformers reads it (None: `block_dtype`); raises `UnsupportedError` for one it does not take
    or one that differs from `block_dtype`."""
    if requested is None:
        return block_dtype
    if requested == "auto":
        dtype = checkpoint_dtype(config, path)
    elif isinstance(requested, str):
        dtype = getattr(torch, requested, None)
    else:
        dtype = requested
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedError(f"from_pretrained(dtype={requested!r}) inside zero.Init: give a torch dtype "
                               "(torch.bfloat16), its name (\"bfloat16\") or \"auto\"; per-module dtypes (a dict) "
                               "are not supported")
    if block_dtype is not None and dtype != block_dtype:
        raise UnsupportedError(
            f"from_pretrained(dtype={requested!r}) asks for {torch_name(dtype)} inside zero.Init(dtype="
            f"{block_dtype}), which builds every parameter in {torch_name(block_dtype)}: leave dtype out of one of "
            "the two, or give both the same")
    return dtype


def checkpoint_dtype(config, path: Path) -> torch.dtype:
    """What `dtype="auto"` loads in, as transformers decides it: the config's dtype, else the dtype of the first
    floating-point tensor of the files (`path`'s safetensors)."""
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared)
    if declared is not None:
        return declared
    found = tensors_in(path)
    return next((entry.dtype for _, entry in found.values() if entry.dtype.is_floating_point),
                torch.get_default_dtype())
