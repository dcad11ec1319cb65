"""Damaged checkpoints never load silently wrong: each damage is a CheckpointError on every rank that
names the file, raised before anything in the engine changes, and `zeroshard checkpoint verify` reports it.

One spawn of 2 gloo ranks runs the whole matrix (`matrix` below): the ranks train and save two tags of
one run, rank 0 damages a copy of the first tag per case (the second one is the "other save of the same
run" that swapped files come from), and both ranks try to load each copy into their trained engine.
Per case they return the message and whether the engine (every weight, fp32 master, optimizer moment and
setting, LR scheduler, counter) is bitwise what it was. The same spawn checks that a save with a NaN
master is refused on every rank, and that the first tag still loads after all of it. The references:
the engine's own state before each call, `zeroshard.consolidate` of the intact tag, zlib and
safetensors' own reader for the file format.

In one process: a rank file is plain safetensors, its crc32 is zlib's over its bytes, and it is
written from the tensors' own memory; every file's mode follows the umask; a stale partial directory
of another tag goes at the next save; a version-1 checkpoint still loads; an infinite optimizer
moment stops a save as a NaN master does.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.checkpoint.tamper import edit_manifest, manifest_of, reseal, write_manifest
from tests.distributed import run_ranks
from tests.recipes import Case, loss_of, make_engine, micro_batch
from zeroshard import CheckpointError, consolidate
from zeroshard.app.cli import main as cli_main
from zeroshard.checkpoint.checks import holdings
from zeroshard.checkpoint.files import STATE, rank_file
from zeroshard.checkpoint.writer import _bytes_of, write_tensors

CASE = Case(stage=2)
CONFIG = CASE.config() | {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
                          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
A, B = "global_step1", "global_step2"  # two saves of one run
RANK0, RANK1 = rank_file(0), rank_file(1)


# -- the damage, one function per case: (save dir holding tag A, tag B of the same run) -> what the
#    error must name, and a phrase of its cause -----------------------------------------------------


def _header(file: Path) -> tuple[int, dict, bytes]:
    data = file.read_bytes()
    length = int.from_bytes(data[:8], "little")
    return length, json.loads(data[8 : 8 + length]), data[8 + length :]


def _write_header(file: Path, length: int, header: dict, body: bytes) -> None:
    """The header rewritten in the same number of bytes (padded with spaces), so only its content differs."""
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    file.write_bytes(length.to_bytes(8, "little") + text + b" " * (length - len(text)) + body)


def _retype(file: Path, key: str, dtype: str, shrink: int = 1) -> None:
    length, header, body = _header(file)
    header[key] = header[key] | {"dtype": dtype, "shape": [header[key]["shape"][0] // shrink]}
    _write_header(file, length, header, body)


def _rewrite(file: Path, change) -> None:
    """Rewrite a rank file through safetensors with its metadata, its tensors changed by `change`."""
    with safe_open(str(file), framework="pt") as f:
        metadata = f.metadata()
    save_file(change(load_file(file)), str(file), metadata=metadata)


def _state(tag_dir: Path, change) -> None:
    state = torch.load(tag_dir / STATE, weights_only=True)
    change(state)
    torch.save(state, tag_dir / STATE)
    reseal(tag_dir, STATE)


def _garble(file: Path, at: int, count: int = 64) -> None:
    data = bytearray(file.read_bytes())
    data[at : at + count] = bytes(b ^ 0xFF for b in data[at : at + count])
    file.write_bytes(bytes(data))


def _nan_fill(file: Path) -> None:
    length, header, body = _header(file)
    start, end = header["param:@shard0"]["data_offsets"]
    nans = np.full((end - start) // 4, np.nan, dtype="<f4").tobytes()
    file.write_bytes(file.read_bytes()[: 8 + length + start] + nans + body[end:])


def _outside(root: Path) -> Path:
    """A copy of tag A outside the save directory."""
    elsewhere = root.parent / f"{root.name}_elsewhere"
    shutil.copytree(root / A, elsewhere)
    return elsewhere


def _moved_entry(root: Path, new_name: str) -> None:
    files = manifest_of(root / A)["files"]
    files[new_name] = files.pop(RANK1)
    edit_manifest(root / A, files=files)


def _manifest_field(root: Path, path: tuple, value, seal: bool = True) -> None:
    manifest = manifest_of(root / A)
    target = manifest
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value(target[path[-1]])
    write_manifest(root / A, manifest, seal)


def _latest(root: Path, text: str) -> tuple[str, ...]:
    (root / "latest").write_text(text + "\n")
    return f"{root / 'latest'} names '{text}'", "which is not a tag directory inside"


# case -> function(save dir holding tag A, tag B's directory) -> phrases the error must hold: the file
# first, then its cause (and "rank R: " where the rank that finds it is known)
DAMAGE = {}


def damage(fn):
    DAMAGE[fn.__name__] = fn
    return fn


@damage
def delete(root, other):
    (root / A / RANK1).unlink()
    return f"missing {RANK1}", "copied or deleted in part"


@damage
def truncate(root, other):
    os.truncate(root / A / RANK0, 1000)
    return RANK0, "is 1000 bytes but was written as"


@damage
def garble_data(root, other):
    _garble(root / A / RANK1, (root / A / RANK1).stat().st_size // 2)
    return RANK1, "has checksum", "rank 1: "  # rank 1 checks file 1 of the sorted three: the checksums are split


@damage
def garble_header(root, other):
    _garble(root / A / RANK0, 8, 40)
    return RANK0, "cannot be read"


@damage
def swap_rank_file(root, other):
    shutil.copy(other / RANK1, root / A / RANK1)  # rank 1's file of the next save of the same run
    return RANK1, "belongs to another save"


@damage
def swap_state(root, other):
    shutil.copy(other / STATE, root / A / STATE)
    return STATE, "belongs to another save"


@damage
def dtype_same_size(root, other):
    _retype(root / A / RANK0, "param:@shard0", "I32")
    return RANK0, "stores 'param:@shard0' as I32", "but the manifest declares F32"


@damage
def dtype_other_size(root, other):
    _retype(root / A / RANK0, "param:@shard0", "F64", shrink=2)
    return RANK0, "stores 'param:@shard0' as F64", "but the manifest declares F32"


@damage
def dtype_forged(root, other):
    _retype(root / A / RANK0, "param:@shard0", "I32")
    reseal(root / A, RANK0)  # the manifest declares I32 too: the parameter tables still say fp32
    return RANK0, "stores 'param:@shard0' as I32, but '", "' is kept in torch.float32"


@damage
def nan_fill(root, other):
    _nan_fill(root / A / RANK0)
    return RANK0, "has checksum", "rank 0: "


@damage
def manifest_unsealed_size(root, other):
    _manifest_field(root, ("files", RANK1, "size"), lambda s: s + 8, seal=False)
    return "manifest.json", "does not match its checksum"


@damage
def manifest_size(root, other):
    _manifest_field(root, ("files", RANK1, "size"), lambda s: s + 8)
    return RANK1, "bytes but was written as"


@damage
def manifest_checksum(root, other):
    _manifest_field(root, ("files", RANK0, "crc32"), lambda c: "0" * 8)
    return RANK0, "but was written with 00000000"


@damage
def manifest_save_id(root, other):
    _manifest_field(root, ("save_id",), lambda s: "0" * 32)
    return STATE, "belongs to another save"  # state.pt is read first, then every rank file says the same


@damage
def manifest_shape(root, other):
    _manifest_field(root, ("params", "wte.weight", "shape"), lambda s: s[::-1], seal=False)
    return "manifest.json", "does not match its checksum"


@damage
def manifest_truncated(root, other):
    (root / A / "manifest.json").write_text('{"format": ')
    return "manifest.json", "is not valid JSON"


@damage
def manifest_dotdot(root, other):
    shutil.copy(root / A / RANK1, root / RANK1)
    _moved_entry(root, "../" + RANK1)
    return f"'../{RANK1}'", "not a plain name inside"


@damage
def manifest_absolute(root, other):
    target = _outside(root) / RANK1
    _moved_entry(root, str(target))
    return f"'{target}'", "not a plain name inside"


@damage
def manifest_extra_entry(root, other):
    (root / A / "extra.bin").write_bytes(b"\0" * 8)
    edit_manifest(root / A, files=manifest_of(root / A)["files"] | {"extra.bin": {"size": 8, "crc32": "00000000"}})
    return "'extra.bin'", "which is not a file of a checkpoint written by 2 ranks"


@damage
def manifest_dropped_entry(root, other):
    files = manifest_of(root / A)["files"]
    del files[RANK1]
    edit_manifest(root / A, files=files)
    return f"does not list {RANK1}", "the manifest was edited or damaged"


@damage
def latest_dotdot(root, other):
    _outside(root)
    return _latest(root, f"../{root.name}_elsewhere")


@damage
def latest_absolute(root, other):
    return _latest(root, str(root / A))


@damage
def latest_symlink_out(root, other):
    os.symlink(_outside(root), root / "linked", target_is_directory=True)
    return _latest(root, "linked")


@damage
def rank_file_symlink_out(root, other):
    target = _outside(root) / RANK1
    (root / A / RANK1).unlink()
    os.symlink(target, root / A / RANK1)
    return f"{RANK1} is a link to {target.resolve()}", "outside"


@damage
def rank_file_extra_key(root, other):
    _rewrite(root / A / RANK0, lambda t: t | {"param:extra": torch.zeros(3)})
    reseal(root / A, RANK0, tensors=False)  # size and checksum agree, the list of tensors does not
    return RANK0, "holds 'param:extra', which the manifest does not list"


@damage
def rank_file_missing_key(root, other):
    _rewrite(root / A / RANK0, lambda t: {k: v for k, v in t.items() if k != "optim.exp_avg:@shard0"})
    reseal(root / A, RANK0, tensors=False)
    return RANK0, "lacks 'optim.exp_avg:@shard0', which the manifest lists"


@damage
def state_missing_key(root, other):
    _state(root / A, lambda s: s.pop("scalars"))
    return STATE, "lacks scalars"


@damage
def state_wrong_type(root, other):
    _state(root / A, lambda s: s.update(global_steps="1"))
    return STATE, "holds 'global_steps' as a str"


@damage
def state_garbled(root, other):
    _garble(root / A / STATE, 0)
    return STATE, "cannot be read"


def damage_all(save_dir: Path, cases: Path) -> dict[str, tuple[str, ...]]:
    """A damaged copy of tag A (with its `latest`) per case, in cases/<case>; case -> the phrases expected."""
    expected = {}
    for name, fn in DAMAGE.items():
        root = cases / name
        shutil.copytree(save_dir / A, root / A)
        (root / "latest").write_text(A + "\n")
        expected[name] = fn(root, save_dir / B)
    return expected


# -- the ranks ------------------------------------------------------------------------------------


def _train(e, step: int, rank: int, world: int, device) -> None:
    x, y = (t.to(device) for t in micro_batch(step, CASE, world, rank, 0))
    e.backward(loss_of(e, x, y))
    e.step()


def _snapshot(e) -> dict:
    """Everything a load may change, copied: weights, fp32 masters, optimizer state and settings,
    the LR scheduler, the counters."""
    opt = e.optimizer.state_dict()
    return {"weights": e.full_state_dict(), "masters": [b.master.detach().clone() for b in e.buckets],
            "optimizer": copy.deepcopy(opt), "scheduler": copy.deepcopy(e.lr_scheduler.state_dict()),
            "counters": (e.global_steps, e.micro_steps, e.skipped_steps)}


def _differences(a, b, where: str = "") -> list[str]:
    """Where two snapshots differ, bitwise (tensors by torch.equal, which also compares dtypes)."""
    if torch.is_tensor(a):
        return [] if torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b) else [where]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [where]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [where]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}/{i}")]
    return [] if a == b else [where]


def _nan_save(e, rank: int, save_dir: Path) -> dict:
    """Rank 1 puts a NaN into its first master element; the save must stop on both ranks, writing nothing."""
    trained = holdings(e._adapter).trained[0]
    run = next(trained.own.runs())
    if rank == 1:
        with torch.no_grad():
            trained.own_part(trained.bucket.master)[run.at] = float("nan")
    before = sorted(os.listdir(save_dir)), (save_dir / "latest").read_text()
    try:
        e.save_checkpoint(save_dir, tag="diverged")
        message = None
    except CheckpointError as exc:
        message = str(exc)
    after = sorted(os.listdir(save_dir)), (save_dir / "latest").read_text()
    return {"message": message, "unchanged": before == after, "name": run.name, "element": run.start}


def _matrix(rank, world, device, root):
    root = Path(root)
    e = make_engine(CASE, optimizer=lambda model: None, config=CONFIG, device=device)
    _train(e, 0, rank, world, device)
    e.save_checkpoint(root / "run")  # tag A
    _train(e, 1, rank, world, device)
    e.save_checkpoint(root / "run")  # tag B: the same run one step on
    expected = damage_all(root / "run", root / "cases") if rank == 0 else None
    dist.barrier()
    results = {"expected": expected}
    for case in DAMAGE:
        before = _snapshot(e)
        try:
            e.load_checkpoint(root / "cases" / case)
            message = None
        except CheckpointError as exc:
            message = str(exc)
        results[case] = (message, _differences(before, _snapshot(e)))
    _train(e, 2, rank, world, device)  # the ranks still step together
    results["nan_save"] = _nan_save(e, rank, root / "run")
    e.load_checkpoint(root / "run", tag=A)  # the earlier checkpoint still loads, and puts finite masters back
    results["loaded"] = {k: v.cpu() for k, v in e.full_state_dict().items()}
    results["global_steps"] = e.global_steps
    return results


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """(the root: run/ holds tags A and B, cases/<case> each damaged copy; each rank's results)."""
    root = tmp_path_factory.mktemp("damage")
    return root, run_ranks(_matrix, 2, str(root), timeout_s=300, collective_timeout_s=120)


# -- loads ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damage_is_refused_on_every_rank_and_changes_nothing(matrix, case):
    _, ranks = matrix
    expected = ranks[0]["expected"][case]
    (message, changed), (other, other_changed) = ranks[0][case], ranks[1][case]
    assert message is not None, f"{case}: the damaged checkpoint loaded"
    assert message == other, f"the ranks raised different errors:\n{message}\n{other}"
    for phrase in expected:
        assert phrase in message, f"{case}: {phrase!r} not in: {message}"
    assert changed == [] and other_changed == [], f"{case}: a failed load changed {changed or other_changed}"


def test_nan_master_save_is_refused_on_every_rank_and_the_last_save_loads(matrix):
    root, ranks = matrix
    nan = ranks[1]["nan_save"]
    assert ranks[0]["nan_save"]["message"] == nan["message"]
    assert nan["message"].startswith(f"rank 1: the master weights of '{nan['name']}' hold nan (element "
                                     f"{nan['element']}) at step 3: "), nan["message"]
    assert nan["message"].endswith("so nothing was written and earlier checkpoints are intact. Find where the run "
                                   "diverged (its losses, engine.skipped_steps), then load the last good checkpoint")
    assert ranks[0]["nan_save"]["unchanged"] and nan["unchanged"]  # no tag, no partial directory, `latest` as it was
    written = consolidate.consolidate(root / "run", A)
    for results in ranks:
        assert results["global_steps"] == 1
        assert results["loaded"].keys() == written.keys()
        assert [k for k in written if not torch.equal(results["loaded"][k], written[k])] == []


# -- the command line: verify, and consolidate (which verifies first) -------------------------------------


@pytest.mark.parametrize("case", list(DAMAGE))
def test_cli_verify_and_consolidate_report_the_damage(matrix, case, capsys):
    root, ranks = matrix
    expected = [p for p in ranks[0]["expected"][case] if not p.startswith("rank ")]
    assert cli_main(["checkpoint", "verify", str(root / "cases" / case)]) == 1
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert any(all(p in line for p in expected) for line in lines), f"{case}: {expected} in no line of:\n{out}"
    assert "problem" in err and "do not load it" in err, err
    out_file = root / f"{case}.safetensors"
    assert cli_main(["consolidate", str(root / "cases" / case), str(out_file)]) == 1
    _, err = capsys.readouterr()
    assert any(all(p in line for p in expected) for line in err.splitlines()), err
    assert not out_file.exists()


def test_cli_verify_an_intact_checkpoint(matrix, capsys):
    root, _ = matrix
    for tag in (A, B):
        assert cli_main(["checkpoint", "verify", str(root / "run"), "--tag", tag]) == 0
        out, err = capsys.readouterr()
        assert out == f"{root / 'run' / tag}: every file is whole (sizes, checksums, save id, dtypes, keys)\n"
        assert err == ""


# -- one process: the file format, file modes, stale partial directories, version 1 -------------------------


def test_rank_file_is_safetensors_streamed_without_a_copy(tmp_path):
    tensors = {"f32": torch.randn(1000), "bf16": torch.randn(333).bfloat16(), "f16": torch.randn(5).half(),
               "i64": torch.arange(7), "bool": torch.tensor([True, False, True]), "u8": torch.arange(9, dtype=torch.uint8),
               "empty": torch.zeros(0), "shard": torch.randn(4096)[1000:3000]}  # a view into a larger buffer
    entry = write_tensors(tmp_path / "f.safetensors", tensors, {"save_id": "abc", "runs": "{}"})
    data = (tmp_path / "f.safetensors").read_bytes()
    assert entry["size"] == len(data) and entry["crc32"] == f"{zlib.crc32(data):08x}"
    read = load_file(tmp_path / "f.safetensors")  # safetensors' own reader: the format is its own
    assert read.keys() == tensors.keys()
    assert all(read[k].dtype == v.dtype and torch.equal(read[k], v) for k, v in tensors.items())
    with safe_open(str(tmp_path / "f.safetensors"), framework="pt") as f:
        assert f.metadata() == {"save_id": "abc", "runs": "{}"}
    assert entry["tensors"] == {"bf16": ["BF16", 333], "bool": ["BOOL", 3], "empty": ["F32", 0], "f16": ["F16", 5],
                                "f32": ["F32", 1000], "i64": ["I64", 7], "shard": ["F32", 2000], "u8": ["U8", 9]}
    shard = tensors["shard"]  # what is written is the tensor's own storage, not a copy of it
    assert np.frombuffer(_bytes_of(shard), dtype=np.uint8).ctypes.data == shard.data_ptr()


def _one_rank_save(save_dir: Path, tag: str | None = None) -> Path:
    e = make_engine(CASE)
    _train(e, 0, 0, 1, "cpu")
    return e.save_checkpoint(save_dir, tag=tag)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o027])
def test_every_file_follows_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        tag_dir = _one_rank_save(tmp_path / "ckpt")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [tag_dir, *tag_dir.iterdir(), tmp_path / "ckpt" / "latest"]}
    assert modes == {tag_dir.name: 0o777 & ~umask, "latest": 0o666 & ~umask, "manifest.json": 0o666 & ~umask,
                     "state.pt": 0o666 & ~umask, RANK0: 0o666 & ~umask}


def test_stale_partial_directories_of_any_tag_are_removed_by_the_next_save(tmp_path):
    save_dir = tmp_path / "ckpt"
    _one_rank_save(save_dir)
    stale, newer = save_dir / ".best.partial", save_dir / ".other.partial"
    for directory in (stale, newer):
        directory.mkdir()
        (directory / RANK0).write_bytes(b"\0" * 16)  # a save that died half-way
    hour_ago = newer.stat().st_mtime - 3600
    os.utime(stale, (hour_ago, hour_ago))
    os.utime(newer, (hour_ago + 7200, hour_ago + 7200))  # changed after the next save began: a save in progress
    _one_rank_save(save_dir, tag="later")
    assert sorted(os.listdir(save_dir)) == [".other.partial", A, "later", "latest"]


def test_a_version_1_checkpoint_still_loads(tmp_path):
    """Written before checksums: sizes only, no save id, no seal. Every other check still runs."""
    tag_dir = _one_rank_save(tmp_path)
    manifest = manifest_of(tag_dir)
    del manifest["save_id"], manifest["checksum"]
    manifest |= {"version": 1, "files": {name: entry["size"] for name, entry in manifest["files"].items()}}
    write_manifest(tag_dir, manifest, seal=False)
    e = make_engine(CASE, seed=3)
    e.load_checkpoint(tmp_path)
    written = consolidate.consolidate(tmp_path)
    assert all(torch.equal(e.full_state_dict()[k], v) for k, v in written.items())
    os.truncate(tag_dir / RANK0, 100)
    with pytest.raises(CheckpointError, match=f"{RANK0} is 100 bytes but was written as"):
        e.load_checkpoint(tmp_path)


def test_save_with_an_infinite_optimizer_moment_is_refused(tmp_path):
    e = make_engine(CASE)
    _train(e, 0, 0, 1, "cpu")
    e.save_checkpoint(tmp_path)
    trained = holdings(e._adapter).trained[-1]
    run = list(trained.own.runs())[-1]
    exp_avg_sq = e.optimizer.state[trained.bucket.master]["exp_avg_sq"]
    exp_avg_sq[run.at + run.numel - 1] = float("inf")
    with pytest.raises(CheckpointError, match=(
            f"^the optimizer state 'exp_avg_sq' of '{run.name}' holds inf \\(element {run.start + run.numel - 1}\\) "
            "at step 1: a checkpoint of them would replace good states with diverged ones, so nothing was written")):
        e.save_checkpoint(tmp_path, tag="diverged")
    assert sorted(os.listdir(tmp_path)) == [A, "latest"]
