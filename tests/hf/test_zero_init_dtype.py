"""`zero.Init` + `from_pretrained(path, dtype=...)` (issue 39): the checkpoint's values in the dtype asked for.

The reference is transformers' own one-process `from_pretrained(path, dtype=...)`: after `initialize`, at
stages 0-3 on 2 gloo ranks, `engine.full_state_dict()` equals its state dict bit for bit (keys, dtypes,
values), and each bucket's fp32 master equals its parameters' values upcast (made from the loaded bf16, as
DeepSpeed makes them). A tiny Llama is saved by `save_pretrained` in fp32 and in bf16 (its safetensors then
hold bf16): loaded with a torch dtype, its name, "auto", none (transformers 5's default, "auto"), and with
`zero.Init(dtype=...)`. Conflicts are `UnsupportedError` or `ModelError` naming the fix.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.hf.models import batch, config_of

BF16 = {"bf16": {"enabled": True}}
# (checkpoint, zero.Init's dtype, from_pretrained's dtype ("-": left out), config section, reference's dtype)
CASES = [
    ("fp32", None, torch.bfloat16, BF16, torch.bfloat16),
    ("fp32", None, "bfloat16", BF16, torch.bfloat16),
    ("fp32", torch.bfloat16, "-", BF16, torch.bfloat16),
    ("fp32", None, "auto", {}, "auto"),
    ("bf16", None, torch.float32, {}, torch.float32),
    ("bf16", None, "auto", BF16, "auto"),
    ("bf16", None, "-", {"bf16": {"enabled": "auto"}}, "-"),
    ("bf16", torch.float32, "-", {}, torch.float32),
]


def _saved(root) -> dict[str, str]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config_of("llama"))
    paths = {"fp32": str(root / "fp32"), "bf16": str(root / "bf16")}
    model.save_pretrained(paths["fp32"])
    model.to(torch.bfloat16).save_pretrained(paths["bf16"])
    return paths


def _kwargs(dtype) -> dict:
    return {} if isinstance(dtype, str) and dtype == "-" else {"dtype": dtype}


def _load(stage: int, path: str, init_dtype, dtype, section: dict):
    from transformers import AutoModelForCausalLM

    import zeroshard.deepspeed as deepspeed

    with deepspeed.zero.Init(dtype=init_dtype):
        model = AutoModelForCausalLM.from_pretrained(path, **_kwargs(dtype))
    built = {p.dtype for p in model.parameters()}
    config = {"train_micro_batch_size_per_gpu": 2, **section,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config)
    return engine, built


def _masters_from_params(engine) -> bool:
    """Each bucket's fp32 master is this rank's part of its parameters, upcast."""
    return all(b.master.dtype == torch.float32 and torch.equal(b.master, b._own_params().float())
               for b in engine.buckets)


def _every_case(rank, world, device, paths: dict[str, str]) -> list:
    out = []
    for checkpoint, init_dtype, dtype, section, _ in CASES:
        for stage in range(4):
            engine, built = _load(stage, paths[checkpoint], init_dtype, dtype, section)
            masters = _masters_from_params(engine)
            state = engine.full_state_dict()
            ids = batch(rank).to(device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            out.append((built, masters, state, loss.item()))
    return out


def test_zero_init_from_pretrained_with_a_dtype_equals_transformers_load_at_stages_0_to_3(tmp_path):
    from transformers import AutoModelForCausalLM

    paths = _saved(tmp_path)
    results = run_ranks(_every_case, 2, paths)
    for rank, result in enumerate(results):
        found = iter(result)
        for checkpoint, init_dtype, dtype, section, ref_dtype in CASES:
            reference = AutoModelForCausalLM.from_pretrained(paths[checkpoint], **_kwargs(ref_dtype))
            expected = reference.state_dict()
            ids = batch(rank)
            with torch.no_grad():
                expected_loss = reference(input_ids=ids, labels=ids).loss.item()
            for stage in range(4):
                built, masters, state, loss = next(found)
                case = (checkpoint, init_dtype, dtype, stage)
                assert built == {reference.dtype}, case
                assert masters, case
                assert list(state) == list(expected), case
                for key, value in expected.items():
                    assert state[key].dtype == value.dtype and torch.equal(state[key], value), (case, key)
                # bf16: zeroshard casts the buffers (rotary inv_freq) to bf16 with the model, transformers keeps
                # them in fp32; a few bf16 roundings (2^-8 each) in a loss of ~4.6.
                tolerance = 0 if reference.dtype == torch.float32 else 2e-2
                assert abs(loss - expected_loss) <= tolerance * expected_loss + 1e-6, (case, loss, expected_loss)


def test_zero_init_dtype_builds_parameters_in_it_and_conflicts_name_the_fix(tmp_path):
    from transformers import AutoModelForCausalLM

    import zeroshard.deepspeed as deepspeed

    paths = _saved(tmp_path)
    with deepspeed.zero.Init(dtype=torch.bfloat16):
        model = AutoModelForCausalLM.from_config(config_of("llama"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and all(p.is_meta for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers keep theirs
    with pytest.raises(deepspeed.UnsupportedError, match=r"zero.Init\(dtype=...\).*torch.bfloat16"):
        deepspeed.zero.Init(dtype=torch.int8)
    with pytest.raises(deepspeed.UnsupportedError, match="leave dtype out of one of the two"):
        with deepspeed.zero.Init(dtype=torch.bfloat16):
            AutoModelForCausalLM.from_pretrained(paths["fp32"], dtype="auto")  # the files' fp32
    with pytest.raises(deepspeed.UnsupportedError, match="per-module dtypes"):
        with deepspeed.zero.Init():
            AutoModelForCausalLM.from_pretrained(paths["fp32"], dtype={"": torch.bfloat16})
    for messages in run_ranks(_refused_at_initialize, 2, paths["bf16"]):
        assert "from_pretrained(path, dtype=torch.float32)" in messages[0]  # bf16 parameters, no bf16 section
        assert "are bfloat16 but the config enables fp16" in messages[1]


def _refused_at_initialize(rank, world, device, path: str) -> list[str]:
    import zeroshard

    messages = []
    for section in ({}, {"fp16": {"enabled": True}}):
        with pytest.raises(zeroshard.ModelError) as error:
            _load(3, path, None, "auto", section)
        messages.append(str(error.value))
    return messages
