"""transformers' MoE models (Mixtral, Qwen2-MoE: experts as 3-D tensors) train at stages 0-3 as one process.

Built from configs (hidden 32, 2 layers, 4 experts, top 2) with the router's auxiliary loss in the loss
(`output_router_logits=True`). The reference is one process that computes each rank's micro-batch loss
on its own and steps on their mean: DDP's gradient, which an auxiliary loss computed per batch keeps
from being the loss of the two batches joined.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.hf.models import VOCAB, batch, layer_class
from tests.recipes import relative_error

STEPS, LR, WORLD = 3, 1e-3, 2


def _model(kind: str):
    import transformers as tf

    cls = {"mixtral": tf.MixtralConfig, "qwen2_moe": tf.Qwen2MoeConfig}[kind]
    extra = {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 32} if kind == "qwen2_moe" else {}
    config = cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts=4,
                 num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02, **extra)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, labels=ids)
    assert out.aux_loss is not None  # the router's loss is in out.loss
    return out.loss


def _train(rank, world, device, kind: str) -> dict:
    import zeroshard

    out = {}
    for stage in range(4):
        model = _model(kind).to(device)
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        engine = zeroshard.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR), config,
                                      wrap=[layer_class(model)] if stage == 3 else None)
        losses = []
        for step in range(STEPS):
            loss = _loss(engine, batch(10 * step + rank).to(device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        full = engine.full_state_dict()
        out[stage] = {"losses": losses, "weights": torch.cat([v.reshape(-1).float().cpu() for v in full.values()])}
    return out


def _reference(kind: str) -> tuple[list[list[float]], torch.Tensor]:
    model = _model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        per_rank = [_loss(model, batch(10 * step + rank)) for rank in range(WORLD)]
        (sum(per_rank) / WORLD).backward()
        opt.step()
        opt.zero_grad()
        losses.append([loss.item() for loss in per_rank])
    return losses, torch.cat([v.reshape(-1).float() for v in model.state_dict().values()])


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_moe_models_train_at_every_stage_as_one_process(kind):
    ref_losses, ref_weights = _reference(kind)
    for rank, result in enumerate(run_ranks(_train, WORLD, kind)):
        for stage, run in result.items():
            mine = torch.tensor(run["losses"])
            ref = torch.tensor([step[rank] for step in ref_losses])
            assert ((mine - ref).abs() / ref).max() <= 2e-5, (kind, stage, mine, ref)
            assert relative_error(run["weights"], ref_weights) <= 1e-4, (kind, stage)
