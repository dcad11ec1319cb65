"""A checkpoint on disk: its layout, its manifest, and the checks that need no file contents.

```
save_dir/
  latest                    the newest tag, one line
  <tag>/
    manifest.json           what was saved: parameters (name, shape, dtype), buffers,
                            state-dict keys, the writing job (world size, stage, dtype),
                            the frozen parameters left out, if any, with their
                            fingerprints (`frozen_excluded`, `frozen.py`),
                            the save id, and for every other file its size, crc32 and
                            (rank files) each tensor's dtype and length; sealed by a crc32
                            of its own content
    state.pt                counters, loss scale, LR scheduler, param-group settings,
                            scalar optimizer state, the user's client_state, the save id
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
elements [start, start + numel) at [at, at + numel) of the tensor; its
entry `save_id` names the save it belongs to. A rank's own state (a codec's
error feedback, PowerSGD's: `rank_state.py`) is no parameter's pieces: its
tensors (`feedback.hop1:@bucket0`, `powersgd.q:@bucket0`) have no runs. Runs are cut by the writing
job's shards and read back by the reading job's, so a checkpoint reloads on
any world size and any stage. A tag directory is written under a temporary
name and renamed when complete, so a tag either exists whole or not at all.

Every name read from the checkpoint (the manifest's files, `latest`) must
be a plain name that resolves inside its directory. The checks that read
file contents (headers, checksums, state.pt's keys) are in `verify.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from itertools import chain, islice
from pathlib import Path

import torch

from zeroshard.errors import ZeroshardError

FORMAT = "zeroshard checkpoint"
VERSION = 2  # 2: checksums, save id, the manifest's seal; version 1 (sizes only) still reads
READABLE = (1, 2)
MANIFEST = "manifest.json"
STATE = "state.pt"
LATEST = "latest"
# What a reader relies on in manifest.json (the rest is for people).
_MANIFEST_KEYS = ("world_size", "stage", "global_steps", "optimizer", "optimizer_state", "param_groups",
                  "params", "buffers", "state_dict", "files")
DAMAGED_FIX = "restore it or load an earlier tag"


class CheckpointError(ZeroshardError, RuntimeError):
    """A checkpoint cannot be written or read: the message names the cause and the fix."""


def group_state_keys(manifest: dict, group: int) -> list[str]:
    """The state keys a manifest holds laid out like the master for param group `group` ("group_state"; a
    manifest written before there were several optimizers lists one set for all: "optimizer_state")."""
    return manifest["group_state"][group] if "group_state" in manifest else manifest["optimizer_state"]


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def window_key(kind: str, window: str) -> str:
    return f"{kind}:{window}"


def runs_metadata(runs: dict[str, list]) -> str:
    """The `runs` entry of a rank file's metadata: key -> [[name, start, at, numel], ...]."""
    return json.dumps(runs, separators=(",", ":"))


def crc_hex(crc: int) -> str:
    """A crc32 as the manifest writes it: 8 hex digits."""
    return f"{crc & 0xFFFFFFFF:08x}"


def manifest_checksum(manifest: dict) -> str:
    """The crc32 of the manifest's content without its own `checksum` (keys sorted, compact JSON)."""
    content = {k: v for k, v in manifest.items() if k != "checksum"}
    return crc_hex(zlib.crc32(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()))


def sealed(manifest: dict) -> str:
    """manifest.json's text: the manifest with its `checksum`, so that an edit or damage is seen on load."""
    return json.dumps(manifest | {"checksum": manifest_checksum(manifest)}, indent=1)


# -- writing ----------------------------------------------------------------------


def check_tag(tag: str | int | float) -> str:
    """The tag as a directory name. DeepSpeed scripts pass numbers too (a step, `loss.item()`): those
    become `str(tag)`, as DeepSpeed's tag directories are named."""
    if isinstance(tag, (int, float)) and not isinstance(tag, bool):
        tag = str(tag)
    if not isinstance(tag, str):
        raise CheckpointError(f"checkpoint tag must be a string or a number (a directory name); got "
                              f"{type(tag).__name__} {tag!r:.60}")
    if not tag or tag.startswith(".") or os.sep in tag or (os.altsep and os.altsep in tag):
        raise CheckpointError(f"checkpoint tag '{tag}' must be a plain directory name "
                              "(no path separators, not starting with '.')")
    return tag


def partial_dir(save_dir: Path, tag: str) -> Path:
    """Where a tag is written before it is complete (a hidden sibling of the final directory)."""
    return save_dir / f".{tag}.partial"


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
        point_latest(save_dir, tag)
    fsync_dir(save_dir)  # the renames themselves survive a power loss
    return final


def point_latest(save_dir: Path, tag: str) -> None:
    """Point `save_dir/latest` at `tag`, replacing the file whole (a reader sees the old tag or the new)."""
    tmp = save_dir / f".{LATEST}.tmp"
    write_bytes(tmp, (tag + "\n").encode())
    os.replace(tmp, save_dir / LATEST)
    fsync_dir(save_dir)


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
        tag = check_tag(tag)
        path = load_dir / tag
        if not path.is_dir():
            raise CheckpointError(f"{load_dir} has no checkpoint '{tag}'; it has: {', '.join(tags_in(load_dir)) or 'none'}")
        return path
    if (load_dir / MANIFEST).is_file():
        return load_dir
    if (load_dir / LATEST).is_file():
        tag = _latest_tag(load_dir)
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


def _latest_tag(load_dir: Path) -> str:
    """The tag `latest` names, refused unless it is a plain name of a directory inside `load_dir`."""
    try:
        tag = (load_dir / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{load_dir / LATEST} cannot be read ({exc}); pass tag= (or the tag's directory) "
                              "to say which checkpoint to load") from None
    try:
        check_tag(tag)
        plain = is_inside(load_dir, tag)
    except CheckpointError:
        plain = False
    if not plain:
        raise CheckpointError(f"{load_dir / LATEST} names '{tag}', which is not a tag directory inside {load_dir} "
                              "(a plain name that leads nowhere else): 'latest' was edited or damaged, and "
                              "nothing outside the save directory is read. Write the tag's name into it, or "
                              "pass tag= (or the tag's directory) to load one")
    return tag


def is_plain(name: str) -> bool:
    """Whether `name` names an entry of a directory: no separator, not '.' or '..', not absolute."""
    return bool(name) and name not in (".", "..") and not any(
        sep and sep in name for sep in ("/", "\\", os.sep, os.altsep))


def is_inside(root: Path, name: str) -> bool:
    """Whether `name` is a plain name whose path, links followed, is in `root`."""
    return is_plain(name) and (root / name).resolve().parent == root.resolve()


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
    return _NOTHING


_NOTHING = "it has no manifest.json and no 'latest' file (write one with engine.save_checkpoint)"


def holds_no_checkpoint(load_dir: str | Path) -> bool:
    """Whether `load_dir` is missing or holds no checkpoint of any kind (zeroshard's, DeepSpeed's, a state
    dict): a resume-if-present script's first run. A directory with tags but no 'latest' is not empty."""
    load_dir = Path(load_dir)
    if not load_dir.exists():
        return True
    if not load_dir.is_dir() or (load_dir / MANIFEST).is_file() or (load_dir / LATEST).exists():
        return False
    return not tags_in(load_dir) and foreign_hint(load_dir) == _NOTHING


def read_manifest(path: Path) -> dict:
    """The manifest of tag directory `path`, after checking every file it lists is there, whole."""
    manifest = parse_manifest(path)
    _, problems = listed_files(path, manifest)
    if problems:
        raise CheckpointError(problems[0])
    return manifest


def parse_manifest(path: Path) -> dict:
    """The manifest of tag directory `path`, checked on its own: JSON, format, version, keys, seal.

    A version-1 manifest (sizes only) is read with each file entry as {"size": n}.
    """
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
    version = manifest.get("version")
    if version not in READABLE:
        raise CheckpointError(f"{path} is checkpoint format version {version}; this zeroshard reads versions "
                              f"{' and '.join(map(str, READABLE))}: load it with the zeroshard that wrote it "
                              f"({manifest.get('zeroshard', 'unknown')})")
    lacking = [key for key in _MANIFEST_KEYS + (("save_id", "checksum") if version >= 2 else ())
               if key not in manifest]
    if lacking:
        raise CheckpointError(f"{manifest_path} lacks {', '.join(lacking)}: it is damaged; load an earlier tag")
    if version >= 2 and manifest["checksum"] != manifest_checksum(manifest):
        raise CheckpointError(f"{manifest_path} does not match its checksum (written {manifest['checksum']}, "
                              f"now {manifest_checksum(manifest)}): it was edited or damaged after the save; "
                              f"{DAMAGED_FIX}")
    malformed = _malformed(manifest)
    if malformed:
        raise CheckpointError(f"{manifest_path} holds {malformed}: it is damaged; load an earlier tag")
    if version == 1:
        manifest["files"] = {name: {"size": size} for name, size in manifest["files"].items()}
        manifest["save_id"] = None
    return manifest


def _malformed(manifest: dict) -> str | None:
    """The first entry of the manifest a reader relies on that is not of its type, described; or None."""
    def table(value, shape_key: str | None = "shape") -> bool:
        return isinstance(value, dict) and all(
            isinstance(v, dict) and (shape_key is None or (isinstance(v.get(shape_key), list) and all(
                isinstance(d, int) and d >= 0 for d in v[shape_key]))) for v in value.values())

    checks = {"world_size": lambda v: isinstance(v, int) and 1 <= v <= 1 << 24,
              "stage": lambda v: v in (0, 1, 2, 3), "global_steps": lambda v: isinstance(v, int) and v >= 0,
              "optimizer": lambda v: isinstance(v, str), "param_groups": lambda v: isinstance(v, int) and v >= 0,
              "optimizer_state": lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v),
              "params": table, "buffers": table, "state_dict": lambda v: isinstance(v, dict) and all(
                  isinstance(k, str) and isinstance(n, str) for k, n in v.items()),
              "files": lambda v: isinstance(v, dict) and (manifest["version"] == 1 or table(v, None)),
              "save_id": lambda v: manifest["version"] == 1 or isinstance(v, str),
              # exclude_frozen_parameters' fingerprints (`frozen.py`), of frozen parameters the table lists
              "frozen_excluded": lambda v: v is None or isinstance(v, dict) and all(
                  isinstance(f, str) and manifest["params"].get(n, {}).get("group", 0) is None for n, f in v.items())}
    for key, ok in checks.items():
        if not ok(manifest.get(key)):
            return f"'{key}' as {json.dumps(manifest.get(key))[:80]}, which no save writes"
    return None


def listed_files(path: Path, manifest: dict) -> tuple[list[str], list[str]]:
    """(the files the manifest lists that are there with their size, in name order; what is wrong with
    the others and with the list itself), from names and sizes alone: no file is read."""
    listing = path / MANIFEST
    expected = [STATE] + [rank_file(r) for r in range(manifest["world_size"])]
    problems, intact = [], []
    for name, entry in sorted(manifest["files"].items()):
        if not is_plain(name):
            problems.append(f"{listing} lists the file '{name}', which is not a plain name inside {path}: it is "
                            "refused, since nothing outside the checkpoint is read; the manifest was edited or "
                            "damaged, load an earlier tag")
        elif not is_inside(path, name):
            problems.append(f"checkpoint file {path / name} is a link to {(path / name).resolve()}, outside "
                            f"{path}: it is refused, since nothing outside the checkpoint is read; put the file "
                            "itself in its place, or load an earlier tag")
        elif name not in expected:
            problems.append(f"{listing} lists '{name}', which is not a file of a checkpoint written by "
                            f"{manifest['world_size']} ranks: the manifest was edited or damaged; load an earlier tag")
        elif not _entry_ok(name, entry, manifest["version"]):
            problems.append(f"{listing} has no size, checksum or tensor list for {name}: the manifest is damaged; "
                            "load an earlier tag")
        else:
            missing = _presence(path, name, entry["size"])
            problems += missing
            intact += [] if missing else [name]
    problems += [f"{listing} does not list {name}, which a checkpoint written by {manifest['world_size']} ranks "
                 "has: the manifest was edited or damaged; load an earlier tag"
                 for name in expected if name not in manifest["files"]]
    return intact, problems


def _entry_ok(name: str, entry, version: int) -> bool:
    """A file's entry has its size (version 1: only that), its crc32, and a rank file its tensors."""
    if not isinstance(entry, dict) or not isinstance(entry.get("size"), int):
        return False
    if version == 1:
        return True
    tensors = entry.get("tensors")
    return isinstance(entry.get("crc32"), str) and (name == STATE or isinstance(tensors, dict) and all(
        isinstance(t, list) and len(t) == 2 and isinstance(t[0], str) and isinstance(t[1], int)
        for t in tensors.values()))


def _presence(path: Path, name: str, size: int) -> list[str]:
    file = path / name
    if not file.is_file():
        return [(f"checkpoint {path} is missing {name}; it was copied or deleted in part: "
                 "restore the file or load an earlier tag")]
    if file.stat().st_size != size:
        return [(f"checkpoint file {file} is {file.stat().st_size} bytes but was written as {size}: it is "
                 f"truncated or damaged; {DAMAGED_FIX}")]
    return []


def read_state(path: Path) -> dict:
    try:
        return torch.load(path / STATE, map_location="cpu", weights_only=True)
    except Exception as exc:  # a damaged pickle: UnpicklingError, RuntimeError, EOFError, ...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if first.startswith("Weights only load failed"):  # torch's advice to drop weights_only is not ours
            first = "its pickle is damaged, or holds objects other than plain data"
        raise CheckpointError(f"checkpoint file {path / STATE} cannot be read ({first}); "
                              "restore it or load an earlier tag") from None
