"""One rank of `compression_convergence.py --bias`: the demo trained with a codec, and what each step delivered.

    python benchmarks/compression_bias.py --out FILE [the demo's training flags: --stage --compress --steps --data --seed]

Started once per rank (benchmarks/launch.py sets RANK, WORLD_SIZE and the
address). The demo's model, optimizer, config and batches (app/demo/train.py),
trained on the compressed run's own path; every bucket's reduction is
watched: the micro-step's gradients it was given are also summed exactly
(torch.distributed's all_reduce, float64) and divided by N, so for the
same gradients the step compares what the codec delivered to the optimizer
(the bucket's gradient shard after backward, 1/accumulation applied, before
clipping) with the exact mean. Per step and bucket, over all ranks' shards:
|delivered - exact| / |exact|, the cosine between delivered - exact and
exact (a bias along the gradient shows as a sign), |delivered| / |exact|,
and the norm of the ranks' error feedback against |exact|; per step, the
clip coefficients the delivered and the exact global norms give
(gradient_clipping), and AdamW's update computed from each (moments kept
for both, float64, the optimizer's betas and eps, bias-corrected): its norm
ratio, its cosine, and the median over elements of sqrt(v_delivered /
v_exact). Rank 0 writes it all to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.app.demo.data import CharCorpus, load_text, micro_batch
from zeroshard.app.demo.train import add_arguments, build_model, engine_config, lr_schedule
from zeroshard.app.demo.mesh import resolve_defaults
from zeroshard.core.grad_norm import clip_coefficient


class Watch:
    """The exact mean of each bucket's gradients, taken as the bucket's reduction is launched."""

    def __init__(self, engine: zeroshard.Engine):
        self.engine = engine
        self.exact = [torch.zeros(b.flat.shard_numel if b.switches.shard_optimizer else b.flat.padded_numel,
                                  dtype=torch.float64) for b in engine.buckets]
        for i, bucket in enumerate(engine.buckets):
            bucket.reduce_grad = self._watched(i, bucket, bucket.reduce_grad)

    def _watched(self, i: int, bucket, reduce_grad):
        def run(comm, pool, scale):
            # The micro-step's input as the reduction reads it (stages 2-3: staging, its empty slots zeroed).
            given = bucket._staging_with_zeros(pool) if bucket.switches.shard_grads else bucket.full_grad
            total = given.double()  # a copy
            dist.all_reduce(total)  # torch's own sum, not the engine's comm: its records stay the codec's
            mean = total * scale  # scale = 1 / (N x accumulation): the exact path's mean, as the step sums it
            self.exact[i] += bucket.flat.shard(mean) if bucket.switches.shard_optimizer else mean
            return reduce_grad(comm, pool, scale)
        return run

    def take(self) -> list[torch.Tensor]:
        """This window's exact means, by bucket; starts the next window at zero."""
        out, self.exact = self.exact, [torch.zeros_like(e) for e in self.exact]
        return out


def owned(bucket, tensor: torch.Tensor) -> torch.Tensor:
    """The part of a bucket's gradient this rank counts in a global norm: its shard (stage 0: of the whole)."""
    return tensor if bucket.switches.shard_optimizer else bucket.flat.shard(tensor)


class Adam:
    """AdamW's moments of one gradient sequence (float64): its bias-corrected update, no weight decay or lr."""

    def __init__(self, numel: int, betas: tuple[float, float], eps: float):
        self.m, self.v = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64)
        self.betas, self.eps, self.t = betas, eps, 0

    def update(self, grad: torch.Tensor) -> torch.Tensor:
        b1, b2 = self.betas
        self.t += 1
        self.m.mul_(b1).add_(grad, alpha=1 - b1)
        self.v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        return (self.m / (1 - b1 ** self.t)) / ((self.v / (1 - b2 ** self.t)).sqrt() + self.eps)


def summed(values: list[float]) -> list[float]:
    """Each value summed over the ranks (one all_reduce)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def step_figures(engine: zeroshard.Engine, exact: list[torch.Tensor], adams: tuple[Adam, Adam],
                 clip: float) -> dict:
    """One step's comparison, from every rank's shards (called after backward, before engine.step())."""
    rows, delivered_all, exact_all = [], [], []
    for bucket, x in zip(engine.buckets, exact):
        d = bucket.grad_shard.double()
        held = sum(t.double().square().sum().item() for t in bucket.feedback.tensors().values()) \
            if bucket.feedback is not None else 0.0
        dx, xx, dd, ee, fb = summed([((d - x) * x).sum().item(), x.square().sum().item(), d.square().sum().item(),
                                     (d - x).square().sum().item(), held])
        rows.append({"rel_error": (ee / xx) ** 0.5, "cosine": dx / (ee * xx) ** 0.5 if ee and xx else 0.0,
                     "norm_ratio": (dd / xx) ** 0.5, "feedback": fb ** 0.5 / xx ** 0.5})
        delivered_all.append(owned(bucket, d))
        exact_all.append(owned(bucket, x))
    d, x = torch.cat(delivered_all), torch.cat(exact_all)
    dd, xx = summed([d.square().sum().item(), x.square().sum().item()])
    clip_d = clip_coefficient(dd ** 0.5, clip) if clip > 0 else 1.0
    clip_x = clip_coefficient(xx ** 0.5, clip) if clip > 0 else 1.0
    ud, ux = adams[0].update(d * clip_d), adams[1].update(x * clip_x)
    uu, vv, uv = summed([ud.square().sum().item(), ux.square().sum().item(), (ud * ux).sum().item()])
    v_ratio = (adams[0].v / adams[1].v.clamp_min(1e-300)).sqrt()
    return {"buckets": rows, "norm_ratio": (dd / xx) ** 0.5, "clip_delivered": clip_d, "clip_exact": clip_x,
            "adam_norm_ratio": (uu / vv) ** 0.5, "adam_cosine": uv / (uu * vv) ** 0.5,
            "adam_v_ratio_median": v_ratio[adams[1].v > 0].median().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    resolve_defaults(args)  # --model and the rest, as `zeroshard train` has them
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    corpus = CharCorpus.from_text(load_text(args.data))
    model, optimizer = build_model(args, corpus, torch.device("cpu"))
    config = engine_config(args)
    engine = zeroshard.initialize(model, optimizer, config)
    schedule = lr_schedule(optimizer, args.steps)
    watch, rank, world = Watch(engine), dist.get_rank(), dist.get_world_size()
    group = optimizer.param_groups[0]
    numel = sum(owned(b, b.grad_shard).numel() for b in engine.buckets)
    adams = (Adam(numel, group["betas"], group["eps"]), Adam(numel, group["betas"], group["eps"]))
    steps = []
    for step in range(args.steps):
        batch = corpus.global_batch(step, args.micro_batch * world * args.accumulation, model.cfg.block_size,
                                    args.seed)
        loss_sum = torch.zeros(())
        for micro in range(args.accumulation):
            x, y = micro_batch(batch, rank, world, micro, args.accumulation)
            loss = engine(x, y)
            engine.backward(loss)
            if micro == args.accumulation - 1:
                steps.append(step_figures(engine, watch.take(), adams, config.gradient_clipping))
            engine.step()
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum)
        steps[-1]["loss"] = loss_sum.item() / (world * args.accumulation)
        schedule.step()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, type(None)))},
                       "steps": steps, "summary": summary(steps)}, f, indent=1)
    dist.destroy_process_group()


def summary(steps: list[dict]) -> dict:
    """Medians over the steps (and the buckets), the share of steps whose error points against the gradient,
    and the feedback's norm at the start, middle and end."""
    buckets = [row for s in steps for row in s["buckets"]]
    third = max(1, len(steps) // 3)
    feedback = [statistics.fmean(row["feedback"] for row in s["buckets"]) for s in steps]
    med = lambda key, rows: statistics.median(r[key] for r in rows)
    return {"rel_error": med("rel_error", buckets), "cosine": med("cosine", buckets),
            "cosine_mean": statistics.fmean(r["cosine"] for r in buckets),
            "negative_cosine_share": sum(r["cosine"] < 0 for r in buckets) / len(buckets),
            "bucket_norm_ratio": med("norm_ratio", buckets), "norm_ratio": med("norm_ratio", steps),
            "clip_ratio": statistics.median(s["clip_delivered"] / s["clip_exact"] for s in steps),
            "clipped_share": sum(s["clip_exact"] < 1 for s in steps) / len(steps),
            "adam_norm_ratio": med("adam_norm_ratio", steps), "adam_cosine": med("adam_cosine", steps),
            "adam_v_ratio_median": med("adam_v_ratio_median", steps),
            "feedback_first_third": statistics.fmean(feedback[:third]),
            "feedback_last_third": statistics.fmean(feedback[-third:])}


if __name__ == "__main__":
    main()
