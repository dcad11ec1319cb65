"""overlap_param_gather: stages 1-2's post-step all-gather waited for at first use in the next forward.

Reference: the same training with the gathers waited for inside `engine.step()`
(overlap_param_gather false), in the same process; the overlapped run must
equal it bit for bit (losses, weights, every value read). The gathers of the
overlapped run are held back: each lands as usual, but its values are set
aside and the flat buffer is filled with NaN until the wait (`_hold_back`),
so any read the engine's waits do not cover shows as NaN, as a direct read
of the parameters right after the step does (the documented rule: call
`engine.wait_for_params()` first). The count of collectives per step is
checked in tests/comm/test_comm_volume.py.
"""

import dataclasses
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tests.distributed import run_ranks
from tests.recipes import (Case, loss_of, make_engine, make_model, make_optimizer, micro_batch, train_reversal,
                           train_zeroshard)

STEPS = 2  # step 0's gathers are waited for in step 1's forward, step 1's by the readers of the weights
PARITY = [
    Case(stage=1, accumulation=3, clip=0.5),
    Case(stage=2, accumulation=3, clip=0.5),
    Case(stage=1, accumulation=2, clip=0.5, dtype="bf16", optimizer="adamw1_slow"),
    Case(stage=2, accumulation=2, clip=0.5, dtype="bf16", optimizer="adamw1_slow", variant="twice"),
    Case(stage=2, optimizer="adamw1", weights_codec="int8", variant="reentrant"),  # the quantized gather
]


class _HeldBack:
    """A gather that has landed, its values set aside until its wait."""

    def __init__(self, flat, values: torch.Tensor):
        self.flat, self.values = flat, values

    def wait(self) -> None:
        self.flat.data.copy_(self.values)


def _hold_back():
    """Make every post-step gather read as NaN until it is waited for; returns the undo."""
    from zeroshard.core.bucket import Bucket

    original = Bucket.gather_params

    def held(self, comm):
        original(self, comm).wait()
        values = self.flat.data.clone()
        self.flat.data.fill_(float("nan"))
        return _HeldBack(self.flat, values)

    Bucket.gather_params = held
    return lambda: setattr(Bucket, "gather_params", original)


class OutOfOrder(torch.nn.Module):
    """Linear layers run in another order than they are registered in (and bucketed in), one weight shared by
    two of them, the second user running first; and a ParameterList (no forward: this forward reads it), in
    a bucket of its own (registered first, so bucketed last, and too large to share the bucket before it)."""

    def __init__(self):
        super().__init__()
        self.mixes = torch.nn.ParameterList([torch.nn.Parameter(torch.eye(16) + 0.1 * torch.randn(16, 16))])
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.layers[3].weight = self.layers[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in (3, 1, 2, 0):
            x = torch.tanh(self.layers[i](x))
        return x @ self.mixes[0]


def _parity(rank, world, device) -> list:
    return [[train_zeroshard(rank, world, device, dataclasses.replace(case, overlap_gather=overlap), STEPS)
             for overlap in (False, True)] for case in PARITY]


def _out_of_order(rank, world, device) -> list:
    out = []
    for stage in (1, 2):
        config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {
            "stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 300}}
        runs = []
        for overlap in (False, True):
            config["zero_optimization"]["overlap_param_gather"] = overlap
            engine = make_engine(model=lambda: OutOfOrder().to(device), optimizer="adamw1", config=config)
            losses = train_reversal(engine, rank, device, STEPS)
            alone = any(len(b.params) == 1 and b.params[0] is engine.module.mixes[0] for b in engine.buckets)
            runs.append((losses, [t.clone() for t in engine.full_state_dict().values()], (len(engine.buckets), alone)))
        out.append(runs)
    return out


def _readers(out_dir: str, x: torch.Tensor, hidden: torch.Tensor) -> dict:
    """Ways to read parameters right after engine.step(), each one's values (one tensor)."""
    import zeroshard

    def cat(tensors) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).float().clone() for t in tensors])

    def evaluated(e, times: int = 1) -> torch.Tensor:
        e.eval()
        with torch.no_grad():
            out = cat(e(x) for _ in range(times))
        e.train()
        return out

    def gathered(e) -> torch.Tensor:
        with zeroshard.gathered_parameters(list(e.module.parameters())):
            return cat(e.module.parameters())

    def saved(e) -> torch.Tensor:
        e.save_16bit_model(Path(out_dir) / str(id(e)))
        state = torch.load(Path(out_dir) / str(id(e)) / "pytorch_model.bin") if e.comm.rank == 0 else {}
        return cat(state.values()) if state else torch.zeros(1)

    return {
        "module.state_dict()": lambda e: cat(e.module.state_dict().values()),
        "engine.full_state_dict()": lambda e: cat(e.full_state_dict().values()),
        "engine.parameters()": lambda e: cat(e.parameters()),
        "gathered_parameters": gathered,
        "engine.wait_for_params(), then the parameters": lambda e: (e.wait_for_params(), cat(e.module.parameters()))[1],
        "an eval forward under no_grad": evaluated,
        "two eval forwards": lambda e: evaluated(e, times=2),
        "the forward of one block alone": lambda e: cat([e.module.blocks[1](hidden)]),
        "save_16bit_model": saved,
        "the parameters, read directly (the rule: NaN while held back)": lambda e: cat(e.module.parameters()),
    }


def _after_the_step(rank, world, device, out_dir) -> dict:
    case = Case(stage=2, optimizer="adamw1")
    engines = [make_engine(dataclasses.replace(case, overlap_gather=overlap), device=device, deepspeed=True)
               for overlap in (False, True)]  # DeepSpeed's readers too: parameters(), save_16bit_model
    x, _ = (t.to(device) for t in micro_batch(100, case, world, rank, 0))
    hidden = torch.randn(2, x.shape[1], engines[0].module.cfg.n_embd, generator=torch.Generator().manual_seed(7))
    out = {}
    for step, (name, read) in enumerate(_readers(out_dir, x, hidden.to(device)).items()):
        values = []
        for engine in engines:
            x_, y_ = (t.to(device) for t in micro_batch(step, case, world, rank, 0))
            engine.backward(loss_of(engine, x_, y_))
            engine.step()
            values.append(read(engine))
        out[name] = values
    return out


def _injected(*args) -> None:
    raise RuntimeError("injected")


def _a_rank_fails_after_the_step(rank, world, device) -> dict:
    """Rank 1's optimizer step fails in step 1, after rank 0's step launched its gathers: rank 0's next forward
    waits for rank 1's shards, which never come, and stops with a CollectiveError instead of hanging."""
    import zeroshard

    group = dist.new_group([0, 1], backend="gloo", timeout=timedelta(seconds=15))  # its own: left with a stuck exchange
    case = Case(stage=2, optimizer="adamw1", overlap_gather=True)
    config = case.config() | {"collective_timeout": 2.0, "rank_check_timeout": 2.0}
    model = make_model(device=device)
    engine = zeroshard.initialize(model, make_optimizer("adamw1", model), config, group=group)
    try:
        for step in range(3):
            if rank == 1 and step == 1:
                engine.offload.tiers.step = _injected
            x, y = (t.to(device) for t in micro_batch(step, case, world, rank, 0))
            engine.backward(loss_of(engine, x, y))
            engine.step()
    except Exception as exc:  # noqa: BLE001 -- what each rank met is the result
        return {"error": type(exc).__name__, "message": str(exc), "step": step, "state": engine.state.name}
    return {"error": None}


def _run(rank, world, device, out_dir):
    undo = _hold_back()
    try:
        out = {"parity": _parity(rank, world, device), "out_of_order": _out_of_order(rank, world, device),
               "after": _after_the_step(rank, world, device, out_dir)}
    finally:
        undo()
    return out | {"failure": _a_rank_fails_after_the_step(rank, world, device)}  # gathers as they are: in flight


def test_overlapped_gathers_train_and_read_bitwise_as_waited_ones(tmp_path):
    ranks = run_ranks(_run, 2, str(tmp_path), timeout_s=240)
    for out in ranks:
        for case, ((ref_losses, ref_weights), (losses, weights)) in zip(PARITY, out["parity"]):
            assert losses == ref_losses, case
            assert torch.equal(weights, ref_weights), case
        for (ref_losses, ref_state, _), (losses, state, (buckets, alone)) in out["out_of_order"]:
            assert buckets > 2 and alone  # several buckets, used out of order; the ParameterList's alone in one
            assert losses == ref_losses and all(torch.equal(a, b) for a, b in zip(state, ref_state))
        for name, (reference, overlapped) in out["after"].items():
            if "directly" in name:
                assert not torch.isnan(reference).any() and torch.isnan(overlapped).any(), name
            else:
                assert torch.equal(reference, overlapped), name
    stopped, failed = ranks[0]["failure"], ranks[1]["failure"]
    assert failed["error"] == "RuntimeError" and "injected" in failed["message"] and failed["step"] == 1, failed
    assert stopped["error"] == "CollectiveError" and stopped["step"] == 2 and stopped["state"] == "FAILED", stopped
    assert "all_gather" in stopped["message"], stopped["message"]
