"""A LightningModule of the tests' own and the Trainer runs the Lightning tests compare.

Every rank records, for each micro-batch, the mean of all ranks' losses
(`all_gather`), so a run on 2 ranks and one on 1 process with twice the batch
record the same numbers when they train the same global batches.
"""

from __future__ import annotations

import contextlib
import os

import torch

SAMPLES, FEATURES = 64, 8
LR = 1e-2


def lightning_module(in_configure_model: bool = False):
    """The regression module; `in_configure_model`: its layers built in `configure_model` (under the strategy's
    `model_sharded_context`), the device they were built on recorded."""
    import lightning as L

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.losses, self.val_losses, self.built_on = [], [], None
            if not in_configure_model:
                self.net = _layers()

        def configure_model(self):
            if not hasattr(self, "net"):
                self.net = _layers()
                self.built_on = self.net[0].weight.device.type

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, index):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self(x), y)
            self.losses.append(self.all_gather(loss.detach().float()).mean().item())
            return loss

        def validation_step(self, batch, index):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self(x).float(), y.float())
            self.val_losses.append(self.all_gather(loss).mean().item())

        def predict_step(self, batch, index):
            return self(batch[0]).float()

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)  # crosses the resume at step 4
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Regression()


def _layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                               torch.nn.GELU(), torch.nn.Linear(32, 1))


def dataset(n: int = SAMPLES, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :4].sum(1, keepdim=True) - x[:, 4:].prod(1, keepdim=True)))


@contextlib.contextmanager
def torchrun_env(rank: int, world: int):
    """What torchrun sets, from which Lightning knows the processes exist (the group is the test's, formed)."""
    saved = dict(os.environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", TORCHELASTIC_RUN_ID="lightning-test", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29500")
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def trainer(device, world: int, strategy, out, epochs: int, **kw):
    import lightning as L

    settings = dict(accelerator="gpu" if device.type == "cuda" else "cpu", devices=world, strategy=strategy,
                    max_epochs=epochs, accumulate_grad_batches=2, gradient_clip_val=0.5, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    default_root_dir=str(out), num_sanity_val_steps=0)
    return L.Trainer(**{**settings, **kw})


def loaders(batch: int):
    train = torch.utils.data.DataLoader(dataset(), batch_size=batch)
    val = torch.utils.data.DataLoader(dataset(16, seed=2), batch_size=batch)
    return train, val


def fit(device, world: int, strategy, out, epochs: int, batch: int = 4, ckpt_path=None, module=None, **kw) -> dict:
    """One fit: the losses it trained (all ranks' mean per micro-batch), validation losses, global_step, the
    trainer and its module."""
    module = module if module is not None else lightning_module()
    run = trainer(device, world, strategy, out, epochs, **kw)
    run.fit(module, *loaders(batch), ckpt_path=ckpt_path)
    return {"losses": module.losses, "val": module.val_losses, "step": run.global_step, "trainer": run,
            "module": module}


def predictions(run) -> torch.Tensor:
    """trainer.predict over 16 fixed inputs, gathered from all ranks in sample order."""
    loader = torch.utils.data.DataLoader(dataset(16, seed=3), batch_size=4)
    out = torch.cat(run["trainer"].predict(run["module"], loader))
    return run["trainer"].strategy.all_gather(out).cpu()
