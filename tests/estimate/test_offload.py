"""`zeroshard.estimate.offload`: ZeRO-Offload and ZeRO-Infinity's three pools by hand, the papers' claims,
and `zeroshard estimate --offload-*`."""

from __future__ import annotations

import json

import pytest

from zeroshard import estimate
from zeroshard.app.cli import main
from zeroshard.app.estimate.model_count import count_model
from zeroshard.estimate.offload import largest_model_offload, offload_pool_bytes, pool_totals, ratio_numel

ZERO = {"params": 0, "grads": 0, "master": 0, "optimizer": 0, "staging": 0}
BF16 = {"param_bytes": 2, "grad_bytes": 2, "master_bytes": 4, "optimizer_bytes": 8}
FP32 = {"param_bytes": 4, "grad_bytes": 4, "master_bytes": 0, "optimizer_bytes": 8}
# Ψ = 10 over N = 4: shards of S = 3 (the padded flat holds 12); at stage 3 a gathered unit of 4.
PSI, N, S = 10, 4, 3


def pools(stage, per_element=BF16, **kwargs):
    return offload_pool_bytes(PSI, N, stage, **per_element, **kwargs)


def kinds(params=0, grads=0, master=0, optimizer=0, staging=0):
    return {"params": params, "grads": grads, "master": master, "optimizer": optimizer, "staging": staging}


# -- nothing offloaded: the device pool is model_state_bytes --------------------------------------------


@pytest.mark.parametrize("stage", estimate.STAGES)
@pytest.mark.parametrize("per_element", [BF16, FP32, {**BF16, "grad_bytes": 6}])
@pytest.mark.parametrize("numel, world", [(10, 4), (13, 3), (1, 8), (1000, 1)])
def test_no_offload_is_model_state_bytes(stage, per_element, numel, world):
    out = offload_pool_bytes(numel, world, stage, **per_element, largest_unit=5)
    assert out["device"] == {**estimate.model_state_bytes(numel, world, stage, **per_element, largest_unit=5),
                             "staging": 0}
    assert out["host"] == out["disk"] == ZERO and out["pinned"] == 0
    # hpZ's secondary shards, as model_state_bytes counts them
    if stage == 3:
        hpz = offload_pool_bytes(numel, world, 3, **per_element, hpz_partition_size=2)["device"]["hpz_secondary"]
        assert hpz == estimate.model_state_bytes(numel, world, 3, **per_element, hpz_partition_size=2)["hpz_secondary"]


# -- the optimizer offloaded (ZeRO-Offload) -------------------------------------------------------------


def test_cpu_optimizer_stage_1_keeps_the_full_gradient_on_the_device():
    out = pools(1, offload_optimizer="cpu")
    assert out["device"] == kinds(params=2 * PSI, grads=2 * PSI)  # the 16-bit gradient buffer, whole
    assert out["host"] == kinds(grads=4 * S, master=4 * S, optimizer=8 * S)
    assert out["disk"] == ZERO
    # with accumulation the fp32 sum stays where today's formula has it: grad_bytes 2 + 4
    assert pools(1, {**BF16, "grad_bytes": 6}, offload_optimizer="cpu")["device"]["grads"] == 6 * PSI


def test_cpu_optimizer_stage_2_keeps_only_the_parameters_and_the_bucket_in_flight():
    out = pools(2, offload_optimizer="cpu", reduce_bucket_size=5)
    assert out["device"] == kinds(params=2 * PSI, staging=2 * 5)
    assert out["host"] == kinds(grads=4 * S, master=4 * S, optimizer=8 * S)
    assert pools(2, offload_optimizer="cpu", reduce_bucket_size=5, reduce_bytes=4)["device"]["staging"] == 20


def test_cpu_optimizer_stage_3_keeps_the_shard_and_the_gathered_unit():
    out = pools(3, offload_optimizer="cpu", largest_unit=4)
    assert out["device"] == kinds(params=2 * (S + 4), grads=2 * 4)  # the unit's unreduced 16-bit gradient
    assert out["host"] == kinds(grads=4 * S, master=4 * S, optimizer=8 * S)


def test_fp32_training_still_has_an_fp32_master_on_the_host():
    out = pools(2, FP32, offload_optimizer="cpu")
    assert out["device"] == kinds(params=4 * PSI)
    assert out["host"] == kinds(grads=4 * S, master=4 * S, optimizer=8 * S)


def test_nvme_optimizer_moves_master_and_state_to_disk_through_buffers():
    out = pools(2, offload_optimizer="nvme", buffer_count=2, sub_group_size=2)
    assert out["device"] == kinds(params=2 * PSI)
    # buffer_count 2 counts as 3 (one sub-group read ahead, one stepping, one written behind) of 2 elements,
    # capped at the whole shard of 3: master, moments and the gradient shard read back with them
    assert out["host"] == kinds(staging=(4 + 8 + 4) * min(3 * 2, S))
    assert out["disk"] == kinds(grads=4 * S, master=4 * S, optimizer=8 * S)
    # a sub-group larger than the shard: the tier is one sub-group, held once
    assert pools(2, offload_optimizer="nvme", buffer_count=2, sub_group_size=100)["host"]["staging"] == 16 * S
    # stage 1 keeps the whole gradient on the device, and its fp32 shard for the step on the host
    out = pools(1, offload_optimizer="nvme", buffer_count=2, sub_group_size=2)
    assert out["host"] == kinds(grads=4 * S, staging=(4 + 8) * min(3 * 2, S))
    assert out["disk"] == kinds(master=4 * S, optimizer=8 * S)


def test_partial_offload_splits_the_shard():
    assert [ratio_numel(PSI, N, r) for r in (0.3, 0.5, 1)] == [1, 2, 3]  # ceil(r × S), 0.3 read as 3/10
    assert ratio_numel(12, 4, 1 / 3) == 1 and ratio_numel(10**9, 1, 0.1) == 10**8
    out = pools(2, offload_optimizer="cpu", offloaded_numel=1)
    assert out["device"] == kinds(params=2 * PSI, grads=2 * 2, master=4 * 2, optimizer=8 * 2)
    assert out["host"] == kinds(grads=4, master=4, optimizer=8)
    out = pools(1, offload_optimizer="nvme", offloaded_numel=2, buffer_count=1)
    assert out["device"] == kinds(params=2 * PSI, grads=2 * PSI, master=4 * 1, optimizer=8 * 1)
    assert out["disk"] == kinds(master=4 * 2, optimizer=8 * 2) and out["host"] == kinds(grads=8, staging=12 * 2)
    nothing = pools(2, offload_optimizer="cpu", offloaded_numel=0, reduce_bucket_size=5)
    assert nothing["device"] == {**estimate.model_state_bytes(PSI, N, 2, **BF16), "staging": 0}


# -- the parameters offloaded (stage 3, ZeRO-Infinity) --------------------------------------------------


def test_cpu_params_leave_the_unit_and_the_persistent_parameters_on_the_device():
    out = pools(3, offload_param="cpu", largest_unit=4)
    assert out["device"] == kinds(params=2 * 4, grads=2 * S + 2 * 4, master=4 * S, optimizer=8 * S)
    assert out["host"] == kinds(params=2 * S)
    # 2 of the 10 elements persistent (whole on every rank): S_p = ceil(8 / 4) = 2
    out = pools(3, offload_param="cpu", largest_unit=4, persistent_numel=2)
    assert out["device"]["params"] == 2 * (2 + 4) and out["host"]["params"] == 2 * 2
    assert pools(3, largest_unit=4, persistent_numel=2)["device"]["params"] == 2 * (2 + 2 + 4)


def test_nvme_params_keep_max_in_cpu_on_the_host():
    out = pools(3, offload_param="nvme", max_in_cpu=1, param_buffer_count=2, param_buffer_size=5)
    # buffers of 2 x 5 elements, capped at the S - 1 shard elements on disk
    assert out["host"] == kinds(params=2 * 1, staging=2 * min(2 * 5, S - 1))
    assert out["disk"] == kinds(params=2 * (S - 1))
    all_in_cpu = pools(3, offload_param="nvme", max_in_cpu=100, param_buffer_count=2, param_buffer_size=5)
    assert all_in_cpu["host"]["params"] == 2 * S and all_in_cpu["disk"] == ZERO


def test_everything_on_disk():
    out = pools(3, offload_optimizer="nvme", offload_param="nvme", largest_unit=4, max_in_cpu=0, buffer_count=1,
                sub_group_size=1, param_buffer_count=1, param_buffer_size=4, reduce_bucket_size=4)
    assert out["device"] == kinds(params=2 * 4, grads=2 * 4, staging=2 * 4)
    # three 1-element sub-groups' master, moments, gradient (buffer_count 1 counts as 3); params' 4-element
    # buffer capped at the shard (S = 3)
    assert out["host"] == kinds(staging=16 * 3 + 2 * S)
    assert out["disk"] == kinds(params=2 * S, grads=4 * S, master=4 * S, optimizer=8 * S)
    assert pool_totals(out) == {"device": 24, "host": 54, "disk": 54}


def test_delayed_update_gives_the_cpu_step_its_own_gradient_copy_at_stages_2_and_3():
    for stage in (2, 3):
        plain = pools(stage, offload_optimizer="cpu", pin_memory=True)
        delayed = pools(stage, offload_optimizer="cpu", pin_memory=True, delayed_update=True)
        assert delayed["host"] == {**plain["host"], "grads": 4 * S + 4 * S}  # the shard the backward sums into, the copy
        assert delayed["device"] == plain["device"] and delayed["disk"] == plain["disk"]
        assert delayed["pinned"] == plain["pinned"]  # only the CPU reads the copy
    # Stage 1 sums the window on the device: its host shard already is the CPU step's own.
    assert pools(1, offload_optimizer="nvme", delayed_update=True) == pools(1, offload_optimizer="nvme")


# -- pinned host memory -------------------------------------------------------------------------------------


def test_pinned_is_every_host_tensor_the_device_copies_not_the_moments():
    assert pools(3, offload_optimizer="cpu", offload_param="cpu")["pinned"] == 0  # without pin_memory
    out = pools(3, offload_optimizer="cpu", offload_param="cpu", pin_memory=True)
    assert out["pinned"] == 4 * S + 4 * S + 2 * S  # grads, master, params; not the optimizer's 8S
    assert pools(3, offload_optimizer="cpu", offload_param="cpu", pin_memory=True,
                 param_pin_memory=False)["pinned"] == 8 * S
    assert pools(3, offload_optimizer="cpu", offload_param="cpu", param_pin_memory=True)["pinned"] == 2 * S
    out = pools(3, offload_optimizer="nvme", offload_param="nvme", pin_memory=True, max_in_cpu=1, buffer_count=2,
                sub_group_size=2, param_buffer_count=2, param_buffer_size=5)
    assert out["pinned"] == out["host"]["grads"] + out["host"]["staging"] + out["host"]["params"] == 0 + 48 + 4 + 2


@pytest.mark.parametrize("kwargs, message", [
    ({"stage": 0, "offload_optimizer": "cpu"}, "needs ZeRO stage 1, 2 or 3"),
    ({"stage": 2, "offload_param": "cpu"}, "needs ZeRO stage 3"),
    ({"stage": 2, "offload_optimizer": "disk"}, "must be one of none, cpu, nvme"),
    ({"stage": 2, "offload_optimizer": "cpu", "offloaded_numel": S + 1}, "between 0 and the rank's shard, 3"),
    ({"stage": 2, "offloaded_numel": 1}, "without an offloaded optimizer"),
    ({"stage": 2, "delayed_update": True}, "delayed_update needs an offloaded optimizer"),
    ({"stage": 3, "offload_param": "cpu", "hpz_partition_size": 2}, "hpZ"),
    ({"stage": 3, "persistent_numel": PSI + 1}, "persistent_numel"),
])
def test_bad_layouts_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        pools(**kwargs)
    with pytest.raises(ValueError, match="ratio"):
        ratio_numel(PSI, N, 1.5)


# -- the largest model ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage, optimizer, param, ranks", [
    (1, "cpu", "none", 1), (2, "cpu", "none", 8), (2, "nvme", "none", 8), (3, "cpu", "cpu", 8),
    (3, "nvme", "nvme", 16), (3, "cpu", "none", 4)])
def test_largest_model_offload_is_the_last_that_fits(stage, optimizer, param, ranks):
    gpu, host, disk, world = 80 * 10**9, 10**12, 4 * 10**12, 16
    layout = {"largest_unit": 10**8, "reduce_bucket_size": 10**7}
    fit = largest_model_offload(gpu, host, disk, world, stage, "bf16", optimizer, param, ranks_per_node=ranks,
                                **layout)

    def fits(numel):
        totals = pool_totals(offload_pool_bytes(numel, world, stage, **BF16, offload_optimizer=optimizer,
                                                offload_param=param, **layout))
        return totals["device"] <= gpu and ranks * totals["host"] <= host and ranks * totals["disk"] <= disk

    assert fits(fit) and not fits(fit + 1)
    # a reserve holds part of every pool back
    assert largest_model_offload(gpu, host, disk, world, stage, "bf16", optimizer, param, ranks_per_node=ranks,
                                 reserve=0.5, **layout) < fit


def test_largest_model_offload_needs_a_limit_that_grows():
    with pytest.raises(estimate.UnboundedError, match="give the host and disk memory"):
        largest_model_offload(80 * 10**9, None, None, 8, 3, "bf16", "cpu", "cpu")
    assert largest_model_offload(10, None, None, 8, 2, "bf16", "cpu") == 5  # 2Ψ bf16 parameters in 10 bytes
    assert largest_model_offload(1, 10**12, None, 8, 3, "bf16", "cpu", "cpu", largest_unit=1) == 0


# -- the papers ---------------------------------------------------------------------------------------------


def _estimate_json(capsys, *flags: str) -> dict:
    assert main(["estimate", *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_zero_offload_paper_13b_on_one_v100(capsys):
    # Ren et al. 2021 (ZeRO-Offload), section 1 and 6: a 13B model trained on one 32 GB V100 of a DGX-2
    # (1.5 TB of host memory), fp16 with Adam, ZeRO-2 with the optimizer offloaded to the CPU, DeepSpeed's
    # reduce bucket of 5e8 elements.
    psi = 13 * 10**9
    out = _estimate_json(capsys, "--params", "13B", "--gpus", "1", "--dtype", "fp16", "--gpu-mem", "32GiB",
                         "--host-mem", "1.5TB", "--offload-optimizer", "cpu", "--reduce-bucket-size", "5e8")
    offload = out["offload"]
    # The GPU keeps the fp16 parameters, 2Ψ, and one fp16 gradient bucket in flight: 27 GB, under 32 GB.
    assert offload["device"]["2"] == kinds(params=2 * psi, staging=2 * 5 * 10**8)
    assert sum(offload["device"]["2"].values()) == 27 * 10**9 <= 32 * 10**9
    # Without offload, stage 2 on one GPU holds 16Ψ = 208 GB: it does not fit.
    assert out["memory_bytes"]["2"] == 16 * psi == 208 * 10**9 > 32 * 2**30
    # The host holds 16Ψ: fp32 master 4Ψ, Adam's moments 8Ψ, fp32 gradients 4Ψ; 208 GB of 1.5 TB.
    assert offload["host"]["2"] == kinds(grads=4 * psi, master=4 * psi, optimizer=8 * psi)
    assert offload["host_per_node"]["2"] == 208 * 10**9 and offload["disk"]["2"] == ZERO
    # The largest model: the GPU bounds it, (32 GiB - 1 GB) / 2 bytes
    assert offload["largest_model"]["2"] == (32 * 2**30 - 10**9) // 2 == 16_679_869_184
    assert out["max_params"]["2"] == 32 * 2**30 // 16  # without offload: 2.1B


def test_zero_infinity_one_dgx2_node(capsys):
    # Rajbhandari et al. 2021 (ZeRO-Infinity): a DGX-2 node, 16 V100 32 GB, 1.5 TB of host memory, 28 TB
    # of NVMe; stage 3 with parameters and optimizer state on NVMe; 1T parameters in fp16.
    psi, ranks = 10**12, 16
    shard = psi // ranks
    out = _estimate_json(capsys, "--params", "1T", "--gpus", "16", "--gpus-per-node", "16", "--dtype", "fp16",
                         "--offload-optimizer", "nvme", "--offload-params", "nvme", "--gpu-mem", "32GiB",
                         "--host-mem", "1.5TB", "--disk-mem", "28TB")["offload"]
    assert list(out["device"]) == ["3"]
    # 4 optimizer buffers of a 1e9 sub-group (fp32 master, two moments, fp32 gradient), 5 parameter buffers
    buffers = 4 * 16 * 10**9 + 5 * 10**8 * 2
    assert out["host"]["3"] == kinds(params=2 * 10**9, staging=buffers)
    assert out["disk"]["3"] == kinds(params=2 * (shard - 10**9), grads=4 * shard, master=4 * shard,
                                     optimizer=8 * shard)
    # The disks hold the model states and the fp32 gradient shards (less what stays in host memory):
    # 17.97 TB of 28 TB; the host 1.07 TB of 1.5 TB: the trillion parameters fit on one node, as the paper has.
    assert out["disk_per_node"]["3"] == 17_968 * 10**9
    assert out["host_per_node"]["3"] == ranks * (buffers + 2 * 10**9) == 1_072 * 10**9 < 15 * 10**11
    # The disks bound it: 16 ranks x (2(S - 1e9) + 16S) <= 28 TB, S = Ψ / 16: 1.557T parameters.
    assert out["largest_model"]["3"] == 1_557_333_333_328


# -- the CLI ------------------------------------------------------------------------------------------------


def test_json_without_offload_has_none(capsys):
    assert _estimate_json(capsys, "--params", "1e9", "--gpus", "8")["offload"] is None


def test_json_per_rank_and_per_node(capsys):
    out = _estimate_json(capsys, "--params", "1e9", "--gpus", "16", "--gpus-per-node", "8", "--offload-optimizer",
                         "cpu", "--offload-ratio", "0.5", "--pin-memory")["offload"]
    shard = 10**9 // 16
    assert out["offloaded_numel"] == shard // 2 and out["ranks_per_node"] == 8 and list(out["host"]) == ["1", "2", "3"]
    assert out["host"]["2"] == kinds(grads=4 * shard // 2, master=4 * shard // 2, optimizer=8 * shard // 2)
    assert out["pinned"]["2"] == 8 * shard // 2 and out["pinned_per_node"]["2"] == 8 * out["pinned"]["2"]
    assert out["host_per_node"]["2"] == 8 * 16 * shard // 2
    assert out["largest_model"] is None  # no --gpu-mem
    assert out["layout"]["reduce_bucket_size"] == 25_000_000  # zeroshard's default
    assert out["device"]["2"]["staging"] == 2 * 25_000_000


def test_model_flag_counts_persistent_parameters(capsys):
    flags = ("--model", "demo", "--gpus", "2", "--persistence-threshold", "1000", "--offload-params", "cpu")
    counted = count_model("demo", persistence_threshold=1000)
    persistent = sum(f.numel for f in counted.flats if f.kind == estimate.PERSISTENT)
    assert persistent > 0
    out = _estimate_json(capsys, *flags)["offload"]
    assert out["device"]["3"]["params"] == 2 * (persistent + counted.largest_unit)
    assert out["host"]["3"]["params"] == 2 * -(-(counted.numel - persistent) // 2)


def test_table_shows_the_pools(capsys):
    assert main(["estimate", "--params", "13B", "--gpus", "1", "--dtype", "fp16", "--gpu-mem", "32GiB",
                 "--host-mem", "1.5TB", "--offload-optimizer", "cpu", "--pin-memory"]) == 0
    out = capsys.readouterr().out
    assert "optimizer state in host memory, parameters on the GPU" in out
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.split("│")] for line in out.splitlines())}
    assert rows["2 device"] == ["26 GB", "0 B", "0 B", "0 B", "50 MB", "26.1 GB", ""], out
    assert "2 disk" not in rows  # nothing on disk: no row
    text = " ".join(out.split())  # the console wraps long lines
    assert "pinned host memory: 104 GB per GPU, 104 GB per node (stages 1, 2, 3)" in text  # 4Ψ grads + 4Ψ master
    assert "max Ψ with the pools within 34.4 GB per GPU, 1.5 TB of host per node: stage 1 8.58 B" in text


@pytest.mark.parametrize("flags, message", [
    (("--host-mem", "1TB"), "--host-mem needs --offload-optimizer or --offload-params"),
    (("--offload-optimizer", "cpu", "--disk-mem", "1TB"), "--disk-mem needs an nvme offload"),
    (("--offload-params", "cpu", "--offload-ratio", "0.5"), "--offload-ratio needs --offload-optimizer"),
    (("--offload-optimizer", "cpu", "--offload-ratio", "1.5"), "--offload-ratio must be in (0, 1]"),
    (("--offload-optimizer", "cpu", "--max-in-cpu", "1e9"), "--max-in-cpu needs --offload-params nvme"),
    (("--offload-optimizer", "cpu", "--hpz"), "leave out hpZ's secondary shards"),
    (("--pin-memory",), "--pin-memory needs"),
])
def test_offload_flags_that_change_nothing_are_refused(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--params", "1e9", "--gpus", "8", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_offload_on_a_mesh_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["estimate", "--model", "demo", "--gpus", "4", "--tp", "2", "--offload-optimizer", "cpu"])
    assert "--offload-optimizer with --tp/--pp" in capsys.readouterr().err
