"""Assertions for users' own test suites: prove in CI that a checkpoint re-slices without losing a bit.

Each raises ``AssertionError`` carrying the same report ``reshard verify`` prints, so a failing test
names the tensor, what differs and the file. Unreadable checkpoints raise :class:`~reshard.ReshardError`.

Bytes are not the whole story: a wrong plan that is consistent with itself round-trips bit-exactly.
:func:`assert_same_logits` runs both checkpoints through transformers and compares what they compute.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from reshard.cli.render import render_verify
from reshard.commands.convert import convert
from reshard.commands.verify import VerifyOptions, VerifyResult, verify
from reshard.io.staging import temporary_folder
from reshard.layouts import discover
from reshard.layouts.hf import HF
from reshard.options import ConvertOptions, ReadOptions

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["assert_roundtrip", "assert_same_checkpoint", "assert_same_logits"]


def _check(result: VerifyResult) -> None:
    if not result.ok:
        raise AssertionError("\n" + render_verify(result))


def assert_roundtrip(
    path: str | Path,
    tp: Iterable[int] = (2, 4),
    *,
    plan: str | Path | None = None,
    config: str | Path | None = None,
    trust_pickle: bool = False,
) -> None:
    """Assert that ``path`` converts to every ``tp`` and back bit-exactly (and matches its reshard.json, if any).

    Example:
        >>> assert_roundtrip("checkpoints/latest", tp=[2, 4])  # doctest: +SKIP
    """
    options = VerifyOptions(
        roundtrip=tuple(tp), read=ReadOptions(plan=_path(plan), config=_path(config), trust_pickle=trust_pickle)
    )
    _check(verify(Path(path), options=options))


def assert_same_checkpoint(
    a: str | Path,
    b: str | Path,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    plan: str | Path | None = None,
    trust_pickle: bool = False,
) -> None:
    """Assert that two checkpoints of any layouts and tp sizes hold the same tensors (bit-exact by default).

    Example:
        >>> assert_same_checkpoint("ckpt", "ckpt-tp4")  # doctest: +SKIP
    """
    options = VerifyOptions(atol=atol, rtol=rtol, read=ReadOptions(plan=_path(plan), trust_pickle=trust_pickle))
    _check(verify(Path(a), Path(b), options))


def assert_same_logits(
    reference: str | Path,
    candidate: str | Path,
    *,
    plan: str | Path | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    seed: int = 0,
) -> None:
    """Assert that ``candidate`` (any layout and tp) computes the logits ``reference`` computes.

    Each checkpoint that is not already a full ``hf`` folder is gathered by reshard (``candidate`` with
    ``plan``) into a temporary folder; both are loaded with ``AutoModelForCausalLM.from_pretrained`` in
    float32 and run on one fixed random batch. This catches what byte checks cannot: a wrong plan that
    round-trips consistently. Needs ``transformers`` and memory for two copies of the model (CPU).

    Raises:
        AssertionError: the candidate cannot be loaded as the same model, or its logits differ.
        ImportError: transformers is not installed.

    Example:
        >>> assert_same_logits("hf-model", "ckpt-tp2")  # doctest: +SKIP
    """
    with temporary_folder(prefix="reshard-logits-") as tmp:
        folders = [
            _full_folder(Path(reference), tmp / "reference", None),
            _full_folder(Path(candidate), tmp / "candidate", _path(plan)),
        ]
        models = [_load(folder, original) for folder, original in zip(folders, (reference, candidate), strict=True)]
        vocab = models[0].config.vocab_size
        ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(seed))
        with torch.inference_mode():
            expected, actual = (model(ids).logits for model in models)
    if expected.shape != actual.shape:
        raise AssertionError(f"{candidate}: logits shape {list(actual.shape)}, {reference}: {list(expected.shape)}")
    if not torch.allclose(actual, expected, atol=atol, rtol=rtol):
        gap = float((actual - expected).abs().max())
        raise AssertionError(
            f"{candidate}: logits differ from {reference}: max abs difference {gap:.6g} (atol={atol}, rtol={rtol})"
        )


def _load(folder: Path, original: str | Path) -> PreTrainedModel:
    """The model in ``folder``; every weight transformers could not place is an AssertionError naming it."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as err:
        raise ImportError("assert_same_logits needs transformers: pip install transformers") from err
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, output_loading_info=True, ignore_mismatched_sizes=True
        )
        model, info = cast("tuple[PreTrainedModel, dict[str, Any]]", loaded)  # output_loading_info: with the info
    except (RuntimeError, ValueError, OSError) as err:
        raise AssertionError(f"{original}: transformers cannot load it: {str(err).strip()}") from err
    problems = [
        f"{name}: shape {list(got)}, the model expects {list(want)}"
        for name, got, want in sorted(info["mismatched_keys"])
    ]
    problems += [f"{name}: missing" for name in sorted(info["missing_keys"])]
    problems += [f"{name}: not a weight of the model" for name in sorted(info["unexpected_keys"])]
    if problems:
        raise AssertionError(f"{original}: not the same model:\n  " + "\n  ".join(problems))
    return model.eval()


def _full_folder(path: Path, scratch: Path, plan: Path | None) -> Path:
    """``path`` itself when it is a full ``hf`` folder read without a plan, else a gathered copy in ``scratch``."""
    source = discover(path, ReadOptions())
    if plan is None and path.is_dir() and source.layout == HF.name and source.tp == 1:
        return path
    convert(path, scratch, ConvertOptions(tp=1, layout=HF.name, read=ReadOptions(plan=plan), progress=False))
    return scratch


def _path(value: str | Path | None) -> Path | None:
    return None if value is None else Path(value)
