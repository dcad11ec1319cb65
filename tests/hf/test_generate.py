"""generate() at stage 3, ranks stopping at different lengths: one process's output, a layer or two whole at a time.

Each rank has its own prompt length and stops at its own length (a different
max_new_tokens, or an end-of-sequence token that only one rank meets).
Reference: the same weights (the engine's full_state_dict after a training
step) in the same transformers model, run whole in one process. While a
6-layer model generates after a training step, the elements whole beyond
the shards are at most the root unit's and two layers' (the one computing,
the next prefetched; the schedule's own count), never the model's.
"""

import copy

import torch
import transformers

from tests.distributed import run_ranks

VOCAB = 64


def _tiny(kind: str) -> torch.nn.Module:
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          eos_token_id=None)  # stops by max_new_tokens only
        return transformers.LlamaForCausalLM(config), "LlamaDecoderLayer"
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(config), "GPT2Block"


def _tokens(seed: int, length: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _train_step(engine, rank: int, device) -> None:
    x = _tokens(100 + rank, 8).to(device)
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()


def _generate_at_stage3(rank, world, device):
    import zeroshard
    from zeroshard.stage3.generation import GenerationError

    out = {}
    for kind in ("llama", "gpt2"):
        torch.manual_seed(0)
        model, block = _tiny(kind)
        model.to(device)
        reference = copy.deepcopy(model)
        engine = zeroshard.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_optimization": {
            "stage": 3, "stage3_wrap_classes": [block], "stage3_param_persistence_threshold": 0}})
        _train_step(engine, rank, device)  # generation between training steps
        reference.load_state_dict(engine.full_state_dict())
        engine.module.eval()
        reference.eval()
        prompt = _tokens(rank, 3 + 4 * rank).to(device)  # 3 tokens on rank 0, 7 on rank 1
        settings = {"do_sample": False, "pad_token_id": 0, "attention_mask": torch.ones_like(prompt)}
        if kind == "llama":  # rank 0 stops after 2 new tokens, rank 1 after 9
            settings["max_new_tokens"] = 2 + 7 * rank
        else:  # rank 0 stops at its second new token, as end-of-sequence; rank 1 meets none
            free = reference.generate(prompt, max_new_tokens=9, **settings)[0, prompt.shape[1]:].tolist()
            settings |= {"max_new_tokens": 9, "eos_token_id": free[1] if rank == 0 else
                         next(t for t in range(VOCAB) if t not in free)}
        want = reference.generate(prompt, **settings)
        out[kind, "same_object"] = engine.module.generate.__self__ is model
        out[kind, "got"] = model.generate(prompt, **settings).tolist()
        out[kind, "want"] = want.tolist()
        try:
            engine.module.generate(prompt, synced_gpus=False, **settings)
        except GenerationError as exc:
            out[kind, "unsynced"] = str(exc)
        engine.module.train()
        _train_step(engine, rank, device)  # training goes on after generating
        out[kind, "live_after"] = engine.schedule.live_numel()
    return out


def test_generate_at_stage3_with_ranks_stopping_at_different_lengths():
    results = run_ranks(_generate_at_stage3, 2)
    for kind in ("llama", "gpt2"):
        lengths = [len(out[kind, "got"][0]) for out in results]
        assert lengths[0] < lengths[1] and lengths[1] - 7 > lengths[0] - 3, lengths  # rank 0 generated fewer
        for out in results:
            assert out[kind, "got"] == out[kind, "want"]
            assert out[kind, "same_object"]
            assert "synced_gpus=False" in out[kind, "unsynced"] and "waiting forever" in out[kind, "unsynced"]
            assert out[kind, "live_after"] == 0


def _live_in_generate(rank, world, device) -> dict:
    import zeroshard

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)
    model = transformers.LlamaForCausalLM(config).to(device)
    engine = zeroshard.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"zero_optimization": {
        "stage": 3, "stage3_wrap_classes": ["LlamaDecoderLayer"], "stage3_param_persistence_threshold": 0}})
    ids = _tokens(50 + rank, 8).to(device)
    engine.backward(engine(input_ids=ids, labels=ids).loss)  # as GRPO: a step, which records the prefetch order
    engine.step()
    schedule, live = engine.schedule, []
    need = schedule.need

    def watched(i, exact=True, after=None):
        need(i, exact, after)
        live.append(schedule.live_numel())
    schedule.need = watched
    prompt = _tokens(rank, 5).to(device)
    model.eval()
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0,
                       attention_mask=torch.ones_like(prompt))
    return {"live": max(live), "sizes": [unit.gathered_numel for unit in engine.units]}


def test_generate_at_stage3_holds_the_root_and_two_layers_whole_not_the_model():
    for r in run_ranks(_live_in_generate, 2):
        root, *layers = r["sizes"]
        assert len(set(layers)) == 1 and len(layers) == 6
        # the root unit (embedding, final norm, head) all along, the layer computing and the next one prefetched
        assert r["live"] == root + 2 * layers[0], (r["live"], r["sizes"])
