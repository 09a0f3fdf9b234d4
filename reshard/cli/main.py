"""The ``reshard`` command line: parse, call the library, print. No logic lives here.

Each command imports its library module when it runs: ``convert``, ``fix`` and ``verify`` may need torch (only
when a byte has to go through it), whose import takes longer than ``reshard check`` needs for a whole 9B model's
headers.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from reshard.cli.hub import CKPT, ArgvGroup, for_display, hub_input, publish, push_options
from reshard.cli.output import emit
from reshard.cli.render import render_check, render_convert, render_fix, render_inspect, render_verify
from reshard.errors import ReshardError
from reshard.hub.source import HubCheckpoint
from reshard.io.interrupts import Interrupted, handled
from reshard.io.staging import KEPT, describe_left, remove_leftovers
from reshard.io.vectored import return_large_frees_to_os
from reshard.layouts import layout, writable_layouts
from reshard.layouts.training import LEFTOVER_KINDS
from reshard.options import ConvertOptions, ReadOptions, composed
from reshard.plans import TRANSFORMERS
from reshard.version import __version__

PATH = click.Path(path_type=Path)
EXISTING = click.Path(exists=True, path_type=Path)


class PlanParam(click.ParamType):
    """``--plan``: an existing plan FILE, or the word ``transformers`` (the installed transformers' plan)."""

    name = "FILE|transformers"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path | str:
        if value == TRANSFORMERS:
            return TRANSFORMERS
        return EXISTING.convert(value, param, ctx)


PLAN = PlanParam()
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?B)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


class InputError(click.ClickException):
    """Bad input: exit code 2, as DESIGN.md promises (1 is for a check that found a difference)."""

    exit_code = 2


def reports_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a library :class:`ReshardError` (or an ``OSError`` of a file) into one line on stderr and exit code 2,
    and a stopping signal (SIGINT, SIGTERM, SIGHUP, SIGQUIT) into one line and exit code 128 + the signal, once the
    run has cleaned up after itself."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        remains: list[Path] = []
        try:
            with handled():
                try:
                    return command(*args, **kwargs)
                finally:  # a last sweep, signals held off, of what a cleanup cut short may have left
                    remains = remove_leftovers()
        except ReshardError as err:
            raise InputError(err.one_line() + _left(remains)) from err
        except OSError as err:  # a file the library opened without a more precise error of its own
            logging.getLogger(__name__).info("the error in full (-v)", exc_info=True)
            where = f"{err.filename}: " if err.filename is not None else ""
            raise InputError(f"{where}{err.strerror or err}{_left(remains)}") from err
        except KeyboardInterrupt as err:
            name = err.name if isinstance(err, Interrupted) else "SIGINT"
            kept = getattr(err, "kept", None)
            left = KEPT.format(staging=kept) if kept else describe_left(remove_leftovers())
            with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone: the exit code still says it
                click.echo(f"Error: interrupted by {name}: {left}", err=True)
            raise SystemExit(err.exit_code if isinstance(err, Interrupted) else 130) from None

    return wrapper


def _left(remains: list[Path]) -> str:
    """Nothing, or what a failed run could not remove (looked for on disk)."""
    return f" ({describe_left(remains)})" if remains else ""


def without_workers(argv: list[str]) -> list[str]:
    """The command line as given, less ``--workers N``: what each worker runs."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--workers":
            skip = True
        elif not arg.startswith("--workers="):
            kept.append(arg)
    return kept


def parse_size(ctx: click.Context, param: click.Parameter, value: str) -> int:
    match = _SIZE.match(value)
    if not match:
        raise click.BadParameter(f"{value!r} is not a size such as 5GB, 500MB or 1000000")
    return int(match.group(1)) * _UNITS[(match.group(2) or "B").upper()]


def parse_drop(ctx: click.Context, param: click.Parameter, value: str | None) -> frozenset[str]:
    """``--drop rng,scheduler``: kinds of training state to leave behind, each one reshard knows."""
    kinds = frozenset(k.strip() for k in (value or "").split(",") if k.strip())
    unknown = sorted(kinds - set(LEFTOVER_KINDS))
    if unknown:
        raise click.BadParameter(f"{', '.join(unknown)}: not one of {', '.join(LEFTOVER_KINDS)}")
    return kinds


def option_group(*options: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[..., Any]:
    """Several ``click.option`` decorators as one, applied in the order given (as they read above a command)."""

    def apply(command: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            command = option(command)
        return command

    return apply


# How to read any checkpoint.
common_read_options = option_group(
    click.option(
        "--config",
        "config",
        type=EXISTING,
        help="config.json to use (default: in or above CKPT), or a torchtitan job .toml.",
    ),
    click.option(
        "--plan",
        "plan",
        type=PLAN,
        help="Plan file (TOML/JSON) whose rules come first, or 'transformers' for transformers' own TP plan.",
    ),
    click.option("--trust-pickle", is_flag=True, help="Fully unpickle torch files (only files you trust)."),
)
# Which copy of the weights to read from a checkpoint that keeps two (convert and inspect).
weights_option = click.option(
    "--weights",
    type=click.Choice(["master", "module"]),
    default="master",
    show_default=True,
    help="DeepSpeed ZeRO-0/1/2: the fp32 master weights of the optimizer, or the module copy (training dtype).",
)
# What every command that writes a checkpoint (convert, fix) takes about its output and report.
writing_options = option_group(
    click.option("--overwrite", is_flag=True, help="Replace a non-empty output folder."),
    click.option("--allow-divergent-replicas", is_flag=True, help="Take rank 0 of replicated tensors that differ."),
    click.option("-q", "--quiet", is_flag=True, help="No progress bars and no report."),
    click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON document."),
)


@click.group(cls=ArgvGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="reshard")
@click.option("-v", "--verbose", is_flag=True, help="Log what reshard does.")
def main(verbose: bool) -> None:
    """Repair and re-slice tensor-parallel checkpoints.

    CKPT is a folder or file, or a Hugging Face Hub repo: org/name, org/name@revision, hf://org/name/folder.

    \b
    Examples:
      reshard inspect ckpt/
      reshard fix ckpt/ --vocab 65535
      reshard convert ckpt/ --tp 4 -o ckpt-tp4/
      reshard verify ckpt-tp4/ --roundtrip 2,8
      reshard fix acme/llama-tp2 --vocab 65535 -o fixed/ --push-to-hub acme/llama-fixed
    """
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(message)s")
    return_large_frees_to_os()


@main.command("inspect")
@click.argument("ckpt", type=CKPT)
@common_read_options
@click.option("--vocab", type=click.IntRange(min=1), help="True vocab size (default: reshard.json, then config).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@weights_option
@reports_errors
@hub_input(download=False)
def inspect_command(
    ckpt: Path | HubCheckpoint,
    config: Path | None,
    plan: Path | str | None,
    trust_pickle: bool,
    vocab: int | None,
    as_json: bool,
    weights: str,
) -> None:
    """Show layout, tp, files and how every tensor is split, and why.

    \b
    Examples:
      reshard inspect sample_ckpts/tiny-llama-tp2
      reshard inspect ckpt/ --json | jq '.tensors[0]'
      reshard inspect Qwen/Qwen3-8B            (a Hub repo: reads its safetensors headers only)
    """
    from reshard.commands.inspect import inspect_checkpoint

    options = ReadOptions(config=config, plan=plan, trust_pickle=trust_pickle, vocab=vocab, weights=weights)
    report = inspect_checkpoint(ckpt, options)
    emit(report, render_inspect, as_json=as_json)


@main.command("convert")
@click.argument("ckpt", type=CKPT)
@click.option("--tp", type=click.IntRange(min=1), required=True, help="Target ranks (1: full; torch_dist: its args).")
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True, help="Pipeline stages (megatron).")
@click.option("-o", "--output", "out", type=PATH, required=True, help="Output folder.")
@click.option("--vocab", type=click.IntRange(min=1), help="True vocab size (default: reshard.json, then config).")
@click.option(
    "--allow-vocab-shrink",
    is_flag=True,
    help="Accept a --vocab below the size reshard.json or config.json gives (drops those rows).",
)
@click.option("--pad-multiple", type=click.IntRange(min=1), help="Pad the vocab to a multiple of K (default: tp).")
@click.option("--uneven", is_flag=True, help="Split sizes that do not divide as torch.chunk does, without padding.")
@click.option(
    "--layout",
    type=click.Choice(writable_layouts()),
    help="Target layout (default: from the source).",
)
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    callback=parse_size,
    help="Largest safetensors (or torch_dist .distcp) file before a new one.",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    default=None,
    show_default="twice the number of cores; the cores when checkpoint and output are both in tmpfs",
    help="Tensors read, hashed and written at once (threads; memory stays bounded).",
)
@click.option(
    "--keep-names",
    is_flag=True,
    help="Keep the source's tensor names (by default the target layout's framework names them: hf = transformers).",
)
@click.option(
    "--dtype",
    type=click.Choice(["bfloat16", "float16", "float32"]),
    help="Write floating tensors in this dtype; FP8 weights (fp8, compressed-tensors) dequantized, scales dropped.",
)
@click.option("--merge-lora", is_flag=True, help="Merge LoRA adapters into their base weights per rank, then reshard.")
@click.option(
    "--lora-alpha",
    type=click.FloatRange(min=0, min_open=True),
    help="LoRA alpha where no adapter_config.json records it (scaling = alpha / rank; SAT's lora2 default 1).",
)
@click.option("--adapter", metavar="NAME", help="The peft adapter to merge or write, of several in the checkpoint.")
@click.option(
    "--base-model",
    metavar="ID|PATH",
    help="The base model a --layout peft adapter folder names (default: the recorded one, else the config's).",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Keep the work done if the run stops (journaled); finish what an earlier --resume run left.",
)
@click.option(
    "--tokenizer",
    metavar="DIR|REPO",
    help="Tokenizer an HF output carries (default: the one the checkpoint names or holds); a folder or a Hub repo.",
)
@click.option(
    "--with-optimizer",
    is_flag=True,
    help="Carry the training state: fp32 masters, Adam's moments, step and param groups (deepspeed, dcp, torch_dist).",
)
@click.option(
    "--drop",
    callback=parse_drop,
    metavar="KINDS",
    help=f"With --with-optimizer, leave these behind: comma-separated, of {', '.join(LEFTOVER_KINDS)}.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Processes sharing the output files (what torchrun -m reshard convert starts, on this machine).",
)
@click.option(
    "--worker-timeout",
    type=click.FloatRange(min=0, min_open=True, max=86400),
    default=None,
    metavar="SECONDS",
    help="How long workers wait for each other to join the group [default: 60; env RESHARD_WORKER_TIMEOUT].",
)
@weights_option
@writing_options
@common_read_options
@reports_errors
@push_options
@hub_input(download=True)
def convert_command(ckpt: Path, out: Path, as_json: bool, quiet: bool, push: Any, **options: Any) -> None:
    """Re-slice CKPT for --tp ranks into OUTPUT, with a reshard.json manifest.

    \b
    Examples:
      reshard convert sample_ckpts/tiny-llama-tp2 --tp 1 -o tiny-full
      reshard convert tiny-full --tp 4 --layout hf-ranks -o tiny-tp4
      reshard convert acme/tiny-tp2 --tp 1 -o tiny-full --push-to-hub acme/tiny
    """
    from reshard.commands.convert import convert

    adapter_out = options["layout"] is not None and layout(options["layout"]).lora_adapter
    for flag in ("lora_alpha", "adapter"):
        if options[flag] is not None and not (options["merge_lora"] or adapter_out):
            raise click.UsageError(f"--{flag.replace('_', '-')} only applies with --merge-lora or --layout peft")
    if options["merge_lora"] and adapter_out:
        raise click.UsageError("--merge-lora writes a merged model; --layout peft writes the adapter alone")
    if options["base_model"] is not None and not adapter_out:
        raise click.UsageError("--base-model only applies with --layout peft")
    if options["drop"] and not options["with_optimizer"]:
        raise click.UsageError("--drop only applies with --with-optimizer")
    workers = options.pop("workers")
    worker_timeout = options.pop("worker_timeout")
    if worker_timeout is not None:  # read by engine/workers.py join(), in this process and the ones launch starts
        from reshard.engine.run.workers import SETUP_TIMEOUT_ENV

        os.environ[SETUP_TIMEOUT_ENV] = repr(worker_timeout)
    if workers > 1 and "WORLD_SIZE" not in os.environ:
        from reshard.engine.run.workers import launch

        raise SystemExit(launch(without_workers(click.get_current_context().meta["reshard.argv"]), workers))
    quiet = quiet or int(os.environ.get("RANK", "0") or 0) != 0  # under torchrun, rank 0 reports
    report = convert(ckpt, out, composed(ConvertOptions, progress=not (quiet or as_json), **options))
    report, render = publish(report, render_convert, push, progress=not (quiet or as_json))
    emit(report, render, as_json=as_json, quiet=quiet)


@main.command("fix")
@click.argument("ckpt", type=CKPT)
@click.option("--vocab", type=click.IntRange(min=1), help="True vocab size (default: reshard.json, then config).")
@click.option(
    "-o",
    "--output",
    "out",
    type=PATH,
    help="Output folder (default: CKPT.fixed beside it; NAME.fixed here for a repo).",
)
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="Ranks to write (1: full).")
@click.option(
    "--allow-vocab-shrink",
    is_flag=True,
    help="Accept a --vocab below the size reshard.json or config.json gives (drops those rows).",
)
@click.option("--force", is_flag=True, help="Write the output even when the checkpoint needs no fix.")
@click.option(
    "--tokenizer",
    metavar="DIR|REPO",
    help="Tokenizer an HF output carries (default: the one the checkpoint names or holds); a folder or a Hub repo.",
)
@writing_options
@common_read_options
@reports_errors
@push_options
@hub_input(download=True)
def fix_command(ckpt: Path, out: Path | None, as_json: bool, quiet: bool, push: Any, **options: Any) -> None:
    """Gather and unpad CKPT into a canonical checkpoint (CKPT.fixed unless -o), with a reshard.json.

    \b
    Examples:
      reshard fix sample_ckpts/tiny-llama-65535-tp2 --vocab 65535 -o tiny-fixed
      reshard fix ckpt/ --vocab 65535 --tp 4 -o ckpt-tp4/
      reshard fix acme/llama-tp2 --vocab 65535 --push-to-hub acme/llama   (writes llama-tp2.fixed/ here)
    """
    from reshard.commands.fix import fix

    report = fix(ckpt, out, composed(ConvertOptions, progress=not (quiet or as_json), **options))
    report, render = publish(report, render_fix, push, progress=not (quiet or as_json))
    emit(report, render, as_json=as_json, quiet=quiet)


@main.command("check")
@click.argument("target", metavar="CKPT|CONFIG", type=CKPT)
@click.option("--tp", type=click.IntRange(min=1), required=True, help="Number of ranks to check for.")
@click.option("--uneven", is_flag=True, help="Allow torch.chunk-style uneven splits (transformers' convention).")
@click.option("--pad-multiple", type=click.IntRange(min=1), help="Pad the vocab to a multiple of K (default: tp).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@common_read_options
@reports_errors
@hub_input(download=False)
def check_command(target: Path | HubCheckpoint, as_json: bool, **options: Any) -> None:
    """Can this model be split --tp ways? Reads headers (or a config.json) only, never tensor data.

    Exit code 0: it can; 1: it cannot (the problems say why); 2: bad input.

    \b
    Examples:
      reshard check sample_ckpts/tiny-llama-tp2 --tp 4
      reshard check config.json --tp 4 --plan transformers --json
    """
    from reshard.commands.check import CheckOptions, check

    report = check(target, composed(CheckOptions, **options))
    emit(report, render_check, as_json=as_json)
    if not report.ok:
        raise SystemExit(1)


def parse_tps(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...]:
    if value is None:
        return ()
    try:
        tps = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        tps = ()
    if not tps or min(tps) < 1:
        raise click.BadParameter(f"{value!r} is not a list of tp sizes such as 2,4,8")
    return tps


@main.command("verify")
@click.argument("ckpt", type=CKPT)
@click.argument("other", type=CKPT, required=False)
@click.option("--roundtrip", callback=parse_tps, metavar="2,4,8", help="Convert to each tp and back; compare.")
@click.option("--atol", type=click.FloatRange(min=0), default=0.0, help="Absolute tolerance for CKPT vs OTHER.")
@click.option("--rtol", type=click.FloatRange(min=0), default=0.0, help="Relative tolerance for CKPT vs OTHER.")
@click.option(
    "--train-state",
    is_flag=True,
    help="Check the optimizer state too: moments, masters, step, groups (against OTHER's: bit for bit).",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress bars and no report (the exit code says it).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON document.")
@common_read_options
@reports_errors
@hub_input(download=True)
def verify_command(ckpt: Path, other: Path | None, quiet: bool, as_json: bool, **options: Any) -> None:
    """Check CKPT against its reshard.json, or against OTHER, and/or round-trip it through other tp sizes.

    Exit 0 when everything holds, 1 with a table of differences, 2 when a checkpoint cannot be read.

    \b
    Examples:
      reshard verify sample_ckpts/tiny-llama-tp2
      reshard verify sample_ckpts/tiny-llama-tp2 tiny-full --json
    """
    from reshard.commands.verify import VerifyOptions, verify

    result = for_display(verify(ckpt, other, composed(VerifyOptions, progress=not (quiet or as_json), **options)))
    emit(result, render_verify, as_json=as_json, quiet=quiet)
    click.get_current_context().exit(0 if result.ok else 1)


# Allocations (less frees) between collections of the youngest generation; Python's default is 700.
GC_YOUNG = 50_000


def run() -> None:
    """The ``reshard`` console script: :func:`main`, then end the process without tearing down the interpreter.

    Freeing every object of torch and its modules at exit takes as long as ``reshard check`` takes for a
    9B model (docs/performance.md). reshard closes its own files and joins its threads
    before a command returns, so once stdout, stderr and the log handlers are flushed nothing is left
    to do but ``os._exit``. A crash still unwinds normally, with its traceback.

    The cyclic collector runs less often (:data:`GC_YOUNG`): importing torch (and, for the config-family
    check, transformers) makes millions of objects that live to the end, and with the default threshold
    every 700 of them start a collection; the full ones walk all of them again (measured: docs/performance.md).
    Cycles are still collected.
    """
    gc.set_threshold(GC_YOUNG, *gc.get_threshold()[1:])
    try:
        main()
        code: object = 0
    except SystemExit as done:
        code = done.code
    if isinstance(code, str):  # what the interpreter does with a message as exit code
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 0)


__all__ = ["main", "run"]
