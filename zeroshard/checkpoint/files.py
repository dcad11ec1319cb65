"""A checkpoint on disk: its layout, its manifest, and reading its pieces back.

```
save_dir/
  latest                    the newest tag, one line
  <tag>/
    manifest.json           what was saved: parameters (name, shape, dtype), buffers,
                            state-dict keys, the writing job (world size, stage, dtype),
                            and the byte size of every other file
    state.pt                counters, loss scale, LR scheduler, param-group settings,
                            scalar optimizer state, the user's client_state
                            (plain data: it loads with torch.load(weights_only=True))
    rank_00000.safetensors  rank 0's pieces; one file per rank that wrote
```

A rank file holds 1-D tensors as the rank held them (its shard of a flat
buffer, saved without a copy) under the key `kind:window`
(`optim.exp_avg:@shard3`): kind `param` is the value (the fp32 master of a
trained parameter, the value itself of a frozen one), `buffer` a module
buffer, `optim.<key>` an optimizer state tensor (`optim.exp_avg`). The
file's metadata entry `runs` says which elements of which parameters each
tensor holds: `[name, start, at, numel]`, the parameter's flattened
elements [start, start + numel) at [at, at + numel) of the tensor. Runs are
cut by the writing job's shards and read back by the reading job's, so a
checkpoint reloads on any world size and any stage. A tag directory is written under a
temporary name and renamed when complete, so a tag either exists whole or
not at all.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path

import torch
from safetensors import safe_open

from zeroshard.errors import ZeroshardError

FORMAT = "zeroshard checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
STATE = "state.pt"
LATEST = "latest"
# What a reader relies on in manifest.json (the rest is for people).
_MANIFEST_KEYS = ("world_size", "stage", "global_steps", "optimizer", "optimizer_state", "param_groups",
                  "params", "buffers", "state_dict", "files")


class CheckpointError(ZeroshardError, RuntimeError):
    """A checkpoint cannot be written or read: the message names the cause and the fix."""


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def window_key(kind: str, window: str) -> str:
    return f"{kind}:{window}"


def runs_metadata(runs: dict[str, list]) -> str:
    """The `runs` entry of a rank file's metadata: key -> [[name, start, at, numel], ...]."""
    return json.dumps(runs, separators=(",", ":"))


# -- writing ----------------------------------------------------------------------


def check_tag(tag: str) -> None:
    if not tag or tag.startswith(".") or os.sep in tag or (os.altsep and os.altsep in tag):
        raise CheckpointError(f"checkpoint tag '{tag}' must be a plain directory name "
                              "(no path separators, not starting with '.')")


def partial_dir(save_dir: Path, tag: str) -> Path:
    """Where a tag is written before it is complete (a hidden sibling of the final directory)."""
    return save_dir / f".{tag}.partial"


def fsync_file(path: Path) -> int:
    """Flush `path` to disk; returns its size in bytes."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
        return os.fstat(f.fileno()).st_size


def write_bytes(path: Path, data: bytes) -> int:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data)


def commit(save_dir: Path, tag: str, save_latest: bool = True) -> Path:
    """Put a complete partial directory in place of the tag (replacing an older one), then point `latest` at it."""
    final, partial, old = save_dir / tag, partial_dir(save_dir, tag), save_dir / f".{tag}.old"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    partial.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    if save_latest:
        tmp = save_dir / f".{LATEST}.tmp"
        write_bytes(tmp, (tag + "\n").encode())
        os.replace(tmp, save_dir / LATEST)
    fsync_dir(save_dir)  # the renames themselves survive a power loss
    return final


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading ----------------------------------------------------------------------


def resolve(load_dir: str | Path, tag: str | None) -> Path:
    """The tag directory to load: `load_dir/tag`, the one `latest` names, or `load_dir` itself."""
    load_dir = Path(load_dir)
    if load_dir.is_file():
        raise CheckpointError(f"{load_dir} is a file, not a checkpoint directory: give the save directory "
                              "(its 'latest' tag) or one tag's directory; a consolidated state dict loads with "
                              "model.load_state_dict() before zeroshard.initialize")
    if not load_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {load_dir} does not exist")
    if tag is not None:
        check_tag(tag)
        path = load_dir / tag
        if not path.is_dir():
            raise CheckpointError(f"{load_dir} has no checkpoint '{tag}'; it has: {', '.join(tags_in(load_dir)) or 'none'}")
        return path
    if (load_dir / MANIFEST).is_file():
        return load_dir
    if (load_dir / LATEST).is_file():
        tag = (load_dir / LATEST).read_text().strip()
        if not (load_dir / tag).is_dir():
            old = load_dir / f".{tag}.old"
            hint = (f"a save over it was interrupted and its previous contents are in {old}: rename that "
                    f"to {load_dir / tag}, or " if old.is_dir() else "")
            raise CheckpointError(f"{load_dir / LATEST} names '{tag}', which is not in {load_dir}; "
                                  f"{hint}pass tag= (or the tag's directory) to load another one")
        return load_dir / tag
    tags = tags_in(load_dir)
    if tags:
        raise CheckpointError(f"{load_dir} has no '{LATEST}' file to say which checkpoint to load; it has: "
                              f"{', '.join(tags)}: pass tag= (or the tag's directory)")
    raise CheckpointError(f"{load_dir} is not a zeroshard checkpoint: {foreign_hint(load_dir)}")


def tags_in(save_dir: Path) -> list[str]:
    """The complete tags of a save directory (not the hidden ones of a save in progress)."""
    return sorted(p.name for p in save_dir.iterdir() if (p / MANIFEST).is_file() and not p.name.startswith("."))


def foreign_hint(path: Path) -> str:
    """What the directory holds instead of a zeroshard checkpoint, and what to do."""
    names = [p.name for p in islice(chain(path.glob("*"), path.glob("*/*")), 10_000) if p.is_file()]
    if any(n.startswith(("zero_pp_rank_", "mp_rank_", "bf16_zero_pp_rank_")) for n in names):
        return ("it holds a DeepSpeed checkpoint (mp_rank_*/zero_pp_rank_* files). Consolidate it with "
                "DeepSpeed's zero_to_fp32.py, load the state dict into the model with "
                "model.load_state_dict() before zeroshard.initialize, then save with engine.save_checkpoint")
    if any(n.endswith(".distcp") for n in names):
        return ("it holds a torch.distributed.checkpoint (FSDP) checkpoint. Load it into the unwrapped model "
                "with torch.distributed.checkpoint before zeroshard.initialize")
    if any(n.endswith((".safetensors", ".bin", ".pt", ".pth")) for n in names):
        return ("it has no manifest.json and no 'latest' file. If it holds a plain state dict, load it with "
                "model.load_state_dict() before zeroshard.initialize")
    return "it has no manifest.json and no 'latest' file (write one with engine.save_checkpoint)"


def read_manifest(path: Path) -> dict:
    """The manifest of tag directory `path`, after checking every file it lists is there, whole."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path} is not a zeroshard checkpoint: {foreign_hint(path)}")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{manifest_path} is not valid JSON ({exc}); the file is damaged, "
                              "load an earlier tag") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path} is not a zeroshard checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{path} is checkpoint format version {manifest.get('version')}; this zeroshard "
                              f"reads version {VERSION}: load it with the zeroshard that wrote it "
                              f"({manifest.get('zeroshard', 'unknown')})")
    lacking = [key for key in _MANIFEST_KEYS if key not in manifest]
    if lacking:
        raise CheckpointError(f"{manifest_path} lacks {', '.join(lacking)}: it is damaged; load an earlier tag")
    for name, size in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {name}; it was copied or deleted in part: "
                                  "restore the file or load an earlier tag")
        if file.stat().st_size != size:
            raise CheckpointError(f"checkpoint file {file} is {file.stat().st_size} bytes but was written as "
                                  f"{size}: it is truncated or damaged; restore it or load an earlier tag")
    return manifest


def read_state(path: Path) -> dict:
    try:
        return torch.load(path / STATE, map_location="cpu", weights_only=True)
    except Exception as exc:  # a damaged pickle: UnpicklingError, RuntimeError, EOFError, ...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"checkpoint file {path / STATE} cannot be read ({first}); "
                              "restore it or load an earlier tag") from None


@dataclass(frozen=True)
class Piece:
    offset: int  # first element, in the parameter's flattened elements
    numel: int
    file: int  # index into the reader's open files
    key: str  # the tensor that holds it
    at: int  # where in that tensor it starts


class PieceReader:
    """Every piece of a checkpoint, by (kind, name); reads ranges without loading whole files."""

    def __init__(self, path: Path, manifest: dict):
        self._stack = ExitStack()
        self._files = []
        self._pieces: dict[tuple[str, str], list[Piece]] = {}
        for name in sorted(n for n in manifest["files"] if n.endswith(".safetensors")):
            try:
                handle = self._stack.enter_context(safe_open(str(path / name), framework="pt", device="cpu"))
            except Exception as exc:  # safetensors reports a damaged header in its own error type
                self.close()
                raise CheckpointError(f"checkpoint file {path / name} cannot be read ({exc}); "
                                      "restore it or load an earlier tag") from None
            self._files.append(handle)
            self._index(path / name, handle, len(self._files) - 1)
        for pieces in self._pieces.values():
            pieces.sort(key=lambda p: p.offset)

    def _index(self, file: Path, handle, index: int) -> None:
        """Note every run the file's metadata lists, after checking it lies inside its tensor."""
        try:
            runs = json.loads((handle.metadata() or {})["runs"])
            for key, entries in runs.items():
                length = handle.get_slice(key).get_shape()[0]
                for name, start, at, numel in entries:
                    if at + numel > length:
                        raise ValueError(f"run of '{name}' past the end of '{key}'")
                    self._pieces.setdefault((key.split(":", 1)[0], name), []).append(
                        Piece(start, numel, index, key, at))
        except Exception as exc:  # KeyError, JSONDecodeError, a safetensors error, ValueError
            self.close()
            raise CheckpointError(f"checkpoint file {file} does not say what it holds ({type(exc).__name__}: "
                                  f"{exc}); it is damaged or not a zeroshard rank file: restore it or load an "
                                  "earlier tag") from None

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "PieceReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def missing(self, kind: str, name: str, start: int, numel: int) -> str | None:
        """Why elements [start, start + numel) of (kind, name) cannot be read, or None if they can."""
        covered = start
        for piece in self._pieces.get((kind, name), []):
            if piece.offset > covered:
                break
            covered = max(covered, piece.offset + piece.numel)
            if covered >= start + numel:
                return None
        if covered >= start + numel:
            return None
        return f"the checkpoint has no {kind} for elements {covered}..{start + numel - 1} of '{name}'"

    def read_into(self, kind: str, name: str, start: int, out: torch.Tensor) -> None:
        """Fill 1-D `out` with elements [start, start + len(out)) of (kind, name)."""
        end = start + out.numel()
        with torch.no_grad():
            for piece in self._pieces.get((kind, name), []):
                lo, hi = max(start, piece.offset), min(end, piece.offset + piece.numel)
                if lo < hi:
                    first = piece.at + lo - piece.offset
                    values = self._files[piece.file].get_slice(piece.key)[first : first + hi - lo]
                    out[lo - start : hi - start].copy_(values)
