"""DeepSpeed's large-model load, `with deepspeed.zero.Init(): model = AutoModelForCausalLM.from_pretrained(path)`,
under `import zeroshard.deepspeed as deepspeed` (issue 28, acceptance 2).

At stage 3 on 4 ranks the weights are read unit by unit into the shards (`zeroshard.pretrained`'s reader):
the logits equal single-process `from_pretrained`'s, and no rank ever holds the whole model (on the CPU each
rank is capped by RLIMIT_DATA below 85% of the model's fp32 bytes, as tests/hf/test_pretrained.py does; on
CUDA the GPU's peak allocated memory is compared with the same bound). Below stage 3 the same script runs
unchanged: `zero.Init` then does nothing, as in DeepSpeed, and the model is the files' whole.
4 ranks, not 2: a rank's own training state at stage 3 (parameter and gradient shards in fp32) is the whole
model's size at 2 ranks, half of it at 4, so only at 4 does a cap below the model leave room for one unit.

In bf16 (issue 39): `from_pretrained(path, dtype=torch.bfloat16)` with the config's bf16 section, under the same
cap below the model's fp32 bytes, gives each parameter the bits of transformers' own bf16 load (a SHA-256 of
each, gathered one unit at a time), so no rank made the model whole in fp32.
"""

from __future__ import annotations

import hashlib

import torch

from tests.distributed import run_ranks
from tests.memory_cap import MemoryCap, return_freed_memory

IDS = torch.tensor([[1, 5, 9, 42, 7, 300, 12, 999]])
FRACTION = 0.85  # of the model's fp32 bytes: each rank's bound at stage 3


def _script(stage: int, path: str, device):
    """The user's DeepSpeed script; only the config depends on the stage."""
    from transformers import AutoModelForCausalLM

    import zeroshard.deepspeed as deepspeed

    with deepspeed.zero.Init():
        model = AutoModelForCausalLM.from_pretrained(path)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config={"train_micro_batch_size_per_gpu": 1,
                                              "zero_optimization": {"stage": stage}})
    with torch.no_grad():
        return engine(input_ids=IDS.to(device)).logits.cpu()


def _load_bf16(rank, world, device, path: str, full_bytes: int):
    """Stage 3 in bf16 under the cap: (cap below the model, held, each parameter's digest by name)."""
    from transformers import AutoModelForCausalLM

    import zeroshard
    import zeroshard.deepspeed as deepspeed

    return_freed_memory()
    for capped in (False, True):  # the first build, on meta, imports and sets up what the cap must not count
        cap = MemoryCap(full_bytes, FRACTION) if capped else None
        with deepspeed.zero.Init():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config={"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                                              "zero_optimization": {"stage": 3}})
    digests = {}
    for name, p in engine.module.named_parameters():
        with zeroshard.gathered_parameters(p):
            digests[name] = _digest(p)
    return not cap.whole_fits, cap.held(), digests


def _digest(tensor: torch.Tensor) -> tuple[str, str]:
    bits = tensor.detach().cpu().clone().view(torch.int16)  # a copy: numpy() pins its storage
    return str(tensor.dtype), hashlib.sha256(bits.numpy().tobytes()).hexdigest()


def _load(rank, world, device, path: str, full_bytes: int) -> dict:
    return_freed_memory()
    below = _script(1, path, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        logits = _script(3, path, device)
        return {"below": below, "stage3": logits, "cap_below_model": True,
                "held": torch.cuda.max_memory_allocated(device) - before <= FRACTION * full_bytes}
    cap = MemoryCap(full_bytes, FRACTION)  # last: the stage-1 load above holds the whole model by design
    logits = _script(3, path, device)
    return {"below": below, "stage3": logits, "cap_below_model": not cap.whole_fits, "held": cap.held()}


def _saved(path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=1024, num_hidden_layers=12,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size="20MB")


def test_zero_init_from_pretrained_at_stage3_and_below(tmp_path):
    from transformers import AutoModelForCausalLM

    _saved(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path)
    full_bytes = 4 * reference.num_parameters()
    with torch.no_grad():
        expected = reference(input_ids=IDS).logits
    del reference
    for result in run_ranks(_load, 4, str(tmp_path), full_bytes, fresh=True):
        assert result["cap_below_model"] and result["held"]
        torch.testing.assert_close(result["stage3"], expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(result["below"], expected, rtol=0, atol=1e-6)


def test_zero_init_from_pretrained_in_bf16_at_stage3_never_holds_the_model_in_fp32(tmp_path):
    from transformers import AutoModelForCausalLM

    _saved(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    full_bytes = 4 * reference.num_parameters()
    expected = {name: _digest(p) for name, p in reference.named_parameters()}
    del reference
    for cap_below_model, held, digests in run_ranks(_load_bf16, 4, str(tmp_path), full_bytes, fresh=True):
        assert cap_below_model and held
        assert digests == expected
