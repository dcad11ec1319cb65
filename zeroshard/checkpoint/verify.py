"""Whether a checkpoint's files are the ones its manifest describes: the checks that read their contents.

One set of checks, shared by `load` (every rank, before anything changes),
`consolidate` and `zeroshard checkpoint verify` (one process). Each
returns its problems as sentences that name the file, the cause and the fix:

- every rank file carries the manifest's save id (files of two saves mixed
  are refused), holds exactly the tensors the manifest lists, each with the
  declared safetensors dtype and length (no silent cast), and each kind in
  the dtype the parameter tables say (fp32 masters, frozen parameters and
  buffers in their own dtype);
- state.pt carries the save id and every part a load reads, of its type;
- every file's bytes have the crc32 written into the manifest. Checksums
  read whole files, so a load splits them: rank r checks files r, r + N, ...
  of the sorted list (`share`), and the ranks agree on the outcome.

A version-1 checkpoint (written before checksums and save ids) gets every
check but those two.
"""

from __future__ import annotations

import json
import math
import zlib
from contextlib import ExitStack
from pathlib import Path

from zeroshard.checkpoint.files import (
    DAMAGED_FIX,
    STATE,
    CheckpointError,
    crc_hex,
    group_state_keys,
    listed_files,
    parse_manifest,
    read_state,
    resolve,
)
from zeroshard.checkpoint.frozen import excluded
from zeroshard.checkpoint.pieces import PieceReader, file_runs, open_rank_file
from zeroshard.checkpoint.writer import SAFETENSORS_DTYPES
from zeroshard.dtypes import MASTER_DTYPE, from_torch_name

# The parts of state.pt a load reads, and their types.
STATE_PARTS = {"global_steps": int, "skipped_steps": int, "loss_scaler": (dict, type(None)),
               "lr_scheduler": (dict, type(None)), "param_groups": list, "scalars": dict, "client_state": dict}
_READ_BYTES = 16 << 20  # the buffer a checksum reads through


def raise_first(problems: list[str]) -> None:
    """Raise the first problem as a CheckpointError, saying how many more there are."""
    if problems:
        more = (f" ({len(problems) - 1} more problem{'s' if len(problems) > 2 else ''}: "
                "`zeroshard checkpoint verify` lists them)") if len(problems) > 1 else ""
        raise CheckpointError(problems[0] + more)


def share(manifest: dict, rank: int, world_size: int) -> list[str]:
    """The files whose checksum rank `rank` of `world_size` checks: r, r + N, ... of the sorted names."""
    return sorted(manifest["files"])[rank::world_size]


def verify(load_dir: str | Path, tag: str | None = None) -> tuple[Path | None, list[str]]:
    """Every problem of a checkpoint, in one process: (its tag directory, or None; the problems)."""
    try:
        path = resolve(load_dir, tag)
        manifest = parse_manifest(path)
    except CheckpointError as exc:
        return None, [str(exc)]
    return path, problems_of(path, manifest)


def problems_of(path: Path, manifest: dict) -> list[str]:
    """Every problem of tag directory `path` with a parsed manifest: names, sizes, headers, state, checksums.

    One problem per file: a file found damaged otherwise is not checksummed as well.
    """
    try:
        return _problems_of(path, manifest)
    except CheckpointError as exc:
        return [str(exc)]
    except Exception as exc:  # what a damaged file or a forged manifest raises that no check foresaw
        return [f"checkpoint {path} cannot be checked ({type(exc).__name__}: {exc}); it is damaged: {DAMAGED_FIX}"]


def _problems_of(path: Path, manifest: dict) -> list[str]:
    intact, problems = listed_files(path, manifest)
    damaged = set()
    with ExitStack() as stack:
        for name in intact:
            try:
                if name == STATE:
                    found = state_problems(path / STATE, manifest, read_state(path))
                else:
                    found = _rank_file_problems(path / name, open_rank_file(path / name, stack),
                                                manifest["files"][name], manifest)
            except CheckpointError as exc:
                found = [str(exc)]
            damaged.update([name] if found else [])
            problems += found
    if not problems:  # every file is there and says what it holds: do they cover every element?
        with PieceReader(path, manifest) as reader:
            problems += coverage_problems(path, manifest, reader)
    return problems + checksum_problems(path, manifest, [n for n in intact if n not in damaged])


def header_problems(path: Path, manifest: dict, handles: dict) -> list[str]:
    """What is wrong with the open rank files' headers: save id, tensors, dtypes and lengths, runs."""
    problems = []
    for name, handle in sorted(handles.items()):
        problems += _rank_file_problems(path / name, handle, manifest["files"][name], manifest)
    return problems


def _rank_file_problems(file: Path, handle, entry: dict, manifest: dict) -> list[str]:
    """A rank file's problems, in the order that says most: what it is, which save, its tensors, its runs."""
    metadata = handle.metadata() or {}
    try:
        json.loads(metadata["runs"])
    except Exception as exc:  # KeyError, JSONDecodeError, TypeError: not a zeroshard rank file
        return [_unsaid(file, exc)]
    save_id = manifest["save_id"]
    if save_id is not None and metadata.get("save_id") != save_id:
        return [_other_save(file, metadata.get("save_id"), save_id)]
    stored = {key: (handle.get_slice(key).get_dtype(), handle.get_slice(key).get_shape()) for key in handle.keys()}
    problems = _declared_problems(file, stored, entry.get("tensors"))
    if problems:
        return problems
    try:
        runs = file_runs(handle)
    except Exception as exc:  # KeyError, a safetensors error, ValueError
        return [_unsaid(file, exc)]
    return _kind_problems(file, stored, runs, manifest)


def _unsaid(file: Path, exc: Exception) -> str:
    return (f"checkpoint file {file} does not say what it holds ({type(exc).__name__}: {exc}); it is damaged "
            "or not a zeroshard rank file: restore it or load an earlier tag")


def _declared_problems(file: Path, stored: dict, declared: dict | None) -> list[str]:
    """The tensors the manifest lists for the file, each with its dtype and length (None: version 1)."""
    if declared is None:
        return []
    problems = [f"checkpoint file {file} lacks '{key}', which the manifest lists: the file was rewritten or "
                f"damaged; {DAMAGED_FIX}" for key in sorted(set(declared) - set(stored))]
    problems += [f"checkpoint file {file} holds '{key}', which the manifest does not list: the file was "
                 f"rewritten or damaged; {DAMAGED_FIX}" for key in sorted(set(stored) - set(declared))]
    for key in sorted(set(stored) & set(declared)):
        (dtype, shape), (want, numel) = stored[key], declared[key]
        if dtype != want or shape != [numel]:
            problems.append(f"checkpoint file {file} stores '{key}' as {dtype} {shape}, but the manifest declares "
                            f"{want} [{numel}]: the file was rewritten or damaged, and a cast would load wrong "
                            f"values; {DAMAGED_FIX}")
    return problems


def _other_save(file: Path, theirs: str | None, ours: str) -> str:
    carried = f"save id {theirs}" if theirs else "no save id"
    return (f"checkpoint file {file} belongs to another save ({carried}; the manifest's is {ours}): files of "
            "two saves were mixed, by a copy or an interrupted save over this tag; restore the tag's own files "
            "or load an earlier tag")


def _kind_problems(file: Path, stored: dict, runs: dict, manifest: dict) -> list[str]:
    """Each tensor in the dtype its kind is kept in: fp32 masters, frozen parameters and buffers as declared."""
    problems = []
    for key, entries in sorted(runs.items()):
        kind, window = key.split(":", 1)
        if kind.startswith("optim.") and kind.removeprefix("optim.") not in manifest["optimizer_state"]:
            problems.append(f"checkpoint file {file} holds '{key}', optimizer state the manifest does not list: the "
                            f"files and the manifest do not belong together; {DAMAGED_FIX}")
        if kind.startswith("optim."):
            continue  # the optimizer's own dtype
        table = manifest["buffers"] if kind == "buffer" else manifest["params"]
        for name, *_ in entries:
            if name not in table:
                problems.append(f"checkpoint file {file} holds pieces of '{name}' in '{key}', which the manifest "
                                f"does not list: the files and the manifest do not belong together; {DAMAGED_FIX}")
                break
            want = MASTER_DTYPE if kind == "param" and window.startswith("@shard") else _dtype(table[name])
            if SAFETENSORS_DTYPES.get(want) != stored[key][0]:
                problems.append(f"checkpoint file {file} stores '{key}' as {stored[key][0]}, but '{name}' is kept "
                                f"in {want}: the file was rewritten or damaged; {DAMAGED_FIX}")
                break
    return problems


def _dtype(entry: dict):
    try:
        return from_torch_name(entry["dtype"])
    except (KeyError, TypeError, ValueError):
        return None


def state_problems(file: Path, manifest: dict, state) -> list[str]:
    """What is wrong with state.pt's contents: the save id and every part a load reads, with its type."""
    if not isinstance(state, dict):
        return [f"checkpoint file {file} holds a {type(state).__name__}, not a checkpoint's state; {DAMAGED_FIX}"]
    save_id = manifest["save_id"]
    if save_id is not None and state.get("save_id") != save_id:
        return [_other_save(file, state.get("save_id"), save_id)]
    lacking = [key for key in STATE_PARTS if key not in state]
    wrong = [f"holds '{key}' as a {type(state[key]).__name__}" for key, kind in STATE_PARTS.items()
             if key in state and not isinstance(state[key], kind)]
    if not (lacking or wrong):
        groups, scalars = state["param_groups"], state["scalars"]
        if len(groups) != manifest["param_groups"] or not all(isinstance(g, dict) for g in groups):
            wrong.append(f"holds {len(groups)} 'param_groups' for the manifest's {manifest['param_groups']}")
        lacking += [f"scalars['{name}']" for name, p in manifest["params"].items()
                    if p.get("group") is not None and not isinstance(scalars.get(name), dict)][:5]
    if not (lacking or wrong):
        return []
    parts = ([f"lacks {', '.join(lacking)}"] if lacking else []) + wrong
    return [f"checkpoint file {file} {'; '.join(parts)}: it is damaged or was rewritten; {DAMAGED_FIX}"]


def coverage_problems(path: Path, manifest: dict, reader: PieceReader) -> list[str]:
    """Every element of every parameter (its value, and its optimizer state if trained) and buffer is held;
    not the frozen parameters a checkpoint saved with exclude_frozen_parameters leaves out. A trained
    parameter's state is its param group's keys at its size ("group_state"), or, owned whole, each key at the
    shape the manifest gives it ("owned_state")."""
    left_out, owned = excluded(manifest), manifest.get("owned_state", {})
    needs = [(kind, name, math.prod(entry["shape"])) for kind, table in (("param", manifest["params"]),
                                                                        ("buffer", manifest["buffers"]))
             for name, entry in table.items() if name not in left_out]
    for name, entry in manifest["params"].items():
        if entry.get("group") is None:
            continue  # frozen: no optimizer state
        keys = [] if name in owned else group_state_keys(manifest, entry["group"])
        needs += [("optim." + key, name, math.prod(entry["shape"])) for key in keys]
        needs += [("optim." + key, name, math.prod(shape)) for key, shape in owned.get(name, {}).items()]
    problems = []
    for kind, name, numel in needs:
        why = reader.missing(kind, name, 0, numel)
        if why is not None:
            problems.append(f"{path}: {why}: the checkpoint is incomplete or damaged; load an earlier tag")
    return problems


def checksum_problems(path: Path, manifest: dict, names: list[str]) -> list[str]:
    """Each named file whose bytes no longer have the crc32 the manifest recorded when it was written."""
    problems = []
    for name in names:
        expected = manifest["files"][name].get("crc32")
        if expected is None:
            continue  # a version-1 checkpoint
        try:
            actual = file_crc32(path / name)
        except OSError as exc:
            problems.append(f"checkpoint file {path / name} cannot be read ({exc}); {DAMAGED_FIX}")
            continue
        if actual != expected:
            problems.append(f"checkpoint file {path / name} has checksum {actual}, but was written with {expected}: "
                            f"its bytes changed after the save (disk or copy damage, or an edit); {DAMAGED_FIX}")
    return problems


def file_crc32(file: Path) -> str:
    """The crc32 of a file's bytes, read through one reused buffer."""
    crc, buffer = 0, bytearray(_READ_BYTES)
    view = memoryview(buffer)
    with open(file, "rb") as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return crc_hex(crc)
