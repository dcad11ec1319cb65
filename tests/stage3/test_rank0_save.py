"""A save made on rank 0 alone at stage 3 ends within 30 s on every rank, in an error naming the call made.

`if rank == 0: model.save_pretrained(dir)` (transformers' own, which calls the
model's state_dict(), which gathers), `model.state_dict()`, `engine.full_state_dict()`,
`engine.save_pretrained(dir)` and PEFT's `save_pretrained` on rank 0 alone, while rank 1 (a) goes on to
its next training step (a stage-3 gather, under the stall watch), (b) waits in torch.distributed.barrier()
(nothing of zeroshard runs there: rank 0's error is the one that counts; rank 1 is let out by rank 0's
barrier after it, as it would be by rank 0's exit), or (c) returns from the case. Each error is measured
from a barrier both ranks pass just before: the bound, 30 s, with the default config; the other
cases pass rank_check_timeout 2 s to stay short. The same calls made on every rank still save what a
single-process model holds (its own state dict, taken before zeroshard wraps it).
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tests.distributed import run_ranks
from tests.hf.models import STAGE3, batch, config_of, layer_class
from tests.recipes import Case, loss_of, make_model, micro_batch

BOUND_S = 30.0  # every rank's error within this, with the default config
GROUP_TIMEOUT_S = 15  # gloo drops a collective left stuck on an abandoned group after this
SHORT = {"rank_check_timeout": 2.0}


def _group():
    return dist.new_group([0, 1], backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))


def _gpt2(seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(config_of("gpt2"))


def _engine(kind: str, config: dict, group):
    """A stage-3 engine over a tiny transformers GPT-2 ("hf"), a PEFT LoRA of it ("peft", whose adapters are
    whole when the config leaves stage3_param_persistence_threshold at its default) or a plain GPT ("plain")."""
    import zeroshard

    if kind == "plain":
        model = make_model()
        return zeroshard.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                    Case(stage=3).config() | config, group=group)
    model = _gpt2()
    if kind == "peft":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                           target_modules=["c_attn"]))
    trained = [p for p in model.parameters() if p.requires_grad]
    return zeroshard.initialize(model, torch.optim.AdamW(trained, lr=1e-2), config, wrap=[layer_class(model)],
                                group=group)


def _step(engine, kind: str, rank: int, device) -> None:
    if kind == "plain":
        x, y = (t.to(device) for t in micro_batch(0, Case(), 2, rank, 0))
        loss = loss_of(engine, x, y)
    else:
        x = batch(rank).to(device)
        loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()


def _save(engine, call: str, out: Path) -> None:
    """The call rank 0 makes alone."""
    if call == "model.save_pretrained":  # transformers' (or PEFT's) own
        engine.module.save_pretrained(out)
    elif call == "model.state_dict":
        engine.module.state_dict()
    elif call == "engine.full_state_dict":
        engine.full_state_dict()
    else:
        engine.save_pretrained(out)


def _timed(fn) -> tuple[str, str, float] | None:
    """(error type, message, seconds until it was raised), None if `fn` returned."""
    import zeroshard

    begun = time.monotonic()
    try:
        fn()
    except zeroshard.ZeroshardError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - begun
    return None


def _alone(rank: int, device, kind: str, call: str, other: str, config: dict, out: Path):
    """Rank 0 makes `call` alone; rank 1 does `other`: "step", "barrier" or "return". What each raised."""
    group = _group()
    engine = _engine(kind, config, group)
    dist.barrier(group=group)  # both ranks start the clock together
    if rank == 0:
        error = _timed(lambda: _save(engine, call, out))
        if other == "barrier":
            dist.barrier()  # lets rank 1 out of its barrier, as rank 0's exit would (torchrun ends it then)
        return error
    if other == "step":
        return _timed(lambda: _step(engine, kind, rank, device))
    if other == "barrier":
        return _timed(dist.barrier)
    return None


def _default_config_cases(rank: int, world: int, device, root: str) -> list:
    out = Path(root)
    return [_alone(rank, device, "hf", "model.save_pretrained", other, STAGE3, out / other)
            for other in ("step", "barrier")]


# Stage 3 with the adapters whole: parameters of at most 200 elements persist (LoRA's A 2 x 32, B 96 x 2, the
# biases and norms), the base's matrices are sharded.
WHOLE_ADAPTERS = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 200}}
SHORT_CASES = [("hf", "model.state_dict", "step"), ("hf", "engine.full_state_dict", "barrier"),
               ("hf", "engine.save_pretrained", "step"), ("plain", "model.state_dict", "barrier"),
               ("plain", "engine.full_state_dict", "step"), ("plain", "engine.save_pretrained", "barrier"),
               ("peft", "model.save_pretrained", "step")]


def _short_cases(rank: int, world: int, device, root: str) -> dict:
    out, short = Path(root), STAGE3 | SHORT
    found = {case: _alone(rank, device, *case, short, out / "_".join(case)) for case in SHORT_CASES}
    found["peft_whole"] = _alone(rank, device, "peft", "model.save_pretrained", "barrier", WHOLE_ADAPTERS | SHORT,
                                 out / "peft_whole")
    # (c), last: rank 1 returns from the case (its group is destroyed) while rank 0 waits.
    found["return"] = _alone(rank, device, "hf", "model.save_pretrained", "return", short, out / "return")
    return found


def _every_rank(rank: int, world: int, device, root: str) -> dict:
    """The same calls made on every rank, and the adapters saved by rank 0 alone with no gather."""
    from safetensors.torch import load_file

    out = Path(root)
    engine = _engine("hf", STAGE3, _group())
    engine.module.save_pretrained(out / "hf", is_main_process=rank == 0)  # transformers' own: every rank gathers
    engine.save_pretrained(out / "engine")
    full = engine.full_state_dict(rank0_only=True)
    state = engine.module.state_dict()
    lora = _engine("peft", WHOLE_ADAPTERS, _group())
    lora.module.save_pretrained(out / "peft", is_main_process=rank == 0)
    if rank == 0:  # the error's rank-0 path: the adapters are whole, nothing to gather
        lora.module.save_pretrained(out / "peft_rank0", state_dict={
            name: p.detach() for name, p in lora.module.named_parameters() if p.requires_grad})
    dist.barrier()
    if rank != 0:
        return {"full": full}
    return {"full": full, "state": state, "files": {name: load_file(out / name / file) for name, file in (
        ("hf", "model.safetensors"), ("engine", "model.safetensors"), ("peft", "adapter_model.safetensors"),
        ("peft_rank0", "adapter_model.safetensors"))}}


# -- checks, in the parent ------------------------------------------------------------------------------------


def _check_error(error, kind: str, call: str, fix: str) -> None:
    assert error is not None, (call, "no error")
    name, message, seconds = error
    assert name == kind and call in message and fix in message, error
    assert seconds < BOUND_S, error


def test_rank0_save_pretrained_fails_within_30s_on_every_rank_with_the_default_config(tmp_path):
    """(a) rank 1 goes on to its next step, (b) it waits in torch.distributed.barrier()."""
    step, barrier = zip(*run_ranks(_default_config_cases, 2, str(tmp_path), timeout_s=180))
    call = "PreTrainedModel.save_pretrained (transformers; it calls the model's state_dict()"
    fix = ("call model.save_pretrained(dir, is_main_process=(rank == 0)) on every rank (every rank gathers, rank 0 "
           "alone writes), or engine.save_pretrained(dir) on every rank")
    _check_error(step[0], "CollectiveError", "rank(s) 1 will not enter " + call, fix)
    # the forward's first collective: the ranks' round on its units (3 units: 1 + 2 x 3 bytes a rank)
    assert "rank 1 is waiting in collective #1 (unit_check of 14 bytes for the units of the step) of the forward of " \
           "step 0" in step[0][1], step[0]
    _check_error(step[1], "CollectiveError", f"rank 0: in {call}", fix)
    assert "but rank(s) 0 will never join that collective" in step[1][1], step[1]
    # (b) rank 1 said nothing: rank 0 waited the default rank_check_timeout, 20 s, and rank 1's barrier passed
    # once rank 0 joined it.
    _check_error(barrier[0], "CollectiveError", "rank(s) 1 did not enter " + call, fix)
    assert "within rank_check_timeout (20 s)" in barrier[0][1] and barrier[0][2] >= 20.0, barrier[0]
    assert barrier[1] is None


FIXES = {"model.state_dict": "call model.state_dict() on every rank, or engine.full_state_dict(rank0_only=True) on "
                             "every rank",
         "engine.full_state_dict": "call engine.full_state_dict(rank0_only=True) on every rank",
         "engine.save_pretrained": "call engine.save_pretrained(dir) on every rank: every rank gathers, rank 0 alone "
                                   "writes",
         "model.save_pretrained": "call peft_model.save_pretrained(dir, is_main_process=(rank == 0)) on every rank"}
CALLS = {"model.state_dict": "module.state_dict", "engine.full_state_dict": "full_state_dict",
         "engine.save_pretrained": "save_pretrained", "model.save_pretrained": "PeftModel.save_pretrained (peft"}
NO_GATHER = ("the trainable parameters (the adapters, 512 elements) are whole on every rank (under "
             "stage3_param_persistence_threshold), so rank 0 alone can save them with no gather: "
             "peft_model.save_pretrained(dir, state_dict={name: p.detach() for name, p in "
             "peft_model.named_parameters() if p.requires_grad})")


def test_each_call_made_on_rank0_alone_is_named_with_its_fix(tmp_path):
    """rank_check_timeout 2 s: every call, on the transformers GPT-2, its PEFT LoRA and a plain module."""
    r0, r1 = run_ranks(_short_cases, 2, str(tmp_path), timeout_s=240)
    kinds = {"engine.save_pretrained": "CheckpointError"}
    for kind, call, other in SHORT_CASES:
        error = kinds.get(call, "CollectiveError")
        _check_error(r0[kind, call, other], error, CALLS[call], FIXES[call])
        assert NO_GATHER not in r0[kind, call, other][1]  # the adapters are sharded here: no rank-0 path
        if other == "step":  # rank 1's gather saw rank 0 in the call: its error names it
            _check_error(r1[kind, call, other], "CollectiveError", f"rank 0: in {CALLS[call]}", FIXES[call])
            assert r0[kind, call, other][2] < 2.0, r0[kind, call, other]  # it saw rank 1 in a collective
        else:
            assert r1[kind, call, other] is None and "within rank_check_timeout (2 s)" in r0[kind, call, other][1]
    _check_error(r0["peft_whole"], "CollectiveError", CALLS["model.save_pretrained"], FIXES["model.save_pretrained"])
    assert NO_GATHER in r0["peft_whole"][1], r0["peft_whole"]
    _check_error(r0["return"], "CollectiveError", "PreTrainedModel.save_pretrained", "is_main_process=(rank == 0)")
    assert "rank 1: running (no collective of it has waited long)" in r0["return"][1], r0["return"]
    assert r1["peft_whole"] is None and r1["return"] is None


def test_the_same_saves_on_every_rank_write_the_single_process_model(tmp_path):
    import peft

    r0, r1 = run_ranks(_every_rank, 2, str(tmp_path), timeout_s=180)
    reference = _gpt2().state_dict()  # the model zeroshard wrapped, built the same way in this process
    assert r1["full"] == {} and sorted(r0["full"]) == sorted(reference)
    for values in (r0["full"], r0["state"]):
        assert all(torch.equal(values[k].cpu(), reference[k]) for k in reference), "not the single-process values"
    tied = {"lm_head.weight", "transformer.wte.weight"}
    for name in ("hf", "engine"):  # transformers may write the tied embedding and head once
        saved = r0["files"][name]
        assert set(reference) - tied <= set(saved) <= set(reference) and set(saved) & tied, (name, sorted(saved))
        assert all(torch.equal(v, reference[k]) for k, v in saved.items()), name
    model = peft.get_peft_model(_gpt2(), peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                         target_modules=["c_attn"]))
    adapters = peft.get_peft_model_state_dict(model)
    for name in ("peft", "peft_rank0"):
        saved = r0["files"][name]
        assert sorted(saved) == sorted(adapters) and all(torch.equal(saved[k], adapters[k]) for k in adapters), name
