"""The command line's Hub options: CKPT arguments that may name a repo, ``--cache-dir``, ``--push-to-hub``."""

from __future__ import annotations

import functools
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from reshard.errors import ReshardError
from reshard.hub.source import HubCheckpoint, checkpoint_argument, hub_origin, with_cache


class CheckpointParam(click.ParamType):
    """A CKPT argument: an existing path, else a Hub repo (``org/name[@revision][/path]``, ``hf://...``)."""

    name = "CKPT|REPO"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path | HubCheckpoint:
        if isinstance(value, (Path, HubCheckpoint)):
            return value
        try:
            return checkpoint_argument(value)
        except ReshardError as err:
            self.fail(err.one_line(), param, ctx)


CKPT = CheckpointParam()


class ArgvGroup(click.Group):
    """A group that keeps the arguments it was given (``ctx.meta["reshard.argv"]``), for the model card."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["reshard.argv"] = list(args)
        return super().parse_args(ctx, args)


def command_line() -> str | None:
    """The command being run, as typed (``reshard fix acme/x --vocab 1001 ...``)."""
    ctx = click.get_current_context(silent=True)
    argv = ctx.meta.get("reshard.argv") if ctx is not None else None
    return shlex.join(["reshard", *argv]) if argv is not None else None


def hub_input(*, download: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add ``--cache-dir``; give it to every Hub checkpoint argument and, with ``download``, fetch those into the
    cache first (``convert``, ``fix``, ``verify`` then read a local folder). Without it (``inspect``, ``check``)
    a repo is read from its headers, except a ``.json`` file (a config for ``check``), which is fetched."""

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def wrapper(*args: Any, cache_dir: Path | None, **kwargs: Any) -> Any:
            progress = not (kwargs.get("quiet") or kwargs.get("as_json"))
            for key, value in list(kwargs.items()):
                if isinstance(value, HubCheckpoint):
                    value = with_cache(value, cache_dir)
                    if download or value.path.endswith(".json"):
                        from reshard.hub.download import download_checkpoint

                        value = download_checkpoint(value, progress=progress)
                    kwargs[key] = value
            return command(*args, **kwargs)

        return click.option(
            "--cache-dir",
            type=click.Path(file_okay=False, path_type=Path),
            help="Hugging Face cache for repo ids (default: HF_HUB_CACHE).",
        )(wrapper)

    return decorate


def push_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``--push-to-hub`` and its options; the command gets ``push`` (a PushOptions or None), checked before
    any work is done (a repo id, a token)."""

    @functools.wraps(command)
    def wrapper(
        *args: Any,
        push_to_hub: str | None,
        private: bool,
        revision: str | None,
        create_pr: bool,
        commit_message: str | None,
        **kwargs: Any,
    ) -> Any:
        from reshard.hub.push import PushOptions, check_push

        push = None
        if push_to_hub is not None:
            push = PushOptions(push_to_hub, private, revision, create_pr, commit_message)
            check_push(push)
        elif private or revision or create_pr or commit_message:
            raise click.UsageError("--private, --revision, --create-pr and --commit-message go with --push-to-hub")
        return command(*args, push=push, **kwargs)

    for option in reversed(
        [
            click.option("--push-to-hub", metavar="ORG/NAME", help="Then upload the output to this Hub model repo."),
            click.option("--private", is_flag=True, help="Create that repo private (ignored if it exists)."),
            click.option("--revision", metavar="BRANCH", help="Push to this branch (created if needed)."),
            click.option("--create-pr", is_flag=True, help="Open a pull request to the default branch instead."),
            click.option("--commit-message", metavar="TEXT", help="Title of the commit (default: what was done)."),
        ]
    ):
        wrapper = option(wrapper)
    return wrapper


class Pushed:
    """A command's report with where its output was pushed (``push`` in ``--json``, a last line in text)."""

    def __init__(self, report: Any, push: Any) -> None:
        self.report, self.push = report, push

    def to_dict(self) -> dict[str, Any]:
        return self.report.to_dict() | {"push": self.push.to_dict()}


def shown(path: str) -> str:
    """A path read from a Hub download as ``org/name@commit[/path]``; any other path as it is."""
    origin = hub_origin(Path(path))
    if origin is None:
        return path
    inside = origin.get("path_in_repo")
    return f"{origin['repo']}@{origin['commit']}" + (f"/{inside}" if inside else "")


def for_display(result: Any) -> Any:
    """``result`` (a verify result) naming Hub downloads by repo and commit rather than by their cache path."""
    result.checkpoint = shown(result.checkpoint)
    for report in result.reports:
        report.checkpoint, report.against = shown(report.checkpoint), shown(report.against)
    return result


def publish(report: Any, render: Callable[[Any], str], push: Any, *, progress: bool) -> tuple[Any, Callable]:
    """Push the finished output of ``report`` when asked; the report (its source named by repo and commit when
    it came from the Hub) and the renderer to emit."""
    report.source = shown(report.source)
    if push is None:
        return report, render
    if not getattr(report, "written", True):
        raise ReshardError(
            "nothing to fix, so nothing was written to push", path=report.source, hint="--force writes a copy to push"
        )
    from reshard.hub.push import push_output

    result = push_output(Path(report.output), push, changed=report.changed, command=command_line(), progress=progress)

    def render_pushed(pushed: Pushed) -> str:
        where = result.pull_request or f"{result.url} (commit {result.commit[:12]})"
        return render(pushed.report) + f"\npushed to {where}"

    return Pushed(report, result), render_pushed


__all__ = ["CKPT", "ArgvGroup", "for_display", "hub_input", "publish", "push_options"]
