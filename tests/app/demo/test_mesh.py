"""`zeroshard train --tp/--pp` (app/demo/mesh.py): the demo on a pp x dp x tp mesh, and the flags it refuses."""

from __future__ import annotations

import csv
import math
import re
import subprocess
import sys

import pytest

from zeroshard.app.cli import build_parser, main, torchrun_argv

# -- flags (no ranks) ---------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--tp", "2", "--zeropp"], "--zeropp (ZeRO++) is not supported on a mesh"),
    (["--pp", "2", "--nodes", "2"], "drop --nodes"),
    (["--tp", "2", "--report", "out"], "drop --report"),
    (["--pp", "2", "--save-every", "5"], "drop --save-every"),
    (["--pp", "2", "--resume", "ck"], "drop --resume"),
    (["--pp", "3"], "--pp 3: GPT 'tiny' has 2 blocks"),
    (["--tp", "3"], "give a --tp that divides 2"),
    (["--pp", "2", "--micro-batches", "1"], "give --micro-batches 2 or more"),
    (["--pp", "2", "--accumulation", "2"], "give those instead, and --accumulation 1"),
    (["--tp", "2", "--pp", "2", "--nproc", "6"], "give --nproc a multiple of 4"),
    (["--micro-batches", "4"], "give --pp 2 or more with it"),
])
def test_flags_a_mesh_cannot_take_are_refused_before_the_launch(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_mesh_defaults_follow_tp_and_pp():
    args = build_parser().parse_args(["train", "--tp", "2", "--pp", "2"])
    argv = torchrun_argv(args)
    assert argv[:4] == ["--nnodes", "1", "--nproc-per-node", "8"]  # dp = 2
    assert (args.model, args.micro_batches) == ("tiny", 4)
    module = build_parser().parse_args(["train", *argv[argv.index("--module") + 2:]])
    assert (module.tp, module.pp, module.micro_batches, module.model) == (2, 2, 4, "tiny")
    plain = build_parser().parse_args(["train"])
    assert torchrun_argv(plain)[3] == "2" and plain.model == "demo" and plain.micro_batches is None
    assert build_parser().parse_args(["train", "--pp", "2", "--model", "demo"]).model == "demo"


# -- end to end: 8 ranks ------------------------------------------------------------------

FLAGS = ("--steps", "2", "--micro-batch", "4", "--seed", "1")  # 4 micro-batches of 4 rows per dp rank


@pytest.fixture(scope="module")
def mesh_run(tmp_path_factory):
    """`zeroshard train --tp 2 --pp 2`: (its output, its CSV's losses)."""
    out = tmp_path_factory.mktemp("mesh")
    cmd = [sys.executable, "-m", "zeroshard.app.cli", "train", "--tp", "2", "--pp", "2", *FLAGS,
           "--log-csv", str(out / "steps.csv")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output, _csv_losses(out / "steps.csv")


def _csv_losses(path) -> list[float]:
    with open(path, newline="") as f:
        return [float(row["loss"]) for row in csv.DictReader(f)]


def _rank_rows(table: str) -> dict[int, list[str]]:
    """rank -> the cells of its row in one of the report's tables."""
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) > 2 and cells[0].isdigit():
            rows[int(cells[0])] = cells
    return rows


def test_train_on_a_2x2x2_mesh_prints_loss_each_step_and_every_ranks_figures(mesh_run):
    output, losses = mesh_run
    steps = re.findall(r"step (\d)/2\s+loss (\S+)", output)
    assert [s for s, _ in steps] == ["1", "2"], output
    assert all(math.isfinite(float(loss)) for _, loss in steps) and len(losses) == 2
    assert "mesh pp=2 x dp=2 x tp=2, 8 ranks" in output, output
    memory_part, comm_part = output.split("Model states per rank")[1].split("Communication per rank")
    memory, comm = _rank_rows(memory_part), _rank_rows(comm_part)
    assert sorted(memory) == sorted(comm) == list(range(8)), output
    coordinates = [f"pp{r // 4} dp{r // 2 % 2} tp{r % 2}" for r in range(8)]  # pipeline-major, tensor-minor
    assert [memory[r][1] for r in range(8)] == [comm[r][1] for r in range(8)] == coordinates
    for rank in range(8):
        params, grads, master, optimizer = (int(c.replace(",", "")) for c in memory[rank][3:7])
        assert params > 0 and grads * 2 == params and master == 0 and optimizer >= params  # stage 2, fp32, dp=2
        dp, tp, pp, mesh = (int(c.replace(",", "")) for c in comm[rank][2:6])
        assert dp > 0 and tp == 0 and pp > 0 and mesh == 8 * 40  # the step check: 5 float64 per rank of 8
    assert memory[0][2] == "0-0" and memory[7][2] == "1-1"  # one block per stage
    assert memory[0][3:] == memory[3][3:] != memory[4][3:]  # ranks of one stage hold equal parts


def test_the_mesh_trains_on_what_the_plain_demo_trains_on(mesh_run, tmp_path):
    # 4 micro-batches of 4 rows per dp rank over 2 dp ranks = the plain demo's 2 ranks with --accumulation 4.
    cmd = [sys.executable, "-m", "zeroshard.app.cli", "train", "--model", "tiny", "--nproc", "2",
           "--accumulation", "4", *FLAGS, "--log-csv", str(tmp_path / "plain.csv")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert mesh_run[1] == pytest.approx(_csv_losses(tmp_path / "plain.csv"), abs=2e-5)
