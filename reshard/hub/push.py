"""``--push-to-hub``: publish a finished output folder to a Hub model repo, with a model card, in one upload.

The output is complete (renamed into place, ``reshard.json`` written) before anything is sent, and stays where
``-o`` put it, with the card added as its ``README.md`` (as transformers' ``push_to_hub`` does). The repo is
created if needed (``--private`` is ignored for an existing repo, as ``hf upload`` does), the branch of
``--revision`` too; one :meth:`~huggingface_hub.HfApi.upload_folder` sends the folder (resumable: a re-run does
not resend what the Hub already holds). Weight, index and manifest files that the repo held at that revision
and the output does not are deleted in the same commit, so a stale shard or rank folder cannot be read beside
the new ones.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from reshard.errors import HubError
from reshard.hub.api import hub_api, hub_errors, progress_bars
from reshard.hub.card import model_card
from reshard.hub.source import require_token
from reshard.manifest import MANIFEST_NAME, read_manifest

CARD = "README.md"
# What a previous push may have left that the new output replaces: weights, their indexes, the manifest.
STALE = ["*.safetensors", "*.bin", "*.pt", "*.pth", "*.index.json", MANIFEST_NAME]


@dataclass(frozen=True)
class PushOptions:
    """Where and how to publish.

    Attributes:
        repo_id: the model repo (``org/name``; a bare name goes to the token's user).
        private: create the repo private (ignored for an existing repo).
        revision: the branch to push to (created from the default branch if needed); None: the default branch.
        create_pr: open a pull request against the default branch instead of committing to it.
        commit_message: the commit's title (default: what reshard did).
    """

    repo_id: str
    private: bool = False
    revision: str | None = None
    create_pr: bool = False
    commit_message: str | None = None


@dataclass
class PushResult:
    """Where the output went: the repo, the commit (and pull request) made."""

    repo: str
    url: str
    commit: str
    revision: str | None
    pull_request: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_push(options: PushOptions) -> None:
    """Refuse a push that cannot succeed before any work: a malformed repo id, a pull request against another
    branch than the default one (``upload_folder`` opens them against it), or no token.

    Raises:
        HubError: with the fix.
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if options.create_pr and options.revision:
        raise HubError(
            "--create-pr opens a pull request against the default branch: it does not go with --revision",
            path=options.repo_id,
        )
    try:
        validate_repo_id(options.repo_id)
    except HFValidationError as err:
        raise HubError(f"not a repo id: {str(err).splitlines()[0]}", path=options.repo_id) from None
    require_token("--push-to-hub")


def push_output(
    out: Path, options: PushOptions, *, changed: list[dict[str, Any]], command: str | None, progress: bool = True
) -> PushResult:
    """Write the model card into ``out`` and upload ``out`` to ``options.repo_id``.

    Args:
        out: a finished output folder (with its ``reshard.json``).
        options: the repo, branch, pull request and message.
        changed: the report's tensors whose shapes changed, for the card.
        command: the command line that produced ``out``, for the card.
        progress: huggingface_hub's progress bars on stderr.

    Raises:
        HubError: the Hub refused (no rights to the namespace, a token without write access, ...); the output
            stays complete in ``out``.
    """
    manifest = read_manifest(out / MANIFEST_NAME)
    title = options.repo_id.split("/")[-1]
    card = model_card(manifest, changed=changed, command=command, title=title, source_card=out / CARD)
    (out / CARD).write_text(card)
    message = options.commit_message or _message(manifest.source, manifest.target)
    api = hub_api()
    try:
        with hub_errors(options.repo_id), progress_bars(progress):
            repo = api.create_repo(options.repo_id, private=options.private, exist_ok=True)
            if options.revision:
                api.create_branch(repo.repo_id, branch=options.revision, exist_ok=True)
            info = api.upload_folder(
                repo_id=repo.repo_id,
                folder_path=out,
                revision=options.revision,
                create_pr=options.create_pr,
                commit_message=message,
                delete_patterns=STALE,
            )
    except HubError as err:
        err.hint = f"the output is complete in {out}; `hf upload {options.repo_id} {out}` publishes it"
        err.args = (err.one_line(),)
        raise
    return PushResult(repo.repo_id, str(repo), info.oid, options.revision, info.pr_url)


def _message(source: dict[str, Any], target: dict[str, Any]) -> str:
    origin = source.get("repo") or Path(str(source.get("path"))).name
    return f"reshard: {origin} ({source.get('layout')}, tp={source.get('tp')}) -> {target['layout']} tp={target['tp']}"


__all__ = ["PushOptions", "PushResult", "check_push", "push_output"]
