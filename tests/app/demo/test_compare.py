"""`zeroshard compare` end to end at 2 ranks: tables, compare.json and the PNG, measured = estimate."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

from zeroshard.app.estimate.model_count import count_model
from zeroshard.app.models import GPT, PRESETS

RUNS = {"0": "stage 0", "1": "stage 1", "2": "stage 2"}  # each run is a launch: keep to these


def _png_size(path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (after the 8-byte signature)."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_compare_two_ranks(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("in the beginning god created the heaven and the earth. " * 40)
    cmd = [sys.executable, "-m", "zeroshard.app.cli", "compare", "--nproc", "2", "--steps", "2",
           "--model", "tiny", "--micro-batch", "2", "--data", str(text), "--out", str(tmp_path / "out"),
           "--runs", *RUNS]
    env = {**os.environ, "COLUMNS": "200"}  # rich fits tables to 80 columns without a terminal
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    lines = [line for line in output.splitlines() if "│" in line]
    for name in RUNS.values():  # a row in each table, ending with the check mark
        rows = [line for line in lines if line.split("│")[0].strip() == name]
        assert len(rows) == 2 and all(row.rstrip().endswith("✓") for row in rows), (name, output)

    rows = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert [row["name"] for row in rows] == list(RUNS.values())
    # The tiny GPT on this text's alphabet: Ψ counted without building it, then padded to N.
    alphabet = len(set(text.read_text()))
    psi = count_model("tiny").numel + (alphabet - PRESETS["tiny"].vocab_size) * PRESETS["tiny"].n_embd
    assert psi == GPT(PRESETS["tiny"].__class__(**{**PRESETS["tiny"].__dict__, "vocab_size": alphabet})).num_params()
    for row in rows:
        padded, stage = row["psi_padded"], row["stage"]
        assert 0 <= padded - psi < 2 * 2  # fewer than N elements of padding per unit (2 units)
        assert padded % 2 == 0  # each unit pads to a multiple of N, so Ψ splits into 2 equal shards
        # The paper's model states, by hand, in fp32 with AdamW (DESIGN.md section 1): parameters 4Ψ,
        # gradients 4Ψ (sharded from stage 2), no separate master, moments 8Ψ (sharded from stage 1),
        # plus torch's 4-byte step counter per optimizer tensor (one per unit).
        shard = padded // 2
        expected_memory = {"params": 4 * padded, "grads": 4 * (shard if stage >= 2 else padded), "master": 0,
                           "optimizer": 8 * (shard if stage >= 1 else padded) + 4 * 2}
        # Logical bytes per step: stage 0 all-reduces the fp32 gradients; stages 1-2 reduce-scatter them and
        # all-gather the updated parameters (the clipping norm rides on the step check, an op of its own).
        expected_comm = ({"all_reduce": 4 * padded, "reduce_scatter": 0, "all_gather": 0} if stage == 0 else
                         {"all_reduce": 0, "reduce_scatter": 4 * padded, "all_gather": 4 * padded})
        assert row["memory"] == row["memory_estimate"] == expected_memory, row
        assert row["comm"] == row["comm_estimate"] == expected_comm, row
    assert _png_size(tmp_path / "out" / "compare.png") == (1100, 480)
