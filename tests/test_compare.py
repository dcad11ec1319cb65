"""`zeroshard compare` end to end at 2 ranks: tables, compare.json and the PNG, measured = estimate."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

from zeroshard import estimate
from zeroshard.app.models import GPT, PRESETS
from zeroshard.estimate.param_count import count_params

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
    psi = count_params("tiny").numel + (alphabet - PRESETS["tiny"].vocab_size) * PRESETS["tiny"].n_embd
    assert psi == GPT(PRESETS["tiny"].__class__(**{**PRESETS["tiny"].__dict__, "vocab_size": alphabet})).num_params()
    for row in rows:
        assert 0 <= row["psi_padded"] - psi < 2 * 2  # fewer than N elements of padding per unit (2 units)
        expected_memory = estimate.model_state_bytes(row["psi_padded"], 2, row["stage"], optimizer_scalar_bytes=8)
        expected_comm = estimate.comm_bytes_per_step(row["psi_padded"], row["stage"], clipping=True)
        assert row["memory"] == row["memory_estimate"] == expected_memory, row
        assert row["comm"] == row["comm_estimate"] == expected_comm, row
    assert _png_size(tmp_path / "out" / "compare.png") == (1100, 480)
