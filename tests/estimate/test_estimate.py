"""`zeroshard estimate` against the ZeRO paper, DeepSpeed's published estimator, and real models' sizes."""

from __future__ import annotations

import json

import pytest

from zeroshard import estimate
from zeroshard.app.cli import main
from zeroshard.app.estimate.model_count import count_model
from zeroshard.app.models import GPT, PRESETS


def _estimate_json(capsys, *flags: str) -> dict:
    assert main(["estimate", *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_zero_paper_figure_1(capsys):
    # Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N = 64, K = 12, mixed precision.
    out = _estimate_json(capsys, "--params", "7.5e9", "--gpus", "64")
    assert {s: round(b / 1e9, 1) for s, b in out["memory_bytes"].items()} == {
        "0": 120.0, "1": 31.4, "2": 16.6, "3": 1.9}
    # Section 7: stages 0-2 send 2Ψ elements per rank, stage 3 3Ψ (× (N-1)/N on rings), 2 bytes each.
    assert out["wire_bytes_per_rank"] == {"0": 2 * 15 * 10**9 * 63 // 64, "1": 2 * 15 * 10**9 * 63 // 64,
                                          "2": 2 * 15 * 10**9 * 63 // 64, "3": 3 * 15 * 10**9 * 63 // 64}
    # comm_stats' logical sizes: all-reduce Ψ; reduce-scatter + all-gather 2Ψ; stage 3 3Ψ.
    assert out["comm_bytes"] == {"0": 15 * 10**9, "1": 30 * 10**9, "2": 30 * 10**9, "3": 45 * 10**9}
    # 8 nodes of 8: ZeRO++ cuts stage 3's 3M across nodes (M = 15 GB in bf16), as comm_stats() records it:
    # qwZ's forward gather, 64 int8 shards of S = Ψ/64 (915,528 blocks of 128 + a 4-byte scale), and qgZ's
    # hop 2 per rank, 8 int4 shards (68 bytes a block); hpZ keeps the backward gather in the node. 0.549M.
    assert out["cross_node_bytes"]["3"] == 45 * 10**9
    assert out["cross_node_bytes_zeropp"] == 915_528 * (132 * 64 + 68 * 8) == 8_232_427_776


def test_deepspeed_published_estimator(capsys):
    # https://deepspeed.readthedocs.io/en/latest/memory.html ("API To Estimate Memory Usage"):
    # estimate_zero{2,3}_model_states_mem_needs_all_cold(total_params=2851e6, largest_layer_params=32e6,
    # num_gpus_per_node=8, num_nodes=1) prints, in the offload_optimizer=none (and offload_param=none)
    # rows, 15.93GB per GPU for ZeRO-2 and 6.09GB for ZeRO-3. Its "GB" are GiB (bytes / 2**30).
    # Only those rows are reproduced: zeroshard has no offload, and the per-CPU column is the
    # host memory needed to build the model (with the 1.5 additional_buffer_factor), not model states.
    # DeepSpeed's ZeRO-2 budgets 4Ψ + 16Ψ/N: 16-bit parameters and gradients whole (2Ψ + 2Ψ, the
    # gradients as DeepSpeed holds them before its reduction) and 16 bytes of fp32 parameters,
    # gradients and moments per sharded parameter: our stage 1 arrangement with K = 16.
    ds_zero2 = _estimate_json(capsys, "--params", "2851e6", "--gpus", "8", "--optimizer-bytes", "16")
    assert round(ds_zero2["memory_bytes"]["1"] / 2**30, 2) == 15.93
    # DeepSpeed's ZeRO-3 budgets 18Ψ/N + 4·largest layer: 2 bytes of 16-bit parameter and 16 of fp32
    # state per sharded parameter (our 2 + 2 + K with K = 14: it keeps the gradient shard in fp32, we
    # count it in 16 bits), and the gathered layer's 16-bit parameters and gradients, as our unit.
    ds_zero3 = _estimate_json(capsys, "--params", "2851e6", "--gpus", "8", "--optimizer-bytes", "14",
                              "--largest-unit", "32e6")
    assert round(ds_zero3["memory_bytes"]["3"] / 2**30, 2) == 6.09


# config.json of public Hugging Face models: their size keys as published, with the known total.
HF_CONFIGS = {
    "gpt2": ({"model_type": "gpt2", "activation_function": "gelu_new", "n_ctx": 1024, "n_embd": 768,
              "n_head": 12, "n_layer": 12, "n_positions": 1024, "vocab_size": 50257,
              "layer_norm_epsilon": 1e-05, "architectures": ["GPT2LMHeadModel"]}, 124_439_808),
    "meta-llama/Llama-2-7b-hf": ({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
        "hidden_size": 4096, "intermediate_size": 11008, "max_position_embeddings": 4096,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
        "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float16",
        "vocab_size": 32000}, 6_738_415_616),
    "mistralai/Mistral-7B-v0.1": ({
        "model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_act": "silu",
        "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
        "tie_word_embeddings": False, "vocab_size": 32000}, 7_241_732_096),
    "Qwen/Qwen2-0.5B": ({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu",
        "hidden_size": 896, "intermediate_size": 4864, "max_position_embeddings": 131072,
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "vocab_size": 151936}, 494_032_768),
    "EleutherAI/pythia-160m": ({
        "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "hidden_act": "gelu",
        "hidden_size": 768, "intermediate_size": 3072, "max_position_embeddings": 2048,
        "num_attention_heads": 12, "num_hidden_layers": 12, "rotary_pct": 0.25,
        "tie_word_embeddings": False, "use_parallel_residual": True, "vocab_size": 50304},
        162_322_944),
    "facebook/opt-125m": ({
        "model_type": "opt", "architectures": ["OPTForCausalLM"], "activation_function": "relu",
        "do_layer_norm_before": True, "ffn_dim": 3072, "hidden_size": 768,
        "max_position_embeddings": 2048, "num_attention_heads": 12, "num_hidden_layers": 12,
        "vocab_size": 50272, "word_embed_proj_dim": 768}, 125_239_296),
    "facebook/opt-350m": ({
        "model_type": "opt", "architectures": ["OPTForCausalLM"], "activation_function": "relu",
        "do_layer_norm_before": False, "ffn_dim": 4096, "hidden_size": 1024,
        "max_position_embeddings": 2048, "num_attention_heads": 16, "num_hidden_layers": 24,
        "vocab_size": 50272, "word_embed_proj_dim": 512}, 331_196_416),
}


@pytest.mark.parametrize("name", HF_CONFIGS)
def test_hf_config_counts_match_published_totals(name, tmp_path):
    config, total = HF_CONFIGS[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert count_model(str(tmp_path / "config.json")).numel == total


def test_model_flag_reads_a_config_file(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_CONFIGS["meta-llama/Llama-2-7b-hf"][0]))
    out = _estimate_json(capsys, "--model", str(path), "--gpus", "8")
    assert out["params"] == 6_738_415_616
    # By size (each module of 1M elements or more is a unit): every Linear is one, and the largest
    # units are the token embedding and the untied head, 32000 × 4096 each.
    assert out["largest_unit"] == 32000 * 4096
    assert out["memory_by_state"]["3"]["params"] == 2 * (-(-out["params"] // 8) + out["largest_unit"])
    # One unit per decoder layer (4 × 4096² attention, 3 × 4096 × 11008 MLP, two RMSNorms): the model
    # itself keeps the embedding, the head and the final norm, larger than a layer.
    out = _estimate_json(capsys, "--model", str(path), "--gpus", "8", "--wrap", "LlamaDecoderLayer")
    assert 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096 < out["largest_unit"] == 2 * 32000 * 4096 + 4096


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_counts_match_the_built_model(name):
    model = GPT(PRESETS[name])
    counted = count_model(name)
    assert counted.numel == model.num_params()
    # The demo wraps each Block; the model itself keeps the (tied) embeddings and the final norm.
    block = sum(p.numel() for p in model.blocks[0].parameters())
    assert counted.largest_unit == max(block, counted.numel - len(model.blocks) * block)


@pytest.mark.parametrize("stage", estimate.STAGES)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_largest_model_is_the_last_that_fits(stage, dtype):
    gpu_mem, n, unit = 80 * 10**9, 64, 200_000_000
    fit = estimate.largest_model(gpu_mem, n, stage, dtype, largest_unit=unit)
    memory = lambda psi: estimate.memory_per_gpu(psi, n, stage, dtype, largest_unit=unit)  # noqa: E731
    assert memory(fit) <= gpu_mem < memory(fit + 1)
    # The paper's closed forms (bytes per parameter p + g + K = 16 in both dtypes here), ± N.
    p = estimate.DTYPE_BYTES[dtype][0]
    per_param = {0: 16, 1: 2 * p + (16 - 2 * p) / n, 2: p + (16 - p) / n, 3: 16 / n}[stage]
    closed = (gpu_mem - (2 * p * unit if stage == 3 else 0)) / per_param
    assert abs(fit - closed) <= n


def test_gpu_mem_flag_reports_max_params(capsys):
    out = _estimate_json(capsys, "--params", "7.5e9", "--gpus", "64", "--gpu-mem", "80GB")
    assert out["gpu_mem_bytes"] == 80 * 10**9
    assert out["max_params"]["0"] == 5 * 10**9  # 80 GB / 16 bytes per parameter
    assert int(estimate.largest_model(80 * 2**30, 64, 2)) == _estimate_json(
        capsys, "--params", "1", "--gpus", "64", "--gpu-mem", "80GiB")["max_params"]["2"]


def test_one_node_has_no_cross_node_traffic(capsys):
    out = _estimate_json(capsys, "--params", "1e9", "--gpus", "8")
    assert out["nodes"] == 1 and set(out["cross_node_bytes"].values()) == {0}
    assert out["cross_node_bytes_zeropp"] == 0


def test_table_lists_every_stage(capsys):
    assert main(["estimate", "--params", "7.5e9", "--gpus", "64", "--gpu-mem", "80GB"]) == 0
    out = capsys.readouterr().out
    for cells in (("0", "120 GB", "16Ψ"), ("1", "31.4 GB", "4Ψ + 12Ψ/N"), ("2", "16.6 GB", "2Ψ + 14Ψ/N"),
                  ("3", "1.88 GB", "16Ψ/N + 4U")):
        assert any(all(c in line for c in cells) and line.split()[0] == cells[0]
                   for line in out.splitlines()), (cells, out)
    assert "3M -> 0.549M" in out


@pytest.mark.parametrize("argv, message", [
    (["--params", "7.5e9", "--gpus", "8", "--gpu-mem", "80"], "expected a size with a unit"),
    (["--params", "1.5", "--gpus", "8"], "expected a whole number"),
    (["--params", "1e9", "--gpus", "8", "--dtype", "bf16", "--optimizer-bytes", "2"], "whose fp32"),
    (["--model", "nope", "--gpus", "8"], "neither a preset"),
    (["--gpus", "8"], "one of the arguments --params --model is required"),
])
def test_bad_flags(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("config, flags, message", [
    ({"hidden_size": 64}, (), 'holds no "model_type": it is not a Hugging Face config.json'),
    ({"model_type": "no-such-model"}, (), "cannot read"),
    ({"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2}, ("--wrap", "Block"),
     "stage 3 wrap classes ['Block'] match no module"),
])
def test_configs_it_cannot_count(tmp_path, capsys, config, flags, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--model", str(tmp_path / "config.json"), "--gpus", "8", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
