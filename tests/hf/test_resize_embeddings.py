"""`model.resize_token_embeddings(n)` with DeepSpeed's large-model load.

Before `initialize`, on a model from `from_pretrained(path)` inside `deepspeed.zero.Init` (tiny Llama, whose
head is its own `nn.Linear`, and GPT-2, whose head is tied to the embedding), the resize runs on the
materialised embeddings: at stage 3 on 2 ranks the model trains 3 SGD steps and saves
(`engine.save_pretrained`) equal to one plain transformers process that loads the same files, resizes the same
way (the new rows drawn from the old rows' statistics by transformers' `mean_resizing`, from the same seed)
and trains on the concatenated batches. After `initialize` (stage 3, and stage 1) the call is a `ModelError`
that names `resize_token_embeddings` and says to resize before `initialize`.
"""

from __future__ import annotations

import torch

from tests.distributed import run_ranks
from tests.hf.models import VOCAB, config_of

KINDS = ["llama", "gpt2"]
NEW_VOCAB = VOCAB + 5
STEPS = 3
WORLD = 2  # the embedding and head sharded over the ranks (tests/deepspeed/test_zero_init_edits.py runs 1 too)
ROWS = 2  # per rank
CONFIG = {"train_micro_batch_size_per_gpu": ROWS,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _batch(step: int, world: int) -> torch.Tensor:
    """Token ids over the resized vocabulary, so the new rows train too."""
    return torch.randint(NEW_VOCAB, (ROWS * world, 12), generator=torch.Generator().manual_seed(50 + step))


def _resized(model) -> None:
    torch.manual_seed(5)  # transformers draws the new rows
    model.resize_token_embeddings(NEW_VOCAB)


def _ranks(rank, world, device, paths: dict, out: str):
    from transformers import AutoModelForCausalLM

    import zeroshard.deepspeed as deepspeed

    results = {}
    for kind, path in paths.items():
        with deepspeed.zero.Init():
            model = AutoModelForCausalLM.from_pretrained(path)
        _resized(model)
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                          config=CONFIG)
        losses = []
        for step in range(STEPS):
            x = _batch(step, world)[ROWS * rank:ROWS * (rank + 1)].to(device)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.save_pretrained(f"{out}/{kind}")
        results[kind] = {"losses": losses, "after": _resize_error(model),
                         "getter": model.resize_token_embeddings() is model.get_input_embeddings()}
    # Below stage 3 the embedding lives in a flat buffer: the same error, naming the stage.
    model = AutoModelForCausalLM.from_pretrained(paths["gpt2"])
    deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         config={**CONFIG, "zero_optimization": {"stage": 1}})
    results["stage 1"] = _resize_error(model)
    return results


def _resize_error(model) -> str:
    import zeroshard

    try:
        model.resize_token_embeddings(NEW_VOCAB + 3)
    except zeroshard.ModelError as exc:
        return str(exc)
    return "no error"


def _reference(path: str, world: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    _resized(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x = _batch(step, world)
        per_rank = [model(input_ids=x[ROWS * r:ROWS * (r + 1)], labels=x[ROWS * r:ROWS * (r + 1)]).loss
                    for r in range(world)]
        opt.zero_grad()
        torch.stack(per_rank).mean().backward()
        opt.step()
        losses.append([loss.item() for loss in per_rank])
    return losses, model.state_dict()


def _saved(kind: str, tmp_path, results) -> None:
    from transformers import AutoModelForCausalLM

    losses, weights = _reference(str(tmp_path / kind), WORLD)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / kind)
    assert saved.config.vocab_size == NEW_VOCAB
    state = saved.state_dict()
    assert sorted(state) == sorted(weights)
    for key, value in weights.items():
        assert torch.allclose(state[key], value, rtol=1e-4, atol=1e-6), (kind, key)
    for rank, result in enumerate(results):
        got = result[kind]["losses"]
        assert all(abs(g - w[rank]) <= 2e-5 * abs(w[rank]) for g, w in zip(got, losses)), (kind, rank)
        assert result[kind]["after"].startswith(
            f"{type(saved).__name__}.resize_token_embeddings() after zeroshard.initialize at ZeRO stage 3")
        assert "Resize before initialize" in result[kind]["after"]
        assert result[kind]["getter"]  # resize_token_embeddings() without a size changes nothing: allowed
        assert result["stage 1"].startswith(
            "GPT2LMHeadModel.resize_token_embeddings() after zeroshard.initialize at ZeRO stage 1: the embedding's "
            "parameters are in zeroshard's flat buffers")


def test_resize_token_embeddings_under_zero_init_trains_and_saves_as_one_process(tmp_path):
    from transformers import AutoModelForCausalLM

    paths = {}
    for kind in KINDS:
        torch.manual_seed(0)
        config = config_of(kind)
        if kind == "gpt2":  # no dropout: the engine trains in train mode, the reference loads in eval mode
            config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / kind)
        paths[kind] = str(tmp_path / kind)
    results = run_ranks(_ranks, WORLD, paths, str(tmp_path / "out"))
    for kind in KINDS:
        _saved(kind, tmp_path, results)
