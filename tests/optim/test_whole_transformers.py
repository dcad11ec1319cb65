"""A transformers Llama with Muon on its hidden matrices and AdamW on the rest (DeepSpeed's split: names
with "embed" or "lm_head" and tensors under 2 dimensions to AdamW), and with Adafactor alone, at stages 1-3 on
2 gloo ranks: losses and weights equal the same optimizers in one process on the global batch."""

import pytest
import torch
import transformers

from tests.distributed import run_ranks
from tests.optim.whole import Muon32

VOCAB, STEPS, ROWS, ACCUMULATION, CLIP = 64, 3, 8, 2, 1.0


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def _optimizers(kind: str, model: torch.nn.Module):
    if kind == "adafactor":
        return torch.optim.Adafactor(model.parameters(), lr=1e-2)
    muon = [(n, p) for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n and "lm_head" not in n]
    rest = [p for n, p in model.named_parameters() if id(p) not in {id(q) for _, q in muon}]
    return [Muon32([p for _, p in muon], lr=2e-2), torch.optim.AdamW(rest, lr=3e-3)]


def _batch(step: int) -> torch.Tensor:
    return torch.randint(VOCAB, (ROWS, 12), generator=torch.Generator().manual_seed(step))


def _reference(kind: str):
    model = _llama()
    opts = _optimizers(kind, model)
    opts = opts if isinstance(opts, list) else [opts]
    losses = []
    for step in range(STEPS):
        total = 0.0
        for chunk in _batch(step).chunk(ACCUMULATION):
            loss = model(input_ids=chunk, labels=chunk).loss
            (loss / ACCUMULATION).backward()
            total += loss.item() / ACCUMULATION
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(total)
    return losses, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(rank, world, device, kind):
    import zeroshard

    out = {}
    for stage in (1, 2, 3):
        model = _llama().to(device)
        engine = zeroshard.initialize(model, _optimizers(kind, model), {
            "train_micro_batch_size_per_gpu": ROWS // world // ACCUMULATION, "gradient_accumulation_steps": ACCUMULATION,
            "gradient_clipping": CLIP, "zero_optimization": {
                "stage": stage, "stage3_wrap_classes": ["LlamaDecoderLayer"], "stage3_param_persistence_threshold": 0}})
        losses = []
        for step in range(STEPS):
            total = 0.0
            for micro, chunk in enumerate(_batch(step).chunk(ACCUMULATION)):
                rows = chunk.chunk(world)[rank].to(device)
                loss = engine(input_ids=rows, labels=rows).loss
                engine.backward(loss)
                engine.step()
                total += loss.item() / ACCUMULATION
            losses.append(total)
        with zeroshard.gathered_parameters(list(model.parameters())):
            out[stage] = losses, torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    return out


@pytest.mark.parametrize("kind", ["muon", "adafactor"])
def test_llama_equals_one_process(kind):
    losses, weights = _reference(kind)
    results = run_ranks(_train, 2, kind)
    for stage in (1, 2, 3):
        mean = [sum(r[stage][0][i] for r in results) / 2 for i in range(STEPS)]
        for got, want in zip(mean, losses):
            assert abs(got - want) <= 2e-5 * abs(want), (stage, got, want)
        assert (results[0][stage][1] - weights).abs().max() <= 1e-4, stage
