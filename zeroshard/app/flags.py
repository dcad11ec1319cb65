"""Command-line pieces that several `zeroshard` commands share: argparse types, flags, subcommands.

Each flag that more than one command takes is declared here once, with its
type, choices and metavar; a command passes its own default and help where
the flag's meaning differs there (`compare`'s --steps are per run). The
commands: `train` (cli.py, and each rank's `python -m zeroshard.app.demo.train`),
`compare`, `estimate`, `config check` and `consolidate`.
"""

from __future__ import annotations

import argparse
import os
from typing import Iterable

from zeroshard.app.models import PRESETS
from zeroshard.dtypes import TRAINING_DTYPES

# ---- argparse types ----

def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got '{text}'") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def true_or_false(text: str) -> bool:
    """argparse type: `true` or `false`, as in JSON configs."""
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got '{text}'")
    return text.lower() == "true"


# ---- subcommands and the flags they share ----

def add_command(commands: argparse._SubParsersAction, name: str, help: str, description: str,
                epilog: str | None = None) -> argparse.ArgumentParser:
    """A `zeroshard NAME` subcommand; its flag errors print its own usage (`args.command_parser`)."""
    parser = commands.add_parser(name, help=help, description=description, epilog=epilog,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(command_parser=parser)
    return parser


def add_group(commands: argparse._SubParsersAction, name: str, help: str) -> argparse._SubParsersAction:
    """A `zeroshard NAME ACTION` group (config check, checkpoint verify): its actions' subparsers."""
    group = commands.add_parser(name, help=help)
    return group.add_subparsers(dest=f"{name}_command", metavar="ACTION", required=True)


def add_nproc(parser: argparse.ArgumentParser, default: int | None, help: str) -> None:
    """--nproc; a default of None is resolved by the command, whose `help` says how."""
    parser.add_argument("--nproc", type=positive_int, default=default, metavar="N",
                        help=help if default is None else f"{help} (default: %(default)s)")


def add_steps(parser: argparse.ArgumentParser, default: int, help: str = "optimizer steps") -> None:
    parser.add_argument("--steps", type=positive_int, default=default, help=f"{help} (default: %(default)s)")


def add_model(parser: argparse.ArgumentParser, default: str | None = "demo",
              help: str = "GPT size preset (default: %(default)s)") -> None:
    """--model: the demo GPT's size preset (None: the command picks it, and its `help` says how)."""
    parser.add_argument("--model", choices=sorted(PRESETS), default=default, help=help)


def add_mesh(parser: argparse.ArgumentParser) -> None:
    """--tp, --pp, --micro-batches: the 3D mesh of `zeroshard train` (app/demo/mesh.py)."""
    parser.add_argument("--tp", type=positive_int, default=1, metavar="T",
                        help="tensor-parallel ranks: each transformer block's heads and MLP split T ways "
                             "(default: %(default)s)")
    parser.add_argument("--pp", type=positive_int, default=1, metavar="P",
                        help="pipeline stages: the blocks split into P stages, trained with 1F1B "
                             "(default: %(default)s)")
    parser.add_argument("--micro-batches", type=positive_int, default=None, metavar="M",
                        help="with --pp: micro-batches each data-parallel rank's rows split into per step, "
                             "of --micro-batch rows each (default: 2 x P)")


def add_data(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", metavar="FILE", default=None,
                        help="UTF-8 text file to train on (default: the King James Bible)")


def add_micro_batch(parser: argparse.ArgumentParser, default: int | None, help: str) -> None:
    parser.add_argument("--micro-batch", type=positive_int, default=default, metavar="ROWS", help=help)


def add_dtype(parser: argparse.ArgumentParser, default: str | None, help: str) -> None:
    """--dtype: one of the training dtypes' names (zeroshard.dtypes)."""
    parser.add_argument("--dtype", choices=TRAINING_DTYPES, default=default, help=help)


def as_argv(args: argparse.Namespace, names: Iterable[str], paths: Iterable[str] = ()) -> list[str]:
    """The flags `names` of `args` (those not None) as a command line; `paths` made absolute.

    What a command passes on to another process: its working directory may differ.
    """
    argv = []
    for name in names:
        value = getattr(args, name)
        if value is None:
            continue
        if name in paths:
            value = os.path.abspath(value)
        argv += ["--" + name.replace("_", "-"), str(value).lower() if isinstance(value, bool) else str(value)]
    return argv
