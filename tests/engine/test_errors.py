"""Bad input is a clear error that names the cause and the fix (asserted message by message)."""

import dataclasses

import pytest
import torch

import zeroshard
from tests.distributed import RankFailure, run_ranks
from tests.recipes import GPT_CFG, Case, make_engine, make_model, micro_batch
from zeroshard.app.models import GPT


@pytest.mark.parametrize("config, message", [
    ({"zero_optimization": {"stgae": 1}}, r"unknown key 'zero_optimization.stgae' \(did you mean 'stage'\?\)"),
    ({"gradient_acumulation_steps": 2}, r"did you mean 'gradient_accumulation_steps'"),
    ({"zero_optimization": {"stage": 7}}, r"zero_optimization.stage must be one of 0, 1, 2, 3; got 7"),
    ({"zero_optimization": {"reduce_bucket_size": -5}}, r"zero_optimization.reduce_bucket_size"),
    ({"amp": {"enabled": True}}, r"amp is not supported by zeroshard: Apex AMP"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, r"bf16.enabled and fp16.enabled are both true"),
])
def test_config_errors_come_before_any_communication(config, message):
    model = make_model()
    with pytest.raises(zeroshard.ConfigError, match=message):
        zeroshard.initialize(model, torch.optim.AdamW(model.parameters()), config)


def _different_model_on_rank1(rank, world, device):
    cfg = dataclasses.replace(GPT_CFG, n_embd=48) if rank == 1 else GPT_CFG
    torch.manual_seed(0)
    model = GPT(cfg)
    zeroshard.initialize(model, torch.optim.AdamW(model.parameters()), {})


def _different_lr_on_rank1(rank, world, device):
    model = make_model()
    zeroshard.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3 * (1 + rank)), {})


def _different_config_on_rank1(rank, world, device):
    model = make_model()
    zeroshard.initialize(model, torch.optim.AdamW(model.parameters()),
                         {"zero_optimization": {"stage": 1 + rank}})


@pytest.mark.parametrize("fn, message", [
    (_different_model_on_rank1,
     r"rank 1 differs from rank 0: parameter 'wte.weight' has shape \[65, 48\] there but \[65, 32\] "
     r"on rank 0. Every rank must build the same model"),
    (_different_config_on_rank1,
     r"rank 1 differs from rank 0: its config differs in .*zero_optimization\.stage \(2 there, 1 on rank 0\)"),
    (_different_lr_on_rank1, r"rank 1 differs from rank 0: its optimizer param group 0 has other lr"),
])
def test_ranks_that_differ_all_stop_with_the_same_error(fn, message):
    with pytest.raises(RankFailure) as failure:
        run_ranks(fn, 2)
    assert failure.value.hung == []
    messages = failure.value.messages()
    assert len(messages) == 2  # every rank raised; none was left waiting in a collective
    for text in messages:
        assert "RankMismatchError" in text
        assert __import__("re").search(message, text), text


class FailingBackward(torch.autograd.Function):
    """Identity forward; its backward fails as an out-of-memory would."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise MemoryError("simulated out-of-memory in backward")


class TwoSegments(torch.nn.Module):
    """One weight used in two reentrant checkpoint segments: its gradient arrives twice."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.v = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        # The weight is captured, not passed: each segment's recomputed backward accumulates it.
        h = checkpoint(lambda t: t @ self.w, x, use_reentrant=True)
        h = checkpoint(lambda t: t @ self.w, h, use_reentrant=True)
        return (h @ self.v).sum()


class GlobalNormSGD(torch.optim.Optimizer):
    """SGD on the gradient divided by the norm of all of them: one tensor's update depends on the others."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] / (norm.item() + 1e-12))


def _misuse(rank, world, device):
    """Each misuse in turn; returns the error message each one raised (None: it did not raise)."""
    import zeroshard

    def attempt(fn):
        try:
            fn()
        except Exception as exc:  # the message is what the test checks
            return f"{type(exc).__name__}: {exc}"
        return None

    def engine():
        return make_engine(optimizer=lambda model: torch.optim.AdamW(model.parameters()), config={})

    def batch():
        return micro_batch(0, Case(), 1, 0, 0)

    def nested_hold():
        e = engine()
        with e.no_sync(), e.coalesce_grad_reduction():
            pass

    def fp16_loss_off_the_outputs():  # a loss on the parameters alone: no output could take the loss scale
        model = make_model()
        e = zeroshard.initialize(model, torch.optim.AdamW(model.parameters()), {"fp16": {"enabled": True}})
        sum(p.float().square().sum() for p in e.module.parameters()).backward()

    def divide_factor_mid_window():
        e = engine()
        e(*batch()).backward()
        e.set_gradient_divide_factor(1.0)

    def half_after_initialize():
        e = engine()
        e.module.half()
        e(*batch())

    def failed_backward():
        e = engine()
        try:
            e.backward(FailingBackward.apply(e(*batch())))
        except MemoryError:
            pass
        e(*batch())

    def wrapped_twice():
        model = make_model()
        zeroshard.initialize(model, torch.optim.AdamW(model.parameters()), {})
        zeroshard.initialize(model, torch.optim.AdamW(model.parameters()), {})

    def fp16_model(config):
        model = make_model().half()
        zeroshard.initialize(model, torch.optim.AdamW(model.parameters()), config)

    def reentrant_reuse():
        model = TwoSegments()
        e = zeroshard.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
        e.backward(e(torch.randn(3, 4, requires_grad=True)))

    def optimizer_for(kind):
        model = make_model()
        opt = {"lbfgs": lambda: torch.optim.LBFGS(model.parameters()),
               "global_norm": lambda: GlobalNormSGD(model.parameters()),
               "two_optimizers": lambda: [torch.optim.AdamW(model.parameters()),
                                          torch.optim.SGD([model.wte.weight], lr=0.1)],
               "partial": lambda: torch.optim.AdamW(list(model.parameters())[1:]),
               "foreign": lambda: torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])}[kind]()
        zeroshard.initialize(model, opt, {})

    return {
        "nested_hold": attempt(nested_hold),
        "divide_factor_mid_window": attempt(divide_factor_mid_window),
        "fp16_loss_off_the_outputs": attempt(fp16_loss_off_the_outputs),
        "step_first": attempt(lambda: engine().step()),
        "half_after_initialize": attempt(half_after_initialize),
        "failed_backward": attempt(failed_backward),
        "wrapped_twice": attempt(wrapped_twice),
        "fp16_model": attempt(lambda: fp16_model({})),
        "fp16_model_bf16_config": attempt(lambda: fp16_model({"bf16": {"enabled": True}})),
        "reentrant_reuse": attempt(reentrant_reuse),
        **{kind: attempt(lambda k=kind: optimizer_for(k))
           for kind in ("lbfgs", "global_norm", "two_optimizers", "partial", "foreign")},
    }


EXPECTED = {  # misuse -> a fragment of its message
    "nested_hold": "coalesce_grad_reduction() entered inside no_sync(); re-entry is not supported",
    "divide_factor_mid_window": "set_gradient_divide_factor() between optimizer steps only",
    "fp16_loss_off_the_outputs": "its gradients would miss the loss scale: call engine.backward(loss)",
    "step_first": "engine.step() was called without a backward (loss.backward() or engine.backward(loss))",
    "lbfgs": "LBFGS could not be run on tensors of its param group's shapes",
    "global_norm": "GlobalNormSGD's update of a tensor depends on other tensors",
    "two_optimizers": "parameter 'wte.weight' is in optimizers 0 (AdamW) and 1 (SGD) of the list",
    "partial": "parameters ['wte.weight'] require grad but are in no param group",
    "foreign": "not a parameter of the model",
    "half_after_initialize": "no longer lives in zeroshard's flat buffer",
    "failed_backward": "cannot continue: a backward failed on this rank (MemoryError",
    "wrapped_twice": "already wrapped by a zeroshard engine",
    "fp16_model": "parameters ['wte.weight', 'wpe.weight', 'blocks.0.ln1.weight'] ... are float16 and are "
                  "not float32, but the config trains in fp32: keep the model in fp32 (model.float(), or "
                  "from_pretrained(path, dtype=torch.float32)), or "
                  'enable mixed precision in the config ("bf16": {"enabled": true} or "fp16": {"enabled": true})',
    "fp16_model_bf16_config": "parameters ['wte.weight', 'wpe.weight', 'blocks.0.ln1.weight'] ... are float16 "
                              "but the config enables bf16 (bfloat16): build the model in float32 (zeroshard "
                              "casts it to bfloat16) or in bfloat16, or enable the config section that matches "
                              "the model's dtype",
    "reentrant_reuse": "use_reentrant=False",
}


def test_misuse_is_explained():
    (errors,) = run_ranks(_misuse, 1)
    assert errors.keys() == EXPECTED.keys()
    for misuse, fragment in EXPECTED.items():
        assert errors[misuse] is not None, f"{misuse} raised nothing"
        assert fragment in errors[misuse], (misuse, errors[misuse])
