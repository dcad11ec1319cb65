"""The peak of a stage-3 step of a PEFT LoRA model: measured, and estimated by `zeroshard.estimate.step_peak`.

A transformers Llama from a config (no download) with LoRA on q_proj and
v_proj; stage 3 with each decoder layer a unit, the frozen base sharded.
Each rank reads the resident high-water mark of its third step above its
RSS before the model was built (the activations and the estimate are
counted on a copy of the model, dropped before) (`ResidentMeter`, as benchmarks/step_peak.py);
rank 0 prints the largest rank's figures as JSON. Run it under this tree and
under an older revision (PYTHONPATH) side by side:

    torchrun --nproc-per-node 2 benchmarks/lora_peak.py
    git worktree add /tmp/base <rev> && PYTHONPATH=/tmp/base torchrun --nproc-per-node 2 benchmarks/lora_peak.py

The estimate: `step_peak` over the trained elements (the adapters) and the
units' flats (frozen ones included, gathered as other units), plus the
frozen base's shards (which `step_peak`'s model states, of trained
elements, leave out) and the activations counted by `count_saved`.
"""

from __future__ import annotations

import argparse
import gc
import json

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.app.resident import ResidentMeter
from zeroshard.estimate.activations import count_saved

VOCAB = 8000


def llama(hidden: int, layers: int):
    """A transformers Llama from a config: heads of 64, the MLP 11/4 of the hidden size (119M at 1024 x 8)."""
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                            num_hidden_layers=layers, num_attention_heads=hidden // 64,
                            num_key_value_heads=hidden // 64, max_position_embeddings=512)
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(config)


def build(hidden: int, layers: int):
    import peft

    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(llama(hidden, layers), lora)


def estimate(model, activations: int, world: int) -> dict:
    """Counted on the model before `initialize` (its parameters still whole)."""
    from zeroshard.app.estimate.model_count import count_module
    from zeroshard.estimate.formulas import shard_numel
    from zeroshard.estimate.peak import step_peak
    from zeroshard.plan.flats import FROZEN

    counted = count_module("lora", model, ("LlamaDecoderLayer",))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    peak = step_peak(trained, activations, 3, world, "fp32", units=counted.units,
                     largest_param=max(p.numel() for p in model.parameters() if p.requires_grad))
    frozen = 4 * sum(shard_numel(f.numel, world) for f in counted.flats if f.kind == FROZEN)
    return {"estimate": peak.total + frozen, "estimate_gathered": peak.gathered, "frozen_shards": frozen,
            "base_bytes": 4 * sum(f.numel for f in counted.flats if f.kind == FROZEN)}


def main() -> None:
    import peft  # noqa: F401  (imported before the base is read: their code is not the step's)
    import transformers  # noqa: F401

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    run(args, 128, 1)  # warm-up: the code and buffers a step brings in for good stay out of the measure
    mine = counted(args, args.hidden, args.layers)  # on a model of its own, dropped before the base is read
    gc.collect()
    meter = ResidentMeter()
    measured, losses = run(args, args.hidden, args.layers, meter)
    mine["losses"] = losses
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine | {"peak": measured["peak"], "file_moved": measured["file_moved"]})
    if dist.get_rank() == 0:
        print(json.dumps(max(everyone, key=lambda r: r["peak"])))
    dist.destroy_process_group()


def _tokens(args) -> torch.Tensor:
    return torch.randint(VOCAB, (args.batch, args.seq), generator=torch.Generator().manual_seed(dist.get_rank()))


def counted(args, hidden: int, layers: int) -> dict:
    """The activations and the estimate, counted on the model before `initialize`."""
    model, tokens = build(hidden, layers), _tokens(args)
    saved = count_saved(lambda: model(input_ids=tokens, labels=tokens).loss, model, tokens)
    return {"activations": saved.total} | estimate(model, saved.total, dist.get_world_size())


def run(args, hidden: int, layers: int, meter: ResidentMeter | None = None):
    """Three steps of a LoRA Llama; with `meter`, the third measured. Returns it and the losses."""
    model, tokens = build(hidden, layers), _tokens(args)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
    engine = zeroshard.initialize(model, opt, {"train_micro_batch_size_per_gpu": args.batch, "zero_optimization": {
        "stage": 3, "stage3_wrap_classes": ["LlamaDecoderLayer"]}})

    def step():
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    losses = [step(), step()]
    measured = meter.peak_of(lambda: losses.append(step())) if meter else step()
    return measured, losses


if __name__ == "__main__":
    main()
