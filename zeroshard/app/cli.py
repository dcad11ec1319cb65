"""The `zeroshard` command.

`zeroshard train` launches local ranks through torchrun's launcher
(`torch.distributed.run`), each running `python -m zeroshard.app.demo.train` with the
same flags, so the demo that runs on a laptop runs unchanged on several
nodes (`--nnodes`, `--rdzv-endpoint`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

from zeroshard.app.demo import compare
from zeroshard.app.estimate import cli as estimate_cli
from zeroshard.app.tune import cli as tune_cli
from zeroshard.app.errors import UsageError
from zeroshard.app.flags import add_command, add_dtype, add_group, add_nproc, positive_int
from zeroshard.app.models import PRESETS
from zeroshard.app.demo.train import add_arguments, engine_config, to_argv
from zeroshard.app.demo.mesh import flag_error, resolve_defaults
from zeroshard.checkpoint import CheckpointError
from zeroshard.checkpoint.consolidate import write
from zeroshard.checkpoint.files import parse_manifest, resolve
from zeroshard.checkpoint.frozen import describe, excluded
from zeroshard.checkpoint.verify import verify
from zeroshard.config import Config, ConfigError, ConfigFacts, ConfigWarning
from zeroshard.dtypes import DTYPES

EXAMPLES = """\
examples:
  zeroshard train                          2 ranks, ZeRO stage 2, the Bible, about a minute on CPU
  zeroshard train --stage 0 --steps 50     plain data parallel (all-reduce), for comparison
  zeroshard train --nproc 4 --data my.txt  4 ranks on your own text file
  zeroshard train --tp 2 --pp 2            a 3D mesh: 8 ranks as pp=2 x dp=2 x tp=2, 1F1B, GPT 'tiny'
  zeroshard train --config ds_config.json --report out/   a DeepSpeed-style config; JSON and charts in out/
  zeroshard config check ds_config.json --world-size 8
                                           validate a DeepSpeed config, print what zeroshard will use
  zeroshard train --dtype bf16             bf16 parameters, fp32 master weights: 2+2+12 bytes per parameter
  zeroshard train --offload cpu            ZeRO-Offload: fp32 masters and AdamW state in host memory, stepped on
                                           the CPU; the report shows the device, host and disk pools per rank
  zeroshard train --stage 3 --offload nvme --offload-params
                                           ZeRO-Infinity: optimizer state and parameter shards in swap files
                                           (under --nvme-path DIR; default: a temp directory, removed after)
  zeroshard train --save-every 50          sharded checkpoints in ./checkpoints; after a stop, go on with
  zeroshard train --save-every 50 --resume checkpoints   (any --nproc or --stage reads them)
  zeroshard consolidate checkpoints model.safetensors   one state dict for the plain model
  zeroshard checkpoint verify checkpoints  check every file of the latest tag (sizes, checksums, save id)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zeroshard",
        description="ZeRO data parallelism (stages 0-3) for PyTorch on torch.distributed.",
        epilog="Run `zeroshard COMMAND --help` for a command's flags.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    train = add_command(
        commands, "train", help="train the demo GPT on N local ranks and compare memory and traffic with the formulas",
        description="Train a small character-level GPT with ZeRO on N ranks (gloo on CPU, NCCL on\n"
                    "GPU, one GPU per rank). Rank 0 shows progress, a generated sample, and tables\n"
                    "of the measured per-rank memory and per-step communication next to the ZeRO\n"
                    "paper's formulas.",
        epilog=EXAMPLES)
    launch = train.add_argument_group("launch (torchrun)")
    add_nproc(launch, None, "ranks (processes) on this node (default: 2, or 2 x tp x pp with --tp/--pp: dp = 2)")
    launch.add_argument("--nnodes", type=positive_int, default=1, metavar="NODES",
                        help="nodes; with more than one, run the same command on each node "
                             "and give --rdzv-endpoint (default: %(default)s)")
    launch.add_argument("--rdzv-endpoint", metavar="HOST:PORT", default=None,
                        help="rendezvous address shared by all nodes (default: a free local port)")
    launch.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="restart the ranks up to N times after one dies (torchrun's elastic agent); each "
                             "restart resumes from the latest complete checkpoint of --save-dir, which "
                             "--save-every writes (default: %(default)s)")
    add_arguments(train.add_argument_group("training"))
    estimate_cli.add_parser(commands)
    compare.add_parser(commands)
    tune_cli.add_parser(commands)
    add_config_command(commands)
    add_consolidate_command(commands)
    add_checkpoint_command(commands)
    return parser


def add_config_command(commands: argparse._SubParsersAction) -> None:
    """`zeroshard config check FILE [--world-size N]`."""
    actions = add_group(commands, "config", "work with DeepSpeed-style JSON config files")
    check = add_command(
        actions, "check", help="validate a config file and print the effective configuration",
        description="Validate a DeepSpeed-style JSON config and print the effective configuration\n"
                    "(JSON, every key with its default and each \"auto\" resolved), or the error.")
    check.add_argument("file", metavar="FILE", help="path to the JSON config")
    check.add_argument("--world-size", type=positive_int, default=None, metavar="N",
                       help="ranks, to derive and check the batch sizes (default: unknown)")


def run_config_check(args: argparse.Namespace) -> int:
    """Print the effective config as JSON (stdout) and what loading decided (stderr: "auto" resolved,
    keys with no effect), or the error (stderr); returns the exit status.

    No model, optimizer or scheduler exists here: an "auto" that only `zeroshard.initialize` can resolve
    (from the model's dtype, the optimizer passed in code, ...) is printed as "auto (at initialize)" and
    listed with where initialize takes it from (an error there if nothing resolves it).
    """
    try:
        with warnings.catch_warnings():  # "strict": false: the report lists each ignored key
            warnings.simplefilter("ignore", ConfigWarning)
            config, report = Config.load_with_report(args.file, ConfigFacts(world_size=args.world_size,
                                                                            deferred=True))
    except ConfigError as error:
        print(f"zeroshard config check: {error}", file=sys.stderr)
        return 1
    effective = config.to_dict()
    for dotted, _ in report.deferred:
        *parents, key = dotted.split(".")
        section = effective
        for parent in parents:
            section = section.setdefault(parent, {}) if isinstance(section.get(parent), dict) else {}
        section[key] = "auto (at initialize)"
    if block := report.block():
        print(block, file=sys.stderr)
    print(json.dumps(effective, indent=2))
    return 0


def add_consolidate_command(commands: argparse._SubParsersAction) -> None:
    """`zeroshard consolidate CHECKPOINT OUT [--tag T] [--dtype D]`."""
    parser = add_command(
        commands, "consolidate", help="join a sharded checkpoint into one safetensors state dict",
        description="Join every rank's shard of a zeroshard checkpoint into one safetensors file keyed\n"
                    "as the model's state_dict(): model.load_state_dict(safetensors.torch.load_file(OUT)).\n"
                    "Runs in one process, on any machine; trained parameters come from the fp32 masters.")
    parser.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="a save directory (its 'latest' tag) or one tag's directory")
    parser.add_argument("out", metavar="OUT", help="the .safetensors file to write, or a directory for "
                        "model.safetensors (created if missing); a Hugging Face model's config.json goes beside it")
    parser.add_argument("--tag", default=None, help="the tag to read in CHECKPOINT (default: its 'latest')")
    add_dtype(parser, None, "cast floating-point tensors (default: fp32 masters, frozen ones as stored)")


def run_consolidate(args: argparse.Namespace) -> int:
    """Verify the checkpoint, then write the consolidated safetensors file; or print every problem (stderr)
    and write nothing. Returns the exit status."""
    _, problems = verify(args.checkpoint, args.tag)
    try:
        if problems:
            raise CheckpointError(problems[0])
        count, files = write(args.checkpoint, args.out, args.tag, DTYPES.get(args.dtype), verified=True)
    except CheckpointError as error:
        for problem in problems or [str(error)]:
            print(f"zeroshard consolidate: {_one_line(problem)}", file=sys.stderr)
        return 1
    print(f"wrote {count} tensors to {files[0]}" + "".join(f", {f.name} beside it" for f in files[1:]))
    _say_what_it_holds(resolve(args.checkpoint, args.tag), "the file holds no more: load it onto the base model "
                       "with model.load_state_dict(state, strict=False); no config.json was written")
    return 0


def add_checkpoint_command(commands: argparse._SubParsersAction) -> None:
    """`zeroshard checkpoint verify CHECKPOINT [--tag T]`."""
    actions = add_group(commands, "checkpoint", "work with sharded checkpoints")
    verify_parser = add_command(
        actions, "verify", help="check a checkpoint's files as a load would, without loading it",
        description="Check a zeroshard checkpoint as engine.load_checkpoint does, in one process, without\n"
                    "a model: the manifest and its seal, every file's presence, size, crc32 and save id,\n"
                    "each tensor's dtype against the manifest, state.pt's parts, names that stay inside\n"
                    "the directory, and that every element is held. One line per problem; exit status 1\n"
                    "if there is any.")
    verify_parser.add_argument("checkpoint", metavar="CHECKPOINT",
                               help="a save directory (its 'latest' tag) or one tag's directory")
    verify_parser.add_argument("--tag", default=None, help="the tag to check in CHECKPOINT (default: its 'latest')")


def run_checkpoint_verify(args: argparse.Namespace) -> int:
    """Print each problem of the checkpoint on its own line (stdout), then a summary; returns the exit status."""
    path, problems = verify(args.checkpoint, args.tag)
    for problem in problems:
        print(_one_line(problem))
    where = path if path is not None else args.checkpoint
    if problems:
        print(f"zeroshard checkpoint verify: {where}: {len(problems)} problem{'s' if len(problems) > 1 else ''}; "
              "do not load it (restore the files named, or load an earlier tag)", file=sys.stderr)
        return 1
    print(f"{where}: every file is whole (sizes, checksums, save id, dtypes, keys)")
    _say_what_it_holds(path, "it resumes with load_checkpoint into an engine over the same base model, loaded "
                       "again")
    return 0


def _say_what_it_holds(path: Path, then: str) -> None:
    """A checkpoint saved without its frozen parameters says so, in a line of its own (others: nothing)."""
    manifest = parse_manifest(path)
    if excluded(manifest):
        print(f"{path}: {describe(manifest)}; {then}")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """torchrun's command line for `args`: the launcher's flags, then the module and its flags."""
    resolve_defaults(args)  # --nproc's default follows from --tp and --pp
    if args.rdzv_endpoint is None:
        rendezvous = ["--standalone"]  # a C10d store on a free port of this machine
    else:
        rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint]
    return ["--nnodes", str(args.nnodes), "--nproc-per-node", str(args.nproc), *rendezvous,
            "--max-restarts", str(args.max_restarts),
            "--module", "zeroshard.app.demo.train", *to_argv(args)]


def run_train(args: argparse.Namespace) -> int:
    """Launch the ranks and wait for them; returns the exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # Ranks share this machine's cores; torchrun would otherwise set 1 thread and warn about it.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    if args.max_restarts:
        # Each generation of ranks its own store: on the rendezvous' shared one, gloo's connect after a
        # restart can read the dead generation's addresses and hang (pytorch/pytorch#135712).
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        run(parse_args(torchrun_argv(args)))
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()  # the root cause; the others were stopped after it
        print(f"zeroshard train: rank {rank} failed first (exit code {failure.exitcode}); "
              "its error is printed above", file=sys.stderr)
        return 1
    return 0


def _check_data(parser: argparse.ArgumentParser, path: str, block_size: int) -> None:
    """Reject a --data file the ranks could not train on, before launching them."""
    if not Path(path).is_file():
        parser.error(f"argument --data: no such file '{path}'")
    try:
        length = len(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        parser.error(f"argument --data: cannot read '{path}' as UTF-8 text ({error})")
    if length <= block_size:
        parser.error(f"argument --data: '{path}' has {length} characters; the model reads "
                     f"{block_size} + 1 at a time, so give a longer text")


def _check_config(args: argparse.Namespace) -> None:
    """Reject a --config file (with the flags on top) before launching ranks that would all fail."""
    try:
        engine_config(argparse.Namespace(**vars(args)))  # a copy: it fills in the resolved values
    except UsageError as error:  # flags that cannot work together: named as they are
        args.command_parser.error(str(error))
    except ConfigError as error:
        args.command_parser.error(f"argument --config: {error}")


def _check_resume(args: argparse.Namespace) -> None:
    """Reject a --resume path that holds no readable checkpoint, before launching the ranks."""
    from zeroshard.checkpoint.files import read_manifest, resolve

    try:
        read_manifest(resolve(args.resume, None))
    except CheckpointError as error:
        args.command_parser.error(f"argument --resume: {error}")


# The commands besides train; argparse has checked that `args.command` is one of them.
_RUN = {"estimate": estimate_cli.run, "compare": compare.run, "tune": tune_cli.run, "config": run_config_check,
        "consolidate": run_consolidate, "checkpoint": run_checkpoint_verify}


def main(argv: list[str] | None = None) -> int:
    """`zeroshard COMMAND [flags]`; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "train":
        resolve_defaults(args)  # --model, --nproc and --micro-batches follow from --tp and --pp
        if (why := flag_error(args, args.nproc * args.nnodes)) is not None:
            args.command_parser.error(why)
        if args.nnodes > 1 and args.rdzv_endpoint is None:
            args.command_parser.error("--nnodes above 1 needs --rdzv-endpoint HOST:PORT, "
                                      "the same on every node")
        if args.data is not None:
            _check_data(args.command_parser, args.data, PRESETS[args.model].block_size)
        if args.nodes is not None and args.nproc % args.nodes:
            args.command_parser.error(f"argument --nodes: {args.nodes} nodes must divide the {args.nproc} ranks "
                                      "of --nproc on this machine")
        if args.max_restarts and args.save_every is None:
            args.command_parser.error("--max-restarts resumes each restart from the latest checkpoint in "
                                      "--save-dir: give --save-every STEPS too")
        if args.max_restarts < 0:
            args.command_parser.error(f"argument --max-restarts: must be 0 or more; got {args.max_restarts}")
        _check_config(args)
        if args.resume is not None:
            _check_resume(args)
        return run_train(args)
    return _RUN[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
