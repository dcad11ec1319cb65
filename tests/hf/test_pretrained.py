"""`init=zeroshard.pretrained(path)`: a sharded `save_pretrained` directory loaded at stage 3 on 4 ranks.

Acceptance 3 (b). Each rank's memory is held below 85% of the model's fp32
size: reading the whole model on one rank (`safetensors.torch.load_file`, a
full state dict, the whole model materialised) would exceed it; the rank's
own state (parameter shards, fp32 master and gradient shards: ~0.7 of the
model at 4 ranks) and one unit at a time fit. On the CPU the cap is
RLIMIT_DATA over the rank's private writable memory (which counts what a
loader copies out of the files, not the read-only mapping of the files
themselves). On CUDA the weights live on the GPU, where RLIMIT_DATA does not
reach (and NCCL's host allocations could trip it): the GPU's peak allocated
memory during the load is compared with the same bound instead. The logits
must equal single-process `from_pretrained`'s.
"""

from __future__ import annotations

import torch

from tests.distributed import run_ranks
from tests.memory_cap import MemoryCap, return_freed_memory

IDS = torch.tensor([[1, 5, 9, 42, 7, 300, 12, 999]])
FRACTION = 0.85  # of the model's fp32 bytes: each rank's bound


def _load_under_cap(rank, world, device, path):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import zeroshard

    return_freed_memory()
    with zeroshard.meta_init():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    full_bytes = 4 * sum(p.numel() for p in model.parameters())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        cap = MemoryCap(full_bytes, FRACTION)
    engine = zeroshard.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  {"zero_optimization": {"stage": 3}}, wrap=[LlamaDecoderLayer],
                                  init=zeroshard.pretrained(path))
    with torch.no_grad():
        logits = engine(input_ids=IDS.to(device)).logits.cpu()
    if device.type == "cuda":
        return True, torch.cuda.max_memory_allocated(device) - before <= FRACTION * full_bytes, logits
    return not cap.whole_fits, cap.held(), logits


def test_sharded_pretrained_weights_load_at_stage3_on_4_ranks_each_capped_below_the_model(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=1024, num_hidden_layers=24,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path, max_shard_size="30MB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) >= 3
    reference = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert 4 * reference.num_parameters() > 100e6
    with torch.no_grad():
        expected = reference(input_ids=IDS).logits
    del reference
    for cap_is_below_model, stayed_under, logits in run_ranks(_load_under_cap, 4, str(tmp_path), fresh=True):
        assert cap_is_below_model and stayed_under
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)
