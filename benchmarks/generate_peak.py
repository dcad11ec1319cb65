"""The peak of `generate` at stage 3: measured, beside the root unit and two layers whole plus the KV cache.

GRPO's rollouts generate with the policy being trained. At stage 3 every
rank runs each forward (`synced_gpus`), gathering one decoder layer at a
time; the whole model is never gathered (DeepSpeed's
`ds3_gather_for_generation=True`, TRL's default, gathers it all). A
transformers Llama from a config (no download), stage 3 with each decoder
layer a unit, one training step first; each rank then reads the resident
high-water mark of a greedy `generate` above its RSS just before it
(`ResidentMeter`, as benchmarks/step_peak.py), and rank 0 prints the larger
rank's figures as JSON with what they are compared with. The layer
computing and the next one, prefetched in the order the training step
recorded, are whole beside the root unit (embedding, final norm, head):

    torchrun --nproc-per-node 2 benchmarks/generate_peak.py

expected = 4 bytes x (the root unit's gathered elements + twice the largest
layer's) + the KV cache at its longest (2 x layers x batch x kv heads x head
size x (prompt + new tokens) x 4 bytes); whole = the model's bytes.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from lora_peak import VOCAB, llama

import zeroshard
from zeroshard.app.resident import ResidentMeter


def generate(engine, args, new_tokens: int) -> list[int]:
    prompt = torch.randint(VOCAB, (args.batch, args.prompt), generator=torch.Generator().manual_seed(dist.get_rank()))
    with torch.no_grad():
        out = engine.module.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, args.prompt:].tolist()


def main() -> None:
    import transformers  # noqa: F401  (imported before the measure: its code is not the generate's)

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = llama(args.hidden, args.layers)
    whole = 4 * sum(q.numel() for q in model.parameters())
    engine = zeroshard.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), {
        "train_micro_batch_size_per_gpu": args.batch, "zero_optimization": {
            "stage": 3, "stage3_wrap_classes": ["LlamaDecoderLayer"]}})
    tokens = torch.randint(VOCAB, (args.batch, args.prompt), generator=torch.Generator().manual_seed(7))
    engine.backward(engine(input_ids=tokens, labels=tokens).loss)
    engine.step()
    generate(engine, args, 2)  # warm-up: the code and buffers a generate brings in for good stay out
    meter, completion = ResidentMeter(), []
    measured = meter.peak_of(lambda: completion.extend(generate(engine, args, args.new)))
    config = model.config
    kv = 2 * config.num_hidden_layers * args.batch * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * (args.prompt + args.new) * 4
    root, *layers = [unit.gathered_numel for unit in engine.units]
    units = 4 * (root + 2 * max(layers))
    mine = {"peak": measured["peak"], "file_moved": measured["file_moved"], "units_in_flight": units, "kv_cache": kv,
            "expected": units + kv, "whole": whole, "completion": completion[:8]}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        print(json.dumps(max(everyone, key=lambda r: r["peak"])))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
