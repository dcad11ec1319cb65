"""Reading parameters' elements back from the rank files, by (kind, name), in ranges.

Every rank opens every rank file (safetensors reads ranges from a memory
map, so nothing is loaded whole) and reads exactly the elements its own
shards need, whatever ranks, stage or shards wrote them. `verify.py` checks
the files before anything is read.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from zeroshard.checkpoint.files import DAMAGED_FIX, CheckpointError


def open_rank_file(file: Path, stack: ExitStack):
    """A safetensors handle on `file`, closed with `stack`; CheckpointError if its header cannot be read."""
    try:
        return stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
    except Exception as exc:  # safetensors reports a damaged header in its own error type
        raise CheckpointError(f"checkpoint file {file} cannot be read ({exc}); {DAMAGED_FIX}") from None


@dataclass(frozen=True)
class Piece:
    offset: int  # first element, in the parameter's flattened elements
    numel: int
    file: int  # index into the reader's open files
    key: str  # the tensor that holds it
    at: int  # where in that tensor it starts


class PieceReader:
    """Every piece of a checkpoint, by (kind, name); reads ranges without loading whole files.

    The files are opened (their headers read) at once; their `runs` are indexed on the first
    question, so that `verify.header_problems` can look at the open headers first.
    """

    def __init__(self, path: Path, manifest: dict):
        self._stack = ExitStack()
        self._path = path
        self.handles: dict[str, object] = {}  # file name -> its open safetensors handle
        self._files = []
        self._pieces: dict[tuple[str, str], list[Piece]] | None = None
        for name in sorted(n for n in manifest["files"] if n.endswith(".safetensors")):
            try:
                self.handles[name] = open_rank_file(path / name, self._stack)
            except CheckpointError:
                self.close()
                raise
            self._files.append(self.handles[name])

    def _indexed(self) -> dict[tuple[str, str], list[Piece]]:
        if self._pieces is None:
            self._pieces = {}
            for index, (name, handle) in enumerate(self.handles.items()):
                self._index(self._path / name, handle, index)
            for pieces in self._pieces.values():
                pieces.sort(key=lambda p: p.offset)
        return self._pieces

    def _index(self, file: Path, handle, index: int) -> None:
        """Note every run the file's metadata lists, after checking it lies inside its tensor."""
        try:
            for key, entries in file_runs(handle).items():
                for name, start, at, numel in entries:
                    self._pieces.setdefault((key.split(":", 1)[0], name), []).append(
                        Piece(start, numel, index, key, at))
        except Exception as exc:  # KeyError, JSONDecodeError, a safetensors error, ValueError
            self._pieces = None
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
        for piece in self._indexed().get((kind, name), []):
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
            for piece in self._indexed().get((kind, name), []):
                lo, hi = max(start, piece.offset), min(end, piece.offset + piece.numel)
                if lo < hi:
                    first = piece.at + lo - piece.offset
                    values = self._files[piece.file].get_slice(piece.key)[first : first + hi - lo]
                    out[lo - start : hi - start].copy_(values)


def file_runs(handle) -> dict[str, list]:
    """A rank file's `runs` metadata, checked to lie inside its tensors: key -> [[name, start, at, numel], ...]."""
    runs = json.loads((handle.metadata() or {})["runs"])
    for key, entries in runs.items():
        length = handle.get_slice(key).get_shape()[0]
        for name, start, at, numel in entries:
            if at + numel > length or min(start, at, numel) < 0:
                raise ValueError(f"run of '{name}' past the end of '{key}'")
    return runs
