"""`zeroshard.estimate`'s formulas against hand-computed numbers, and `zeroshard train` end to end."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys

import pytest

from zeroshard import estimate
from zeroshard.app.cli import build_parser, main, torchrun_argv

# -- estimate: model states (ZeRO paper section 3, DESIGN.md section 1) -------------------

PSI, N = 1000, 4


@pytest.mark.parametrize("stage, expected", [
    (0, {"params": 4000, "grads": 4000, "master": 0, "optimizer": 8000}),
    (1, {"params": 4000, "grads": 4000, "master": 0, "optimizer": 2000}),
    (2, {"params": 4000, "grads": 1000, "master": 0, "optimizer": 2000}),
])
def test_model_states_fp32_adamw(stage, expected):
    assert estimate.model_state_bytes(PSI, N, stage) == expected


@pytest.mark.parametrize("stage, total", [(0, 16 * PSI), (1, 4 * PSI + 12 * PSI // N),
                                          (2, 2 * PSI + 14 * PSI // N)])
def test_model_states_mixed_precision_match_the_paper(stage, total):
    # fp16 params and grads, fp32 master + Adam moments (K = 12): the table of DESIGN.md section 1.
    states = estimate.model_state_bytes(PSI, N, stage, param_bytes=2, grad_bytes=2, master_bytes=4)
    assert sum(states.values()) == total


@pytest.mark.parametrize("args, expected", [
    (("fp32",), (4, 4, 0, 8)),
    (("bf16",), (2, 2, 4, 8)),  # the paper's 2 + 2 + 12
    (("fp16", None, 4, 1), (2, 2 + 4, 4, 8)),  # fp32 sum over micro-steps beside the 16-bit gradients
    (("bf16", "fp32", 1, 2), (2, 4, 4, 8)),  # stage 2: the fp32 shard replaces the 16-bit one
])
def test_state_bytes_per_element(args, expected):
    per = estimate.state_bytes_per_element(*args)
    assert tuple(per[k] for k in ("param_bytes", "grad_bytes", "master_bytes", "optimizer_bytes")) == expected


def test_model_states_uneven_split_rounds_shards_up():
    # 10 elements on 4 ranks: each rank holds a padded shard of 3.
    states = estimate.model_state_bytes(10, 4, 2, optimizer_scalar_bytes=12)
    assert states == {"params": 40, "grads": 12, "master": 0, "optimizer": 24 + 12}


# -- estimate: communication (ZeRO paper section 5) ---------------------------------------

@pytest.mark.parametrize("stage, kwargs, expected", [
    (0, {}, {"all_reduce": 4000, "reduce_scatter": 0, "all_gather": 0}),
    (0, {"accumulation": 3}, {"all_reduce": 4000, "reduce_scatter": 0, "all_gather": 0}),
    (1, {}, {"all_reduce": 0, "reduce_scatter": 4000, "all_gather": 4000}),
    (1, {"accumulation": 3}, {"all_reduce": 0, "reduce_scatter": 4000, "all_gather": 4000}),
    (1, {"reduce_scatter": False}, {"all_reduce": 4000, "reduce_scatter": 0, "all_gather": 4000}),
    (2, {"accumulation": 3}, {"all_reduce": 0, "reduce_scatter": 12000, "all_gather": 4000}),
    (2, {"elem_bytes": 2}, {"all_reduce": 0, "reduce_scatter": 2000, "all_gather": 2000}),
    (1, {"elem_bytes": 2, "reduce_bytes": 4}, {"all_reduce": 0, "reduce_scatter": 4000, "all_gather": 2000}),
])
def test_comm_bytes_per_step(stage, kwargs, expected):
    assert estimate.comm_bytes_per_step(PSI, stage, **kwargs) == expected


def test_step_check_is_four_float64_per_rank():
    # Norm, non-finite flag and counters: one all-gather per optimizer step, whatever the stage, dtype or clipping.
    assert [estimate.step_check_bytes(n) for n in (1, 2, 4)] == [40, 80, 160]
    with pytest.raises(ValueError):
        estimate.step_check_bytes(0)


@pytest.mark.parametrize("op, expected", [("all_reduce", 6000), ("reduce_scatter", 3000),
                                          ("all_gather", 3000), ("all_to_all", 3000)])
def test_wire_bytes_ring_factors(op, expected):
    assert estimate.wire_bytes(4000, N, op) == expected
    assert estimate.wire_bytes(4000, 1, op) == 0  # one rank sends nothing


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_every_stage_sends_2psi_elements_per_rank(stage):
    # The paper's result: stages 0-2 all move 2Ψ elements per rank and step, x (N-1)/N.
    per_op = estimate.comm_bytes_per_step(PSI, stage)
    assert sum(estimate.wire_bytes(b, N, op) for op, b in per_op.items()) == 2 * 4 * PSI * (N - 1) / N


@pytest.mark.parametrize("call", [
    lambda: estimate.model_state_bytes(PSI, N, 4),
    lambda: estimate.model_state_bytes(PSI, 0, 1),
    lambda: estimate.model_state_bytes(-1, N, 1),
    lambda: estimate.comm_bytes_per_step(PSI, 2, accumulation=0),
    lambda: estimate.wire_bytes(PSI, N, "broadcast"),
])
def test_bad_inputs_raise_value_error(call):
    with pytest.raises(ValueError):
        call()


# -- the command line ---------------------------------------------------------------------

def test_help_lists_train(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "train" in capsys.readouterr().out


def test_train_help_lists_its_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    for flag in ("--nproc", "--stage", "--steps", "--data", "--micro-batch", "--accumulation",
                 "--bucket-size", "--seed", "--model", "--config", "--reduce-scatter", "--report",
                 "--log-csv", "--log-every", "--max-restarts", "--async-save"):
        assert flag in out


@pytest.mark.parametrize("argv, message", [
    (["train", "--stage", "4"], "invalid choice"),
    (["train", "--nproc", "0"], "expected a positive integer"),
    (["train", "--data", "/no/such/file.txt"], "no such file"),
    (["train", "--nnodes", "2"], "needs --rdzv-endpoint"),
    (["train", "--config", "/no/such/config.json"], "config file '/no/such/config.json' not found"),
    (["train", "--reduce-scatter", "maybe"], "expected true or false"),
    (["train", "--nproc", "2", "--nodes", "3"], "argument --nodes: 3 nodes must divide the 2 ranks"),
    (["train", "--zeropp"], "need stage 3, not stage 2"),
    (["train", "--max-restarts", "3"], "--max-restarts resumes each restart from the latest checkpoint in "
                                       "--save-dir: give --save-every STEPS too"),
    (["train", "--max-restarts", "-1", "--save-every", "5"], "argument --max-restarts: must be 0 or more"),
    (["compare", "--runs", "9"], "invalid choice"),
    ([], "required"),
])
def test_bad_flags_are_argparse_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_torchrun_argv():
    args = build_parser().parse_args(["train", "--nproc", "3", "--stage", "1", "--steps", "7"])
    argv = torchrun_argv(args)
    assert argv[:7] == ["--nnodes", "1", "--nproc-per-node", "3", "--standalone", "--max-restarts", "0"]
    module = argv.index("--module")
    assert argv[module + 1] == "zeroshard.app.demo.train"
    assert build_parser().parse_args(["train", *argv[module + 2:]]).steps == 7
    args = build_parser().parse_args(["train", "--nnodes", "2", "--rdzv-endpoint", "host:29400"])
    assert "--standalone" not in torchrun_argv(args)
    assert "host:29400" in torchrun_argv(args)


# -- end to end ---------------------------------------------------------------------------

def _table_rows(output: str, names: tuple[str, ...]) -> dict[str, list[str]]:
    """The cells of the report's table rows whose first cell is one of `names`."""
    rows = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) > 3 and cells[0] in names:
            rows[cells[0]] = cells
    return rows


def test_train_two_ranks_stage3_reports_measured_equal_to_formula(tmp_path):
    # The file says stage 2 and micro-batch 4; the --stage flag overrides the file's stage.
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
                                  "zero_optimization": {"stage": 2, "reduce_bucket_size": 50000,
                                                        "allgather_bucket_size": 50000,
                                                        "stage3_wrap_classes": ["Block"],
                                                        "stage3_param_persistence_threshold": 0}}))
    cmd = [sys.executable, "-m", "zeroshard.app.cli", "train", "--nproc", "2", "--config", str(config),
           "--stage", "3", "--steps", "5", "--report", str(tmp_path / "report"),
           "--log-csv", str(tmp_path / "steps.csv"), "--sample", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "--stage 3 overrides zero_optimization.stage = 2" in output
    assert "sample:" not in output  # --sample 0: none written
    assert "no effect" not in output  # the file sets no key without an effect; its defaults ask for nothing
    assert re.search(r"loss \d+\.\d+ \(first step\) -> \d+\.\d+ \(last step\)", output), output
    psi = int(re.search(r"Ψ = ([\d,]+) elements", output).group(1).replace(",", ""))

    memory = _table_rows(output, ("params", "grads", "master", "optimizer"))
    assert set(memory) == {"params", "grads", "master", "optimizer"}, output
    for name, (_, measured, formula, _, ok) in memory.items():
        assert measured == formula and ok == "✓", (name, output)
    assert memory["params"][1] == memory["grads"][1] == f"{4 * psi // 2:,}"  # stage 3: both sharded

    comm = _table_rows(output, ("all_reduce", "reduce_scatter", "all_gather", "step_check"))
    assert set(comm) == {"reduce_scatter", "all_gather", "step_check"}, output  # no all-reduce, no order check
    for name, (_, _, measured, formula, _, _, ok) in comm.items():
        assert measured == formula and ok == "✓", (name, output)
    assert comm["reduce_scatter"][2] == f"{4 * psi:,}"
    assert comm["all_gather"][2] == f"{8 * psi:,}"  # forward and backward
    assert comm["step_check"][2] == "80"  # norm, non-finite flag, counters, checksum: 5 float64 per rank
    _check_report(tmp_path / "report", tmp_path / "steps.csv", psi, memory, comm)


def _check_report(report_dir, csv_path, psi: int, memory: dict, comm: dict) -> None:
    """--report's JSON agrees with the printed tables; --log-csv has one row per step."""
    report = json.loads((report_dir / "report.json").read_text())
    assert report["config"]["zero_optimization"]["stage"] == 3
    assert report["config"]["train_micro_batch_size_per_gpu"] == 4
    assert report["psi_padded"] == psi and report["world_size"] == 2 and report["steps"] == 5
    assert report["tokens_per_step"] == 4 * 2 * 128  # micro-batch x ranks x context
    for rank_memory in report["memory_stats"]:
        assert {k: f"{rank_memory[k]:,}" for k in memory} == {k: cells[1] for k, cells in memory.items()}
    for rank_comm in report["comm_stats"]:
        assert {op: f"{rank_comm[op]['bytes']:,}" for op in comm} == {op: c[2] for op, c in comm.items()}
    estimate_memory = report["estimate"]["memory"]
    assert estimate_memory == {k: report["memory_stats"][1][k] for k in estimate_memory}
    assert report["estimate"]["comm"] == {op: report["comm_stats"][1][op]["bytes"] for op in report["estimate"]["comm"]}
    for png in ("loss.png", "memory.png"):
        assert (report_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["step", "loss", "lr", "step_seconds", "tokens_per_second"]
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5]
    assert [float(r["loss"]) for r in rows] == pytest.approx(report["losses"], abs=1e-6)
    assert [float(r["lr"]) for r in rows] == pytest.approx(report["lr"], rel=1e-5)
    assert [float(r["tokens_per_second"]) for r in rows] == pytest.approx(
        [report["tokens_per_step"] / s for s in report["step_seconds"]], rel=1e-3)


def _train(tmp_path, *flags: str) -> str:
    cmd = [sys.executable, "-m", "zeroshard.app.cli", "train", "--model", "tiny", "--steps", "4", *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def _csv_losses(path) -> dict[int, float]:
    with open(path, newline="") as f:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(f)}


def test_train_resumes_on_another_world_size_and_stage(tmp_path):
    # 2 ranks x 4 rows at stage 2, stopped after step 2; 4 ranks x 1 row x 2 micro-steps at stage 3 go on.
    _train(tmp_path, "--micro-batch", "4", "--save-every", "2", "--save-dir", "ck", "--log-csv", "a.csv")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["global_step2", "global_step4", "latest"]
    assert (tmp_path / "ck" / "latest").read_text().strip() == "global_step4"
    # 1 row per rank: gradient accumulation 2 keeps the checkpoint's global batch of 8 rows.
    output = _train(tmp_path, "--nproc", "4", "--stage", "3", "--micro-batch", "1", "--resume", "ck/global_step2",
                    "--save-dir", "ck4", "--log-csv", "b.csv", "--report", "report")
    assert "resumed from" in output and "steps 3-4 (resumed)" in output, output
    assert "gradient accumulation 1 -> 2 keeps the checkpoint's global batch of 8 rows" in " ".join(output.split())
    whole, resumed = _csv_losses(tmp_path / "a.csv"), _csv_losses(tmp_path / "b.csv")
    assert list(whole) == [1, 2, 3, 4] and list(resumed) == [3, 4]
    assert [resumed[s] for s in (3, 4)] == pytest.approx([whole[3], whole[4]], rel=1e-5)
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["first_step"] == 3 and len(report["losses"]) == 2 and report["world_size"] == 4


def test_train_zeropp_on_emulated_nodes_reports_bytes_by_scope_equal_to_the_estimate(tmp_path):
    # 2 ranks as 2 nodes x 1: qwZ and qgZ (hpZ needs 2 ranks a node; the 4-rank case is tests/stage3/test_zeropp.py).
    output = _train(tmp_path, "--nproc", "2", "--stage", "3", "--zeropp", "--nodes", "2", "--dtype", "bf16",
                    "--steps", "2", "--report", "report")
    scopes = _table_rows(output, ("node", "cross-node"))
    assert set(scopes) == {"node", "cross-node"}, output
    rows = [line for line in output.splitlines() if line.split("│")[0].strip() in ("node", "cross-node")]
    assert len(rows) == 4 and all(line.rstrip().endswith("✓") for line in rows), output
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    for rank_comm in report["comm_stats"]:
        assert "node" not in rank_comm["reduce_scatter"]["by_scope"]  # one rank a node: qgZ's first hop is skipped
        assert rank_comm["all_gather"]["by_scope"]["cross_node"] == report["estimate"]["comm"]["all_gather"]
        assert rank_comm["reduce_scatter"]["by_scope"]["cross_node"] == report["estimate"]["comm"]["reduce_scatter"]
    assert report["config"]["zero_optimization"]["zero_quantized_weights"] is True
    assert report["config"]["zero_optimization"]["zero_hpz_partition_size"] == 1
