"""`zeroshard train --offload cpu|nvme [--offload-params] [--nvme-path DIR]`: the demo with offload, end to end.

The run with optimizer state and parameter shards on disk (stage 3,
--nvme-path left to its default) against the same run without offload:
the same losses, bit for bit (the arithmetic is the same); every rank's
three pools equal estimate/offload.py's formula in report.json and in the
printed table; the default swap directory is named and gone afterwards.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from zeroshard.app.cli import main

KINDS = ("params", "grads", "master", "optimizer")
ROOT = Path(__file__).resolve().parents[2]  # this checkout's zeroshard, whatever the ranks' working directory


def _train(tmp_path, name: str, *flags: str) -> tuple[str, dict]:
    """One 2-rank run of the tiny GPT with the system temp dir at tmp_path/tmp: (output, report.json)."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "zeroshard.app.cli", "train", "--model", "tiny", "--steps", "3", "--stage", "3",
           "--report", name, *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=os.environ | {"TMPDIR": str(tmp_path / "tmp"), "PYTHONPATH": str(ROOT)})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output, json.loads((tmp_path / name / "report.json").read_text())


def test_disk_offload_of_optimizer_and_parameters_trains_as_without_it(tmp_path):
    output, report = _train(tmp_path, "offload", "--offload", "nvme", "--offload-params")
    _, plain = _train(tmp_path, "plain")
    assert report["losses"] == plain["losses"]  # exact: the same fp32 arithmetic, wherever the state lives

    zero = report["config"]["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "nvme"
    swap = zero["offload_optimizer"]["nvme_path"]
    assert swap == zero["offload_param"]["nvme_path"] and swap.startswith(str(tmp_path / "tmp")), swap
    assert "swapfilesunder" + swap in re.sub(r"\s", "", output), output  # named (rich wraps long lines)
    assert not os.path.exists(swap)  # each rank's files, then the directory, removed at the end

    formula = report["estimate"]["pools"]
    for pools in report["memory_pools"]:  # every rank
        for pool in ("device", "host", "disk"):
            assert {k: pools[pool][k] for k in KINDS} == {k: formula[pool][k] for k in KINDS}, (pool, pools)
        assert pools["host"]["staging"] <= formula["host"]["staging"]
    psi = report["psi_padded"]
    assert formula["disk"]["params"] == 4 * psi // 2 and formula["disk"]["master"] == 4 * psi // 2  # fp32, N = 2
    assert formula["device"]["master"] == formula["device"]["optimizer"] == formula["device"]["params"] == 0
    assert report["estimate"]["memory"] == {k: report["memory_stats"][1][k] for k in KINDS}  # the pools' sum

    rows = [line.split("│") for line in output.splitlines() if line.split("│")[0].strip() in ("device", "host", "disk")]
    checked = [cells for cells in rows if cells[1].strip() in KINDS]
    assert len(checked) == 12 and all(cells[-1].strip() == "✓" for cells in checked), output


@pytest.mark.parametrize("argv, message", [
    (["train", "--offload-params"], "--offload-params puts the parameter shards on the device --offload names"),
    (["train", "--offload", "cpu", "--offload-params"], "--offload-params needs --stage 3"),
    (["train", "--offload", "cpu", "--stage", "0"], "--offload cpu needs --stage 1, 2 or 3"),
    (["train", "--offload", "cpu", "--nvme-path", "/tmp"], "--nvme-path is where disk offload writes"),
    (["train", "--offload", "cpu", "--tp", "2"], "--offload: the mesh demo (--tp/--pp) does not report"),
])
def test_offload_flags_that_cannot_work_are_refused_before_the_launch(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
