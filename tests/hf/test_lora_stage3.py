"""PEFT LoRA at stage 3 with the frozen base sharded: losses as one process, and the base released as used.

A tiny Llama (tests/hf/models.py, 4 layers) with LoRA on q_proj and v_proj, every
parameter sharded (persistence threshold 0), each decoder layer a unit.
The reference for the losses is the same model trained in one process on
the mean of the ranks' losses. The reference for memory is the plan's rule
(`zeroshard.plan.prefetch.gathered_numel`, what `zeroshard.estimate.step_peak`
prices): the elements whole in backward never exceed the units in flight,
the root and the layer computing and the one prefetched behind it, where
holding each frozen layer to the end of backward would hold all of them.
"""

from __future__ import annotations

import torch

from tests.distributed import run_ranks
from tests.hf.models import batch, config_of, layer_class, train_lm

STEPS, LR, WORLD = 3, 1e-3, 2


def _lora():
    import peft
    import transformers as tf

    config = config_of("llama")
    config.num_hidden_layers = 4  # more layers than the units in flight
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def _train(rank, world, device) -> dict:
    import zeroshard
    from zeroshard.app.estimate.model_count import stage3_flats

    model = _lora().to(device)
    engine = zeroshard.initialize(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR),
                                  {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": {
                                      "stage": 3, "stage3_param_persistence_threshold": 0}},
                                  wrap=[layer_class(model)])
    schedule, live = engine.schedule, []
    need = schedule.need

    def watched(i, exact=True, after=None):
        need(i, exact, after)
        if schedule.phase.value == "backward":
            live.append(schedule.live_numel())
    schedule.need = watched
    losses = train_lm(engine, rank, device, STEPS)
    units = [[f for f in stage3_flats([u])] for u in engine.units]
    return {"losses": losses, "live": max(live), "units": units, "sizes": [u.gathered_numel for u in engine.units]}


def test_lora_at_stage_3_trains_as_one_process_and_releases_the_base_as_backward_goes():
    from zeroshard.plan.prefetch import gathered_numel

    model = _lora()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    ref = []
    for step in range(STEPS):
        per_rank = [model(input_ids=batch(10 * step + r), labels=batch(10 * step + r)).loss for r in range(WORLD)]
        (sum(per_rank) / WORLD).backward()
        opt.step()
        opt.zero_grad()
        ref.append([loss.item() for loss in per_rank])
    for rank, r in enumerate(run_ranks(_train, WORLD)):
        mine, want = torch.tensor(r["losses"]), torch.tensor([step[rank] for step in ref])
        assert ((mine - want).abs() / want).max() <= 2e-5, (mine, want)
        assert r["live"] == gathered_numel(r["units"], WORLD)  # the plan's units in flight, to the element
        assert r["live"] < sum(r["sizes"])  # not the whole base
