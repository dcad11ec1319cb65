"""`zeroshard.meta_init()` + the model's own initialisation at stage 3, against eager construction.

Acceptance 3 (a): every norm weight and every buffer (a Llama's `inv_freq`,
BERT's `position_ids`) equals the eagerly built model's exactly; the loss
falls over 20 steps, also for a transformers model held by a plain module (a LightningModule's
`configure_model`); a parameter no init sets, and a buffer lost on the meta
device, are errors naming them.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tests.distributed import run_ranks
from tests.hf.models import STAGE3, auto_class, batch, config_of, layer_class

KINDS = ["llama", "gpt2", "bert", "qwen2"]


def _deterministic(model: nn.Module) -> dict[str, torch.Tensor]:
    """What eager construction sets without randomness: norm weights and biases, and every buffer."""
    values = {k: b.clone() for k, b in model.named_buffers()}
    for name, module in model.named_modules():
        if "Norm" in type(module).__name__:
            values.update({f"{name}.{k}": p.detach().clone() for k, p in module.named_parameters(recurse=False)})
    return values


class Wrapper(nn.Module):
    """A LightningModule's shape: a transformers model held by a plain module, with a (frozen) layer of its own
    that only `reset_parameters` initialises."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model, self.head = model, nn.Linear(4, 4)
        self.head.requires_grad_(False)

    def forward(self, **kwargs):
        return self.model(**kwargs)


def _train_from_meta(kind, device, rank, wrapped: bool = False):
    import zeroshard

    config = config_of(kind)
    torch.manual_seed(0)
    eager = auto_class(kind).from_config(config)
    with zeroshard.meta_init():
        hf = auto_class(kind).from_config(config)
        model = Wrapper(hf) if wrapped else hf
    assert all(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    engine = zeroshard.initialize(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                                           lr=1e-2), STAGE3, wrap=[layer_class(hf)])
    state = engine.full_state_dict()
    # Every buffer where the model runs: meta_init kept them on the CPU, the engine moved them.
    off_device = [k for k, b in model.named_buffers() if b.device != engine.device]
    buffers = {k: b.cpu() for k, b in model.named_buffers()}
    prefix = "model." if wrapped else ""
    expected = {prefix + k: v for k, v in _deterministic(eager).items()}
    exact = {k: torch.equal(state[k].cpu() if k in state else buffers[k], v) for k, v in expected.items()}
    finite = all(bool(torch.isfinite(t).all()) for t in state.values())
    x = batch(rank).to(device)
    losses = []
    for _ in range(20):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    # module.state_dict() at stage 3: full tensors, the same as engine.full_state_dict's.
    module_state = model.state_dict()
    shapes_ok = all(module_state[prefix + k].shape == v.shape for k, v in eager.state_dict().items())
    same = all(torch.equal(module_state[k], v) for k, v in engine.full_state_dict().items())
    return exact, finite, losses, shapes_ok, same, sorted(expected), off_device


class Scaled(nn.Module):
    """A layer with a parameter of its own and no reset_parameters: nothing initialises `scale`."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("offsets", torch.arange(4.0))  # computed in __init__

    def forward(self, x):
        return self.proj(x) * self.scale + self.offsets


def _every_parameter(module: nn.Module) -> None:
    """Sets every parameter of the model above, and no buffer."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    if isinstance(module, Scaled):
        nn.init.ones_(module.scale)


def _error(build, init=None) -> str:
    import zeroshard

    model = build()
    try:
        zeroshard.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), STAGE3, init=init)
    except zeroshard.ModelError as exc:
        return str(exc)
    return "no error"


def _ranks(rank, world, device):
    import zeroshard

    results = {kind: _train_from_meta(kind, device, rank) for kind in KINDS}
    results["wrapped gpt2"] = _train_from_meta("gpt2", device, rank, wrapped=True)

    def on_meta():
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(4, 4), Scaled())

    def under_meta_init():
        with zeroshard.meta_init():
            return nn.Sequential(nn.Linear(4, 4), Scaled())

    results["missing"] = _error(under_meta_init)
    results["buffer"] = _error(on_meta, init=_every_parameter)
    results["no_init"] = _error(on_meta)
    try:
        with zeroshard.meta_init():
            from transformers import LlamaForCausalLM

            LlamaForCausalLM.from_pretrained("/no/such/dir")  # refused before any file is read
        results["from_pretrained"] = "no error"
    except zeroshard.ModelError as exc:
        results["from_pretrained"] = str(exc)
    return results


def test_meta_init_gives_the_eager_norms_and_buffers_and_trains_and_names_what_no_init_set():
    for results in run_ranks(_ranks, 2):
        for kind in [*KINDS, "wrapped gpt2"]:  # the wrapped one: _init_weights inside, reset_parameters outside
            exact, finite, losses, shapes_ok, same, keys, off_device = results[kind]
            assert not off_device, (kind, off_device)
            assert exact and all(exact.values()), (kind, [k for k, ok in exact.items() if not ok])
            assert any("norm" in k.lower() or "ln_" in k for k in keys), keys
            assert any("inv_freq" in k for k in keys) or kind in ("gpt2", "bert", "wrapped gpt2"), keys
            assert finite, kind
            assert losses[-1] < 0.5 * losses[0], (kind, losses)
            assert shapes_ok and same, kind
        # meta_init, no init=: reset_parameters set the Linear layers, nothing set Scaled.scale.
        assert "'1.scale'" in results["missing"] and "'1.proj.weight'" not in results["missing"], results["missing"]
        assert "the model's own initialisation" in results["missing"] and "init=fn" in results["missing"]
        # torch.device("meta"): the buffer computed in __init__ is lost, and init= did not set it.
        assert "'1.offsets'" in results["buffer"] and "meta_init" in results["buffer"], results["buffer"]
        assert "meta_init" in results["no_init"], results["no_init"]
        # from_pretrained under meta_init would lose the weights it loads: refused, pointing to pretrained().
        assert "init=zeroshard.pretrained(path)" in results["from_pretrained"], results["from_pretrained"]


def test_a_meta_model_is_materialised_on_its_local_ranks_gpu_before_the_group_sets_it(monkeypatch):
    """Under torchrun every rank's current GPU is cuda:0 until the group is joined, when a meta model's
    device is chosen: it must be LOCAL_RANK's (the current one where the process sees fewer GPUs)."""
    import torch.distributed as dist

    from zeroshard.stage3.materialize import default_device

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert default_device() == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # CUDA_VISIBLE_DEVICES gave this rank one GPU
    assert default_device() == torch.device("cuda", 0)
    monkeypatch.delenv("LOCAL_RANK")
    assert default_device() == torch.device("cuda", 0)
