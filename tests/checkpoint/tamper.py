"""Changing a saved checkpoint on purpose: files rewritten with a manifest that agrees, or not.

A test that damages one thing at a time must keep the rest consistent, or an
earlier check (the manifest's seal, a file's checksum) would report the
damage before the check under test sees it. `reseal` makes the manifest
describe the files as they now are (sizes, checksums, tensors) and seals it
again, as a careful forger would.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from zeroshard.checkpoint.files import MANIFEST, sealed
from zeroshard.checkpoint.verify import file_crc32


def manifest_of(tag_dir: Path) -> dict:
    return json.loads((tag_dir / MANIFEST).read_text())


def write_manifest(tag_dir: Path, manifest: dict, seal: bool = True) -> None:
    """Write `manifest` (sealed again unless `seal` is false: then its old checksum stays)."""
    manifest = {k: v for k, v in manifest.items() if k != "checksum" or not seal}
    (tag_dir / MANIFEST).write_text(sealed(manifest) if seal else json.dumps(manifest, indent=1))


def edit_manifest(tag_dir: Path, seal: bool = True, **changes) -> None:
    write_manifest(tag_dir, manifest_of(tag_dir) | changes, seal)


def reseal(tag_dir: Path, *names: str, tensors: bool = True) -> None:
    """Make the manifest's entries for `names` describe the files as they are now (their size and
    checksum; their tensors too unless `tensors` is false), and seal it."""
    manifest = manifest_of(tag_dir)
    for name in names:
        file = tag_dir / name
        entry = manifest["files"][name] | {"size": file.stat().st_size, "crc32": file_crc32(file)}
        if name.endswith(".safetensors") and tensors:
            with safe_open(str(file), framework="pt") as f:
                entry["tensors"] = {k: [f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()[0]]
                                    for k in sorted(f.keys())}
        manifest["files"][name] = entry
    write_manifest(tag_dir, manifest)
