"""`zeroshard tune` (app/tune*.py): candidates and rejections against zeroshard.estimate's figures, the trial
runner's memory limit and deadline, the written config, and the command end to end on the demo."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import zeroshard
import zeroshard.deepspeed as deepspeed
from zeroshard import estimate
from zeroshard.app.tune import search as tune_search
from zeroshard.app.estimate.activation_count import count_activations
from zeroshard.app.cli import main
from zeroshard.app.demo.config import demo_model_config
from zeroshard.app.estimate.model_count import count_model
from zeroshard.app.models import GPT, PRESETS
from zeroshard.app.tune.candidates import (
    Candidate,
    Setup,
    count,
    grid,
    bucket_size,
    offload_variants,
    predict_peak,
    rejection,
)
from zeroshard.app.tune.config import ds_config, write_config
from zeroshard.app.tune.search import Row, choose, measure
from zeroshard.app.tune.step_time import Calibration, StepTime
from zeroshard.app.tune.trials import Limit, Outcome, choose_limit, run_trial
from zeroshard.app.units import human_bytes
from zeroshard.config import ConfigFacts
from tests.distributed import run_ranks

TINY = Setup("tiny", ranks=2, nodes=1, dtype="fp32", seq=32, device_mem=10**12, micro_batches=(1, 4), global_batch=8)
PROGRAM = "tests.app.tune.tune_programs"
MIB = 2**20


def _states(candidate: Candidate, numel: int, largest_unit: int) -> int:
    """Model states per rank of 2 ranks, from the paper's formula (zeroshard.estimate) alone."""
    per_element = estimate.state_bytes_per_element("fp32", None, candidate.accumulation, candidate.stage)
    return sum(estimate.model_state_bytes(numel, 2, candidate.stage, **per_element, largest_unit=largest_unit).values())


def test_each_candidates_peak_is_runtime_states_buffers_and_counted_activations():
    counts, counted = count(TINY), count_model("tiny")
    assert (counts.numel, counts.largest_unit) == (counted.numel, counted.largest_unit)
    candidates, skipped = grid(TINY, counts)
    assert skipped == []
    assert sorted((c.stage, c.micro_batch, c.accumulation, c.checkpointing) for c in candidates) == sorted(
        (s, b, 8 // (2 * b), k) for s in range(4) for b in (1, 4) for k in ("none", "full"))
    assert {c.bucket_size for c in candidates} == {counts.bucket_size} == {50_000}  # the demo's, for a small model
    # about 16 buckets, between the demo's 50,000 elements and the engine's default 25,000,000
    assert (bucket_size(818_048), bucket_size(96_000_000), bucket_size(10**10)) == (51_128, 6_000_000, 25_000_000)
    for candidate in candidates:
        peak = predict_peak(candidate, TINY, counts, runtime=123_456, workspace=0.25)
        plain = count_activations("tiny", candidate.micro_batch, 32, "none", "fp32")
        full = count_activations("tiny", candidate.micro_batch, 32, "full", "fp32")
        saved = plain.total if candidate.checkpointing == "none" else full.total + max(plain.per_layer)
        # two buckets of staging at stages 1-3 (a bucket's gradients, its reduction's scratch), fp32
        bucket = counted.largest_unit if candidate.stage == 3 else max(counted.buckets)
        buffers = 0 if candidate.stage == 0 else 2 * bucket * 4
        assert (peak.states, peak.buffers) == (_states(candidate, counted.numel, counted.largest_unit), buffers)
        assert peak.workspace == round(0.25 * saved)  # temporaries beside the saved activations, as measured
        assert peak.device == 123_456 + peak.states + buffers + saved + peak.workspace, candidate


def test_the_calibrations_workspace_is_its_largest_step_over_the_counted_activations():
    counts = count(TINY)
    one, four = counts.activations[1, "none"][0], counts.activations[4, "none"][0]
    calibration = Calibration(0, {1: 0.1, 4: 0.3}, {1: one // 2, 4: 3 * four // 2}, 1e-9, 1e9)
    assert calibration.workspace(counts) == pytest.approx(0.5)  # micro-batch 1 added less than its count: 0
    assert calibration.micro_step(2) == pytest.approx(0.1 + (0.3 - 0.1) / 3)  # the line through the points


def test_rejections_name_the_part_over_the_memory_in_the_users_words():
    counts, counted, runtime = count(TINY), count_model("tiny"), 1_000_000
    stage0 = Candidate(0, 4, 1)
    peak = predict_peak(stage0, TINY, counts, runtime)
    states = _states(stage0, counted.numel, 0)
    limit = peak.fixed - 1
    assert rejection(stage0, peak, replace(TINY, device_mem=limit)) == (
        f"stage 0, micro-batch 4: model states {human_bytes(states)} and buffers 0 B over "
        f"{human_bytes(limit - runtime)} free ({human_bytes(limit)} per rank less {human_bytes(runtime)} runtime)")
    stage2 = Candidate(2, 1, 4, "full")
    peak = predict_peak(stage2, TINY, counts, runtime)
    plain = count_activations("tiny", 1, 32, "none", "fp32")
    limit = peak.device - 1
    fixed = runtime + _states(stage2, counted.numel, 0) + 2 * max(counted.buckets) * 4
    assert rejection(stage2, peak, replace(TINY, device_mem=limit)) == (
        f"stage 2, micro-batch 1, accumulation 4, checkpointing: activations "
        f"{human_bytes(count_activations('tiny', 1, 32, 'full', 'fp32').total)} + recompute "
        f"{human_bytes(max(plain.per_layer))} over {human_bytes(limit - fixed)} free")
    assert rejection(stage2, peak, replace(TINY, device_mem=peak.device)) is None  # exactly full: it fits


def test_the_grid_keeps_the_global_batch_and_offers_zeropp_and_offload_only_where_they_apply():
    setup = replace(TINY, ranks=4, nodes=2, micro_batches=(1, 3), global_batch=8, disk_mem=10**9, nvme_path="/d")
    candidates, skipped = grid(setup, count(setup))
    assert skipped == [("micro-batch 3", "3 rows x 4 ranks = 12 does not divide the global batch of 8 rows")]
    assert {c.accumulation for c in candidates} == {2}
    assert {c.stage for c in candidates if c.zeropp} == {3} and sum(c.zeropp for c in candidates) == 2
    assert offload_variants(Candidate(0, 1, 2), setup) == []  # stage 0 shards nothing to offload
    assert offload_variants(Candidate(3, 1, 2), setup) == [Candidate(3, 1, 2, offload_optimizer="nvme"),
                                                          Candidate(3, 1, 2, "none", "nvme", "nvme")]
    assert offload_variants(Candidate(2, 1, 2), replace(setup, disk_mem=None, nvme_path=None)) == []  # no pool
    offloaded = Candidate(2, 1, 2, offload_optimizer="nvme")
    peak = predict_peak(offloaded, setup, count(setup), 0)
    assert peak.states == 4 * count_model("tiny").numel  # the fp32 parameters stay; shards and state go to disk
    assert rejection(offloaded, peak, replace(setup, disk_mem=peak.disk)) == (
        f"{offloaded.label()}: disk {human_bytes(2 * peak.disk)} per node over {human_bytes(peak.disk)}")


@pytest.mark.parametrize("kind", ["rlimit", "cgroup"])
def test_a_trial_over_its_memory_limit_ends_out_of_memory(tmp_path, kind):
    try:
        limit = choose_limit(kind, 150 * MIB)
    except ValueError as error:  # not root, or no cgroup v1 memory controller here: tune says which to use
        assert kind == "cgroup" and "use --limit-with rlimit" in str(error)
        return
    result = run_trial([PROGRAM, "allocate", str(400 * MIB), str(tmp_path / "steps.csv")], 2, limit, 60,
                       tmp_path / "trial", tmp_path / "steps.csv")
    assert result.outcome is Outcome.OUT_OF_MEMORY, result
    assert ("MemoryError" if kind == "rlimit" else "killed by the kernel at its memory limit") in result.reason
    assert result.step_seconds == () and result.measured_step is None


def test_the_search_records_a_failed_or_out_of_memory_trial_and_goes_on(tmp_path, monkeypatch):
    setup = replace(TINY, device_mem=150 * MIB)
    peak = predict_peak(Candidate(0, 1, 4), setup, count(setup), 0)

    def row(stage: int, micro_batch: int, needs: int) -> Row:  # a candidate predicted to need `needs` bytes
        return Row(Candidate(stage, micro_batch, 4 // micro_batch), replace(peak, runtime=needs - peak.device
                   + peak.runtime), None, StepTime(1, 0, 0))

    # in rank order: out of memory, failed, passed over (needs more than the first, at its stage), ran, ran;
    # top 2 have run
    rows = [row(0, 4, 3 * MIB), row(1, 4, MIB), row(0, 2, 4 * MIB), row(3, 1, 5 * MIB), row(2, 2, MIB),
            row(2, 1, MIB)]

    def argv(setup, config, steps, steps_csv):  # stage 0 allocates past the limit, stage 1 fails, 2 and 3 run
        stage = json.loads(config.read_text())["zero_optimization"]["stage"]
        return [PROGRAM, "fail"] if stage == 1 else [PROGRAM, "allocate", str((400 if stage == 0 else 20) * MIB),
                                                      str(steps_csv)]

    monkeypatch.setattr(tune_search, "trial_argv", argv)
    measure(rows, setup, choose_limit("rlimit", setup.device_mem), top=2, steps=2, timeout=60, workdir=tmp_path)
    assert rows[0].trial.outcome is Outcome.OUT_OF_MEMORY and "MemoryError" in rows[0].trial.reason
    assert rows[1].trial.outcome is Outcome.FAILED
    assert rows[1].trial.reason in (f"rank {r} exited with exit code 3: ValueError: rank {r} was told to fail"
                                    for r in (0, 1))
    assert rows[2].trial is None and rows[2].untried == (
        f"predicted to need at least the {human_bytes(3 * MIB)} of {rows[0].candidate.label()}, which ran out of "
        "memory")
    for ran in rows[3:5]:
        assert ran.trial.outcome is Outcome.OK and ran.trial.step_seconds == (0.5, 0.25)
        assert ran.trial.measured_step == 0.25  # the median after the first step
    assert rows[5].trial is None and rows[5].untried is None  # two have run: the search stops
    assert choose(rows, top=2) is rows[3]  # the first of two equally fast
    assert json.loads((tmp_path / "trial3" / "ds_config.json").read_text()) == ds_config(rows[3].candidate, setup)


def test_a_trial_that_hangs_is_killed_at_its_timeout_with_its_children(tmp_path):
    start = time.monotonic()
    result = run_trial([PROGRAM, "hang", str(tmp_path / "pid")], 2, Limit("rlimit", None), 4.0, tmp_path / "trial")
    assert result.outcome is Outcome.TIMED_OUT
    assert result.reason == "timed out after 4 s: every rank's process group killed"
    assert 4.0 <= time.monotonic() - start < 15
    for rank in (0, 1):
        child = int((tmp_path / f"pid.rank{rank}").read_text())  # a process the rank started
        for _ in range(50):
            if not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z":
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"rank {rank}'s child {child} outlived the trial")


def _deepspeed_step(rank, world, device, path):
    torch.manual_seed(0)
    model = GPT(PRESETS["tiny"]).to(device)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                           config=str(path))
    tokens = torch.randint(65, (4, 32), device=device)
    engine.backward(engine(tokens, tokens))
    engine.step()
    return engine.zero_optimization_stage(), engine.train_batch_size()


def test_the_written_config_loads_as_the_candidate_and_runs_through_deepspeed_initialize(tmp_path):
    setup = replace(TINY, ranks=4, nodes=2)
    candidate = Candidate(3, 4, 2, "full", zeropp=True, bucket_size=60_000)
    path = tmp_path / "ds_config.json"
    write_config(path, ds_config(candidate, setup))
    config = zeroshard.Config.load(path, ConfigFacts(world_size=4))
    zero = config.zero_optimization
    assert (config.stage, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps,
            config.train_batch_size) == (3, 4, 2, 32)
    assert (zero.zero_quantized_weights, zero.zero_quantized_gradients, zero.zero_hpz_partition_size) == (True, True, 2)
    assert (zero.reduce_bucket_size, zero.allgather_bucket_size) == (60_000, 60_000)
    assert "activation_checkpointing" in config.model_fields_set
    assert demo_model_config(argparse.Namespace(config=str(path), model="tiny"), 65).checkpointing == "deepspeed"
    plain = tmp_path / "plain.json"
    write_config(plain, ds_config(Candidate(1, 2, 1), TINY))
    assert demo_model_config(argparse.Namespace(config=str(plain), model="tiny"), 65).checkpointing == ""
    assert run_ranks(_deepspeed_step, 2, plain) == [(1, 4), (1, 4)]  # 2 rows x 1 micro-step x 2 ranks


@pytest.mark.parametrize("argv, message", [
    (["tune", "--device-mem", "1GB", "--nproc-per-node", "2", "--nodes", "3"], "3 nodes must divide the 2 ranks"),
    (["tune", "--device-mem", "1GB", "--seq", "64"], "the trials train 'demo' at its block size of 128"),
    (["tune", "--device-mem", "1GB", "--global-batch", "6", "--micro-batches", "2"], "no micro-batch of 2 x 2"),
    (["tune", "--device-mem", "1GB", "--disk-mem", "1TB"], "--disk-mem and --nvme-path go together"),
    (["tune", "--device-mem", "lots"], "expected a size with a unit"),
    (["tune", "--device-mem", "350"], "'350' is 350 bytes, less than any training step needs: give a unit"),
    (["tune", "--device-mem", "1GB", "--global-batch", "7"], "7 rows cannot be split over 2 ranks"),
    (["tune", "--device-mem", "1GB", "--global-batch", "50", "--micro-batches", "4", "8"],
     "micro-batches that do: 1 5 25"),
    (["tune", "--device-mem", "1GB", "--model", "nosuch"], "trials train the built-in presets"),
    (["tune", "--device-mem", "1GB", "--steps", "1"], "give 2 or more"),
    (["tune", "--device-mem", "1GB", "--trials-dir", __file__], "is a file; give a directory"),
    (["tune", "--device-mem", "1GB", "--trials-dir", str(Path(__file__).parent)], "is not empty"),
])
def test_bad_tune_flags_are_argparse_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_tune_on_the_demo_end_to_end(tmp_path):
    out, trials = tmp_path / "ds_config.json", tmp_path / "trials"
    cmd = [sys.executable, "-m", "zeroshard.app.cli", "tune", "--device-mem", "8GB", "--micro-batches", "1", "2",
           "--global-batch", "4", "--top", "1", "--steps", "2", "--out", str(out), "--trials-dir", str(trials),
           "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    found = json.loads(done.stdout)
    rows = found["candidates"]
    assert len(rows) == 16 and all(row["fits"] for row in rows)  # 2 micro-batches x 4 stages x checkpointing
    per_row = [row["predicted_step"]["total"] / (row["micro_batch"] * row["accumulation"]) for row in rows]
    assert per_row == sorted(per_row)
    measured = [row for row in rows if row["trial"] is not None]
    assert measured == rows[:1] and measured[0]["trial"]["outcome"] == "ran"
    assert len(measured[0]["trial"]["step_seconds"]) == 2 and found["choice"] == measured[0]["label"]
    ran = json.loads((trials / "trial1" / "ds_config.json").read_text())  # the config its trial trained with
    assert json.loads(out.read_text()) == found["config"] == ran
