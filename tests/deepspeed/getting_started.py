"""DeepSpeed's getting-started loop (https://www.deepspeed.ai/getting-started/), as a script has it.

The only change from a DeepSpeed script is the import. The loop is the page's:
initialize with `args` and `model_parameters`, `engine(batch)`, `backward`,
`step`, `save_checkpoint` every `save_interval` with `loss.item()` as the tag,
and the resume-if-present idiom around `load_checkpoint` (the page's
`dataloader_to_step` written out). The page passes `client_sd=client_sd`,
which DeepSpeed's `save_checkpoint` does not take; its keyword is
`client_state`, used here.
"""

import argparse

import torch.nn as nn

import zeroshard.deepspeed as deepspeed


class Net(nn.Module):
    """The loss is the model's output, as the page's `loss = model_engine(batch)` has it."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.body(x), y)


def parse_args(argv):
    parser = argparse.ArgumentParser(description="getting started")
    parser.add_argument("--save_dir", type=str)
    parser.add_argument("--save_interval", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def dataloader_to_step(data_loader, step):
    for _ in range(step):
        next(data_loader)


def main(argv, model, data_loader):
    """Returns what the test compares: the loss, learning rates and first load's result of each step."""
    cmd_args = parse_args(argv)
    params = [p for p in model.parameters() if p.requires_grad]
    model_engine, optimizer, _, _ = deepspeed.initialize(args=cmd_args, model=model, model_parameters=params)

    # load checkpoint, if there is one
    path, client_sd = model_engine.load_checkpoint(cmd_args.save_dir)
    loaded = (path, None if client_sd is None else dict(client_sd))  # for the test: the loop changes client_sd
    start = 0 if client_sd is None else client_sd["step"] + 1
    client_sd = client_sd or {}
    data_loader = iter(data_loader)
    dataloader_to_step(data_loader, start)

    losses, lrs = [], []
    for step, batch in enumerate(data_loader, start):
        if step == cmd_args.steps:
            break
        batch = tuple(t.to(model_engine.device) for t in batch)
        # forward() method
        loss = model_engine(batch)
        # runs backpropagation
        model_engine.backward(loss)
        # weight update
        model_engine.step()
        losses.append(loss.item())
        lrs.append(model_engine.get_lr())
        # save checkpoint
        if step % cmd_args.save_interval:
            client_sd["step"] = step
            ckpt_id = loss.item()
            model_engine.save_checkpoint(cmd_args.save_dir, ckpt_id, client_state=client_sd)
    return loaded, losses, lrs, model_engine
